"""Load a request's leading prompt chunks from the store into the paged cache, off the engine thread.

Called by ``StoreConnector`` (engine thread):

    hit = loader.lookup(chunk_keys, chunk_lens)            # store_hit_tokens (leading chunks, every layer)
    loader.start(req_id, chunk_keys, chunk_lens, slots, start, n)   # request waits in WAITING_FOR_KV
    for req_id, loaded in loader.finished().items(): ...   # loaded <= n tokens; 0 after a failure

The loader thread reads each chunk's layer objects, checks their shape, and scatters the token range
``[start, start + n)`` into the blocks the scheduler allocated. A missing or malformed object stops
the load at the chunk before it: those tokens are recomputed, never read wrong.

    prompt   |<- chunk 0 ->|<- chunk 1 ->|<- chunk 2 ->|
    load         [start ................ start+n)          (block-aligned; never the last prompt token)
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from pdserve.kernels.transfer import scatter_kv
from pdserve.kvstore.keys import object_key

logger = logging.getLogger(__name__)


@dataclass
class LoadJob:
    request_id: str
    chunk_keys: list[str]
    chunk_lens: list[int]
    slots: torch.Tensor          # [start + n] flat slots of positions 0..start+n-1
    start: int
    num_tokens: int


class ChunkLoader:
    def __init__(self, store, kv_caches: list[dict], first_layer: int, expect_shape, health):
        self.store = store
        self.health = health                 # TierHealth shared with the publisher: down -> no store I/O
        self.kv_caches = kv_caches
        self.first_layer = first_layer
        self.expect_shape = expect_shape     # (components, kv_heads, head_dim) of a stored object
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()
        self.failures = 0
        threading.Thread(target=self._loop, name="kv-loader", daemon=True).start()

    def lookup(self, chunk_keys: list[str], chunk_lens: list[int]) -> int:
        """Tokens covered by the leading chunks whose every layer is in the store (0 if it is down)."""
        if not chunk_keys or not self.health.available():
            return 0
        try:
            n = self.store.lookup(chunk_keys, self.first_layer + len(self.kv_caches))
        except Exception as exc:   # logged once by the health gate; counted here
            self.health.failed(exc)
            self.failures += 1
            return 0
        self.health.ok()
        return sum(chunk_lens[:n])

    def start(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def finished(self) -> dict[str, int]:
        with self._lock:
            done, self._done = self._done, {}
        return done

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                loaded = self._load(job)
                self.health.ok()
            except Exception as exc:
                logger.warning("KV load of %s failed (%s); recomputing", job.request_id, exc)
                self.health.failed(exc)
                self.failures += 1
                loaded = 0
            with self._lock:
                self._done[job.request_id] = loaded

    def _load(self, job: LoadJob) -> int:
        end, chunk_start, loaded_to = job.start + job.num_tokens, 0, job.start
        for key, length in zip(job.chunk_keys, job.chunk_lens):
            lo, hi = max(chunk_start, job.start), min(chunk_start + length, end)
            if lo < hi:
                if not self._load_chunk(key, length, job.slots[lo:hi], lo - chunk_start, hi - chunk_start):
                    break
                loaded_to = hi
            chunk_start += length
            if chunk_start >= end:
                break
        return loaded_to - job.start

    def _load_chunk(self, key: str, length: int, slots, a: int, b: int) -> bool:
        layers = range(self.first_layer, self.first_layer + len(self.kv_caches))
        with self.store.borrow([object_key(key, layer) for layer in layers]) as objs:
            if any(o is None or tuple(o.shape) != self._shape(length) for o in objs):
                self.failures += 1
                logger.warning("chunk %s: missing or malformed object; recomputing from here", key)
                return False
            for cache, obj in zip(self.kv_caches, objs):
                scatter_kv(cache, slots, obj[:, a:b])                     # obj: [C, length, Hkv, D]
        return True

    def _shape(self, length: int) -> tuple[int, ...]:
        c, h, d = self.expect_shape
        return (c, length, h, d)
