"""Every Triton kernel variant the planner can choose, built for sm_90 offline: registers, spills, shared memory.

    python -P devbench/compile_table.py                       # the full matrix, a markdown table on stdout
    python -P devbench/compile_table.py --json OUT.json       # also the rows as JSON (tests/test_kernel_compile.py)

The matrix: bf16 / fp16 / fp32 x head dims 64..256 x GQA ratios 1..8 (8 KV heads), every tile choice of the
attention planner for each (``kernels/kernel_variants.py``: decode and prefill, with and without split-K, and the
reduce of the split), the cache write, the KV connector's gather/scatter, the fused MoE's two grouped GEMMs at
each BLOCK_M and DeepSeek's MLA decode (latent 512 + rope 64: one split and split-K, its reduce, the latent write);
jobs that compile the same kernel
are built once (the head group is a runtime argument, so the attention kernel does not depend on it). A row fails
on any register spill or more shared memory than an sm_90 block may use (227 KB). Needs no GPU: Triton's
bundled ptxas (``kernels/offline_compile.py``); run with TRITON_INTERPRET unset or 0. About 90 s on 2 cores.
Exit status 1 if any row fails; also a part of ``bench/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"                  # before triton: the interpreter's jit compiles nothing
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # the launch's default, without Triton 3.9's warning

from pdserve.kernels import offline_compile  # noqa: E402
from pdserve.kernels.kernel_variants import MLA_SHAPES, MLAShape, ModelShape  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (64, 96, 128, 192, 256)
QPKS = tuple(range(1, 9))
WINDOWED = (128, 4, 4096)    # head dim, GQA ratio, window of a Mistral-shaped model: WINDOW adds a compare per key


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    p.add_argument("--qpk", default=",".join(map(str, QPKS)), help="query heads per KV head (8 KV heads)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: every core)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--markdown", default=None, help="write the summary and the full table here")
    return p.parse_args(argv)


def shapes(args) -> list[ModelShape]:
    dtypes = args.dtypes.split(",")
    plain = [ModelShape(8 * q, 8, d, dt, args.block_size)
             for dt in dtypes for d in map(int, args.head_dims.split(",")) for q in map(int, args.qpk.split(","))]
    d, q, window = WINDOWED
    return plain + [ModelShape(8 * q, 8, d, dt, args.block_size, window) for dt in dtypes]


def mla_shapes(args) -> list[MLAShape]:
    return [MLAShape(L, R, dt, args.block_size) for dt in args.dtypes.split(",") for L, R in MLA_SHAPES]


def rows(shape_list: list[ModelShape], workers: int | None, mla: list[MLAShape] = ()) -> list[dict]:
    """One row per distinct kernel: label, usage, pass/fail."""
    jobs = {}
    for shape in shape_list:
        for job in offline_compile.launch_jobs(shape):
            jobs.setdefault(job.key, job)
    for shape in mla:
        for job in offline_compile.mla_jobs(shape):
            jobs.setdefault(job.key, job)
    for dtype in sorted({shape.dtype for shape in shape_list}):
        for job in offline_compile.moe_jobs(dtype):
            jobs.setdefault(job.key, job)
    jobs = list(jobs.values())
    out = []
    for job, usage in zip(jobs, offline_compile.compile_all(jobs, workers)):
        ok = usage["spill_stores"] == 0 and usage["smem"] <= offline_compile.SM90_SMEM_LIMIT
        out.append({"variant": job.label, **usage, "ok": ok})
    return out


def summary(table: list[dict]) -> str:
    """Attention per dtype and head dim, the other kernels per dtype: how many variants, the most registers,
    spill stores and smem of any."""
    groups: dict[tuple, list[dict]] = {}
    for r in table:
        kernel, dt, d = r["variant"].split()[:3]
        groups.setdefault((kernel, dt, d[1:] if kernel == "attn" else "all"), []).append(r)
    lines = ["| kernel | dtype | head dim | variants | max registers | spill stores (B) | max smem (KB) |",
             "|---|---|---|---|---|---|---|"]
    kernels = ("attn", "reduce", "write", "gather", "scatter", "norm", "rope", "moe", "mla", "mla_reduce", "mla_write")
    order = {name: i for i, name in enumerate(kernels)}
    order.update(bf16=0, fp16=1, fp32=2)          # a kernel not named here sorts last, by name
    for (kernel, dt, d), rs in sorted(groups.items(), key=lambda g: (order.get(g[0][0], 99), g[0][0],
                                                                    order.get(g[0][1], 9),
                                                                    int(g[0][2]) if g[0][2].isdigit() else 0)):
        lines.append(f"| {kernel} | {dt} | {d} | {len(rs)} | {max(r['registers'] for r in rs)} | "
                     f"{sum(r['spill_stores'] for r in rs)} | {max(r['smem'] for r in rs) / 1024:.1f} |")
    return "\n".join(lines)


def markdown(table: list[dict]) -> str:
    lines = ["| variant | registers | spill stores (B) | spill loads (B) | smem (KB) | |", "|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['variant']} | {r['registers']} | {r['spill_stores']} | {r['spill_loads']} | "
                     f"{r['smem'] / 1024:.1f} | {'ok' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = offline_compile.ptxas_missing()
    if missing:
        print(f"no offline compile: {missing}")
        return 0
    start = time.monotonic()
    table = rows(shapes(args), args.workers, mla_shapes(args))
    failed = [r["variant"] for r in table if not r["ok"]]
    text = (f"{summary(table)}\n\n{markdown(table)}\n\n{len(table)} kernels compiled for sm_90 in "
            f"{time.monotonic() - start:.0f} s; {len(failed)} spill or exceed "
            f"{offline_compile.SM90_SMEM_LIMIT // 1024} KB of smem" + (": " + "; ".join(failed) if failed else ""))
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
