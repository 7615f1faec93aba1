"""Qwen3-MoE, Mixtral and Qwen2-MoE: greedy token ids of pdserve's engine equal HF transformers' on the same weights
(fp32).

Tiny checkpoints from ``make_tiny_model(arch="qwen3_moe" | "mixtral" | "qwen2_moe")`` (8 experts, top 2; the Qwen
ones have 3 layers, layer 1 dense through ``mlp_only_layers``; Qwen2-MoE adds its gated shared expert). Covered as
for the dense models (test_engine_parity.py, test_parallel_engine.py): prompt lengths 1 / 17 / 300, a mixed batch
under chunked prefill, a warm prefix cache, tensor parallel 2 (each expert's width split, one all-reduce per MoE
layer) and pipeline parallel 2 (MoE layers on both stages), worker processes on gloo; a vocabulary that does not
divide by tp (515) at tp 2 and tp 2 x pp 2; the layers torch.compile'd; prefill -> store -> decode (the decode
engine loads the prompt's KV).
"""

from __future__ import annotations

import dataclasses

import pytest

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.llama import ShardSizes
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.moe import MoE

ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
LAYERS = {"qwen3_moe": 3, "mixtral": 2, "qwen2_moe": 3}
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
    qwen2 = ModelConfig.from_dir(moe_models["qwen2_moe"])
    assert qwen2.moe.shared_expert_gate and qwen2.moe.shared_intermediate_size == 64 and qwen2.attention_bias
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


@pytest.mark.parametrize("arch,tp,pp", [("qwen3_moe", 2, 1), ("mixtral", 2, 2)],
                         ids=["qwen3_moe-tp2", "mixtral-tp2pp2"])
def test_odd_vocabulary_at_tp2_matches_hf(arch, tp, pp, tmp_path):
    """vocab_size 515 does not divide by 2: the embedding and LM head shards are padded (``models/vocab.py``)."""
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch=arch, seed=5, num_layers=LAYERS[arch], vocab_size=515)
    ref = hf_model(path)
    assert ref.config.vocab_size == 515
    prompts = _prompts(515, (1, 17, 70), seed=400)
    with LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=48,
             block_size=8) as llm:
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 12) for p in prompts]


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_writes_a_deterministic_checkpoint_hf_loads_whole(arch, tmp_path):
    """``pdserve make-tiny-model --arch``: the same bytes twice; transformers finds every tensor it wants and no other
    (a router or expert it did not load would be initialised at random, and parity could pass by luck elsewhere)."""
    import argparse

    import transformers
    from pdserve.engine.checkpoints.tiny_model import register

    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command", required=True))
    for name in ("a", "b"):
        args = parser.parse_args(["make-tiny-model", str(tmp_path / name), "--arch", arch, "--num-layers", "3"])
        assert args.func(args) == 0
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_compiled_layers_match_hf(moe_models, references):
    """``--torch-compile`` (fullgraph pieces): the routed experts are one opaque op (``pdserve::fused_moe``) inside
    the compiled graph; MoE and dense layers each get their graph."""
    ref = references["qwen3_moe"]
    prompts = _prompts(ref.config.vocab_size, (5, 200), seed=500)
    llm = LLM(str(moe_models["qwen3_moe"]), torch_compile=True, max_num_batched_tokens=128, block_size=8)
    assert llm.engine.runner.compiled is not None
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 8) for p in prompts]


@pytest.mark.parametrize("arch", ARCHS)
def test_disaggregated_prefill_then_decode_matches_hf(arch, moe_models, references):
    """Prefill engine -> in-memory store -> decode engine (one process): the decode side loads the prompt's KV
    (nothing MoE-specific travels: the KV layout is the attention's) and answers as HF."""
    from test_disagg_engine import _engine, _run

    from pdserve.kvstore.memory import MemoryTier
    from pdserve.kvstore.tiered import TieredStore

    ref, path = references[arch], moe_models[arch]
    prompt = random_prompt(ref.config.vocab_size, 100, seed=600)
    store = TieredStore(MemoryTier(256 << 20))
    try:
        prefill, decode = _engine(path, "prefill", store), _engine(path, "decode", store)
        _, pf = _run(prefill, "p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                     {"do_remote_decode": True})
        tokens, df = _run(decode, "d", prompt, GREEDY, pf.kv_transfer_params)
    finally:
        store.close()
    assert tokens == hf_greedy(ref, prompt, 12)
    assert df.kv_accounting["loaded_tokens"] == 96                  # whole blocks of 8 loaded, not recomputed
