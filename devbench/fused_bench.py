"""Fused vs unfused RMSNorm (+ residual add) and rotary embedding: us per call at a 1B Llama's shapes (CUDA).

Decides ``PDSERVE_FUSED_NORM`` / ``PDSERVE_FUSED_ROPE`` (``kernels/fused_ops.py``; default ``auto``: the kernels
on CUDA). Per token count (decode batches 1, 32, 256; prompt steps 2048, 8192), Llama-3.2-1B in bf16 (hidden
2048, 32 q / 8 KV heads of 64):

    add+norm   unfused: ``residual + x`` then the torch RMSNorm (float32 temporaries, ~6 kernels)
               fused:   ``triton_norm.rms_norm(x, w, eps, residual)`` (one kernel, both outputs)
    norm       the plain norm (a layer's first input norm): the torch RMSNorm vs the kernel
    rope       unfused: ``apply_rotary``'s torch path on q and on k, float32 cos/sin cast per call, rotate_half's cat
               fused:   ``triton_rope.rotary_qk`` on q and k in place, cos/sin cast once beforehand

Each is timed eagerly (CUDA events, mean of ``--iters`` after ``--warmup``) and, for decode sizes (<= 256 tokens,
which the engine replays as CUDA graphs), as ``--graph-calls`` calls captured in one CUDA graph, replayed. The
verdict per switch: ``auto`` where the fused op is no slower (within 2%) at every size in the mode the engine
runs it (graph for decode sizes, eager for prompts), else ``0`` where it is slower at every size, else mixed.
Then the bits: the rope kernel must equal the torch path exactly (bf16 and fp32: fp32 with FMA contraction off)
and the fused add's residual exactly; the norm's max difference is reported. Exit 1 if a bit check fails.
``--small``: the CPU dry run of ``bench/gpu_check.sh`` (tiny shapes, kernels interpreted: set TRITON_INTERPRET=1;
wall-clock figures that mean nothing). Run: ``python devbench/fused_bench.py [--output fused_bench.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kernel_bench import time_ms

LLAMA_1B = dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, tokens=[1, 32, 256, 2048, 8192])
SMALL = dict(hidden=48, heads=4, kv_heads=2, head_dim=16, tokens=[1, 8], warmup=1, iters=2)
GRAPH_MAX_TOKENS = 256
EPS = 1e-5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fused_bench", description=__doc__.splitlines()[0])
    p.add_argument("--output", default="fused_bench.json", help="JSON results file")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--graph-calls", type=int, default=20, help="calls captured in one CUDA graph")
    p.add_argument("--small", action="store_true", help="CPU dry run: tiny shapes, interpreted kernels")
    args = p.parse_args(argv)
    vars(args).update(LLAMA_1B)
    if args.small:
        vars(args).update(SMALL)
    args.device = "cpu" if args.small else "cuda"
    return args


def cases(args, t: int, dtype: torch.dtype) -> dict:
    """-> {op: (unfused fn(i), fused fn(i))} on fresh tensors of ``t`` tokens."""
    from pdserve.kernels import fused_ops, triton_norm, triton_rope

    dev, d, hd = args.device, args.hidden, args.head_dim
    g = torch.Generator().manual_seed(t)
    x, r = (torch.randn(t, d, generator=g).to(dtype).to(dev) for _ in "xr")
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(dev)
    q = torch.randn(t, args.heads, hd, generator=g).to(dtype).to(dev)
    k = torch.randn(t, args.kv_heads, hd, generator=g).to(dtype).to(dev)
    cos, sin = rope_tables(t, hd, dev)
    cos_dt, sin_dt = cos.to(dtype), sin.to(dtype)
    return {
        "add+norm": (lambda i: fused_ops.rms_norm_ref(x, w, EPS, r), lambda i: triton_norm.rms_norm(x, w, EPS, r)),
        "norm": (lambda i: fused_ops.rms_norm_ref(x, w, EPS), lambda i: triton_norm.rms_norm(x, w, EPS)),
        "rope": (lambda i: (fused_ops.rotary_ref(q, cos, sin), fused_ops.rotary_ref(k, cos, sin)),
                 lambda i: triton_rope.rotary_qk(q, k, cos_dt, sin_dt)),
    }


def rope_tables(t: int, hd: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [t, hd] at positions 0..t-1 (theta 500000, Llama 3's)."""
    freqs = torch.arange(t).float()[:, None] / 500000.0 ** (torch.arange(0, hd, 2).float() / hd)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dev), emb.sin().to(dev)


def graph_ms(fn, calls: int, iters: int) -> float:
    """ms per call of ``fn`` with ``calls`` calls captured in one CUDA graph, replayed ``iters`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return time_ms(lambda i: graph.replay(), 2, max(1, iters // calls)) / calls


def measure(args, dtype: torch.dtype) -> list[dict]:
    rows = []
    for t in args.tokens:
        for op, (unfused, fused) in cases(args, t, dtype).items():
            row = {"op": op, "tokens": t}
            for name, fn in (("unfused", unfused), ("fused", fused)):
                row[f"{name}_eager_us"] = 1e3 * time_ms(fn, args.warmup, args.iters, args.device)
                if args.device == "cuda" and t <= GRAPH_MAX_TOKENS:
                    row[f"{name}_graph_us"] = 1e3 * graph_ms(fn, args.graph_calls, args.iters)
            mode = "graph" if "fused_graph_us" in row else "eager"
            row["mode"], row["speedup"] = mode, row[f"unfused_{mode}_us"] / row[f"fused_{mode}_us"]
            rows.append(row)
    return rows


def verdicts(rows: list[dict]) -> dict:
    """switch -> auto (fused no slower anywhere), 0 (slower everywhere) or mixed, from the engine's modes."""
    out = {}
    for switch, ops in (("PDSERVE_FUSED_NORM", ("add+norm", "norm")), ("PDSERVE_FUSED_ROPE", ("rope",))):
        speedups = [r["speedup"] for r in rows if r["op"] in ops]
        out[switch] = ("auto" if min(speedups) >= 0.98 else "0" if max(speedups) < 1.0 else "mixed") + \
            f" (speedup {min(speedups):.2f}..{max(speedups):.2f})"
    return out


def bit_checks(args) -> dict:
    """The kernels' bits against the torch path at 37 tokens, per dtype (bf16 is not checked interpreted:
    the interpreter truncates to bf16)."""
    from pdserve.kernels import fused_ops, triton_rope

    out = {}
    for dtype in (torch.float32, torch.float16) if args.small else (torch.float32, torch.bfloat16):
        c = cases(args, 37, dtype)
        (y_ref, s_ref), (y, s) = c["add+norm"][0](0), c["add+norm"][1](0)
        q, k = (torch.randn(37, h, args.head_dim).to(dtype).to(args.device) for h in (args.heads, args.kv_heads))
        cos, sin = rope_tables(37, args.head_dim, args.device)
        want = fused_ops.rotary_ref(q, cos, sin), fused_ops.rotary_ref(k, cos, sin)
        triton_rope.rotary_qk(q, k, cos, sin)
        plain, plain_ref = c["norm"][1](0).float(), c["norm"][0](0).float()
        out[str(dtype).removeprefix("torch.")] = {
            "rope_exact": torch.equal(q, want[0]) and torch.equal(k, want[1]),
            "residual_exact": torch.equal(s, s_ref),
            "norm_max_abs_diff": max((y.float() - y_ref.float()).abs().max().item(),
                                     (plain - plain_ref).abs().max().item()),
        }
    return out


def report(rows: list[dict], verdict: dict, bits: dict) -> None:
    print(f"{'op':<10}{'tokens':>7}{'unfused us':>12}{'fused us':>10}{'speedup':>9}  mode  (eager us unfused/fused)")
    for r in rows:
        m = r["mode"]
        print(f"{r['op']:<10}{r['tokens']:>7}{r[f'unfused_{m}_us']:>12.1f}{r[f'fused_{m}_us']:>10.1f}"
              f"{r['speedup']:>9.2f}  {m:<5} ({r['unfused_eager_us']:.1f}/{r['fused_eager_us']:.1f})")
    for switch, v in verdict.items():
        print(f"verdict {switch}={v}")
    for dtype, b in bits.items():
        print(f"bits {dtype}: rope exact {b['rope_exact']}, residual exact {b['residual_exact']}, "
              f"norm max |diff| {b['norm_max_abs_diff']:.3g}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.small and not torch.cuda.is_available():
        print("fused_bench needs a CUDA device; the kernels' CPU check is tests/test_fused_ops.py under "
              "TRITON_INTERPRET=1 (or run --small)", file=sys.stderr)
        return 2
    import triton

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (--small dry run, interpreted)"
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, hidden {args.hidden}, "
          f"{args.heads}/{args.kv_heads} heads of {args.head_dim}")
    with torch.inference_mode():
        rows = measure(args, getattr(torch, args.dtype))
        bits = bit_checks(args)
    verdict = verdicts(rows)
    report(rows, verdict, bits)
    with open(args.output, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__, "config": vars(args),
                   "results": rows, "verdict": verdict, "bits": bits}, f, indent=2)
    print(f"wrote {args.output}")
    ok = all(b["rope_exact"] and b["residual_exact"] for b in bits.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
