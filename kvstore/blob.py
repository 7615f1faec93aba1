"""Shared logic of the tiers that store serialised bytes (Redis, disk).

Who calls it: ``RedisTier`` and ``DiskTier`` subclass it and provide four byte-level
methods (``_write``, ``_read``, ``_exists``, ``_remove``). This class encodes on put,
decodes and validates on get, and turns a corrupt object into a miss: logged, counted
(``checksum_failures``; ``key_mismatch`` when an intact object was written for another key),
deleted. The store key (without any backend prefix) is written into every object's header. Backend errors
(connection refused, disk full) are counted in ``errors`` and raised, so ``TieredStore`` can mark the tier down.
Reads are bounded: a backend reads at most ``codec.max_blob_bytes(max_object_bytes)`` bytes of one object
(a longer value is cut there and fails its checks), and ``codec.decode`` checks the header's sizes before it
allocates: whoever else writes to Redis or the directory cannot make this process allocate more.
Sealed objects (every KV object a node stores; ``seal.py``) are written with ``codec``'s FLAG_SEALED when
``seal.sealed_for`` says they are laid out for their key: the tier's checksum then covers the header and the seal
head, and the payload's bytes are checked once, by the MAC every loader verifies (``ChunkLoader.unsealed``): a
flipped payload byte is a loader's integrity failure (counted, the object deleted), not a checksum failure here.
"""

from __future__ import annotations

import abc
import logging

import torch

from pdserve.kvstore import codec
from pdserve.kvstore.base import KVStore, StatsDict, TierStats
from pdserve.kvstore.keys import check_key
from pdserve.kvstore.seal import sealed_for

log = logging.getLogger(__name__)


class BlobTier(KVStore):
    name = "blob"

    def __init__(self, codec_name: str = "none", max_object_bytes: int = codec.DEFAULT_MAX_OBJECT_BYTES) -> None:
        if codec_name not in codec.CODECS:
            raise ValueError(f"unknown codec {codec_name!r}; choose one of {sorted(codec.CODECS)} (--kv-codec)")
        if max_object_bytes <= 0:
            raise ValueError(f"--kv-max-object-bytes must be > 0, got {max_object_bytes}")
        self.codec_name, self.max_object_bytes = codec_name, max_object_bytes
        self.max_blob_bytes = codec.max_blob_bytes(max_object_bytes)     # what one object read may return
        self._stats = TierStats()

    @abc.abstractmethod
    def _write(self, blobs: list[tuple[str, bytes]]) -> None: ...

    @abc.abstractmethod
    def _read(self, keys: list[str]) -> list[bytes | memoryview | None]: ...

    @abc.abstractmethod
    def _exists(self, keys: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    def _remove(self, keys: list[str]) -> None: ...

    def put(self, items: list[tuple[str, torch.Tensor]]) -> None:
        fits = [(k, t) for k, t in items if t.numel() * t.element_size() <= self.max_object_bytes]
        if len(fits) < len(items):          # no reader would take it back (decode's bound): not stored, counted
            self._stats.add(rejected=len(items) - len(fits))
        blobs = [(check_key(k), codec.encode(t, self.codec_name, k, sealed_for)) for k, t in fits]
        self._guarded(self._write, blobs)
        self._stats.add(bytes_in=sum(len(b) for _, b in blobs))

    def get(self, keys: list[str]) -> list[torch.Tensor | None]:
        blobs = self._guarded(self._read, [check_key(k) for k in keys])
        out, corrupt = [], []
        for key, blob in zip(keys, blobs):
            out.append(None if blob is None else self._decode(key, blob, corrupt))
        if corrupt:
            self._guarded(self._remove, corrupt)
        hits = sum(t is not None for t in out)
        self._stats.add(hits=hits, misses=len(keys) - hits,
                        bytes_out=sum(len(b) for b in blobs if b is not None))
        return out

    def contains(self, keys: list[str]) -> list[bool]:
        return self._guarded(self._exists, [check_key(k) for k in keys])

    def delete(self, keys: list[str]) -> None:
        self._guarded(self._remove, [check_key(k) for k in keys])

    def stats(self) -> StatsDict:
        return {self.name: self._stats.snapshot()}

    def _decode(self, key: str, blob: bytes | memoryview, corrupt: list[str]) -> torch.Tensor | None:
        try:
            return codec.decode(blob, key, self.max_object_bytes, sealed_for)
        except codec.CorruptObject as exc:
            log.warning("%s tier: object %s is corrupt (%s); counted as a miss and deleted", self.name, key, exc)
            if isinstance(exc, codec.KeyMismatch):
                self._stats.add(key_mismatch=1)
            else:
                self._stats.add(checksum_failures=1)
            corrupt.append(key)
            return None

    def _guarded(self, fn, arg):
        try:
            return fn(arg)
        except Exception:
            self._stats.add(errors=1)
            raise

