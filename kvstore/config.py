"""The store's configuration (one frozen dataclass) and the factory that builds it.

Who calls it: ``cli.py`` (daemon flags -> config), the engine later (embedded store),
tests and the bench. ``build_store`` returns a ``TieredStore`` whose L1 is memory
(the daemon's: a shared-memory arena); Redis and disk are added when their flags are given.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvstore.arena_tier import ArenaTier
from pdserve.kvstore.codec import CODECS, DEFAULT_MAX_OBJECT_BYTES
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.redis_tier import RedisTier
from pdserve.kvstore.tiered import TieredStore


_BYTE_FLAGS = {"cpu_bytes": "--kv-cpu-bytes", "disk_bytes": "--kv-disk-bytes",
               "queue_bytes": "--kv-writethrough-queue-bytes", "max_object_bytes": "--kv-max-object-bytes"}


@dataclass(frozen=True)
class KVStoreConfig:
    cpu_bytes: int = 4 << 30                 # --kv-cpu-bytes (L1 budget)
    redis_url: str | None = None             # --kv-redis redis://host:port/db | redis+cluster://host:port
    redis_prefix: str = "pdkv:"              # --kv-redis-prefix
    redis_ttl_s: int | None = None           # --kv-redis-ttl
    disk_dir: str | None = None              # --kv-disk-dir
    disk_bytes: int = 64 << 30               # --kv-disk-bytes (L3 budget)
    codec: str = "none"                      # --kv-codec, for Redis and disk ("none" | "lz4")
    queue_bytes: int = 256 << 20             # --kv-writethrough-queue-bytes (write-through queue bound)
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES   # --kv-max-object-bytes: the largest object read or written
    backoff_base_s: float = 0.5              # first retry delay of a tier marked down
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"--kv-codec {self.codec!r} is not one of {sorted(CODECS)}")
        for name, flag in _BYTE_FLAGS.items():
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 bytes, got {getattr(self, name)} ({flag})")


def build_store(config: KVStoreConfig, arena: bool = False) -> TieredStore:
    """``arena``: L1 in a shared-memory arena local clients read and write in place (the daemon's store)."""
    lower = []
    if config.redis_url:
        lower.append(RedisTier(config.redis_url, config.redis_prefix, config.redis_ttl_s, config.codec,
                               max_object_bytes=config.max_object_bytes))
    if config.disk_dir:
        lower.append(DiskTier(config.disk_dir, config.disk_bytes, config.codec, config.max_object_bytes))
    l1 = ArenaTier(config.cpu_bytes) if arena else MemoryTier(config.cpu_bytes)
    return TieredStore(l1, lower, config.queue_bytes,
                       config.backoff_base_s, config.backoff_max_s)
