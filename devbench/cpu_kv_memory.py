"""Decode attention against a KV cache that lives in DRAM: how fast the C kernel streams the cache.

    python devbench/cpu_kv_memory.py [--batch 32] [--context 550] [--layers 4] [--kv-heads 2] [--output F.json]

A decode step reads each running sequence's whole context once per layer. ``devbench/cpu_attention.py`` times
one layer's cache over and over, which a 32 MiB L3 partly holds; here the step cycles over ``--layers``
caches of one buffer allocated like the engine's (``KVLayout.allocate``), blocks scrambled, so every call
streams from DRAM, as in the engine. Three setups, in rounds (a shared box's load drifts over them alike):

    hugepages   the engine's cache: advised onto transparent huge pages (engine/host_memory.py)
    4k-pages    the same shape from plain torch.zeros (what the engine had before)
    hot         every sequence's table points into the same 40 blocks: cache-resident, the compute floor

Prints ms per layer call and the KV bytes read per second; the layer calls write no K/V (q only).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pdserve.engine.kv.kv_layout import KVLayout
from pdserve.kernels import AttentionMetadata, cpu_attention


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="cpu_kv_memory", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=550, help="mean context; uniform in +- 100")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", default="cpu_kv_memory.json")
    return p.parse_args(argv)


def setups(args):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.context - 100, args.context + 101, (args.batch,), generator=g).tolist()
    nbs = [(n + args.block_size - 1) // args.block_size for n in lens]
    num_blocks = 2 * sum(nbs) + 64                        # half the blocks unused, as in a half-full cache
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in nbs]
    layout = KVLayout("mha", args.layers, args.kv_heads, args.head_dim, torch.float32)
    huge = layout.allocate(num_blocks, args.block_size)
    plain = torch.zeros_like(huge.buffer)                 # 4 KiB pages: THP's default "madvise" mode skips it
    for buf in (huge.buffer, plain):
        buf.normal_(generator=g)
    hot = [[b % 40 for b in t] for t in tables]
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g)
    meta = AttentionMetadata.build([1] * args.batch, lens, tables, args.block_size)
    hot_meta = AttentionMetadata.build([1] * args.batch, lens, hot, args.block_size)
    return q, lens, {"hugepages": (huge.buffer, meta), "4k-pages": (plain, meta), "hot": (huge.buffer, hot_meta)}


def layer_call(lib, q, buf, layer, meta, args):
    k, v = buf[layer, 0], buf[layer, 1]
    out = torch.empty_like(q)
    rc = lib.pd_paged_attention(q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(), 0,
                                meta.block_table.data_ptr(), meta.block_table.stride(0),
                                meta.query_start_loc_cpu.data_ptr(), meta.seq_lens_cpu.data_ptr(), args.batch,
                                args.heads, args.kv_heads, args.head_dim, args.block_size, args.head_dim ** -0.5, 0,
                                1)
    assert rc == 0
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    lib = cpu_attention.load()
    if lib is None:
        raise SystemExit("the cpu attention kernel is not built here")
    q, lens, cases = setups(args)
    kv_bytes = sum(lens) * args.kv_heads * args.head_dim * 4 * 2
    best = {name: float("inf") for name in cases}
    for _ in range(args.rounds):
        for name, (buf, meta) in cases.items():
            t = time.perf_counter()
            for i in range(args.iters):
                layer_call(lib, q, buf, i % args.layers, meta, args)
            best[name] = min(best[name], (time.perf_counter() - t) / args.iters)
    rows = [{"setup": n, "ms_per_layer": round(s * 1e3, 3), "kv_gb_per_s": round(kv_bytes / s / 1e9, 1)}
            for n, s in best.items()]
    print(f"decode step, {args.batch} sequences x ~{args.context} tokens, {args.layers} layers of "
          f"{kv_bytes / 2**20:.1f} MiB K+V each")
    for r in rows:
        print(f"  {r['setup']:10s} {r['ms_per_layer']:8.3f} ms/layer  {r['kv_gb_per_s']:6.1f} GB/s")
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
