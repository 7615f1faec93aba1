"""The engine's one connection to a KV store: look up and load before prefill, publish after.

Who calls what (all on the engine thread; the I/O runs on the publisher/loader/lookup threads):

    LLMEngine.add_request      connector.add(req, kv_transfer_params)     keys, compatibility check; the store
                                                                          lookup starts on the loader's lookup
                                                                          thread (``decode/lookups.py``)
    Scheduler, first admission n = connector.num_loadable_tokens(req, local_hit)   (lookup answer + accounting;
                                                                          None: not answered yet, the request
                                                                          stays waiting, asked again next step)
                               connector.start_load(req, local_hit, n)    req waits in WAITING_FOR_KV
    LLMEngine.step, nothing    connector.wait_lookups(timeout_s)          a bounded wait for a lookup's answer
      running
    Scheduler.schedule         connector.finished_loads() -> {id: loaded tokens}   (0 = recompute all)
  --kv-load-layerwise (``decode/layerwise.py``): start_load queues the load and the request runs in this step
    LLMEngine.step, before run connector.begin_loads() -> the step's LayerHooks (None: no load queued)
    LLMEngine.step, after run  connector.end_loads() -> {id: load start} of loads that failed: their step's
                               result is dropped and the scheduler rewinds them there
    LLMEngine.step, before run hooks = connector.begin_step(scheduled)    --kv-publish-layerwise: ring slots for
                                                                          the chunks the step completes (may wait;
                                                                          not a request whose layerwise load runs
                                                                          in this step: it publishes per step, after
                                                                          end_loads said the load held);
                                                                          the runner sets hooks on the step's
                                                                          AttentionMetadata.layer_hooks, the model
                                                                          hands each layer over as it finishes
    LLMEngine.step, after run  connector.after_step(scheduled)            publish chunks now complete (may wait
                                                                          for a publish-ring slot: back-pressure)
                               connector.abandon_step()                   instead, when the forward raised
    request finished           connector.close(req)  -> the response waits for finished_publishes()
    request aborted            connector.forget(req)  (queued chunks are still put; no result is kept; a lookup
                                                       still running is dropped: its answer is not kept)
    response                   connector.transfer_params(req), connector.accounting(req)

Integrity: every object is sealed by the publisher (``kvstore.seal``: a keyed MAC with the cluster's seal
key) and checked by the loader before it is scattered, on every node that loads; ``transfer_params``
carries the digest of each chunk the prefill node published, which the decode node's loader compares with
what it read.

The store behind it is any ``pdserve.kvstore.KVStore``: the embedded tiered store or a daemon
client. A store that fails costs hits (logged once, counted), never a request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import dataclasses
import json

import torch
import xxhash

from pdserve.decode.loader import ChunkLoader, LoadJob
from pdserve.engine.kv.kv_transfer import KVTransferParams
from pdserve.kvstore.accounting import KVAccounting, account, not_run
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.keys import chunk_keys, model_fingerprint
from pdserve.prefill.layerwise import LayerChunk, LayerwisePublish
from pdserve.prefill.publisher import DEFAULT_BUFFER_BYTES, ChunkPublisher, PublishResult

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass
class _Transfer:
    keys: list[str]
    lens: list[int]
    publish: bool
    remote: KVTransferParams | None
    store_hit: int | None = None        # tokens the store lookup found (None: not answered yet)
    stored: int = 0                     # leading chunks already in the store at lookup (not published here)
    published: int = 0                  # chunks handed to the publisher (or already stored)
    result: PublishResult | None = None # what the store acknowledged, once the publish finished
    accounting: KVAccounting | None = None
    extra: dict = field(default_factory=dict)
    times: list = field(default_factory=lambda: [0.0, 0.0, 0, 0.0, 0.0, 0])   # see ``timing``


class StoreConnector:
    def __init__(self, store, model_config, layout, kv_caches: list[dict], block_size: int,
                 chunk_tokens: int, role: str, seal_key: bytes, kv_io=None,
                 publish_buffer_bytes: int = DEFAULT_BUFFER_BYTES, load_layerwise: bool = False,
                 load_layerwise_timeout_s: float | None = None, publish_layerwise: bool = False):
        if chunk_tokens % block_size:
            raise ValueError(f"--kv-chunk-tokens {chunk_tokens} must be a multiple of --block-size {block_size}")
        self.store, self.block_size, self.chunk_tokens, self.role = store, block_size, chunk_tokens, role
        self.bytes_per_token = layout.bytes_per_token
        self.layout_text = layout.describe()
        self.fingerprint = model_fingerprint(model_config.architecture, weights_identity(model_config.model_dir),
                                             str(layout.dtype), self.layout_text, FORMAT_VERSION,
                                             config_identity(model_config))
        shape = (len(layout.components), layout.num_kv_heads, layout.head_dim)
        self.health = TierHealth("kv-store", base_s=2.0, max_s=30.0)
        durable = role == "prefill" and hasattr(store, "flush")   # embedded store: the reader is elsewhere
        ring = dict(chunk_tokens=chunk_tokens, chunk_bytes=layout.bytes_per_token * chunk_tokens,
                    buffer_bytes=publish_buffer_bytes if role != "decode" else 0)   # a decode node never publishes
        if kv_io is None:
            self.publisher = ChunkPublisher(store, kv_caches, layout.first_layer, self.health, seal_key, durable,
                                            **ring)
            self.loader = ChunkLoader(store, kv_caches, layout.first_layer, shape, self.health, seal_key,
                                      chunk_tokens)
        else:   # tp x pp: the cache lives in the worker ranks (pdserve.engine.parallel.kv)
            self.publisher = kv_io.publisher(store, self.health, seal_key, durable, **ring)
            self.loader = kv_io.loader(store, shape, self.health, seal_key)
        self.load_layerwise = load_layerwise and kv_io is None
        if self.load_layerwise:
            self.loader.layer_timeout_s = load_layerwise_timeout_s   # a hung store read fails the step's loads only
        if load_layerwise and kv_io is not None:
            logger.warning("--kv-load-layerwise is ignored on a tensor/pipeline-parallel node: its worker ranks load "
                           "chunk by chunk (the request waits for its load)")
        self._queued: list[LoadJob] = []    # layerwise loads of the step being scheduled
        self._batch = None                  # layerwise: the running step's LayerBatch
        self._discarded: set[str] = set()   # layerwise: requests whose last step computed on a failed load
        self.layerwise_batches = 0          # steps that ran layerwise loads
        self.layerwise_wait_s = 0.0         # the engine thread's time blocked in their ``before(i)``
        self._reqs: dict[str, _Transfer] = {}
        self.publish_layerwise = (publish_layerwise and role != "decode"
                                  and getattr(self.publisher, "layerwise", False))
        if publish_layerwise and role != "decode" and not self.publish_layerwise:
            logger.info("--kv-publish-layerwise: this node's KV lives in its tensor/pipeline-parallel ranks; "
                        "it publishes per step (after the whole forward)")
        self._hooks: LayerwisePublish | None = None     # the step's, between begin_step and after/abandon_step

    # -- requests -----------------------------------------------------------------------------

    def check(self, params: KVTransferParams) -> None:
        params.check_compatible(fingerprint=self.fingerprint, block_size=self.block_size,
                                chunk_tokens=self.chunk_tokens, kv_layout=self.layout_text)

    def add(self, req, params: KVTransferParams | None) -> None:
        if params is not None and params.do_remote_prefill:
            self.check(params)
        keys = chunk_keys(req.prompt_token_ids, self.chunk_tokens, self.fingerprint, include_partial=True,
                          cache_salt=req.cache_salt)
        n = req.num_prompt_tokens
        lens = [min(self.chunk_tokens, n - i * self.chunk_tokens) for i in range(len(keys))]
        t = _Transfer(keys, lens, publish=self.role != "decode", remote=params)
        self._reqs[req.request_id] = t
        if req.computes_prompt_logprobs or not keys:    # a load has no logits in it: it computes every token
            t.store_hit = 0
        else:
            self.loader.lookups.ask(req.request_id, keys, lens)

    def num_loadable_tokens(self, req, local_hit: int) -> int | None:
        """Tokens to load beyond ``local_hit``; None while the store lookup has not answered (ask next step)."""
        t = self._reqs.get(req.request_id)
        if t is None:
            return 0
        if t.store_hit is None:
            t.store_hit = self.loader.lookups.take(req.request_id)
            if t.store_hit is None:
                return None
        t.accounting = account(req.num_tokens, local_hit, t.store_hit, self.block_size)
        t.stored = t.published = _chunks_covered(t.lens, t.store_hit)   # already in the store: not again
        return t.accounting.need_to_load

    def wait_lookups(self, timeout_s: float) -> bool:
        """Until a pending store lookup is answered, at most ``timeout_s``; False at once if none is pending."""
        return self.loader.lookups.wait(timeout_s)

    def start_load(self, req, start: int, num_tokens: int) -> None:
        t = self._reqs[req.request_id]
        slots = _slots(req.block_ids, start + num_tokens, self.block_size)
        digests = t.remote.chunk_digests if t.remote is not None else []
        t.times[0] = time.monotonic()
        job = LoadJob(req.request_id, t.keys, t.lens, slots, start, num_tokens, list(digests))
        if self.load_layerwise:
            self._queued.append(job)                        # handed over by begin_loads, lands within the step
        else:
            self.loader.start(job)

    def finished_loads(self) -> dict[str, int]:
        done = self.loader.finished()
        for rid, loaded in done.items():
            self._loaded(rid, loaded)
        return done

    def _loaded(self, rid: str, loaded: int) -> None:
        t = self._reqs.get(rid)
        if t is not None:
            t.times[1], t.times[2] = time.monotonic(), loaded * self.bytes_per_token
        if t is not None and t.accounting is not None:
            if loaded < t.accounting.need_to_load:      # a chunk failed its seal (or vanished): ours to publish
                good = _chunks_covered(t.lens, t.accounting.local_hit_tokens + loaded)
                t.stored = t.published = min(t.stored, good)
            t.accounting = t.accounting.with_loaded(loaded)

    def begin_loads(self):
        """Layerwise: hand the loads queued by this step's schedule to the loader -> the step's ``LayerHooks``."""
        self._discarded = set()
        jobs, self._queued = self._queued, []       # taken first: a raise here leaves no load for a later step
        if not jobs:                                # (whose blocks may belong to another request by then)
            return None
        self._batch = self.loader.start_layers(jobs)
        return self._batch

    def end_loads(self) -> dict[str, int]:
        """Layerwise: wait until the step's loads ended (they did, if the model ran its hooks) -> {request id: load
        start} of those that failed: the step computed them on a partial cache."""
        batch, self._batch = self._batch, None
        self._queued = []                   # a step that failed before begin_loads: its loads never start
        if batch is None:
            return {}
        failed, loads = {}, batch.wait()
        self.layerwise_batches += 1
        self.layerwise_wait_s += batch.waited_s
        for rid, load in loads.items():
            self._loaded(rid, load.loaded)
            if load.failed:
                failed[rid] = load.job.start
                logger.warning("layerwise KV load of %s failed (%s); its step is dropped, it recomputes from "
                               "token %d", rid, load.failed, load.job.start)
        self._discarded = set(failed)
        return failed

    def after_step(self, scheduled) -> None:
        """Publish every prompt chunk that the step just computed (call before blocks are freed)."""
    def begin_step(self, scheduled) -> LayerwisePublish | None:
        """Before the forward, with ``--kv-publish-layerwise``: a ring slot for each chunk the step completes (up to
        the ring's size; the rest go per step in ``after_step``) -> the hooks that publish them layer by layer
        (``prefill/layerwise.py``), or None. Every ``begin_step`` is followed by ``after_step`` or ``abandon_step``."""
        self._hooks = None
        if not self.publish_layerwise:
            return None
        chunks, skips, room = [], [], self.publisher.ring.num_slots
        loading = {job.request_id for job in self._queued}   # their step may be dropped: per step, once it counts
        for req, t, end in self._due(scheduled):
            if req.request_id in loading:
                continue
            try:
                while t.published < end and len(chunks) < room:
                    chunk = self._start_layers(req, t, t.published)
                    if chunk is None:
                        skips.append((req.request_id, t.published, t.keys[t.published]))
                        t.publish = False      # the ring stayed full: skipped (counted); nothing after a gap
                        break
                    chunks.append(chunk)
                    t.published += 1
            except Exception as exc:  # noqa: BLE001 - as in after_step
                self._publish_failed(req, t, exc)
        if chunks or skips:
            self._hooks = LayerwisePublish(self.publisher, chunks, skips)
        return self._hooks

    def _start_layers(self, req, t: _Transfer, index: int) -> LayerChunk | None:
        start = index * self.chunk_tokens
        slots = _slots(req.block_ids, start + t.lens[index], self.block_size)[start:]
        t.times[3] = t.times[3] or time.monotonic()
        chunk = self.publisher.start_layers(req.request_id, index, t.keys[index], slots)
        if chunk is not None:
            t.times[5] += t.lens[index] * self.bytes_per_token
        return chunk

    def abandon_step(self) -> None:
        """The forward raised after ``begin_step``: the step's layerwise chunks end unpublished."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.abandon()

    def _due(self, scheduled):
        """-> (request, transfer, chunks complete once the step ran) of each request that publishes."""
        for item in scheduled:
            req, t = item.request, self._reqs.get(item.request.request_id)
            if t is None or not t.publish or not req.block_ids or req.request_id in self._discarded:
                continue
            done_tokens = min(item.first_token_index + item.num_new_tokens, req.num_prompt_tokens)
            yield req, t, _chunks_covered(t.lens, done_tokens)

    def _publish_failed(self, req, t: _Transfer, exc: Exception) -> None:
        logger.warning("publishing KV of %s failed (%s: %s); its later chunks are not published",
                       req.request_id, type(exc).__name__, exc)
        self.publisher.failures += 1
        t.publish = False

    def after_step(self, scheduled) -> None:
        """Publish every prompt chunk that the step just computed (call before blocks are freed): end the layerwise
        chunks of ``begin_step``, then the rest per step."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.finish()
            for rid in hooks.failed:                 # a gather raised: nothing after that gap is published
                if rid in self._reqs:
                    self._reqs[rid].publish = False
        for req, t, end in self._due(scheduled):
            try:
                while t.published < end:
                    if not self._publish_chunk(req, t, t.published):
                        t.publish = False    # the ring stayed full: skipped (counted); nothing after a gap is used
                        break
                    t.published += 1
            except Exception as exc:  # noqa: BLE001 - this request's KV stays unpublished; decode recomputes
                self._publish_failed(req, t, exc)

    def _publish_chunk(self, req, t: _Transfer, index: int) -> bool:
        """False: the publisher skipped the chunk (its ring stayed full; may have waited for a slot first)."""
        start = index * self.chunk_tokens
        slots = _slots(req.block_ids, start + t.lens[index], self.block_size)[start:]
        t.times[3] = t.times[3] or time.monotonic()
        if not self.publisher.publish(req.request_id, index, t.keys[index], slots):
            return False
        t.times[5] += t.lens[index] * self.bytes_per_token
        return True

    def close(self, request_id: str) -> None:
        """The request finished: its publish is complete once ``finished_publishes`` names it."""
        t = self._reqs.get(request_id)
        self.publisher.close_request(request_id, t.stored if t is not None else 0)

    def forget(self, request_id: str) -> None:
        """The request was aborted: no publish result will be asked for."""
        self.publisher.forget(request_id)
        self.loader.lookups.cancel(request_id)
        self._reqs.pop(request_id, None)

    def finished_publishes(self) -> set[str]:
        done = self.publisher.finished()
        now = time.monotonic()
        for rid, result in done.items():
            if rid in self._reqs:
                t = self._reqs[rid]
                t.result = result
                t.times[4] = now if t.times[3] else 0.0
        return set(done)

    def timing(self, request_id: str) -> tuple:
        """(load start, load end, bytes loaded, publish start, publish end, bytes handed to the store) of a
        request still known here (time.monotonic(), 0 where it did not happen; an end is when this thread saw
        it, within a step). Read by the ``OutputAssembler`` for ``RequestTimes``; () for an unknown request."""
        t = self._reqs.get(request_id)
        return () if t is None else tuple(t.times)

    # -- results ------------------------------------------------------------------------------

    def accounting(self, req) -> KVAccounting:
        t = self._reqs.get(req.request_id)
        if t is None:
            return account(req.num_prompt_tokens, req.num_cached_tokens, 0, self.block_size)
        if t.accounting is None:              # never admitted (e.g. ended by the prefill node's token)
            return not_run()
        return t.accounting

    def transfer_params(self, req) -> KVTransferParams:
        """What the decode node needs; call once ``finished_publishes`` named the request."""
        t = self._reqs[req.request_id]
        chunks = t.result.chunks if t.result is not None else t.stored
        digests = [t.result.digests.get(i, "") for i in range(chunks)] if t.result is not None else []
        first = req.output_token_ids[0] if req.output_token_ids else None
        return KVTransferParams(do_remote_prefill=True, model_fingerprint=self.fingerprint,
                                block_size=self.block_size, chunk_tokens=self.chunk_tokens,
                                kv_layout=self.layout_text, num_tokens=sum(t.lens[:chunks]),
                                chunk_keys=t.keys, chunk_digests=digests, first_token_id=first,
                                accounting=_acc_dict(self.accounting(req)))

    def release(self, request_id: str) -> None:
        self.loader.lookups.cancel(request_id)       # one never scheduled (ended by the prefill node's token)
        self._reqs.pop(request_id, None)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the publisher (its queued puts go out first) and the loader; the store is closed by its owner."""
        if not self.publisher.stop(timeout_s):
            logger.warning("KV publisher still busy after %.0fs at shutdown; unpublished chunks are lost", timeout_s)
        self.loader.stop(timeout_s)

    def stats(self) -> dict:
        return {"load_failures": self.loader.failures, "publish_failures": self.publisher.failures,
                "load_integrity_failures": self.loader.integrity_failures,
                "load_digest_mismatches": self.loader.digest_mismatches,
                "publish_skipped": self.publisher.skipped, **self.publisher.buffer_stats(),
                "load_layerwise_batches": self.layerwise_batches,
                "load_layerwise_wait_seconds": round(self.layerwise_wait_s, 6),
                **{f"store_{k}": v for k, v in self.health.snapshot().items()}}


def weights_identity(model_dir) -> str:
    """xxh3-64 over every safetensors file (names and bytes): different weights, different keys."""
    h = xxhash.xxh3_64()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


_NOT_KV = ("model_dir", "eos_token_ids", "bos_token_id")   # fields that never change a KV byte


def config_identity(model_config) -> str:
    """sha256 over every ModelConfig field that can shape KV (RoPE, norm eps, window, dims, dtype...).

    Fields are opt-out, not opt-in: a field added to ModelConfig later is covered without a change here.
    """
    fields = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in _NOT_KV}
    text = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode())


def _slots(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(num_tokens)
    table = torch.tensor(block_ids[: (num_tokens + block_size - 1) // block_size], dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def _chunks_covered(lens: list[int], tokens: int) -> int:
    n, total = 0, 0
    while n < len(lens) and total + lens[n] <= tokens:
        total += lens[n]
        n += 1
    return n


def _acc_dict(a: KVAccounting) -> dict[str, int]:
    return {"total_tokens": a.total_tokens, "local_hit_tokens": a.local_hit_tokens,
            "store_hit_tokens": a.store_hit_tokens, "need_to_load": a.need_to_load,
            "loaded_tokens": a.loaded_tokens, "recomputed_tokens": a.recomputed_tokens}
