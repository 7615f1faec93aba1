"""A tiny DeepSeek V3 through prefill -> store -> decode, and across TP / PP ranks: the latent cache end to end.

* Disaggregated equals colocated (and HF): a prefill engine publishes the prompt's latent chunks into a shared
  in-memory store, a decode engine loads them (whole blocks loaded, only the last prompt token recomputed).
* The store holds the latent + rope part only: its bytes per token are layers x (kv_lora_rank + qk_rope_head_dim)
  x dtype size, asserted from the stored objects (the seal's header aside); the fingerprint names the MLA layout.
* TP 2 (heads split, the latent replicated: TP rank 0 publishes it, every rank loads all of it) and PP 2 engines
  give HF's greedy tokens for V3 and V2 (with and without q_lora_rank) and a V3 whose vocabulary does not divide
  by tp (the padded embedding / LM head), colocated (the prompt chunked), and as the prefill or decode side of a
  disaggregated pair (V3).
"""

from __future__ import annotations

import pytest

from engine_run import run_request
from hf_reference import hf_greedy, hf_model, random_prompt
from pdserve.engine.checkpoints.tiny_deepseek import make_tiny_deepseek
from pdserve.engine.config import (CacheConfig, EngineConfig, KVTransferConfig, ParallelConfig,
                                   SchedulerConfig)
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.auth import process_key
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.seal import SEAL_BYTES, unseal
from pdserve.kvstore.tiered import TieredStore

LENGTH, CHUNK, BLOCK = 77, 32, 8            # 2 full chunks + a partial one
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(model_dir, role, store=None, tp=1, pp=1, budget=2048):
    kv = KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=CHUNK) if role != "both" else \
        KVTransferConfig()
    cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=BLOCK),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                       parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp), kv_transfer=kv)
    return LLMEngine(cfg, store=store)


MODELS = {"v3": ("deepseek_v3", {"q_lora_rank": 24}), "v2-lite": ("deepseek_v2", {}),
          "v2-q-lora": ("deepseek_v2", {"q_lora_rank": 24}),
          "v3-vocab-515": ("deepseek_v3", {"q_lora_rank": 24, "vocab_size": 515})}   # 515 rows: not a multiple of tp


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model dir, prompt, HF's greedy tokens); 2 layers: layer 0 dense, layer 1 MoE."""
    root, out = tmp_path_factory.mktemp("deepseek"), {}
    for name, (arch, shape) in MODELS.items():
        path = make_tiny_deepseek(root / name, arch, seed=4, num_layers=2, **shape)
        ref = hf_model(path)
        prompt = random_prompt(ref.config.vocab_size, LENGTH, seed=11)
        out[name] = (path, prompt, hf_greedy(ref, prompt, GREEDY.max_tokens))
    return out


@pytest.fixture(scope="module")
def v3(models):
    return models["v3"]


@pytest.fixture()
def store():
    s = TieredStore(MemoryTier(64 << 20))
    yield s
    s.close()


def _disagg(path, prompt, store, prefill_par=(1, 1), decode_par=(1, 1)):
    prefill = _engine(path, "prefill", store, *prefill_par)
    decode = _engine(path, "decode", store, *decode_par)
    try:
        first, pf = run_request(prefill, "p", prompt, FIRST, {"do_remote_decode": True})
        params = pf.kv_transfer_params
        tokens, df = run_request(decode, "d", prompt, GREEDY, params)
        assert tokens[0] == first[0]
        return tokens, df.kv_accounting, params
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_disaggregated_equals_colocated_and_loads_the_latent(v3, store):
    path, prompt, expected = v3
    colocated = _engine(path, "both")
    try:
        cold, _ = run_request(colocated, "c", prompt, GREEDY)
    finally:
        colocated.shutdown()
    tokens, acc, params = _disagg(path, prompt, store)
    assert tokens == cold == expected
    assert acc["loaded_tokens"] == LENGTH // BLOCK * BLOCK and acc["recomputed_tokens"] == LENGTH + 1 - acc[
        "loaded_tokens"]
    assert params["kv_layout"] == "mla:latent=32:rope=8:torch.float32"


def test_store_bytes_per_token_are_the_latent_only(v3, store):
    path, prompt, _ = v3
    _, _, params = _disagg(path, prompt, store)
    layers, latent = 2, 32 + 8                                       # tiny V3: kv_lora_rank 32, rope 8, fp32
    keys = [object_key(c, layer) for c in params["chunk_keys"] for layer in range(layers)]
    objects = store.get(keys)
    assert all(o is not None for o in objects)
    payload = sum(o.numel() - SEAL_BYTES for o in objects)
    assert payload == params["num_tokens"] * layers * latent * 4        # bytes/token = layers x (L + R) x 4
    shapes = {tuple(unseal(k, o, process_key().seal_key)[0].shape[::2]) for k, o in zip(keys, objects)}
    assert shapes == {(1, 1)}                                        # [C=1, n, heads=1, W]: nothing per head


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_parallel_colocated_matches_hf(models, name, tp, pp):
    path, prompt, expected = models[name]
    engine = _engine(path, "both", tp=tp, pp=pp, budget=48)            # the prompt is chunked across steps
    try:
        tokens, _ = run_request(engine, "r", prompt, GREEDY)
    finally:
        engine.shutdown()
    assert tokens == expected


@pytest.mark.parametrize("prefill_par,decode_par", [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (2, 1))],
                         ids=["tp2-to-tp1", "tp1-to-tp2", "pp2-to-tp2"])
def test_parallel_disaggregated_matches_hf(v3, store, prefill_par, decode_par):
    path, prompt, expected = v3
    tokens, acc, _ = _disagg(path, prompt, store, prefill_par, decode_par)
    assert tokens == expected
    assert acc["loaded_tokens"] == LENGTH // BLOCK * BLOCK
