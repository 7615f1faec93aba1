"""Greedy token ids of pdserve's engine on tiny DeepSeek V2 / V3 equal HF transformers' (fp32).

Models from ``pdserve make-tiny-model --arch deepseek_v2|deepseek_v3`` (``tiny_deepseek.py``): V2 without
q_lora_rank (V2-Lite's q_proj), V2 with it, V3 with it and YaRN. Covers prompt lengths 1 / 17 / 300, a mixed
batch with chunked prefill (the plain path over a cached prefix, decode rows absorbed in the same step), a warm
prefix cache (the latent blocks reused). Layer 0 is dense, layer 1 MoE. Tensor / pipeline parallel 2 and the
store: ``test_deepseek_disagg.py``.
"""

from __future__ import annotations

import pytest

from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.checkpoints.tiny_deepseek import make_tiny_deepseek

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MODELS = {"v2-lite": ("deepseek_v2", {}), "v2-q-lora": ("deepseek_v2", {"q_lora_rank": 24}),
          "v3": ("deepseek_v3", {"q_lora_rank": 24, "yarn": True})}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-deepseek")
    paths = {name: make_tiny_deepseek(root / name, arch, seed=3, **shape) for name, (arch, shape) in MODELS.items()}
    return {name: (path, hf_model(path)) for name, path in paths.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_single_prompts_match_hf(deepseek, name):
    path, ref = deepseek[name]
    llm = LLM(str(path))
    assert llm.engine.layout.kind == "mla"
    for prompt in [random_prompt(ref.config.vocab_size, n, seed=n) for n in (1, 17, 300)]:
        [out] = llm.generate([prompt], GREEDY)
        assert out.token_ids == hf_greedy(ref, prompt, 12), f"{name} len={len(prompt)}"
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_batch_and_chunked_prefill_match_hf(deepseek, name):
    path, ref = deepseek[name]
    prompts = [random_prompt(ref.config.vocab_size, n, seed=100 + n) for n in (5, 64, 130, 9, 257)]
    expected = [hf_greedy(ref, p, 12) for p in prompts]
    llm = LLM(str(path), max_num_batched_tokens=48, block_size=8)     # 48 < prompt length: chunks over a prefix
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.block_manager.num_free_blocks == llm.engine.runtime.num_blocks


@pytest.mark.parametrize("name,backend", [("v3", "cpu"), ("v3", "torch"), ("v2-lite", "cpu"), ("v2-q-lora", "cpu")])
def test_warm_prefix_cache_same_output(deepseek, name, backend):
    path, ref = deepseek[name]
    prompt = random_prompt(ref.config.vocab_size, 100, seed=7)
    llm = LLM(str(path), block_size=16, attention_backend=backend)
    [cold] = llm.generate([prompt], GREEDY)
    [warm] = llm.generate([prompt], GREEDY)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 96     # latent blocks of the prefix reused
    assert warm.token_ids == cold.token_ids == hf_greedy(ref, prompt, 12)
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_make_tiny_model_cli_writes_a_deepseek_both_sides_read(tmp_path, arch):
    import transformers

    from pdserve.engine.cli import main
    from pdserve.engine.models.model_config import ModelConfig

    assert main(["make-tiny-model", str(tmp_path / arch), "--arch", arch, "--num-layers", "3"]) == 0
    hf = transformers.AutoConfig.from_pretrained(tmp_path / arch)
    ours = ModelConfig.from_dir(tmp_path / arch)
    assert hf.architectures == [ours.architecture] and ours.mla.latent_dim == 40 and ours.num_layers == 3
    assert [ours.moe.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert ours.mla.rope_interleave and (arch == "deepseek_v3") == (ours.moe.topk_method == "noaux_tc")
