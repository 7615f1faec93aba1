"""Load a request's leading prompt chunks from the store into the paged cache, off the engine thread.

Called by ``StoreConnector`` (engine thread):

    loader.lookups.ask(req_id, chunk_keys, chunk_lens)     # at add: ``lookup`` on the lookup thread (lookups.py)
    hit = loader.lookups.take(req_id)                      # store_hit_tokens (leading chunks, every layer), or
                                                           #   None while the store has not answered
    loader.start(req_id, chunk_keys, chunk_lens, slots, start, n)   # request waits in WAITING_FOR_KV
    for req_id, loaded in loader.finished().items(): ...   # loaded <= n tokens; 0 after a failure
    batch = loader.start_layers(jobs)                      # --kv-load-layerwise: one step's loads, layer-major,
                                                           #   handed to the model layer by layer (the design:
                                                           #   layerwise.py; this thread's half: layer_reader.py)

Threads and the store: the engine thread never calls the store. The ``kv-lookup`` thread calls ``store.lookup``,
the ``kv-loader`` thread ``store.borrow``/``discard``, the publisher's thread ``store.put`` (and the node's
``kv-stats`` thread ``store.stats``, ``kvstore/stats_cache.py``) -- one store object shared by them: the embedded
``TieredStore`` is thread-safe, and a ``DaemonClient`` serialises them under its lock (one request in flight per
client; a daemon that does not answer holds the caller up to the client's timeout, and the others behind it,
never the engine thread). The three KV threads share one health gate (``TierHealth``).

The loader thread reads each chunk's layer objects and, before a single block is written, checks
each object's seal (``kvstore.seal``: a MAC with the cluster's seal key over the key it was written for
and every byte, shape as expected) -- always, whoever asked for the load -- and, when the prefill node
sent one, the chunk's digest from ``kv_transfer_params.chunk_digests``. Then it
scatters the token range ``[start, start + n)`` into the blocks the scheduler allocated, through the loader
thread's own double-buffered ``ScatterPipe`` (``kernels/scatter_pipe.py``: chunk i+1 is read, checked and packed
while chunk i moves into the cache; one sync per job, before the load is reported finished). A missing,
malformed or mismatching object stops the load at the chunk before it: those tokens are recomputed,
never read wrong. An object whose seal fails is discarded from the store (it would fail every reader; a
tier that holds another copy keeps it: ``KVStore.discard``).

    prompt   |<- chunk 0 ->|<- chunk 1 ->|<- chunk 2 ->|
    load         [start ................ start+n)          (block-aligned; never the last prompt token)
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from pdserve.decode.layer_reader import LayerReader
from pdserve.decode.layerwise import LayerBatch
from pdserve.decode.lookups import StoreLookups
from pdserve.kernels.chunk_io import ChunkIO
from pdserve.kernels.scatter_pipe import ScatterPipe
from pdserve.kernels.transfer import scatter_kv
from pdserve.kvstore.keys import object_key
from pdserve.kvstore.seal import SealError, chunk_digest, unseal

logger = logging.getLogger(__name__)


@dataclass
class LoadJob:
    request_id: str
    chunk_keys: list[str]
    chunk_lens: list[int]
    slots: torch.Tensor          # [start + n] flat slots of positions 0..start+n-1
    start: int
    num_tokens: int
    digests: list[str] = field(default_factory=list)   # prefill's digest per chunk ("" = not sent)
    fence: object = None         # CUDA: an event on the compute stream when the load started (``start``)


class ChunkLoader:
    """``chunk_tokens`` sizes the scatter pipe's two staging buffers (the loader thread owns them)."""

    def __init__(self, store, kv_caches: list[dict], first_layer: int, expect_shape, health, seal_key: bytes,
                 chunk_tokens: int = 256):
        self.store = store
        self.seal_key = seal_key             # the cluster's seal key: an object it did not seal is a miss
        self.health = health                 # TierHealth shared with the publisher: down -> no store I/O
        self.kv_caches = kv_caches
        self.io = ChunkIO.of(kv_caches)      # one buffer: every layer of a chunk in one scatter
        self.pipe = ScatterPipe(self.io, chunk_tokens) if self.io is not None else None   # double-buffered
        self.first_layer = first_layer
        self.expect_shape = expect_shape     # (components, kv_heads, head_dim) of a stored object
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()
        self.failures = 0                    # loads stopped early: store error, miss or bad object
        self.integrity_failures = 0          # objects whose seal (MAC) failed (deleted from the store)
        self.digest_mismatches = 0           # chunks that differ from what the prefill node published
        self.layers = LayerReader(self)      # --kv-load-layerwise: this thread's layer-major reads
        self.layer_timeout_s: float | None = None   # layerwise: the engine's longest wait for a step's loads
        self._thread = threading.Thread(target=self._loop, name="kv-loader", daemon=True)
        self._thread.start()
        self.lookups = StoreLookups(self.lookup)    # its own thread: a store that does not answer stalls no step

    def lookup(self, chunk_keys: list[str], chunk_lens: list[int]) -> int:
        """The lookup thread: tokens covered by the leading chunks whose every layer is in the store (0 if it is down)."""
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
        """Engine thread, once the blocks are allocated: on CUDA the scatter will wait for what the compute
        stream has queued so far (a write to a block freed since, that this load now reuses)."""
        if self.io is not None:
            job.fence = self.io.fence()
        self._jobs.put(job)

    def start_layers(self, jobs: list[LoadJob]) -> LayerBatch:
        """Engine thread, after the step's blocks are allocated: the step's layerwise loads, read layer-major by the
        loader thread; the returned batch is the step's layer hooks (``layerwise.py``)."""
        device = next(iter(self.kv_caches[0].values())).device if self.kv_caches else torch.device("cpu")   # any layout
        fence = self.io.fence() if self.io is not None else None
        batch = LayerBatch(jobs, len(self.kv_caches), device, fence, self.layer_timeout_s)
        self._jobs.put(batch)
        return batch

    def finished(self) -> dict[str, int]:
        with self._lock:
            done, self._done = self._done, {}
        return done

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Finish the queued loads, then end the threads; False if they did not finish within the timeout."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return self.lookups.stop(timeout_s) and not self._thread.is_alive()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, LayerBatch):
                self.layers.load(job)
                continue
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
        """Tokens loaded; every chunk's scatter has landed in the cache when this returns (the pipe's one sync)."""
        end, chunk_start, loaded_to = job.start + job.num_tokens, 0, job.start
        with self._job(job):
            for index, length in enumerate(job.chunk_lens):
                lo, hi = max(chunk_start, job.start), min(chunk_start + length, end)
                if lo < hi:
                    if not self._load_chunk(job, index, job.slots[lo:hi], lo - chunk_start, hi - chunk_start):
                        break
                    loaded_to = hi
                chunk_start += length
                if chunk_start >= end:
                    break
        return loaded_to - job.start

    def _job(self, job: LoadJob):
        """The pipe's job scope (CUDA: after the job's fence); nothing to scope without a pipe."""
        return self.pipe.job(job.fence) if self.pipe is not None else contextlib.nullcontext()

    def _load_chunk(self, job: LoadJob, index: int, slots, a: int, b: int) -> bool:
        keys = [object_key(job.chunk_keys[index], layer) for layer in self.layer_ids()]
        expect = job.digests[index] if index < len(job.digests) else ""
        with self.store.borrow(keys) as objs:
            views = self._verified(keys, objs, job.chunk_lens[index], expect)
            if views is None:
                self.failures += 1
                return False
            self._scatter(views, slots, a, b, job.fence)
        return True

    def layer_ids(self) -> range:
        return range(self.first_layer, self.first_layer + len(self.kv_caches))

    def _scatter(self, views: list[torch.Tensor], slots, a: int, b: int, fence=None) -> None:
        """Inside the store's borrow: the pipe packs the views into its own buffer before returning, so nothing
        queued reads the borrowed objects after the borrow ends."""
        if self.pipe is not None:
            self.pipe.put([obj[:, a:b] for obj in views], slots)
            return
        for cache, obj in zip(self.kv_caches, views):
            scatter_kv(cache, slots, obj[:, a:b])                         # obj: [C, length, Hkv, D]

    def _verified(self, keys: list[str], objs, length: int, expect: str) -> list[torch.Tensor] | None:
        """Typed views of the chunk's layer objects, or None (logged, counted) if any is not right."""
        views, macs = [], []
        for key, obj in zip(keys, objs):
            checked = self.unsealed(key, obj, length)
            if checked is None:
                return None
            views.append(checked[0])
            macs.append(checked[1])
        if expect and not self.digest_ok(keys[0], macs, expect):
            return None
        return views

    def unsealed(self, key: str, obj, length: int) -> tuple[torch.Tensor, bytes] | None:
        """(view, mac) of one layer object, or None (logged, counted; a bad seal deletes it) if it is not right."""
        if obj is None:
            logger.warning("chunk object %s is missing; recomputing from here", key)
            return None
        try:
            view, mac = unseal(key, obj, self.seal_key)
        except SealError as exc:
            self.integrity_failures += 1
            logger.warning("%s; deleted from the store, recomputing from here", exc)
            self._discard(key, obj)
            return None
        if tuple(view.shape) != self._shape(length):
            logger.warning("chunk object %s has shape %s, want %s; recomputing from here", key,
                           tuple(view.shape), self._shape(length))
            return None
        return view, mac

    def digest_ok(self, key: str, macs: list[bytes], expect: str) -> bool:
        if chunk_digest(macs) == expect:
            return True
        self.digest_mismatches += 1
        logger.warning("chunk %s differs from what the prefill node published (digest %s, want %s); "
                       "recomputing from here", key.rsplit(":", 1)[0], chunk_digest(macs), expect)
        return False

    def _discard(self, key: str, obj) -> None:
        """The refused object's copies leave the store (``KVStore.discard``: a tier holding another copy keeps it)."""
        try:
            self.store.discard(key, obj)
        except Exception as exc:  # noqa: BLE001 - the store is failing anyway; the miss is what counts
            logger.debug("could not delete bad object %s: %s", key, exc)

    def _shape(self, length: int) -> tuple[int, ...]:
        c, h, d = self.expect_shape
        return (c, length, h, d)
