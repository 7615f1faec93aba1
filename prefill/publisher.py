"""Publish a request's prompt KV to the store, chunk by chunk, while the prompt is still computing.

Called by ``StoreConnector.after_step`` on the engine thread after every model step:

    step N computes tokens [0, 256)   -> chunk 0 complete: gather its layers (a memcpy), queue the put
    step N+1 computes [256, 300)      -> chunk 1 (partial, the prompt's end): gather, queue the put
    the publisher thread puts queued chunks to the store while the engine keeps computing
    ``finished()`` names requests whose every queued chunk the store acknowledged

The gather copies KV out of the paged cache, so the request's blocks are free to be reused as soon
as the engine is done with them; the prefill response waits for ``finished()``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict

import torch

from pdserve.kernels.transfer import gather_kv
from pdserve.kvstore.keys import object_key

logger = logging.getLogger(__name__)


class ChunkPublisher:
    def __init__(self, store, kv_caches: list[dict], first_layer: int, health, durable: bool = False):
        self.store = store
        self.durable = durable              # wait for the lower tiers (embedded store over Redis) before acking
        self.health = health                # TierHealth shared with the loader: down -> skip puts
        self.kv_caches = kv_caches          # this rank's layers; object keys use global layer ids
        self.first_layer = first_layer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._outstanding: dict[str, int] = defaultdict(int)   # chunks queued, not yet acknowledged
        self._closed: set[str] = set()                          # no more chunks will come
        self._done: set[str] = set()
        self._lock = threading.Lock()
        self.failures = 0
        self.skipped = 0                    # chunks not published because the store was down
        self._thread = threading.Thread(target=self._loop, name="kv-publisher", daemon=True)
        self._thread.start()

    def publish(self, request_id: str, chunk_key: str, slots: torch.Tensor) -> None:
        """Copy one chunk's KV (tokens at ``slots``) out of the cache now; put it to the store later."""
        items = [(object_key(chunk_key, self.first_layer + i), gather_kv(layer, slots))
                 for i, layer in enumerate(self.kv_caches)]              # each [C, n, Hkv, D]
        with self._lock:
            self._outstanding[request_id] += 1
        self._queue.put((request_id, items))

    def close_request(self, request_id: str) -> None:
        """No more chunks will come for this request; it is finished once its puts are acknowledged."""
        with self._lock:
            self._closed.add(request_id)
            self._settle(request_id)

    def finished(self) -> set[str]:
        """Requests closed since the last call whose every chunk the store acknowledged."""
        with self._lock:
            done, self._done = self._done, set()
        return done

    def _loop(self) -> None:
        while True:
            request_id, items = self._queue.get()
            self._put(request_id, items)
            with self._lock:
                self._outstanding[request_id] -= 1
                self._settle(request_id)

    def _put(self, request_id: str, items) -> None:
        if not self.health.available():
            self.skipped += 1
            return
        try:
            self.store.adopt(items)
            if self.durable:
                self.store.flush()          # another process reads it from Redis/disk, not our L1
            self.health.ok()
        except Exception as exc:   # the store is down: the decode node will recompute (logged once)
            self.health.failed(exc)
            self.failures += 1
            logger.debug("publishing KV of %s failed: %s", request_id, exc)

    def _settle(self, request_id: str) -> None:
        if request_id in self._closed and self._outstanding.get(request_id, 0) == 0:
            self._closed.discard(request_id)
            self._outstanding.pop(request_id, None)
            self._done.add(request_id)
