"""The GPU execution path's table, each figure beside its roofline (run by ``bench/gpu_check.sh``).

    python devbench/gpu_bench.py --device cuda --output OUT.json            # the ~1B Llama of issue 13
    python devbench/gpu_bench.py --device cpu --small --output OUT.json     # dry run of the same code

Measures, on one generated Llama (16 layers, hidden 2048, 32 q / 8 KV heads, head dim 64,
intermediate 8192, bf16 — or a tiny one with ``--small``):

| figure             | how                                                               | roofline                     |
| offline tok/s      | 256 prompts x 512 in / 128 out, greedy, ``LLM.generate``           | decode steps at HBM speed    |
| decode step ms     | 256 running requests at ~600 tokens of context, mean engine step   | (weights + KV bytes) / HBM   |
| 8k prefill ms      | one 8,192-token prompt in one step (max_tokens 1)                  | 2 * params * 8192 / peak     |
| 8k store hit ms    | the same prompt on a second engine over one embedded store: TTFT   | KV bytes / PCIe-host copy    |
|                    | with the KV loaded vs recomputed                                   |                              |

Each row prints ``measured``, ``roofline`` and ``measured / roofline``; the JSON holds all of it.
Every figure syncs the device before reading the clock. ``--peak-gbps`` / ``--peak-tflops`` give
the device's limits (H200: 4,800 GB/s, ~790 dense bf16 TFLOP/s measured).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BIG = dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, intermediate_size=8192)
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny model and workload: a CPU dry run of this script")
    p.add_argument("--model-dir", default="/tmp/gpu-bench-model")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attention-backend", default=None, choices=["cpu", "torch", "triton"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--only", default="offline,decode,prefill,store", help="comma-separated figures to measure")
    p.add_argument("--peak-gbps", type=float, default=4800.0)
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--host-gbps", type=float, default=50.0, help="pinned host<->device copy speed for the store row")
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def workload(args) -> dict:
    if args.small:
        return dict(prompts=8, input_len=24, output_len=8, decode_batch=8, decode_ctx=40, long_prompt=96)
    return dict(prompts=256, input_len=512, output_len=128, decode_batch=256, decode_ctx=600, long_prompt=8192)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_llm(args, **kw):
    from pdserve.engine import LLM

    return LLM(args.model_dir, device=args.device, dtype=args.dtype, max_num_seqs=kw.pop("max_num_seqs", 256),
               attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
               enable_prefix_caching=False, **kw)


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def offline(args, w, cfg) -> dict:
    from pdserve.engine import SamplingParams

    llm = make_llm(args, max_num_batched_tokens=8192, max_model_len=1024,
                   kv_cache_memory_bytes=_kv_bytes(args, cfg, w, 1.3))
    ps = prompts(cfg["vocab"], w["prompts"], w["input_len"], 0)
    params = SamplingParams(max_tokens=w["output_len"], temperature=0.0, ignore_eos=True)
    llm.generate(ps[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))    # warm-up
    sync(args.device)
    start = time.perf_counter()
    outs = llm.generate(ps, params)
    sync(args.device)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    tokens = sum(len(o.token_ids) for o in outs)
    # roofline: every decode step reads the weights once plus the batch's KV; prefill at peak FLOPs
    steps = w["output_len"]
    kv_read = sum(cfg["kv_bytes_per_token"] * (w["input_len"] + i) * w["prompts"] for i in range(steps))
    ideal = (steps * cfg["weight_bytes"] + kv_read) / (args.peak_gbps * 1e9) \
        + 2 * cfg["params"] * w["input_len"] * w["prompts"] / (args.peak_tflops * 1e12)
    return _row("offline output tok/s", tokens / elapsed, tokens / ideal, higher_is_better=True)


def decode_step(args, w, cfg) -> dict:
    from pdserve.engine import SamplingParams

    b, ctx = w["decode_batch"], w["decode_ctx"]
    llm = make_llm(args, max_num_batched_tokens=8192, max_model_len=1024,
                   kv_cache_memory_bytes=_kv_bytes(args, cfg, w, 1.5))
    engine = llm.engine
    for i, p in enumerate(prompts(cfg["vocab"], b, max(1, ctx - 23), 1)):   # ~ctx during the timed steps
        engine.add_request(f"d{i}", p, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()                                          # every prompt prefilled
    for _ in range(3):
        engine.step()
    sync(args.device)
    n, start = 20, time.perf_counter()
    for _ in range(n):
        engine.step()
    sync(args.device)
    ms = (time.perf_counter() - start) / n * 1e3
    for i in range(b):
        engine.abort_request(f"d{i}")
    llm.shutdown()
    ideal_ms = (cfg["weight_bytes"] + cfg["kv_bytes_per_token"] * ctx * b) / (args.peak_gbps * 1e9) * 1e3
    return _row(f"decode step ms (batch {b}, ~{ctx} ctx)", ms, ideal_ms)


def prefill(args, w, cfg) -> dict:
    from pdserve.engine import SamplingParams

    n = w["long_prompt"]
    llm = make_llm(args, max_num_batched_tokens=n, max_model_len=n + 64,
                   kv_cache_memory_bytes=cfg["kv_bytes_per_token"] * (n + 64) * 3)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompts(cfg["vocab"], 1, n, 5)[0]], params)                                # warm-up
    best = float("inf")
    for seed in (2, 3):
        sync(args.device)
        start = time.perf_counter()
        llm.generate([prompts(cfg["vocab"], 1, n, seed)[0]], params)
        sync(args.device)
        best = min(best, (time.perf_counter() - start) * 1e3)
    llm.shutdown()
    ideal_ms = 2 * cfg["params"] * n / (args.peak_tflops * 1e12) * 1e3
    return _row(f"{n}-token prefill ms", best, ideal_ms)


def store_hit(args, w, cfg) -> list[dict]:
    from pdserve.engine.config import CacheConfig, EngineConfig, ExecutionConfig, KVTransferConfig, SchedulerConfig
    from pdserve.engine.core.llm_engine import LLMEngine
    from pdserve.engine.kv.store_factory import build_node_store
    from pdserve.engine.sampling_params import SamplingParams

    n = w["long_prompt"]
    kv = KVTransferConfig(role="both", kv_store="embedded", kv_cpu_bytes=cfg["kv_bytes_per_token"] * n * 4)

    def engine():
        return LLMEngine(EngineConfig(
            model=args.model_dir, dtype=args.dtype or "auto", device=args.device,
            cache=CacheConfig(kv_cache_memory_bytes=cfg["kv_bytes_per_token"] * (n + 64) * 3,
                              enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=n, max_model_len=n + 64, max_num_seqs=8),
            execution=ExecutionConfig(args.attention_backend, args.enforce_eager), kv_transfer=kv), store=store)

    accounting = {}

    def ttft(eng, rid, prompt) -> float:
        sync(args.device)
        start = time.perf_counter()
        eng.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished():
            for out in eng.step():
                accounting[rid] = out.kv_accounting or accounting.get(rid)
        sync(args.device)
        return (time.perf_counter() - start) * 1e3

    store = build_node_store(kv)
    a, b = engine(), engine()
    ttft(a, "warm-a", prompts(cfg["vocab"], 1, n, 7)[0])
    ttft(b, "warm-b", prompts(cfg["vocab"], 1, n, 7)[0])                 # warm-up: a hit, kernels compiled
    p = prompts(cfg["vocab"], 1, n, 8)[0]
    recompute = ttft(a, "publish", p)                                     # computes and publishes
    hit = ttft(b, "hit", p)                                               # loads from the store
    loaded = (accounting.get("hit") or {}).get("loaded_tokens")
    a.shutdown(), b.shutdown()
    store.close()
    kv_bytes = cfg["kv_bytes_per_token"] * n
    return [_row(f"{n}-token store hit ms (TTFT, KV loaded)", hit, kv_bytes / (args.host_gbps * 1e9) * 1e3,
                 extra={"recompute_ms": recompute, "hit_over_recompute": recompute / hit, "loaded_tokens": loaded,
                        "kv_mb": kv_bytes / 1e6})]


def _row(name: str, measured: float, ideal: float, higher_is_better: bool = False, extra=None) -> dict:
    ratio = ideal / measured if higher_is_better else measured / ideal
    return {"figure": name, "measured": measured, "roofline": ideal, "times_roofline": ratio, **(extra or {})}


def _kv_bytes(args, cfg, w, factor: float) -> int:
    tokens = max(w["prompts"] * (w["input_len"] + w["output_len"]), w["decode_batch"] * (w["decode_ctx"] + 100),
                 1024)
    return int(cfg["kv_bytes_per_token"] * tokens * factor)


def model_facts(args) -> dict:
    from pdserve.engine.checkpoints.tiny_model import make_tiny_model
    from pdserve.engine.models.model_config import ModelConfig

    spec = SMALL if args.small else BIG
    if not (Path(args.model_dir) / "config.json").exists():
        make_tiny_model(args.model_dir, arch="llama", seed=0, max_position_embeddings=16384, **spec)
    mc = ModelConfig.from_dir(args.model_dir, dtype=args.dtype)
    layout = mc.kv_layout()
    h, inter, layers, vocab = spec["hidden_size"], spec["intermediate_size"], spec["num_layers"], mc.vocab_size
    hd = h // spec["num_heads"]
    per_layer = h * hd * (spec["num_heads"] + 2 * spec["num_kv_heads"]) + hd * spec["num_heads"] * h + 3 * h * inter
    params = layers * per_layer + 2 * vocab * h
    item = torch.empty((), dtype=layout.dtype).element_size()
    return {"params": params, "weight_bytes": params * item, "kv_bytes_per_token": layout.bytes_per_token,
            "vocab": vocab}


def main(argv=None) -> None:
    args = parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    torch.set_num_threads(1 if args.device == "cuda" else torch.get_num_threads())
    cfg, w = model_facts(args), workload(args)
    print(f"model: {cfg['params'] / 1e9:.2f} B params, {cfg['weight_bytes'] / 1e9:.2f} GB weights, "
          f"{cfg['kv_bytes_per_token']} KV bytes/token; workload {w}", flush=True)
    rows, figures = [], args.only.split(",")
    steps = {"offline": offline, "decode": decode_step, "prefill": prefill, "store": store_hit}
    for name in figures:
        start = time.perf_counter()
        got = steps[name](args, w, cfg)
        for r in got if isinstance(got, list) else [got]:
            r["wall_s"] = time.perf_counter() - start
            rows.append(r)
            print(f"{r['figure']:<48} {r['measured']:>10.2f}   roofline {r['roofline']:>10.2f}   "
                  f"x{r['times_roofline']:.2f}", flush=True)
        if args.output:
            Path(args.output).write_text(json.dumps({"model": cfg, "workload": w, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
