"""Publish a request's prompt KV to the store, chunk by chunk, while the prompt is still computing.

Called by ``StoreConnector.after_step`` on the engine thread after every model step:

    step N computes tokens [0, 256)   -> chunk 0 complete: gather its layers (a memcpy), queue the put
    step N+1 computes [256, 300)      -> chunk 1 (partial, the prompt's end): gather, queue the put
    the publisher thread seals each layer object (a keyed MAC, ``kvstore.seal``) and puts the
    chunk to the store while the engine keeps computing
    ``finished()`` -> {request: PublishResult} for requests closed since the last call whose every
    queued chunk the store answered (acknowledged or failed)

The gather copies KV out of the paged cache, so the request's blocks are free to be reused as soon
as the engine is done with them; the prefill response waits for ``finished()``.

Ownership: the engine thread calls ``publish``/``close_request``/``forget``/``finished``; the
publisher thread alone calls the store. ``_lock`` guards the per-request bookkeeping they share.
A chunk counts as published only when the store acknowledged it -- with ``durable`` (an embedded
store whose readers are other processes) only when ``flush()`` reported that it reached every lower
tier. ``PublishResult.chunks`` is the number of leading chunks published without a gap; the prefill
node advertises only those to the decode node.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from pdserve.kernels.chunk_io import ChunkIO, Gathered
from pdserve.kernels.transfer import gather_kv
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.seal import chunk_digest, seal

logger = logging.getLogger(__name__)


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
    def __init__(self, store, kv_caches: list[dict], first_layer: int, health, seal_key: bytes,
                 durable: bool = False):
        self.store = store
        self.seal_key = seal_key            # the cluster's seal key (kvstore.auth.ClusterKey.seal_key)
        self.durable = durable              # wait for the lower tiers (embedded store over Redis) before acking
        self.health = health                # TierHealth shared with the loader: down -> skip puts
        self.kv_caches = kv_caches          # this rank's layers; object keys use global layer ids
        self.io = ChunkIO.of(kv_caches)     # all layers in one gather (device -> pinned host on CUDA)
        self.first_layer = first_layer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._done: dict[str, PublishResult] = {}
        self._lock = threading.Lock()
        self.failures = 0
        self.published = 0                  # chunks the store acknowledged
        self.skipped = 0                    # chunks not published because the store was down
        self._thread = threading.Thread(target=self._loop, name="kv-publisher", daemon=True)
        self._thread.start()

    def publish(self, request_id: str, index: int, chunk_key: str, slots: torch.Tensor) -> None:
        """Copy chunk ``index`` (tokens at ``slots``) out of the cache now; seal and put it later."""
        if self.io is not None:
            layers = self.io.gather(slots)                  # Gathered: the publisher thread waits for it
        else:
            layers = [gather_kv(layer, slots) for layer in self.kv_caches]      # each [C, n, Hkv, D]
        self._enqueue(request_id, index, chunk_key, layers, self.first_layer)

    def close_request(self, request_id: str, first_index: int = 0) -> None:
        """No more chunks will come; ``first_index`` = chunks already in the store (not ours to publish)."""
        with self._lock:
            p = self._pending.setdefault(request_id, _Pending())
            _start(p, first_index)
            p.closed = True
            self._settle(request_id)

    def forget(self, request_id: str) -> None:
        """The request was aborted: whatever is still queued is put, but no result is kept."""
        with self._lock:
            p = self._pending.get(request_id)
            self._done.pop(request_id, None)
            if p is not None:
                p.forgotten = p.closed = True
                self._settle(request_id)

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

    def _enqueue(self, request_id: str, index: int, chunk_key: str, layers: list, first_layer: int) -> None:
        with self._lock:
            p = self._pending.setdefault(request_id, _Pending())
            _start(p, index)
            p.outstanding += 1
        self._queue.put((request_id, index, chunk_key, layers, first_layer))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            request_id, index, chunk_key, layers, first_layer = item
            digest = self._put(request_id, chunk_key, layers, first_layer)
            with self._lock:
                p = self._pending[request_id]
                p.outstanding -= 1
                _record(p.result, index, digest)
                self._settle(request_id)

    def _put(self, request_id: str, chunk_key: str, layers: list, first_layer: int) -> str | None:
        """Seal and store one chunk; its digest, or None when it did not reach the store."""
        if isinstance(layers, Gathered):
            layers = layers.wait()                          # the device -> host copy has landed
        if not self.health.available():
            self.skipped += 1
            return None
        try:
            sealed = [seal(object_key(chunk_key, first_layer + i), t, self.seal_key) for i, t in enumerate(layers)]
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

    def _settle(self, request_id: str) -> None:
        p = self._pending.get(request_id)
        if p is None or not p.closed or p.outstanding:
            return
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
