"""What the bounded publish path and the double-buffered load cost on this machine (issue 38, items 5 and 8).

publish  one long prompt's chunks published by the real ``ChunkPublisher`` into an in-memory store, the calling
         thread playing the engine thread: a ring of ``--ring-chunks`` slots (the bound) vs a ring that holds
         every chunk (never waits: what the unbounded queue did). Figures: GB/s from the first gather until the
         store acknowledged the last chunk, the engine thread's time inside ``publish`` (the back-pressure it
         felt), the ring's peak bytes. ``--store-delay-ms`` slows every put (a lagging store).
load     the same chunks loaded back by ``ChunkLoader`` through the double-buffered pipe vs through its per-layer
         ``scatter_kv`` fallback (what its CPU path was before the pipe), seal checks included.

Bounded and unbounded alternate within one run (``--repeats``, the best of each is printed with the ratio).
Run: ``python devbench/publish_ring.py [--layers 32 --kv-heads 8 --head-dim 128 --chunk-tokens 64 --chunks 16]``.
On CPU only (a CUDA cache works too: the ring's device and pinned halves are then what it bounds).
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.decode.loader import ChunkLoader, LoadJob
from pdserve.engine.kv.kv_layout import KVLayout
from pdserve.kvstore.auth import process_key
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.tiered import TieredStore
from pdserve.prefill.publisher import ChunkPublisher

KEY = process_key().seal_key
BS = 16


class DelayedStore(TieredStore):
    def __init__(self, capacity: int, delay_s: float):
        super().__init__(MemoryTier(capacity))
        self.delay_s = delay_s

    def adopt(self, items):
        if self.delay_s:
            time.sleep(self.delay_s)
        super().adopt(items)


def setup(a):
    layout = KVLayout("mha", a.layers, a.kv_heads, a.head_dim, getattr(torch, a.dtype))
    tokens = a.chunks * a.chunk_tokens
    caches = layout.allocate(tokens // BS + 1, BS)
    caches.buffer.copy_(torch.randn(caches.buffer.shape, generator=torch.Generator().manual_seed(0)))
    slots = torch.randperm(tokens // BS, generator=torch.Generator().manual_seed(1))
    slots = (slots[torch.arange(tokens) // BS] * BS + torch.arange(tokens) % BS)
    return layout, caches, slots, layout.bytes_per_token * a.chunk_tokens


def publish_once(a, caches, slots, chunk_bytes, ring_chunks: int):
    store = DelayedStore(2 * a.chunks * chunk_bytes, a.store_delay_ms / 1000)
    pub = ChunkPublisher(store, caches, 0, TierHealth("bench"), KEY, chunk_tokens=a.chunk_tokens,
                         buffer_bytes=ring_chunks * chunk_bytes)
    engine_s, t0 = 0.0, time.perf_counter()
    for i in range(a.chunks):
        s = time.perf_counter()
        pub.publish("r", i, f"c{i}", slots[i * a.chunk_tokens:(i + 1) * a.chunk_tokens])
        engine_s += time.perf_counter() - s
    pub.close_request("r")
    while "r" not in pub.finished():
        time.sleep(0.0005)
    total_s = time.perf_counter() - t0
    peak = pub.ring.peak_bytes
    pub.stop()
    return store, {"gbps": a.chunks * chunk_bytes / total_s / 1e9, "engine_ms": engine_s * 1e3,
                   "peak_mib": peak / 2**20}


def load(a, layout, store, slots, pipe: bool) -> float:
    """Seconds for ``ChunkLoader`` to load every chunk; ``pipe=False``: its per-layer ``scatter_kv`` fallback,
    the loader's CPU path before the pipe (same thread, same checks)."""
    caches = layout.allocate(slots.numel() // BS + 1, BS)
    loader = ChunkLoader(store, caches, 0, (2, a.kv_heads, a.head_dim), TierHealth("b"), KEY, a.chunk_tokens)
    if not pipe:
        loader.pipe = None
    lens, t0 = [a.chunk_tokens] * a.chunks, time.perf_counter()
    loader.start(LoadJob("l", [f"c{i}" for i in range(a.chunks)], lens, slots, 0, slots.numel()))
    while not loader.finished():
        time.sleep(0.0005)
    dt = time.perf_counter() - t0
    loader.stop()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--ring-chunks", type=int, default=4)
    ap.add_argument("--store-delay-ms", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    layout, caches, slots, chunk_bytes = setup(a)
    print(f"{a.chunks} chunks of {chunk_bytes / 2**20:.1f} MiB; ring {a.ring_chunks} chunks vs all {a.chunks}; "
          f"store delay {a.store_delay_ms} ms; {a.repeats} repeats, best of each")
    best: dict[str, dict] = {}
    loads = {"pipe": float("inf"), "per-layer": float("inf")}
    for r in range(a.repeats):
        order = [("bounded", a.ring_chunks), ("unbounded", a.chunks)]
        for name, ring in order if r % 2 == 0 else order[::-1]:
            store, fig = publish_once(a, caches, slots, chunk_bytes, ring)
            if name not in best or fig["gbps"] > best[name]["gbps"]:
                best[name] = fig
            if name == "unbounded":
                for name, pipe in (("pipe", True), ("per-layer", False)) if r % 2 == 0 else \
                        (("per-layer", False), ("pipe", True)):
                    loads[name] = min(loads[name], load(a, layout, store, slots, pipe))
            store.close()
    for name, fig in best.items():
        print(f"publish {name:9s}  {fig['gbps']:6.2f} GB/s  engine thread in publish {fig['engine_ms']:8.1f} ms  "
              f"ring peak {fig['peak_mib']:7.1f} MiB")
    print(f"publish throughput bounded/unbounded: {best['bounded']['gbps'] / best['unbounded']['gbps']:.2f}")
    nbytes = a.chunks * chunk_bytes
    for name, dt in loads.items():
        print(f"load {name:9s}  {nbytes / dt / 1e9:6.2f} GB/s")
    print(f"load throughput pipe/per-layer: {loads['per-layer'] / loads['pipe']:.2f}")


if __name__ == "__main__":
    main()
