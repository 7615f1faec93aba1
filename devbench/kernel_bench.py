"""Triton kernel micro-benchmark: achieved GB/s of decode attention and of chunk gather/scatter (CUDA only).

    decode attention  batch 256, contexts 500..700 tokens (fixed seed), 32 q / 8 KV heads, head dim 64,
                      bf16, block size 16, scrambled block tables; ``unified_attention`` with its own
                      split plan. Bytes = every context's K and V read once + q read + out written.
    gather / scatter  one 256-token chunk of all 16 layers (K and V) between the paged cache and one
                      contiguous object; bytes = the object read once + written once. Successive
                      iterations move different chunks, so the working set is larger than L2.

Each figure is a CUDA-event mean over ``--iters`` launches after ``--warmup``, printed as GB/s, as a
fraction of ``--peak-gbps`` (4800: an H200's HBM3e) and as a ratio to a device memcpy of the same bytes
measured in the same run. Run: ``python devbench/kernel_bench.py [--output kernel_bench.json]``.
``--small`` is the CPU dry run of ``bench/gpu_check.sh``: tiny shapes, the kernels in Triton's interpreter
(set TRITON_INTERPRET=1 first), wall-clock timing; its figures mean nothing, it only runs the code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SMALL = dict(batch=4, context=120, heads=4, kv_heads=2, head_dim=16, layers=2, chunk=16, chunks=2, warmup=1, iters=2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kernel_bench", description=__doc__.splitlines()[0])
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="device memory bandwidth (H200: 4800)")
    p.add_argument("--output", default="kernel_bench.json", help="JSON results file")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=600, help="mean context; lengths are uniform in +-100")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--chunk", type=int, default=256, help="tokens per gathered/scattered chunk")
    p.add_argument("--chunks", type=int, default=16, help="distinct chunks cycled through (beats L2)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="CPU dry run: tiny shapes, interpreted kernels")
    args = p.parse_args(argv)
    if args.small:
        vars(args).update(SMALL)
    args.device = "cpu" if args.small else "cuda"
    return args


def time_ms(fn, warmup: int, iters: int, device: str = "cuda") -> float:
    """Mean ms per call of ``fn(i)`` over iters, CUDA events (CPU: the wall clock), after warmup calls."""
    for i in range(warmup):
        fn(i)
    if device == "cpu":
        start = time.perf_counter()
        for i in range(iters):
            fn(i)
        return (time.perf_counter() - start) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def memcpy_gbps(nbytes: int, args) -> float:
    """Device-to-device copy of nbytes: GB/s counting the read and the write (as the kernels' bytes do)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda i: dst.copy_(src), args.warmup, args.iters, args.device) / 1e6


def decode_case(args):
    """-> (name, fn(i), bytes moved, note) for decode attention over a random paged batch."""
    from pdserve.kernels.metadata import AttentionMetadata
    from pdserve.kernels.triton_attention import plan_attention, unified_attention

    g = torch.Generator().manual_seed(args.seed)
    B, bs, hkv, d = args.batch, args.block_size, args.kv_heads, args.head_dim
    lens = torch.randint(args.context - 100, args.context + 101, (B,), generator=g).tolist()
    per_seq = [-(-n // bs) for n in lens]
    blocks = torch.randperm(sum(per_seq), generator=g).split(per_seq)           # scrambled block tables
    dev = args.device
    meta = AttentionMetadata.build([1] * B, lens, [t.tolist() for t in blocks], bs, device=dev, backend="triton")
    k_cache, v_cache = (torch.randn(sum(per_seq), bs, hkv, d, generator=g).to(torch.bfloat16).to(dev) for _ in "kv")
    q = torch.randn(B, args.heads, d, generator=g).to(torch.bfloat16).to(dev)
    out = torch.empty_like(q)
    plan = plan_attention(B, B, args.heads, hkv, d, 1, max(lens), False)
    nbytes = sum(lens) * hkv * d * 2 * 2 + 2 * q.numel() * 2                    # K+V bf16, q in, out
    fn = lambda i: unified_attention(q, k_cache, v_cache, out, meta, d ** -0.5)   # noqa: E731
    return "decode attention", fn, nbytes, str(plan)


def transfer_cases(args):
    """-> [(name, fn(i), bytes, note)] for gather_chunk and scatter_chunk of one chunk of all layers."""
    from pdserve.kernels.triton_transfer import gather_chunk, scatter_chunk

    g = torch.Generator().manual_seed(args.seed)
    L, bs, hkv, d, n = args.layers, args.block_size, args.kv_heads, args.head_dim, args.chunk
    num_blocks = args.chunks * -(-n // bs)
    dev = args.device
    kv = torch.randn(L, 2, num_blocks, bs, hkv, d, dtype=torch.bfloat16, device=dev)
    slots = torch.randperm(num_blocks * bs, generator=g).to(dev).view(args.chunks, -1)[:, :n].contiguous()
    objs = [torch.empty(L, 2, n, hkv, d, dtype=torch.bfloat16, device=dev) for _ in range(args.chunks)]
    nbytes = 2 * objs[0].numel() * 2
    note = f"{L} layers x K/V x {n} tokens x {hkv} heads x {d}, {args.chunks} chunks cycled"
    return [("gather chunk", lambda i: gather_chunk(kv, slots[i % args.chunks], objs[i % args.chunks]), nbytes, note),
            ("scatter chunk", lambda i: scatter_chunk(kv, slots[i % args.chunks], objs[i % args.chunks]), nbytes, note)]


def measure(name, fn, nbytes, note, args) -> dict:
    ms = time_ms(fn, args.warmup, args.iters, args.device)
    gbps, copy = nbytes / ms / 1e6, memcpy_gbps(nbytes // 2, args)
    return {"name": name, "ms": ms, "bytes": nbytes, "gbps": gbps, "peak_fraction": gbps / args.peak_gbps,
            "memcpy_gbps": copy, "vs_memcpy": gbps / copy, "note": note}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.small and not torch.cuda.is_available():
        print("kernel_bench needs a CUDA device (torch.cuda.is_available() is False); "
              "the kernels' CPU check is tests/test_triton_kernels.py under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import triton

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (--small dry run, interpreted)"
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}, peak {args.peak_gbps:.0f} GB/s")
    rows = [measure(name, fn, nbytes, note, args) for name, fn, nbytes, note in [decode_case(args),
                                                                                *transfer_cases(args)]]
    print(f"{'kernel':<18}{'us':>10}{'MB':>10}{'GB/s':>10}{'% peak':>9}{'memcpy GB/s':>13}{'vs memcpy':>11}")
    for r in rows:
        print(f"{r['name']:<18}{r['ms'] * 1e3:>10.1f}{r['bytes'] / 1e6:>10.1f}{r['gbps']:>10.0f}"
              f"{100 * r['peak_fraction']:>8.1f}%{r['memcpy_gbps']:>13.0f}{r['vs_memcpy']:>11.2f}")
    with open(args.output, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__,
                   "config": vars(args), "results": rows}, f, indent=2)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
