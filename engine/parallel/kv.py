"""KV publish / load when the paged cache lives in the worker ranks (tp x pp > 1).

The store objects are TP/PP-agnostic: one per (chunk, global layer), ``[C, n, all KV heads, D]``.
The chosen split, the simplest that is correct for every pair of layouts: the driver keeps what
needs no cache (``StoreConnector``: keys, lookup, accounting) and does the store I/O; each rank
copies only its own layers and KV heads in and out of its cache. Ranks never talk to the store,
so an embedded (in-process) store works as well as a daemon or Redis.

    publish (engine thread, StoreConnector.after_step -> RankPublisher.publish)
        KVGather(slots) ──broadcast──> every rank: gather its layers/heads [L_r, C, n, H_r, D]
        each rank ──KVPart──> its own queue -> driver: heads concatenated in tp order, layers in
        stage order -> one [C, n, Hkv, D] per global layer -> the publisher thread puts them
    load (loader thread, ChunkLoader._load -> RankLoader._load_chunk)
        store.borrow(every layer's object) -> [L, C, n, Hkv, D] ──KVScatter──> every rank writes its
        layers and heads (``scatter_kv(heads=...)``) and acks with an empty KVPart

On GPUs each rank gathers its share on its device and makes one device -> host copy for the wire; a
scatter slices the rank's layers and heads on the host and makes one copy from pinned memory to the
device, after which every layer is written device side (no host round trip per layer).

MLA (``layout.tp_replicated``): every TP rank of a stage holds the same latent cache (the latent is computed
from the replicated hidden state), so only TP rank 0 of each stage gathers it (one writer; the others ack with
an empty part) and every rank scatters all of it (one KV "head": nothing to slice).

Both are synchronous round trips; ranks handle messages in queue order, so a gather always sees
the step before it and a scatter lands before any step scheduled after the load reported back.
A copy that fails on a rank comes back as the part's ``error`` (the rank lives on): ``KVCopyError``
fails that chunk's publish (the connector stops publishing the request) or load (the loader keeps the
chunks before it and the scheduler recomputes the rest).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading

import torch

from pdserve.decode.loader import ChunkLoader
from pdserve.engine.parallel import messages as m
from pdserve.kernels.chunk_io import Gathered
from pdserve.kernels.transfer import scatter_kv
from pdserve.prefill.publisher import ChunkPublisher

logger = logging.getLogger(__name__)


class KVCopyError(RuntimeError):
    """A rank could not copy its share of a KV chunk; the message names each rank and its error."""


def to_wire(t: torch.Tensor) -> m.Tensor:
    t = t.contiguous()
    return m.Tensor(str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes())


def from_wire(w: m.Tensor) -> torch.Tensor:
    dtype = getattr(torch, w.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {w.dtype!r} on the wire")
    return torch.frombuffer(bytearray(w.data), dtype=torch.uint8).view(dtype).reshape(w.shape)


# -- worker side --------------------------------------------------------------------------------

def gather_part(runner, rank: int, op: m.KVGather, tp: int = 0) -> m.KVPart:
    """This rank's layers and heads at ``op.slots``: gathered on its device, one copy to the host."""
    if runner.layout.tp_replicated and tp != 0:           # MLA: TP rank 0 of the stage sends the one copy
        return m.KVPart(op.op_id, rank, runner.layout.first_layer)
    device = _cache_device(runner)
    slots = torch.tensor(op.slots, dtype=torch.long).to(device)
    part = torch.stack([_gather_layer(layer, slots) for layer in runner.kv_caches])   # [L_r, C, n, H_r, D] on device
    return m.KVPart(op.op_id, rank, runner.layout.first_layer, to_wire(part.cpu()))


def scatter_part(runner, rank: int, tp: int, op: m.KVScatter) -> m.KVPart:
    """The store's [L, C, n, Hkv, D] -> this rank's layers and heads: sliced on the host, one copy to the device
    (from pinned memory on CUDA), then every layer written on the device."""
    data = from_wire(op.data)                                                       # [L, C, n, Hkv, D]
    first, h, count = runner.layout.first_layer, runner.layout.num_kv_heads, len(runner.kv_caches)
    heads = slice(None) if runner.layout.tp_replicated else slice(tp * h, (tp + 1) * h)   # MLA: all of it, every rank
    device = _cache_device(runner)
    mine = _to_device(data[first:first + count, :, :, heads], device)              # [L_r, C, n, H_r, D]
    slots = torch.tensor(op.slots, dtype=torch.long).to(device)
    for i, cache in enumerate(runner.kv_caches):
        scatter_kv(cache, slots, mine[i])
    return m.KVPart(op.op_id, rank, first)


def _cache_device(runner) -> torch.device:
    return next(iter(runner.kv_caches[0].values())).device if runner.kv_caches else torch.device("cpu")


def _gather_layer(layer_cache: dict[str, torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """-> [C, n, H_r, D] on the cache's device (``gather_kv`` without its copy to the host)."""
    return torch.stack([t.view(-1, *t.shape[2:]).index_select(0, slots) for t in layer_cache.values()])


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host -> device copy through pinned memory (the caching host allocator keeps the buffer until it is done)."""
    if device.type != "cuda":
        return t
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)


# -- driver side --------------------------------------------------------------------------------

class KVRelay:
    """The executor's KV round trips; also builds the connector's publisher and loader (``kv_io``)."""

    def __init__(self, executor, part_queues: dict, num_layers: int, tp_size: int):
        self.executor, self.queues = executor, part_queues        # rank -> MessageQueue reader
        self.num_layers, self.tp_size = num_layers, tp_size
        self._ids = itertools.count(1)
        self._lock = threading.Lock()                             # one op in flight

    def publisher(self, store, health, seal_key: bytes, durable: bool = False, **ring) -> ChunkPublisher:
        """``ring``: ``ChunkPublisher``'s ring sizing (``chunk_tokens``, ``buffer_bytes``, ``chunk_bytes``)."""
        return RankPublisher(store, self, health, seal_key, durable, **ring)

    def loader(self, store, shape, health, seal_key: bytes) -> ChunkLoader:
        return RankLoader(store, self, shape, health, seal_key)

    def gather(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """-> one [C, n, Hkv, D] tensor per global layer."""
        parts = self._call(lambda op_id: m.KVGather(op_id, slots.tolist()))
        stages: dict[int, list] = {}
        for p in sorted(parts, key=lambda p: p.rank):               # rank = pp * T + tp: tp order within a stage
            if p.data is not None:                                  # MLA: only TP rank 0 of a stage sends
                stages.setdefault(p.first_layer, []).append(from_wire(p.data))
        layers = torch.cat([torch.cat(stages[first], dim=3) for first in sorted(stages)])   # [L, C, n, Hkv, D]
        if layers.shape[0] != self.num_layers:
            raise RuntimeError(f"gathered {layers.shape[0]} layers from the ranks; the model has {self.num_layers}")
        return list(layers.unbind(0))

    def scatter(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """data: [L, C, n, Hkv, D] -> every rank's cache at ``slots``."""
        self._call(lambda op_id: m.KVScatter(op_id, slots.tolist(), to_wire(data)))

    def _call(self, make) -> list[m.KVPart]:
        with self._lock:
            op_id = next(self._ids)
            with self.executor.busy():
                self.executor.send(make(op_id))
                parts = [self._part(rank, q, op_id) for rank, q in self.queues.items()]
        errors = [f"rank {p.rank}: {p.error}" for p in parts if p.error]
        if errors:
            raise KVCopyError("KV copy failed on " + "; ".join(errors))
        return parts

    def _part(self, rank: int, queue, op_id: int) -> m.KVPart:
        while True:
            data = queue.dequeue(timeout=0.1)
            if data is not None:
                part = m.decode_part(data)
                if part.op_id != op_id:
                    raise RuntimeError(f"rank {rank} answered KV op {part.op_id} while op {op_id} was waiting")
                return part
            self.executor.raise_if_failed()


class RankPublisher(ChunkPublisher):
    """``ChunkPublisher`` whose gather runs on the ranks (the ring, sealing, queueing and acks are the parent's).
    Its ring slots hold no buffers: each stands for one chunk of fresh host tensors from the ranks, so the queue
    is bounded the same way."""

    def __init__(self, store, relay: KVRelay, health, seal_key: bytes, durable: bool, **ring):
        super().__init__(store, [], 0, health, seal_key, durable, **ring)
        self.relay = relay

    def _gather(self, slots: torch.Tensor, slot) -> Gathered:
        return Gathered(self.relay.gather(slots), release=functools.partial(self.ring.release, slot))


class RankLoader(ChunkLoader):
    """``ChunkLoader`` whose scatter runs on the ranks (lookup, checks, threading and failure rules are the parent's)."""

    def __init__(self, store, relay: KVRelay, shape, health, seal_key: bytes):
        super().__init__(store, [None] * relay.num_layers, 0, shape, health, seal_key)   # lookup counts every layer
        self.relay = relay

    def _scatter(self, views: list[torch.Tensor], slots, a: int, b: int, fence=None) -> None:
        self.relay.scatter(slots, torch.stack([v[:, a:b] for v in views]))          # [L, C, b - a, Hkv, D]

    def _load_chunk(self, job, index: int, slots, a: int, b: int) -> bool:
        """A rank's copy error fails this chunk only: the chunks before it stay loaded (the store is fine)."""
        try:
            return super()._load_chunk(job, index, slots, a, b)
        except KVCopyError as exc:
            self.failures += 1
            logger.warning("KV load of %s: chunk %d failed on the ranks (%s); recomputing from there",
                           job.request_id, index, exc)
            return False
