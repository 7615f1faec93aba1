"""Publish a request's prompt KV to the store, chunk by chunk, while the prompt is still computing.

Called by ``StoreConnector.after_step`` on the engine thread after every model step:

    step N computes tokens [0, 256)   -> chunk 0 complete: take a publish-ring slot, gather its layers into it
                                         (a memcpy; on CUDA a device gather + an async copy to pinned memory),
                                         queue the put
    step N+1 computes [256, 300)      -> chunk 1 (partial, the prompt's end): the same
    the publisher thread seals each layer object (a keyed MAC, ``kvstore.seal``: a copy out of the slot),
    hands the slot back, and puts the sealed chunk to the store while the engine keeps computing
    ``finished()`` -> {request: PublishResult} for requests closed since the last call whose every
    queued chunk the store answered (acknowledged or failed)

Layerwise (``layerwise.py``, ``--kv-publish-layerwise``): ``start_layers`` before the forward, ``put_layer`` after
each layer, ``end_chunk`` after the last; the publisher thread puts the layer objects as they come (what queued up
while the store lagged goes in one put) and answers the chunk at its end, with the same result as above.

The gather copies KV out of the paged cache, so the request's blocks are free to be reused as soon
as the engine is done with them; the prefill response waits for ``finished()``.

Memory: every queued chunk holds one slot of the ring (``kernels/publish_ring.py``, ``--kv-publish-buffer-bytes``);
when the store lags and the ring is full, ``publish`` waits for a slot (the step slows to the store's pace), and
only a ring stuck full for ``wait_s`` makes it skip the chunk (``publish`` -> False, counted). So the publish path
holds at most the ring (device + pinned host on CUDA, host on a CPU node) plus the one sealed chunk the publisher
thread is putting.

Ownership: the engine thread calls ``publish``/``close_request``/``forget``/``finished`` and acquires ring
slots; the publisher thread alone calls the store, and releases each slot once its chunk is sealed or dropped.
``_lock`` guards the per-request bookkeeping they share; the ring has its own.
A chunk counts as published only when the store acknowledged it -- with ``durable`` (an embedded
store whose readers are other processes) only when ``flush()`` reported that it reached every lower
tier. ``PublishResult.chunks`` is the number of leading chunks published without a gap; the prefill
node advertises only those to the decode node.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from pdserve.kernels.chunk_io import ChunkIO, Gathered
from pdserve.kernels.publish_ring import DEFAULT_WAIT_S, STAT_NAMES, PublishRing, RingSlot, slot_count
from pdserve.kernels.transfer import gather_kv
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.seal import chunk_digest, seal
from pdserve.prefill.layerwise import LayerChunk, LayerWork

logger = logging.getLogger(__name__)
DEFAULT_BUFFER_BYTES = 256 << 20            # --kv-publish-buffer-bytes
_NOTHING = object()                         # _loop: no work item held over


@dataclass
class PublishResult:
    chunks: int = 0                                        # leading chunks the store acknowledged
    digests: dict[int, str] = field(default_factory=dict)  # chunk index -> digest of its layers' MACs
    failed: bool = False                                   # a chunk after ``chunks`` was not stored


@dataclass
class _Pending:
    outstanding: int = 0                 # chunks queued, not yet answered by the store
    closed: bool = False                 # no more chunks will come
    forgotten: bool = False              # aborted: drop the result when the last answer arrives
    started: bool = False                # the first chunk (or the close) fixed where our chunks begin
    result: PublishResult = field(default_factory=PublishResult)


class ChunkPublisher:
    """``chunk_tokens``/``buffer_bytes``: the ring holds ``buffer_bytes // chunk bytes`` chunks (0 bytes: no ring, a
    node that never publishes); ``chunk_bytes`` sizes the slots when there is no ``ChunkIO`` (tp x pp: the ranks
    send host tensors) -- one chunk of every layer. ``wait_s``: how long a full ring may stall a step."""

    def __init__(self, store, kv_caches: list[dict], first_layer: int, health, seal_key: bytes,
                 durable: bool = False, *, chunk_tokens: int = 256, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 chunk_bytes: int | None = None, wait_s: float = DEFAULT_WAIT_S):
        self.store = store
        self.seal_key = seal_key            # the cluster's seal key (kvstore.auth.ClusterKey.seal_key)
        self.durable = durable              # wait for the lower tiers (embedded store over Redis) before acking
        self.health = health                # TierHealth shared with the loader: down -> skip puts
        self.kv_caches = kv_caches          # this rank's layers; object keys use global layer ids
        self.io = ChunkIO.of(kv_caches)     # all layers in one gather (device -> pinned host on CUDA)
        self.first_layer = first_layer
        self.ring = self._ring(chunk_tokens, buffer_bytes, chunk_bytes, wait_s) if buffer_bytes else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()    # items hold ring slots: as bounded as the ring
        self._pending: dict[str, _Pending] = {}
        self._done: dict[str, PublishResult] = {}
        self._lock = threading.Lock()
        self.failures = 0
        self.published = 0                  # chunks the store acknowledged
        self.skipped = 0                    # chunks not published because the store was down
        self._thread = threading.Thread(target=self._loop, name="kv-publisher", daemon=True)
        self._thread.start()

    def _ring(self, chunk_tokens: int, buffer_bytes: int, chunk_bytes: int | None, wait_s: float) -> PublishRing:
        if self.io is not None:
            count = slot_count(buffer_bytes, self.io.chunk_bytes(chunk_tokens))
            return PublishRing(self.io.ring_slots(count, chunk_tokens), wait_s)
        if chunk_bytes is None:
            raise ValueError("a publisher without a ChunkIO needs chunk_bytes to size its ring")
        return PublishRing([RingSlot(i, chunk_bytes) for i in range(slot_count(buffer_bytes, chunk_bytes))], wait_s)

    def publish(self, request_id: str, index: int, chunk_key: str, slots: torch.Tensor) -> bool:
        """Copy chunk ``index`` (tokens at ``slots``) into a ring slot now; seal and put it later. False: no slot
        freed within ``wait_s``, the chunk is skipped (counted) -- the caller publishes nothing more of the request."""
        if self.ring is None:
            raise RuntimeError("this publisher has no ring (--kv-publish-buffer-bytes 0: a node that never publishes)")
        slot = self.ring.acquire()
        if slot is None:       # queued empty, so it is answered (a failure) in order, after the chunks before it
            self._enqueue(request_id, index, chunk_key, None, self.first_layer)
            return False
        try:
            gathered = self._gather(slots, slot)
        except BaseException:
            self.ring.release(slot)
            raise
        self._enqueue(request_id, index, chunk_key, gathered, self.first_layer)
        return True

    def _gather(self, slots: torch.Tensor, slot: RingSlot) -> Gathered:
        """Engine thread: the chunk's layers, holding ``slot`` until the publisher thread releases it."""
        release = functools.partial(self.ring.release, slot)
        if self.io is not None:
            return self.io.gather(slots, slot, release)     # the publisher thread waits for the copy
        return Gathered([gather_kv(layer, slots) for layer in self.kv_caches], release=release)   # [C, n, Hkv, D]

    # -- layerwise (``layerwise.py``): engine thread ------------------------------------------------

    @property
    def layerwise(self) -> bool:
        """Whether chunks can go layer by layer: this node's own cache (one buffer) and a ring."""
        return self.io is not None and self.ring is not None

    def start_layers(self, request_id: str, index: int, chunk_key: str, slots: torch.Tensor) -> LayerChunk | None:
        """Before the forward: a ring slot for chunk ``index`` (waiting as ``publish`` does); None: no slot freed
        within ``wait_s`` -- the caller queues a ``skip`` for it after the step's chunks and publishes no more."""
        slot = self.ring.acquire()
        if slot is None:
            return None
        return LayerChunk(self._register(request_id, index), request_id, index, chunk_key, slots, slot,
                          len(self.kv_caches))

    def put_layer(self, chunk: LayerChunk) -> None:
        """Gather the chunk's next layer (it has just run) and queue its seal and put."""
        layer = chunk.queued
        gathered = self.io.gather_layer(layer, chunk.slots, chunk.slot, first=layer == 0)
        chunk.queued += 1
        self._queue.put(LayerWork(chunk, layer, gathered))

    def end_chunk(self, chunk: LayerChunk, failed: bool = False) -> None:
        chunk.ended = True
        self._queue.put(functools.partial(self._end_chunk, chunk, failed))

    def skip(self, request_id: str, index: int, chunk_key: str) -> None:
        self._enqueue(request_id, index, chunk_key, None, self.first_layer)

    def hold_blocks(self) -> None:
        self.io.hold_blocks()

    # -- layerwise: publisher thread ---------------------------------------------------------------

    def _put_layers(self, batch: list[LayerWork]) -> None:
        """Seal the batch's layer objects and store them in one put (``_loop`` coalesces what is queued: alone when
        the store keeps up, up to one chunk's worth of objects when it lags); a failure fails each chunk in it."""
        items, owners = [], []
        for work in batch:
            sealed = self._seal_layer(work)
            if sealed is not None:
                items.append(sealed[0])
                owners.append((work.chunk, sealed[1]))
        if not items:
            return
        try:
            self.store.adopt(items)
        except Exception as exc:   # the store is down: the decode node will recompute (logged once)
            self.health.failed(exc)
            lost = {id(chunk): chunk for chunk, _ in owners if not chunk.failed}
            self.failures += len(lost)                                  # each chunk the put lost, as per step
            logger.debug("publishing %d layer objects failed: %s", len(items), exc)
            for chunk in lost.values():
                chunk.failed = True
            return
        for chunk, mac in owners:
            chunk.macs.append(mac)

    def _seal_layer(self, work: LayerWork) -> tuple | None:
        """((key, sealed object), MAC) of one layer once its copy landed; None when its chunk failed or the store
        is down (the chunk fails: its later layers are not put). The slot goes back after the last layer."""
        chunk = work.chunk
        try:
            host = work.gathered.wait()[0]                                 # [C, n, Hkv, D]
            if chunk.failed:
                return None
            if not self.health.available():
                chunk.failed, self.skipped = True, self.skipped + 1
                return None
            key = object_key(chunk.chunk_key, self.first_layer + work.layer)
            obj, mac = seal(key, host, self.seal_key)
        except Exception as exc:  # noqa: BLE001 - that chunk is not published
            chunk.failed = True
            self.failures += 1
            logger.warning("sealing layer %d of %s's chunk %d failed: %s", work.layer, chunk.request_id, chunk.index,
                           exc)
            return None
        if work.layer == chunk.num_layers - 1:
            chunk.give_back_slot(self.ring.release)                       # every layer is copied out of it
        return (key, obj), mac

    def _end_chunk(self, chunk: LayerChunk, failed: bool) -> None:
        """Every queued layer was answered: the chunk is published only if each of its layers was (and flushed)."""
        chunk.give_back_slot(self.ring.release)
        digest = None
        if not (failed or chunk.failed) and len(chunk.macs) == chunk.num_layers:
            try:
                if self.durable and not self.store.flush():
                    raise RuntimeError("the store's write-through did not reach every tier (flush reported a loss)")
                self.health.ok()
                self.published += 1
                digest = chunk_digest(chunk.macs)
            except Exception as exc:  # noqa: BLE001 - as a failed put
                self.health.failed(exc)
                self.failures += 1
                logger.debug("publishing KV of %s failed: %s", chunk.request_id, exc)
        self._answer(chunk.pending, chunk.request_id, chunk.index, digest)

    def buffer_stats(self) -> dict[str, float]:
        return self.ring.stats() if self.ring is not None else dict.fromkeys(STAT_NAMES, 0)

    def close_request(self, request_id: str, first_index: int = 0) -> None:
        """No more chunks will come; ``first_index`` = chunks already in the store (not ours to publish)."""
        with self._lock:
            p = self._pending.setdefault(request_id, _Pending())
            _start(p, first_index)
            p.closed = True
            self._settle(request_id, p)

    def forget(self, request_id: str) -> None:
        """The request was aborted: whatever is still queued is put, but no result is kept."""
        with self._lock:
            p = self._pending.pop(request_id, None)     # its queued chunks settle this object, not the id: the id
            self._done.pop(request_id, None)            # may come back (a new request) before they are answered
            if p is not None:
                p.forgotten = p.closed = True

    def finished(self) -> dict[str, PublishResult]:
        """Requests closed since the last call whose every chunk the store answered."""
        with self._lock:
            done, self._done = self._done, {}
        return done

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Put what is queued, then end the thread; False if it did not finish within the timeout."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _enqueue(self, request_id: str, index: int, chunk_key: str, gathered: Gathered | None,
                 first_layer: int) -> None:
        p = self._register(request_id, index)
        self._queue.put(functools.partial(self._put_chunk, p, request_id, index, chunk_key, gathered, first_layer))

    def _register(self, request_id: str, index: int) -> _Pending:
        """Engine thread: one more chunk of the request on its way; -> the entry it will settle."""
        with self._lock:
            p = self._pending.setdefault(request_id, _Pending())
            _start(p, index)
            p.outstanding += 1
        return p

    def _loop(self) -> None:
        """Run the queued work in order; consecutive layer objects go to the store together (``_put_layers``)."""
        held = _NOTHING
        while (work := self._queue.get() if held is _NOTHING else held) is not None:
            held = _NOTHING
            if not isinstance(work, LayerWork):
                work()
                continue
            batch = [work]
            while len(batch) < len(self.kv_caches):                # at most one chunk's worth of sealed copies
                try:
                    held = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(held, LayerWork):
                    break
                batch.append(held)
                held = _NOTHING
            self._put_layers(batch)

    def _put_chunk(self, p: _Pending, request_id: str, index: int, chunk_key: str, gathered: Gathered | None,
                   first_layer: int) -> None:
        self._answer(p, request_id, index, self._put(request_id, chunk_key, gathered, first_layer))

    def _answer(self, p: _Pending, request_id: str, index: int, digest: str | None) -> None:
        """Publisher thread: the store answered chunk ``index`` (digest None: not stored)."""
        with self._lock:
            p.outstanding -= 1
            _record(p.result, index, digest)
            self._settle(request_id, p)

    def _put(self, request_id: str, chunk_key: str, gathered: Gathered | None, first_layer: int) -> str | None:
        """Seal and store one chunk; its digest, or None when it did not reach the store (None: skipped for want
        of a ring slot)."""
        if gathered is None:
            return None
        try:
            sealed = self._seal(chunk_key, gathered, first_layer)
            if sealed is None:
                return None
            self.store.adopt([(object_key(chunk_key, first_layer + i), obj) for i, (obj, _) in enumerate(sealed)])
            if self.durable and not self.store.flush():
                raise RuntimeError("the store's write-through did not reach every tier (flush reported a loss)")
            self.health.ok()
            self.published += 1
            return chunk_digest([mac for _, mac in sealed])
        except Exception as exc:   # the store is down: the decode node will recompute (logged once)
            self.health.failed(exc)
            self.failures += 1
            logger.debug("publishing KV of %s failed: %s", request_id, exc)
            return None

    def _seal(self, chunk_key: str, gathered: Gathered, first_layer: int) -> list | None:
        """Sealed copies of the chunk's layers, or None when the store is down (skipped); the ring slot is free
        again when this returns, however it returns (``seal`` copied every byte out of it)."""
        try:
            layers = gathered.wait()                        # the device -> host copy has landed
            if not self.health.available():
                self.skipped += 1
                return None
            return [seal(object_key(chunk_key, first_layer + i), t, self.seal_key) for i, t in enumerate(layers)]
        finally:
            gathered.release()

    def _settle(self, request_id: str, p: _Pending) -> None:
        """``p`` (the request's bookkeeping when its chunks were queued) is complete: hand its result out,
        unless it was forgotten (an abort already took it out of ``_pending``)."""
        if not p.closed or p.outstanding:
            return
        if self._pending.get(request_id) is p:
            del self._pending[request_id]
        if not p.forgotten:
            self._done[request_id] = p.result


def _start(p: _Pending, first_index: int) -> None:
    """Chunks before the first one this node publishes were store hits: count them as present."""
    if not p.started:
        p.started, p.result.chunks = True, first_index


def _record(result: PublishResult, index: int, digest: str | None) -> None:
    """Chunks are answered in order: the acknowledged prefix grows until the first failure."""
    if digest is None:
        result.failed = True
        return
    result.digests[index] = digest
    if not result.failed and index == result.chunks:
        result.chunks = index + 1
