"""The engine's one connection to a KV store: look up and load before prefill, publish after.

Who calls what (all on the engine thread; the I/O runs on the publisher/loader threads):

    LLMEngine.add_request      connector.add(req, kv_transfer_params)     keys, compatibility check
    Scheduler, first admission n = connector.num_loadable_tokens(req, local_hit)   (lookup + accounting)
                               connector.start_load(req, local_hit, n)    req waits in WAITING_FOR_KV
    Scheduler.schedule         connector.finished_loads() -> {id: loaded tokens}   (0 = recompute all)
    LLMEngine.step, after run  connector.after_step(scheduled)            publish chunks now complete
    request finished           connector.close(req)  -> the response waits for finished_publishes()
    response                   connector.transfer_params(req), connector.accounting(req)

The store behind it is any ``pdserve.kvstore.KVStore``: the embedded tiered store or a daemon
client. A store that fails costs hits (logged once, counted), never a request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from pdserve.decode.loader import ChunkLoader, LoadJob
from pdserve.engine.kv_transfer import KVTransferParams
from pdserve.kvstore.accounting import KVAccounting, account
from pdserve.kvstore.health import TierHealth
from pdserve.kvstore.keys import chunk_keys, model_fingerprint
from pdserve.prefill.publisher import ChunkPublisher

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass
class _Transfer:
    keys: list[str]
    lens: list[int]
    publish: bool
    remote: KVTransferParams | None
    published: int = 0                  # chunks handed to the publisher
    accounting: KVAccounting | None = None
    extra: dict = field(default_factory=dict)


class StoreConnector:
    def __init__(self, store, model_config, layout, kv_caches: list[dict], block_size: int,
                 chunk_tokens: int, role: str, kv_io=None):
        if chunk_tokens % block_size:
            raise ValueError(f"--kv-chunk-tokens {chunk_tokens} must be a multiple of --block-size {block_size}")
        self.store, self.block_size, self.chunk_tokens, self.role = store, block_size, chunk_tokens, role
        self.layout_text = layout.describe()
        self.fingerprint = model_fingerprint(model_config.architecture, weights_identity(model_config.model_dir),
                                             str(layout.dtype), self.layout_text, FORMAT_VERSION)
        shape = (len(layout.components), layout.num_kv_heads, layout.head_dim)
        self.health = TierHealth("kv-store", base_s=2.0, max_s=30.0)
        durable = role == "prefill" and hasattr(store, "flush")   # embedded store: the reader is elsewhere
        if kv_io is None:
            self.publisher = ChunkPublisher(store, kv_caches, layout.first_layer, self.health, durable)
            self.loader = ChunkLoader(store, kv_caches, layout.first_layer, shape, self.health)
        else:   # tp x pp: the cache lives in the worker ranks (pdserve.engine.parallel.kv)
            self.publisher = kv_io.publisher(store, self.health, durable)
            self.loader = kv_io.loader(store, shape, self.health)
        self._reqs: dict[str, _Transfer] = {}

    # -- requests -----------------------------------------------------------------------------

    def check(self, params: KVTransferParams) -> None:
        params.check_compatible(fingerprint=self.fingerprint, block_size=self.block_size,
                                chunk_tokens=self.chunk_tokens, kv_layout=self.layout_text)

    def add(self, req, params: KVTransferParams | None) -> None:
        if params is not None and params.do_remote_prefill:
            self.check(params)
        keys = chunk_keys(req.prompt_token_ids, self.chunk_tokens, self.fingerprint, include_partial=True)
        n = req.num_prompt_tokens
        lens = [min(self.chunk_tokens, n - i * self.chunk_tokens) for i in range(len(keys))]
        self._reqs[req.request_id] = _Transfer(keys, lens, publish=self.role != "decode", remote=params)

    def num_loadable_tokens(self, req, local_hit: int) -> int:
        t = self._reqs.get(req.request_id)
        if t is None:
            return 0
        store_hit = self.loader.lookup(t.keys, t.lens)
        t.accounting = account(req.num_tokens, local_hit, store_hit, self.block_size)
        t.published = _chunks_covered(t.lens, store_hit)     # already in the store: do not publish again
        return t.accounting.need_to_load

    def start_load(self, req, start: int, num_tokens: int) -> None:
        t = self._reqs[req.request_id]
        slots = _slots(req.block_ids, start + num_tokens, self.block_size)
        self.loader.start(LoadJob(req.request_id, t.keys, t.lens, slots, start, num_tokens))

    def finished_loads(self) -> dict[str, int]:
        done = self.loader.finished()
        for rid, loaded in done.items():
            t = self._reqs.get(rid)
            if t is not None and t.accounting is not None:
                t.accounting = t.accounting.with_loaded(loaded)
        return done

    def after_step(self, scheduled) -> None:
        """Publish every prompt chunk that the step just computed (call before blocks are freed)."""
        for item in scheduled:
            req, t = item.request, self._reqs.get(item.request.request_id)
            if t is None or not t.publish or not req.block_ids:
                continue
            done_tokens = min(item.first_token_index + item.num_new_tokens, req.num_prompt_tokens)
            while t.published < len(t.keys) and sum(t.lens[:t.published + 1]) <= done_tokens:
                self._publish_chunk(req, t, t.published)
                t.published += 1

    def _publish_chunk(self, req, t: _Transfer, index: int) -> None:
        start = index * self.chunk_tokens
        slots = _slots(req.block_ids, start + t.lens[index], self.block_size)[start:]
        self.publisher.publish(req.request_id, t.keys[index], slots)

    def close(self, request_id: str) -> None:
        """The request finished: its publish is complete once ``finished_publishes`` names it."""
        self.publisher.close_request(request_id)

    def finished_publishes(self) -> set[str]:
        return self.publisher.finished()

    # -- results ------------------------------------------------------------------------------

    def accounting(self, req) -> KVAccounting:
        t = self._reqs.get(req.request_id)
        if t is None or t.accounting is None:
            return account(req.num_prompt_tokens, req.num_cached_tokens, 0, self.block_size)
        return t.accounting

    def transfer_params(self, req) -> KVTransferParams:
        t = self._reqs[req.request_id]
        published = sum(t.lens[:t.published])
        first = req.output_token_ids[0] if req.output_token_ids else None
        return KVTransferParams(do_remote_prefill=True, model_fingerprint=self.fingerprint,
                                block_size=self.block_size, chunk_tokens=self.chunk_tokens,
                                kv_layout=self.layout_text, num_tokens=published,
                                chunk_keys=t.keys, first_token_id=first,
                                accounting=_acc_dict(self.accounting(req)))

    def release(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def stats(self) -> dict:
        return {"load_failures": self.loader.failures, "publish_failures": self.publisher.failures,
                "publish_skipped": self.publisher.skipped, **{f"store_{k}": v for k, v in self.health.snapshot().items()}}


def weights_identity(model_dir) -> str:
    """xxh3-64 over every safetensors file (names and bytes): different weights, different keys."""
    h = xxhash.xxh3_64()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


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
