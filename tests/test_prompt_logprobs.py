"""Prompt logprobs (vLLM's ``prompt_logprobs``) in the engine, against HF transformers' log_softmax (fp32).

Each prompt token's logprob given the tokens before it, its rank and the top-k must equal HF's on the same weights:
in one step, across chunked prefill (a budget smaller than the prompt), after a prefix-cache hit (the cached prefix
has no logits: the request computes its whole prompt) and through a KV store on a prefill node. A decode node does
not compute them: it emits the prefill node's, checked against the prompt.
"""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_model, random_prompt
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.kv.kv_transfer import TransferMismatchError
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore

K, LENGTH, ATOL = 4, 40, 2e-4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_models):
    path = tiny_models[request.param]
    return path, hf_model(path)


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """HF's log_softmax [P - 1, V]: row i is prompt token i + 1's distribution."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]


def assert_equal_hf(entries: list, hf, prompt: list[int], k: int = K) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    ref = hf_prompt_logprobs(hf, prompt)
    for i, e in enumerate(entries[1:]):
        want = ref[i, prompt[i + 1]].item()
        assert e.token_id == prompt[i + 1]
        assert e.logprob == pytest.approx(want, abs=ATOL), i
        surely_above, maybe_above = int((ref[i] > want + ATOL).sum()), int((ref[i] >= want - ATOL).sum())
        assert surely_above < e.rank <= maybe_above, i         # vLLM's rank: tokens with a logprob >= its own
        values, ids = ref[i].topk(k)
        assert [lp for _, lp in e.top] == pytest.approx(values.tolist(), abs=ATOL), i
        assert len(e.top) == k and all(ref[i, t] >= values[-1] - ATOL for t, _ in e.top), i


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-step", "chunked"])
def test_prompt_logprobs_equal_hf(model, budget):
    path, hf = model
    prompt = random_prompt(hf.config.vocab_size, LENGTH, seed=5)
    with LLM(str(path), max_num_batched_tokens=budget, block_size=4) as llm:
        [out] = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K))
        assert_equal_hf(out.prompt_logprobs, hf, prompt)
        [plain] = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert plain.prompt_logprobs is None and out.token_ids == plain.token_ids


def test_prompt_logprobs_after_a_prefix_cache_hit(model):
    """The prompt's blocks are cached by a first request; one asking for prompt logprobs computes them anyway."""
    path, hf = model
    prompt = random_prompt(hf.config.vocab_size, LENGTH, seed=6)
    with LLM(str(path), block_size=4) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        [again] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        assert again.num_cached_tokens == 36                     # the cache holds the prefix
        [out] = llm.generate([prompt + [7]], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    assert out.num_cached_tokens == 0
    assert_equal_hf(out.prompt_logprobs, hf, prompt + [7], k=0)


def test_prompt_logprobs_survive_preemption(model):
    """Two requests that cannot both fit the KV cache: one is preempted and recomputes; its prompt logprobs are
    still every prompt token's, once."""
    path, hf = model
    prompts = [random_prompt(hf.config.vocab_size, LENGTH, seed=s) for s in (11, 12)]
    cfg = EngineConfig(model=str(path), cache=CacheConfig(block_size=4, num_gpu_blocks_override=20),
                       scheduler=SchedulerConfig(max_num_batched_tokens=16, max_model_len=80))
    engine = LLMEngine(cfg)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                           prompt_logprobs=K))
    reqs, firsts = list(engine.scheduler.waiting), {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in firsts
                firsts[out.request_id] = out.prompt_logprobs
    assert sum(r.num_preemptions for r in reqs) >= 1
    for i, prompt in enumerate(prompts):
        assert_equal_hf([None, *firsts[f"r{i}"]], hf, prompt)


def test_prompt_logprobs_of_a_one_token_prompt_is_one_none(tiny_llama):
    with LLM(str(tiny_llama)) as llm:
        [out] = llm.generate([[9]], SamplingParams(max_tokens=1, prompt_logprobs=3))
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_range():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=1.5)


# ---- a prefill node computes them (the store's prefix is not used for it), a decode node forwards them -------------

def _engine(model_dir, role, store):
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=8),
                       scheduler=SchedulerConfig(max_num_batched_tokens=24),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=16))
    return LLMEngine(cfg, store=store)


def _run(engine, rid, prompt, params, transfer=None):
    engine.add_request(rid, prompt, params, transfer)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_prefill_node_computes_them_and_the_decode_node_emits_them(tiny_models):
    path = tiny_models["llama"]
    hf = hf_model(path)
    prompt = random_prompt(hf.config.vocab_size, 50, seed=8)
    store = TieredStore(MemoryTier(64 << 20))
    prefill, decode = _engine(path, "prefill", store), _engine(path, "decode", store)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
        _run(prefill, "warm", prompt, SamplingParams(max_tokens=1), {"do_remote_decode": True})   # fills the store
        outs = _run(prefill, "p", prompt, params, {"do_remote_decode": True})
        assert outs[-1].kv_accounting["store_hit_tokens"] == 0    # computed, not loaded: loaded KV has no logits
        transfer = outs[-1].kv_transfer_params
        assert_equal_hf([None, *outs[0].prompt_logprobs], hf, prompt, k=2)
        assert len(transfer["prompt_logprobs"]) == len(prompt) - 1
        douts = _run(decode, "d", prompt, params, transfer)
        assert douts[-1].kv_accounting["loaded_tokens"] >= 40     # the decode node loaded the prompt
        assert douts[0].prompt_logprobs == outs[0].prompt_logprobs
        assert [o.prompt_logprobs for o in douts[1:]] == [None] * (len(douts) - 1)   # with the first token only
        bad = {**transfer, "prompt_logprobs": transfer["prompt_logprobs"][:-1]}
        with pytest.raises(TransferMismatchError, match="do not follow the prompt"):
            decode.add_request("d2", prompt, params, bad)
        with pytest.raises(TransferMismatchError, match="carries none"):
            decode.add_request("d3", prompt, params, {**transfer, "prompt_logprobs": None})
        token, logprob, _, top = transfer["prompt_logprobs"][0]
        for forged in ([token, logprob, 0, top], [token, 0.5, 1, top], [token, logprob, 1, [[10 ** 6, -1.0]]]):
            with pytest.raises(TransferMismatchError, match="is not a prompt logprob"):
                decode.add_request("d4", prompt, params, {**transfer, "prompt_logprobs": [
                    forged, *transfer["prompt_logprobs"][1:]]})
        with pytest.raises(TransferMismatchError, match="length <= 20"):
            decode.add_request("d5", prompt, params, {**transfer, "prompt_logprobs": [
                [token, logprob, 1, [[1, -1.0]] * 21], *transfer["prompt_logprobs"][1:]]})
        assert not decode.has_unfinished()
    finally:
        prefill.shutdown()
        decode.shutdown()
        store.close()
