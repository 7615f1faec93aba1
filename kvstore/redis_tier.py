"""L2: Redis (or Redis Cluster) holding serialised objects under a key prefix.

Who calls it: ``TieredStore`` (write-through worker and read misses), the bench, tests.
All I/O is batched: one pipeline of SETs per put, one pipeline of GETRANGEs per get (each reads
at most ``max_blob_bytes``: a huge value someone else wrote is cut short and fails its checks, never
read whole), one pipeline of EXISTS per contains. redis-py's connection pool is shared by the threads that call in.
``redis+cluster://host:port`` uses redis-py's cluster client (the scale-out path).
Connection errors propagate (counted in ``errors``); ``TieredStore`` marks the tier down.
Redis is shared by many writers, so ``objects``/``bytes`` are not tracked here (Redis's
INFO has them); ``bytes_in``/``bytes_out`` count this client's traffic.
"""

from __future__ import annotations

import redis
from redis.cluster import RedisCluster

from pdserve.kvstore.blob import BlobTier
from pdserve.kvstore.codec import DEFAULT_MAX_OBJECT_BYTES

CLUSTER_SCHEME = "redis+cluster://"


class RedisTier(BlobTier):
    name = "redis"

    def __init__(self, url: str, prefix: str = "pdkv:", ttl_s: int | None = None,
                 codec_name: str = "none", timeout_s: float = 1.0,
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> None:
        super().__init__(codec_name, max_object_bytes)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"Redis TTL must be > 0 seconds, got {ttl_s} (--kv-redis-ttl)")
        self.url, self.prefix, self.ttl_s = url, prefix, ttl_s
        opts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._cluster = url.startswith(CLUSTER_SCHEME)
        if self._cluster:
            self._client = RedisCluster.from_url("redis://" + url[len(CLUSTER_SCHEME):], **opts)
        else:
            self._client = redis.Redis.from_url(url, **opts)

    def _write(self, blobs: list[tuple[str, bytes]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key, blob in blobs:
            pipe.set(self.prefix + key, blob, ex=self.ttl_s)
        pipe.execute()

    def _read(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self.prefix + key, 0, self.max_blob_bytes)   # one byte past the limit: cut, refused
        return [blob or None for blob in pipe.execute()]                 # a missing key reads as b""

    def _exists(self, keys: list[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.prefix + key)
        return [bool(n) for n in pipe.execute()]

    def _remove(self, keys: list[str]) -> None:
        if keys:
            self._client.delete(*[self.prefix + k for k in keys])

    def ping(self) -> bool:
        return bool(self._client.ping())

    def close(self) -> None:
        self._client.close()
