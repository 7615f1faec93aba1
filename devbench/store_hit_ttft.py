"""TTFT with a full KV-store hit against recomputing the prompt, and the disaggregation overhead.

    python devbench/store_hit_ttft.py --model smollm2-135m-instruct --prompt-len 3000 [--repeats 3]

Fixed-seed random prompt. Three measurements in one process, same weights, one thread:
  recompute   a fresh node prefills the whole prompt                         -> TTFT_cold
  store hit   a fresh node (empty prefix cache) loads the prompt's KV from
              the store and recomputes only the last token                  -> TTFT_hit
  overhead    vLLM's disaggregation-overhead method: a decode node given a
              request whose KV is already in the store; its time to the
              first token it computes, in units of one decode step (ITL)
Prints the ratios and writes JSON (``--output``). The store is the embedded memory tier
(``--kv-store tcp://HOST:PORT`` measures a daemon instead).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch


def _engine(model_dir: str, role: str, store, chunk: int):
    from pdserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine

    cfg = EngineConfig(model=model_dir, cache=CacheConfig(kv_cache_memory_bytes=1 << 30),
                       scheduler=SchedulerConfig(max_num_batched_tokens=4096),
                       kv_transfer=KVTransferConfig(role=role, kv_store="embedded", kv_chunk_tokens=chunk))
    return LLMEngine(cfg, store=store)


def _timed(engine, rid: str, prompt, params, transfer=None) -> tuple[list[float], dict]:
    """Seconds from add_request to each token; the final output."""
    start, stamps, final = time.perf_counter(), [], None
    engine.add_request(rid, prompt, params, transfer)
    while engine.has_unfinished():
        for out in engine.step():
            stamps += [time.perf_counter() - start] * len(out.new_token_ids)
            final = out if out.finished else final
    return stamps, final


def run(model_dir: str, prompt_len: int, repeats: int, chunk: int, store_url: str | None) -> dict:
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvstore.memory import MemoryTier
    from pdserve.kvstore.tiered import TieredStore

    store = _store(store_url) if store_url else TieredStore(MemoryTier(4 << 30))
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(0)
    cold, hit, overhead_steps, itl = [], [], [], []
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for r in range(repeats):
        prompt = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        prefill = _engine(model_dir, "prefill", store, chunk)       # fresh: empty prefix cache
        stamps, pf = _timed(prefill, f"p{r}", prompt, one, {"do_remote_decode": True})
        cold.append(stamps[0])
        reader = _engine(model_dir, "both", store, chunk)            # fresh node, warm store
        stamps, out = _timed(reader, f"h{r}", prompt, one)
        hit.append(stamps[0])
        assert out.kv_accounting["loaded_tokens"] > 0, out.kv_accounting
        decode = _engine(model_dir, "decode", store, chunk)
        stamps, _ = _timed(decode, f"d{r}", prompt, SamplingParams(max_tokens=17, temperature=0.0,
                                                                    ignore_eos=True), pf.kv_transfer_params)
        step = statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:]))
        itl.append(step)
        overhead_steps.append(stamps[1] / step)                      # stamps[0]: prefill's token, emitted at once
    return {"prompt_len": prompt_len, "repeats": repeats, "kv_chunk_tokens": chunk,
            "ttft_recompute_s": statistics.median(cold), "ttft_store_hit_s": statistics.median(hit),
            "speedup_store_hit": statistics.median(cold) / statistics.median(hit),
            "decode_itl_s": statistics.median(itl), "disagg_overhead_decode_steps": statistics.median(overhead_steps)}


def _store(url: str):
    from pdserve.kvstore.client import DaemonClient

    return DaemonClient(url, shm_bytes=256 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-chunk-tokens", type=int, default=256)
    ap.add_argument("--kv-store", default=None, help="tcp://HOST:PORT of a `pdserve kvstore` daemon")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--output", default="results/store_hit_ttft.json")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    from pdserve.engine.node import resolve_model

    result = run(str(resolve_model(args.model)), args.prompt_len, args.repeats, args.kv_chunk_tokens, args.kv_store)
    result.update(model=args.model, hardware=f"{platform.machine()} {os.cpu_count()} cores", threads=args.num_threads,
                  torch=torch.__version__, store=args.kv_store or "embedded memory tier")
    print(f"\n{args.model}, {args.prompt_len}-token prompt, {result['hardware']}, {args.num_threads} thread(s)")
    print(f"TTFT recompute        {result['ttft_recompute_s'] * 1000:9.1f} ms")
    print(f"TTFT full store hit   {result['ttft_store_hit_s'] * 1000:9.1f} ms   "
          f"({result['speedup_store_hit']:.1f}x faster)")
    print(f"decode step (ITL)     {result['decode_itl_s'] * 1000:9.1f} ms")
    print(f"disagg overhead       {result['disagg_overhead_decode_steps']:9.2f} decode steps "
          f"(decode-node time to its first computed token / ITL)")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    json.dump(result, open(args.output, "w"), indent=2)


if __name__ == "__main__":
    main()
