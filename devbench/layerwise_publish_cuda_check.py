"""CUDA check of layerwise publishing: on a GPU node the objects a layerwise prefill stores are the per-step bytes,
with two requests in one step, a 2-slot ring and a busy compute stream, and a decode node loading them answers as a
colocated node does. Prints one verdict line per check; exit status 1 if any failed.

    python3 -P devbench/layerwise_publish_cuda_check.py [--layers 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from pdserve.engine.checkpoints.tiny_model import make_tiny_model
from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.engine.core.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore

CHUNK = 32
GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine(model, role, store, layerwise=False, slots=None, budget=2048):
    ring = {} if slots is None else dict(kv_publish_buffer_bytes=slots)
    kv = KVTransferConfig(role=role, kv_store="embedded" if store is not None else None, kv_chunk_tokens=CHUNK,
                          kv_publish_layerwise=layerwise, **ring)
    cfg = EngineConfig(model=str(model), device="cuda", cache=CacheConfig(block_size=16),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget), kv_transfer=kv)
    return LLMEngine(cfg, store=store)


def run(eng, reqs, transfer):
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params, transfer)
    tokens, finals = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    return tokens, finals


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    model = make_tiny_model(Path(tempfile.mkdtemp()) / "llama", arch="llama", seed=0, num_layers=args.layers,
                            hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=512)
    g = torch.Generator().manual_seed(0)
    prompts = {"a": torch.randint(3, 1000, (300,), generator=g).tolist(),
               "b": torch.randint(3, 1000, (170,), generator=g).tolist()}
    probe = engine(model, "both", None)
    chunk_bytes = probe.layout.bytes_per_token * CHUNK
    probe.shutdown()
    ok = True
    for budget in (2048, 100):
        results = {}
        for layerwise in (False, True):
            store = TieredStore(MemoryTier(1 << 30))
            eng = engine(model, "prefill", store, layerwise, 2 * chunk_bytes, budget)
            reqs = [(rid, p, SamplingParams(max_tokens=1, **GREEDY)) for rid, p in prompts.items()]
            _, finals = run(eng, reqs, {"do_remote_decode": True})
            n = eng.layout.num_layers
            keys = [object_key(k, i) for p in prompts.values()
                    for k in chunk_keys(p, CHUNK, eng.connector.fingerprint, include_partial=True) for i in range(n)]
            results[layerwise] = ({r: f.kv_transfer_params for r, f in finals.items()},
                                  dict(zip(keys, store.get(keys))), store)
            inflight = eng.connector.stats()["publish_buffer_bytes_in_flight"]
            eng.shutdown()
            ok &= verdict(f"budget {budget} layerwise={layerwise}: ring empty after", inflight == 0)
        (pp, po, _), (lp, lo, lstore) = results[False], results[True]
        ok &= verdict(f"budget {budget}: transfer params equal", pp == lp)
        ok &= verdict(f"budget {budget}: every chunk published", all(lp[r]["num_tokens"] == len(p)
                                                                     for r, p in prompts.items()))
        same = po.keys() == lo.keys() and all(po[k] is not None and torch.equal(po[k], lo[k]) for k in po)
        ok &= verdict(f"budget {budget}: stored objects byte-equal ({len(po)})", same)
        colocated, _ = run(engine(model, "both", None), [("c", prompts["a"], SamplingParams(max_tokens=8, **GREEDY))],
                           None)
        dec = engine(model, "decode", lstore)
        got, fin = run(dec, [("d", prompts["a"], SamplingParams(max_tokens=8, **GREEDY))], lp["a"])
        ok &= verdict(f"budget {budget}: decode == colocated (loaded {fin['d'].kv_accounting['loaded_tokens']})",
                      got["d"] == colocated["c"])
        dec.shutdown()
    return 0 if ok else 1


def verdict(name: str, good: bool) -> bool:
    print(("PASS " if good else "FAIL ") + name, flush=True)
    return good


if __name__ == "__main__":
    sys.exit(main())
