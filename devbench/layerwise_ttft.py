"""TTFT of a full store hit on a decode node: chunk-major loads vs ``--kv-load-layerwise``, same run.

    python devbench/layerwise_ttft.py --model DIR [--prompt-len 1024] [--chunk 256] [--repeats 5]
        [--store delay --get-ms 2 --get-gbps 1]     a real embedded memory store behind a delay wrapper: every read
                                                    call (borrow/get/lookup) sleeps get_ms + bytes / get_gbps
        [--store redis --redis redis://127.0.0.1:6379/0]   the decode node's embedded store reads from Redis (its own
                                                    empty L1; the prefill node wrote through to the same Redis)
        [--tail N]                                  the store holds all but the last N prompt tokens: a prefix hit
                                                    whose tail (N tokens) the decode node computes

Per repeat and mode: a fresh fixed-seed prompt is prefilled and published by a prefill engine, then a decode engine
(chunk-major or layerwise) gets the request with the prefill's ``kv_transfer_params``: it loads every chunk but the
tail and computes the tail. TTFT = add_request -> the first token the decode node computes (its first output token is the prefill's,
streamed at once), in-process, one thread for torch. The modes alternate
within a repeat. Prints the medians (and minimums: the box may be shared) and layerwise / chunk-major, writes JSON
(``--output``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import torch


class DelayedStore:
    """A real store whose read calls take ``get_ms`` + their bytes at ``get_gbps`` longer (a store across a link)."""

    def __init__(self, store, get_ms: float, get_gbps: float):
        self.store, self.get_s, self.bytes_per_s = store, get_ms / 1e3, get_gbps * 1e9
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def _wait(self, objs) -> None:
        self.calls += 1
        nbytes = sum(o.numel() * o.element_size() for o in objs if o is not None)
        time.sleep(self.get_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0))

    def lookup(self, chunk_keys, num_layers):
        time.sleep(self.get_s)
        return self.store.lookup(chunk_keys, num_layers)

    def get(self, keys):
        objs = self.store.get(keys)
        self._wait(objs)
        return objs

    @contextlib.contextmanager
    def borrow(self, keys):
        with self.store.borrow(keys) as objs:
            self._wait(objs)
            yield objs


def _engine(model_dir: str, role: str, store, chunk: int, layerwise: bool = False):
    from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine

    cfg = EngineConfig(model=model_dir, cache=CacheConfig(kv_cache_memory_bytes=512 << 20),
                       scheduler=SchedulerConfig(max_num_batched_tokens=4096),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=chunk,
                                                    kv_load_layerwise=layerwise))
    return LLMEngine(cfg, store=store)


def _ttft(engine, rid: str, prompt, params, transfer) -> tuple[float, dict]:
    """Seconds to the first token the decode node computes (given the prefill's ``transfer``, its first output
    token is the prefill node's, streamed at once: the second one here), and the request's KV accounting."""
    start, stamps, final = time.perf_counter(), [], None
    engine.add_request(rid, prompt, params, transfer)
    while engine.has_unfinished():
        for out in engine.step():
            stamps += [time.perf_counter() - start] * len(out.new_token_ids)
            final = out if out.finished else final
    return stamps[1 if transfer else 0], final.kv_accounting


def _stores(args):
    """(the prefill engine's store, the decode engines' stores): same data, the decode side behind the link."""
    from pdserve.kvstore.memory import MemoryTier
    from pdserve.kvstore.redis_tier import RedisTier
    from pdserve.kvstore.tiered import TieredStore

    if args.store == "delay":
        shared = TieredStore(MemoryTier(4 << 30))
        return shared, [DelayedStore(shared, args.get_ms, args.get_gbps) for _ in range(2)]
    prefix = f"pdkv-lwbench-{os.getpid()}:"
    return (TieredStore(MemoryTier(4 << 30), [RedisTier(args.redis, prefix=prefix)]),
            [TieredStore(MemoryTier(4 << 30), [RedisTier(args.redis, prefix=prefix)]) for _ in range(2)])


def run(args) -> dict:
    from pdserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    prefill_store, decode_stores = _stores(args)
    prefill = _engine(args.model, "prefill", prefill_store, args.chunk)
    decodes = [_engine(args.model, "decode", s, args.chunk, layerwise=lw) for s, lw in zip(decode_stores, (0, 1))]
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ttft, accounting = {"chunk_major": [], "layerwise": []}, {}
    for r in range(args.repeats + 1):                               # repeat 0 warms both engines up
        for mode, decode in zip(ttft, decodes):
            prompt = torch.randint(10, vocab - 10, (args.prompt_len,), generator=g).tolist()
            out = None
            prefill.add_request(f"p{r}{mode}", prompt[:args.prompt_len - args.tail], one, {"do_remote_decode": True})
            while prefill.has_unfinished():
                out = next((o for o in prefill.step() if o.finished), out)
            transfer = None if args.tail else out.kv_transfer_params   # --tail: a prefix hit, found by lookup
            seconds, accounting[mode] = _ttft(decode, f"d{r}{mode}", prompt, two, transfer)
            if r:
                ttft[mode].append(seconds)
    for engine in (prefill, *decodes):
        engine.shutdown()
    med = {mode: statistics.median(v) for mode, v in ttft.items()}
    best = {mode: min(v) for mode, v in ttft.items()}
    return {"model": args.model, "prompt_len": args.prompt_len, "chunk_tokens": args.chunk, "store": args.store,
            "get_ms": args.get_ms if args.store == "delay" else None,
            "get_gbps": args.get_gbps if args.store == "delay" else None,
            "threads": args.threads, "repeats": args.repeats, "cpu": platform.processor() or platform.machine(),
            "tail": args.tail, "ttft_s": ttft, "median_ttft_ms": {m: round(v * 1e3, 2) for m, v in med.items()},
            "min_ttft_ms": {m: round(v * 1e3, 2) for m, v in best.items()},
            "layerwise_over_chunk_major": round(med["layerwise"] / med["chunk_major"], 3),
            "layerwise_over_chunk_major_min": round(best["layerwise"] / best["chunk_major"], 3),
            "accounting": accounting}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--tail", type=int, default=0, help="0: a full store hit (the prefill node's request); N: the "
                   "store holds all but the last N prompt tokens (a prefix published earlier), the decode node "
                   "computes N")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--store", choices=("delay", "redis"), default="delay")
    p.add_argument("--get-ms", type=float, default=2.0, help="delay store: per read call")
    p.add_argument("--get-gbps", type=float, default=0.0, help="delay store: read bandwidth (0: latency only)")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    result = run(args)
    m, b = result["median_ttft_ms"], result["min_ttft_ms"]
    print(f"{args.store} store, prompt {args.prompt_len}, tail {args.tail}, chunk {args.chunk}: TTFT median (min) "
          f"chunk-major {m['chunk_major']} ({b['chunk_major']}) ms, layerwise {m['layerwise']} ({b['layerwise']}) ms, "
          f"layerwise / chunk-major {result['layerwise_over_chunk_major']} "
          f"({result['layerwise_over_chunk_major_min']})")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
