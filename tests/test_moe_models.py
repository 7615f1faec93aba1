"""Qwen3-MoE and Mixtral: greedy token ids of pdserve's engine equal HF transformers' on the same weights (fp32).

Tiny checkpoints from ``make_tiny_model(arch="qwen3_moe" | "mixtral")`` (8 experts, top 2; the Qwen3-MoE one has
3 layers, layer 1 dense through ``mlp_only_layers``). Covered as for the dense models (test_engine_parity.py,
test_parallel_engine.py): prompt lengths 1 / 17 / 300, a mixed batch under chunked prefill, a warm prefix cache,
tensor parallel 2 (each expert's width split, one all-reduce per MoE layer) and pipeline parallel 2 (MoE layers on
both stages), worker processes on gloo.
"""

from __future__ import annotations

import dataclasses

import pytest

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.llama import ShardSizes
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.moe import MoE

ARCHS = ("qwen3_moe", "mixtral")
LAYERS = {"qwen3_moe": 3, "mixtral": 2}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-moe")
    return {a: make_tiny_model(root / a, arch=a, seed=0, num_layers=LAYERS[a]) for a in ARCHS}


@pytest.fixture(scope="module")
def references(moe_models):
    return {arch: hf_model(path) for arch, path in moe_models.items()}


def _prompts(vocab: int, lengths=(1, 17, 300), seed: int = 0) -> list[list[int]]:
    return [random_prompt(vocab, n, seed=seed + n) for n in lengths]


def test_config_and_layers(moe_models):
    qwen = ModelConfig.from_dir(moe_models["qwen3_moe"])
    assert qwen.moe.num_experts == 8 and qwen.moe.top_k == 2 and qwen.moe.norm_topk_prob and qwen.qk_norm
    assert [qwen.moe.is_moe_layer(i) for i in range(3)] == [True, False, True]
    mixtral = ModelConfig.from_dir(moe_models["mixtral"])
    assert mixtral.moe.block_name == "block_sparse_moe" and mixtral.moe.intermediate_size == 64
    llm = LLM(str(moe_models["qwen3_moe"]))
    kinds = [type(layer.mlp).__name__ for layer in llm.engine.runner.model.layers]
    assert kinds == ["MoE", "GatedMLP", "MoE"]
    dense_fits = dataclasses.replace(qwen, num_heads=3, num_kv_heads=3, intermediate_size=3, vocab_size=3)
    with pytest.raises(ValueError, match="32 moe_intermediate_size, not divisible by --tensor-parallel-size 3"):
        ShardSizes.for_tp(dense_fits, 3)


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prompts_match_hf(arch, moe_models, references):
    llm = LLM(str(moe_models[arch]))
    assert any(isinstance(m, MoE) for m in llm.engine.runner.model.modules())
    for prompt in _prompts(references[arch].config.vocab_size):
        [out] = llm.generate([prompt], GREEDY)
        assert out.token_ids == hf_greedy(references[arch], prompt, 12), f"{arch} len={len(prompt)}"
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_and_chunked_prefill_match_hf(arch, moe_models, references):
    ref = references[arch]
    prompts = _prompts(ref.config.vocab_size, (5, 64, 130, 9, 257), seed=100)
    expected = [hf_greedy(ref, p, 12) for p in prompts]
    llm = LLM(str(moe_models[arch]), max_num_batched_tokens=48, block_size=8)   # prompts split across steps
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.block_manager.num_free_blocks == llm.engine.runtime.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_warm_prefix_cache_matches_hf(arch, moe_models, references):
    prompt = random_prompt(references[arch].config.vocab_size, 100, seed=7)
    llm = LLM(str(moe_models[arch]), block_size=16)
    [cold] = llm.generate([prompt], GREEDY)
    [warm] = llm.generate([prompt], GREEDY)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 96
    assert warm.token_ids == cold.token_ids == hf_greedy(references[arch], prompt, 12)
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_matches_hf(arch, tp, pp, moe_models, references):
    ref = references[arch]
    prompts = _prompts(ref.config.vocab_size, (1, 17, 90), seed=300)
    with LLM(str(moe_models[arch]), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             max_num_batched_tokens=48, block_size=8) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 12) for p in prompts]
