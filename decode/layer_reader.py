"""The loader thread's half of a layerwise load (``layerwise.py``): one step's loads, read layer-major.

Called on the loader thread only (``ChunkLoader._loop``, for a ``LayerBatch`` it was handed):

    reader.load(batch)      for each layer i: one ``store.borrow`` of layer i of every chunk of every load still
                            good; each object's seal and shape checked (``ChunkLoader.unsealed``) before it is
                            scattered into cache layer i (CUDA: on the reader's own stream, after the batch's fence);
                            then ``batch.layer_done(i, event)``. After the last layer: each load's chunk digests
                            (``ChunkLoader.digest_ok``: a digest covers every layer of a chunk). ``batch.finish()``
                            always, whatever failed.

A load that fails (missing or bad object, store error at a layer, digest mismatch) stops being read; the
others in the batch go on.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from pdserve.decode.layerwise import TIMED_OUT, LayerBatch, LayerLoad
from pdserve.kernels.transfer import scatter_kv
from pdserve.kvstore.keys import object_key

logger = logging.getLogger(__name__)


class LayerReader:
    def __init__(self, loader):
        self.loader = loader                 # ChunkLoader: its store, health gate, cache, checks and counters
        self._layer_stream = None            # CUDA: the layerwise loads' stream (made on first use)

    def load(self, batch: LayerBatch) -> None:
        """Every layer of every load of ``batch``, layer-major, ``group`` layers per store read; ends with
        ``batch.finish()`` whatever happens."""
        layers = list(self.loader.layer_ids())
        group = _group_size(len(layers), batch)
        try:
            with self._layer_scope(batch) as stream:
                for first in range(0, len(layers), group):
                    ids = range(first, min(first + group, len(layers)))
                    self._load_group(batch, ids, layers, stream)
                    event = _mark(stream)
                    for i in ids:
                        batch.layer_done(i, event)
            for load in batch.loads:
                self._check_digests(load)
        except Exception as exc:  # noqa: BLE001 - not the store's fault (a scatter): every unfinished load fails
            logger.warning("layerwise KV load failed (%s: %s); recomputing", type(exc).__name__, exc)
            for load in batch.loads:
                self._fail(load, f"{type(exc).__name__}: {exc}")
        finally:
            if batch.abandoned:                   # the loads the engine gave up on count as failed loads
                self.loader.failures += sum(1 for load in batch.loads if load.failed == TIMED_OUT)
            batch.finish(_mark(self._layer_stream if batch.device.type == "cuda" else None))

    def _load_group(self, batch: LayerBatch, ids: range, layers: list[int], stream=None) -> None:
        """Layers ``ids`` (local indices; global ``layers[i]``) of every chunk of every load still good: one store
        read, then each object's seal and shape checked before it is scattered into its cache layer."""
        parts = [(load, *part, i) for load in batch.loads if not load.failed for part in _parts(load.job) for i in ids]
        if not parts:
            return
        keys = [object_key(load.job.chunk_keys[index], layers[i]) for load, index, *_, i in parts]
        where = f"layers {layers[ids[0]]}..{layers[ids[-1]]}"
        if not self.loader.health.available():    # marked down by another read or the publisher: no new failure
            for load, *_ in parts:                # (a failed() here would double the back-off and cancel a
                self._fail(load, f"the KV store is marked down at {where}")   # probe that another thread runs)
            return
        stage = "read"
        try:
            with self.loader.store.borrow(keys) as objs, batch.write_lock:
                stage = "write"
                if not batch.abandoned:           # the engine gave up waiting (``before``): no write may land
                    for (load, index, lo, hi, a, i), key, obj in zip(parts, keys, objs):
                        self._scatter_layer(load, i, index, key, obj, lo, hi, a)
                    batch.last_event = _mark(stream)   # CUDA: what an abandoning engine thread waits for
                stage = "read"                    # the borrow's exit (unpinning) is the store's again
        except Exception as exc:  # noqa: BLE001 - the store failed: this group's loads recompute
            if stage == "write":                  # the store answered; a scatter failed: load() fails the batch
                self.loader.health.ok()
                raise
            logger.warning("layerwise KV load of %s failed (%s: %s); recomputing", where, type(exc).__name__, exc)
            self.loader.health.failed(exc)
            for load, *_ in parts:
                self._fail(load, f"store error at {where}")
            return
        self.loader.health.ok()

    def _scatter_layer(self, load: LayerLoad, i: int, index: int, key: str, obj, lo: int, hi: int, a: int) -> None:
        if load.failed:                                   # an earlier chunk of it failed at this layer
            return
        checked = self.loader.unsealed(key, obj, load.job.chunk_lens[index])
        if checked is None:
            self._fail(load, f"object {key} missing or not right")
            return
        view, mac = checked
        load.macs.setdefault(index, []).append(mac)
        scatter_kv(self.loader.kv_caches[i], load.job.slots[lo:hi], view[:, a:a + hi - lo])   # view: [C, length, Hkv, D]

    def _check_digests(self, load: LayerLoad) -> None:
        """Once every layer is in: each chunk's digest (it covers all layers) against the prefill node's."""
        for index, macs in sorted(load.macs.items()):
            expect = load.job.digests[index] if index < len(load.job.digests) else ""
            if not load.failed and expect and not self.loader.digest_ok(load.job.chunk_keys[index], macs, expect):
                self._fail(load, f"chunk {index} digest mismatch")

    def _fail(self, load: LayerLoad, why: str) -> None:
        if not load.failed:
            load.failed = why
            self.loader.failures += 1

    @contextlib.contextmanager
    def _layer_scope(self, batch: LayerBatch):
        """CUDA: the loader's layer stream, after the batch's fence; CPU: nothing (scatters run at once)."""
        if batch.device.type != "cuda":
            yield None
            return
        if self._layer_stream is None:
            self._layer_stream = torch.cuda.Stream(batch.device)
        stream = self._layer_stream
        if batch.fence is not None:
            stream.wait_event(batch.fence)
        with torch.cuda.stream(stream):
            yield stream


def _group_size(num_layers: int, batch: LayerBatch) -> int:
    """Layers per store read: as many reads as the longest load has chunks (what a chunk-major load makes), never
    more than one per layer. A store read costs a round trip whatever its size; one per layer would cost a deep
    model (30 layers) 7x the round trips of a 4-chunk load and more than the overlap gains (devbench/layerwise_ttft.py)."""
    chunks = max((sum(1 for _ in _parts(load.job)) for load in batch.loads), default=1)
    return -(-num_layers // max(1, min(chunks, num_layers)))


def _parts(job):
    """(chunk index, token lo, token hi, offset in the chunk) of every chunk the load covers: [start, start + n)."""
    end, chunk_start = job.start + job.num_tokens, 0
    for index, length in enumerate(job.chunk_lens):
        lo, hi = max(chunk_start, job.start), min(chunk_start + length, end)
        if lo < hi:
            yield index, lo, hi, lo - chunk_start
        chunk_start += length
        if chunk_start >= end:
            break


def _mark(stream):
    """CUDA: an event after what the layer stream has queued so far; None on the CPU."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
