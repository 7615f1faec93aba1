"""CPU paged attention micro-benchmark (issue 14): decode-step variants of ``kernels/reference.py`` and the C kernel.

    shapes     decode steps of --batch sequences (fixed seed), contexts uniform in --context +- --spread,
               block size 16, scrambled block tables, float32; heads: tiny (4 q / 2 KV, head dim 64:
               ``pdserve make-tiny-model --num-layers 4 --hidden-size 256``) and smol (9 q / 3 KV, 64:
               SmolLM2-135M)
    variants   baseline    the pre-issue-14 path: sorted groups of 8, index_select of whole blocks into a
                           fresh tensor, one masked SDPA per group with enable_gqa (K/V heads expanded)
               sdpa-gN     the same with groups of N ("all": one group, one gather for the step)
               fold-g8     GQA folded into query rows: q viewed [b, Hkv, H/Hkv, D], K/V not expanded
               *-ws-gN     gathers into one workspace per step, reused by every group and layer
               matmul-ws   folded, one baddbmm + softmax + bmm per KV head on strided views, not SDPA
               flex        torch.compile'd flex_attention straight on the paged cache (no gather): a
                           BlockMask built from the block tables (--flex; the first call compiles)
               torch-ref   ``kernels/reference.py`` as it is now: fold-ws-g8, K/V write included
               cpu-kernel  ``kernels/cpu_attention.c``: the C kernel straight on the paged cache (no gather,
                           one call for the step), K/V write included
    --prefill  also prompt steps, torch-ref against cpu-kernel (the only two that take them): a 512-token
               first chunk, and a 256-token chunk over 256 cached tokens, per head shape

Each figure is the best of --repeats means over --iters calls of one layer's attention, at
--threads torch threads; every round times all variants in turn, so a shared box's load drifts over
them alike. The step's plan (sorting, tables, flex's BlockMask) is built once outside the timing, as
the backend does at layer 0, and its cost is printed on its own. Every variant's output is checked against
the baseline's. Ratios are baseline / variant (> 1: faster). Writes --output JSON.
Run: ``python devbench/cpu_attention.py [--flex] [--output cpu_attention.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

from pdserve.kernels import AttentionMetadata, cpu_attention, paged_attention, reference

HEADS = {"tiny": (4, 2, 64), "smol": (9, 3, 64)}   # name -> (q heads, KV heads, head dim)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cpu_attention", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--context", type=int, default=550, help="mean context tokens")
    p.add_argument("--spread", type=int, default=100, help="contexts are uniform in context +- spread")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5, help="best of this many means")
    p.add_argument("--flex", action="store_true", help="also time compiled flex_attention (compiles ~20 s)")
    p.add_argument("--prefill", action="store_true", help="also time prompt steps (torch-ref vs cpu-kernel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="cpu_attention.json")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- the case


def make_case(batch: int, heads: tuple[int, int, int], args, seed: int, q_len: int = 1,
              lens: list[int] | None = None) -> dict:
    """One step: a paged cache, scrambled tables, q/k/v for the last q_len rows of each sequence (1: decodes
    with contexts drawn from --context/--spread; else ``lens`` gives the sequences' lengths)."""
    H, Hkv, D = heads
    bs, g = args.block_size, torch.Generator().manual_seed(seed)
    if lens is None:
        lens = torch.randint(args.context - args.spread, args.context + args.spread + 1, (batch,), generator=g).tolist()
    nbs = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(nbs) + 64
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in nbs]
    meta = AttentionMetadata.build([q_len] * batch, lens, tables, bs)
    cache = {c: torch.randn(num_blocks, bs, Hkv, D, generator=g) for c in ("k", "v")}
    q, k, v = (torch.randn(batch * q_len, h, D, generator=g) for h in (H, Hkv, Hkv))
    for c, x in (("k", k), ("v", v)):             # already in place: torch-ref and cpu-kernel rewrite the same values
        cache[c].view(-1, Hkv, D)[meta.slot_mapping] = x
    return {"q": q, "k": k, "v": v, "cache": cache, "meta": meta, "scale": D ** -0.5}


def sorted_groups(meta: AttentionMetadata, size: int | None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Decode rows sorted by length in groups of ``size`` (None: one group) -> [(rows, table, lens)]."""
    lens, bs = meta.seq_lens_cpu.long(), meta.block_size
    order = torch.argsort(lens, stable=True)
    size = size or len(order)
    groups = []
    for i in range(0, len(order), size):
        rows = order[i:i + size]
        nb = (int(lens[rows].max()) + bs - 1) // bs
        groups.append((rows, meta.block_table.long()[rows, :nb], lens[rows]))
    return groups


def gather(cache: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """cache [N, bs, Hkv, D], table [b, nb] -> [b, nb * bs, Hkv, D]; into ``out``'s storage when given."""
    index = table.reshape(-1)
    if out is None:
        blocks = cache.index_select(0, index)
    else:
        blocks = torch.index_select(cache, 0, index, out=out[: index.numel()])
    return blocks.view(table.shape[0], -1, *cache.shape[2:])


def valid(lens: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)                 # [b, W]


# ------------------------------------------------------------------------------------------ the variants


def sdpa_expanded(q, keys, values, lens, scale):
    """The baseline's group: q [b, H, D] over enable_gqa SDPA (K/V heads expanded inside)."""
    b, W = keys.shape[:2]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=valid(lens, W).view(b, 1, 1, W), scale=scale, enable_gqa=True)
    return o.squeeze(2)                                                             # [b, H, D]


def sdpa_folded(q, keys, values, lens, scale):
    """GQA folded: q [b, Hkv, H/Hkv, D] against K/V [b, Hkv, W, D] (no head expansion)."""
    b, W, Hkv, D = keys.shape
    o = F.scaled_dot_product_attention(q.view(b, Hkv, -1, D), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=valid(lens, W).view(b, 1, 1, W), scale=scale)
    return o.reshape(b, -1, D)


def matmul_folded(q, keys, values, lens, scale):
    """Folded GQA by hand, one bmm pair per KV head on strided views: softmax(q K^T + mask) V."""
    b, W, Hkv, D = keys.shape
    qf, bias = q.view(b, Hkv, -1, D), torch.zeros(b, 1, W).masked_fill_(~valid(lens, W).view(b, 1, W), float("-inf"))
    outs = [torch.bmm(torch.baddbmm(bias, qf[:, h], keys[:, :, h].transpose(1, 2), alpha=scale).softmax(-1),
                      values[:, :, h]) for h in range(Hkv)]                          # Hkv x [b, G, D]
    return torch.stack(outs, 1).reshape(b, -1, D)


def grouped(attend, size: int | None, workspace: bool):
    """Sorted groups of ``size`` (None: one group); ``workspace``: gathers reuse one buffer per step."""
    def make_plan(case):
        groups = sorted_groups(case["meta"], size)
        return groups, ({"blocks": max(t.numel() for _, t, _ in groups)} if workspace else {})

    def run(case, plan):
        (groups, ws), cache = plan, case["cache"]
        if workspace and "k" not in ws:        # allocated once per step (the plan), reused by every layer
            ws.update({c: torch.empty(ws["blocks"], *cache[c].shape[1:]) for c in ("k", "v")})
        q, out = case["q"], torch.empty_like(case["q"])
        for rows, table, lens in groups:
            keys, values = gather(cache["k"], table, ws.get("k")), gather(cache["v"], table, ws.get("v"))
            out[rows] = attend(q[rows], keys, values, lens, case["scale"])
        return out
    return run, make_plan


def torch_ref(case, plan):
    return paged_attention(case["q"], case["k"], case["v"], case["cache"], case["meta"], case["scale"])


def torch_ref_plan(case):
    """The backend's own per-step plan (built at layer 0), stored where ``paged_attention`` looks for it."""
    case["meta"].derived["torch"] = reference._plan(case["meta"], case["q"].device)


def cpu_kernel(case, plan):
    return cpu_attention.paged_attention(case["q"], case["k"], case["v"], case["cache"], case["meta"], case["scale"])


def cpu_kernel_build(isa: str):
    """The C kernel's ``isa`` build (cpu_attention.ISAS), whichever the machine's default is."""
    lib = cpu_attention.load(isa)

    def run(case, plan):
        best, cpu_attention.load = cpu_attention.load, lambda isa=None: lib
        try:
            return cpu_kernel(case, plan)
        finally:
            cpu_attention.load = best
    return run


VARIANTS = {
    "baseline": grouped(sdpa_expanded, 8, False),
    "sdpa-g4": grouped(sdpa_expanded, 4, False),
    "sdpa-gall": grouped(sdpa_expanded, None, False),
    "fold-g8": grouped(sdpa_folded, 8, False),
    "sdpa-ws-g8": grouped(sdpa_expanded, 8, True),
    "fold-ws-g4": grouped(sdpa_folded, 4, True),
    "fold-ws-g8": grouped(sdpa_folded, 8, True),
    "fold-ws-g16": grouped(sdpa_folded, 16, True),
    "fold-ws-g32": grouped(sdpa_folded, 32, True),
    "matmul-ws-g8": grouped(matmul_folded, 8, True),
    "torch-ref": (torch_ref, torch_ref_plan),
}
PREFILL_VARIANTS = {"baseline": (torch_ref, torch_ref_plan)}   # the reference is the prefill baseline
if cpu_attention.load() is not None:
    VARIANTS["cpu-kernel"] = PREFILL_VARIANTS["cpu-kernel"] = (cpu_kernel, lambda case: None)
    for _isa in cpu_attention.ISAS:                      # each build this CPU runs (same bits, other speed)
        if cpu_attention.load(_isa) is not None:
            VARIANTS[f"cpu-kernel-{_isa}"] = PREFILL_VARIANTS[f"cpu-kernel-{_isa}"] = (cpu_kernel_build(_isa),
                                                                                     lambda case: None)


# ----------------------------------------------------------------------------------------------- flex


def flex_variant():
    """flex_attention compiled once (dynamic shapes) over the whole paged cache; the BlockMask's KV blocks
    are the cache's pages: every page but a sequence's last is a full block, the last one is masked.
    The mask is the step's plan (built once, reused by every layer)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=True)

    def block_mask(meta, num_blocks: int) -> BlockMask:
        bs, lens, table = meta.block_size, meta.seq_lens_cpu.long(), meta.block_table
        B, nbs, last = len(lens), (lens + bs - 1) // bs, (lens - 1) % bs + 1
        full_idx = torch.zeros(B, 1, 1, num_blocks, dtype=torch.int32)     # KV-block columns span the cache
        full_idx[..., : table.shape[1]] = table.view(B, 1, 1, -1)
        last_idx = torch.zeros(B, 1, 1, num_blocks, dtype=torch.int32)
        last_idx[..., 0] = table.gather(1, (nbs - 1).view(B, 1)).view(B, 1, 1)
        return BlockMask.from_kv_blocks(
            torch.ones(B, 1, 1, dtype=torch.int32), last_idx, (nbs - 1).int().view(B, 1, 1), full_idx,
            BLOCK_SIZE=(1, bs), mask_mod=lambda b, h, qi, kv: (kv % bs) < last[b], seq_lengths=(1, num_blocks * bs),
            compute_q_blocks=False)

    def run(case, mask):
        cache, q = case["cache"], case["q"]
        N, bs, Hkv, D = cache["k"].shape
        keys = cache["k"].view(1, N * bs, Hkv, D).transpose(1, 2)                 # [1, Hkv, N*bs, D]
        values = cache["v"].view(1, N * bs, Hkv, D).transpose(1, 2)
        o = compiled(q.unsqueeze(2), keys, values, block_mask=mask, scale=case["scale"], enable_gqa=True)
        return o.squeeze(2)                                                        # [B, H, D]

    return run, (lambda case: block_mask(case["meta"], case["cache"]["k"].shape[0]))


# ---------------------------------------------------------------------------------------------- timing


def mean_ms(fn, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e3


def bench_case(name: str, case: dict, variants: dict, args) -> list[dict]:
    """Rounds over all variants (so a shared box's load drifts over them alike); best round per variant."""
    calls, rows = {}, {}
    for vname, (run, make_plan) in variants.items():
        t0 = time.perf_counter()
        plan = make_plan(case)
        out = run(case, plan)
        first_s = time.perf_counter() - t0
        expected = rows["baseline"]["out"] if rows else out
        calls[vname] = (lambda run=run, plan=plan: run(case, plan)), (lambda make_plan=make_plan: make_plan(case))
        rows[vname] = {"out": out, "shape": name, "variant": vname, "ms_per_layer": float("inf"),
                       "plan_ms": float("inf"), "max_abs_err": float((out - expected).abs().max()),
                       "first_call_s": round(first_s, 2)}
    for _ in range(args.repeats):
        for vname, (call, plan) in calls.items():
            r = rows[vname]
            r["ms_per_layer"] = min(r["ms_per_layer"], mean_ms(call, args.iters))
            r["plan_ms"] = min(r["plan_ms"], mean_ms(plan, args.iters))
    base = rows["baseline"]["ms_per_layer"]
    for r in rows.values():
        del r["out"]
        r["ratio_vs_baseline"] = base / r["ms_per_layer"]
        print(f"{name:10s} {r['variant']:19s} {r['ms_per_layer']:8.3f} ms  x{r['ratio_vs_baseline']:5.2f}  "
              f"plan {r['plan_ms']:6.3f} ms  err {r['max_abs_err']:.1e}  first call {r['first_call_s']:.2f} s")
    return list(rows.values())


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = dict(VARIANTS)
    if args.flex:
        variants["flex"] = flex_variant()
    print(f"# {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}, {args.threads} thread(s); "
          f"contexts {args.context} +- {args.spread}, block {args.block_size}, float32")
    results = []
    with torch.inference_mode():
        for heads in args.heads:
            for batch in args.batch:
                case = make_case(batch, HEADS[heads], args, args.seed)
                results += bench_case(f"{heads}/b{batch}", case, variants, args)
            if args.prefill:
                for name, q_len, lens in (("p512", 512, [512]), ("c256+256", 256, [512])):
                    case = make_case(1, HEADS[heads], args, args.seed, q_len, lens)
                    results += bench_case(f"{heads}/{name}", case, PREFILL_VARIANTS, args)
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "cpu": cpu_name(), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
