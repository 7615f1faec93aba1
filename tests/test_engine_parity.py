"""Greedy token ids of pdserve's engine equal HF transformers' on the same weights (fp32).

Covers every architecture, prompt lengths 1 / 17 / 300+, a mixed batch, chunked prefill
(--max-num-batched-tokens smaller than the prompt), a warm prefix cache, and preemption.
"""

from __future__ import annotations

import pytest

from conftest import ARCHS
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(tiny_models):
    return {arch: hf_model(path) for arch, path in tiny_models.items()}


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(vocab, n, seed=n) for n in (1, 17, 300)]


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prompts_match_hf(arch, tiny_models, references):
    llm = LLM(str(tiny_models[arch]))
    for prompt in _prompts(references[arch].config.vocab_size):
        [out] = llm.generate([prompt], GREEDY)
        assert out.token_ids == hf_greedy(references[arch], prompt, 12), f"{arch} len={len(prompt)}"
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_and_chunked_prefill_match_hf(arch, tiny_models, references):
    ref = references[arch]
    prompts = [random_prompt(ref.config.vocab_size, n, seed=100 + n) for n in (5, 64, 130, 9, 257)]
    expected = [hf_greedy(ref, p, 12) for p in prompts]
    for budget in (2048, 48):   # 48 < prompt length: prompts are split across steps
        llm = LLM(str(tiny_models[arch]), max_num_batched_tokens=budget, block_size=8)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == expected, f"budget={budget}"
        assert llm.engine.block_manager.num_free_blocks == llm.engine.runtime.num_blocks


def test_warm_prefix_cache_same_output(tiny_llama, references):
    prompt = random_prompt(references["llama"].config.vocab_size, 100, seed=7)
    llm = LLM(str(tiny_llama), block_size=16)
    [cold] = llm.generate([prompt], GREEDY)
    [warm] = llm.generate([prompt], GREEDY)
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 96            # full blocks only, never the whole prompt
    assert warm.token_ids == cold.token_ids == hf_greedy(references["llama"], prompt, 12)
    llm.engine.block_manager.check_integrity()


def test_preemption_keeps_output_exact(tiny_llama, references):
    ref = references["llama"]
    prompts = [random_prompt(ref.config.vocab_size, 40, seed=200 + i) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # 24 blocks of 8 tokens = 192 slots, while the batch wants 6 x 64 = 384: requests get preempted.
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=24, max_model_len=128)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 24) for p in prompts]
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == 24


def test_stop_strings_and_max_tokens(tiny_llama):
    llm = LLM(str(tiny_llama))
    [free] = llm.generate(["hello world"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop = free.text[3:6]
    assert stop, "the tiny model produced too little text to cut"
    [cut] = llm.generate(["hello world"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                         stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]


def test_min_tokens_suppresses_eos(tiny_llama):
    llm = LLM(str(tiny_llama))
    [free] = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stop_id = free.token_ids[2]                       # make the 3rd greedy token a stop token
    [early] = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_id]))
    assert early.token_ids == free.token_ids[:3] and early.finish_reason == "stop"
    [held] = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_id],
                                                    min_tokens=6))
    assert len(held.token_ids) >= 6 and stop_id not in held.token_ids[:6]


def test_smollm2_matches_hf(smollm2):
    ref = hf_model(smollm2)
    llm = LLM(str(smollm2), max_num_batched_tokens=128)        # the 300-token prompt is chunked
    tok = llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [tok.encode(chat, add_special_tokens=False)] + [random_prompt(ref.config.vocab_size, n, seed=n)
                                                             for n in (1, 17, 300)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 10) for p in prompts]
    assert outs[0].text.startswith("The capital of France is Paris")


def test_offline_llm_with_tensor_parallel_matches_single_rank(tiny_llama, references):
    prompt = random_prompt(references["llama"].config.vocab_size, 40, seed=9)
    with LLM(str(tiny_llama), tensor_parallel_size=2) as llm:
        [out] = llm.generate([prompt], GREEDY)
    assert out.token_ids == hf_greedy(references["llama"], prompt, 12)
