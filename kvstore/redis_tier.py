"""L2: Redis (or Redis Cluster) holding serialised objects under a key prefix.

Who calls it: ``TieredStore`` (write-through worker and read misses), the bench, tests.
All I/O is batched. A put of uncompressed objects: one SET each on ``_lean_pipeline``, framed by
``redis_wire.set_frames``: the payload leaves from the tensor's own memory (no header+payload copy, no packed
copy), and Redis can keep a large value in the buffer it read it into (a SET is whole or absent; an earlier
SET header + APPEND payload in MULTI/EXEC made Redis grow and copy every value: 8 MiB puts ~0.7x raw redis-py,
now ~1.3x). lz4 objects are SETs of joined blobs (Redis Cluster: every object that way, on redis-py's cluster
pipeline).
A get: one GETRANGE per key, each reading at most ``max_blob_bytes``, sent at once on one pooled connection
(``_lean_pipeline``; Redis Cluster: redis-py's pipeline); the payload stays in the reply's ``bytes``
(codec.decode uses it in place). The bound is the server's: GETRANGE never sends more than ``max_blob_bytes`` +
1 bytes of a value, however large a value someone planted (it is cut there and fails the codec's length check),
and nothing is read twice -- STRLEN first would race a writer, a Lua wrapper would copy every value again.
``_lean_pipeline`` is redis-py's connection pool and hiredis (a dependency): hiredis (or ``redis_wire``) packs
the commands and parses the replies in C; what it leaves out is redis-py's per-command layers (command stack, callbacks), which
cost more than a 64 KiB object's transfer. Sealed objects (every KV object a node stores) are written with the
codec's FLAG_SEALED: neither put nor get hashes their payload; the MAC every loader checks covers every byte
(codec.py, blob.py).
Contains: one pipeline of EXISTS. redis-py's connection pool is shared by the threads that call in.
``redis+cluster://host:port`` uses redis-py's cluster client (the scale-out path).
Connection errors propagate (counted in ``errors``); ``TieredStore`` marks the tier down. A key that holds
another type (a hash, a list: junk a local user planted -- Redis has no auth on loopback) reads as a corrupt
object: that one is a miss, counted and deleted, the rest of the read stands.
Redis is shared by many writers, so ``objects``/``bytes`` are not tracked here (Redis's
INFO has them); ``bytes_in``/``bytes_out`` count this client's traffic.
"""

from __future__ import annotations

import threading

import redis
import torch
from redis.cluster import RedisCluster

from pdserve.kvstore import codec, redis_wire
from pdserve.kvstore.blob import BlobTier
from pdserve.kvstore.codec import DEFAULT_MAX_OBJECT_BYTES
from pdserve.kvstore.keys import check_key
from pdserve.kvstore.seal import sealed_for

CLUSTER_SCHEME = "redis+cluster://"
NOT_AN_OBJECT = b"\0"       # what a key holding a hash, list, ... reads as: refused by the codec, counted, deleted


class RedisTier(BlobTier):
    name = "redis"

    def __init__(self, url: str, prefix: str = "pdkv:", ttl_s: int | None = None,
                 codec_name: str = "none", timeout_s: float = 1.0,
                 max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> None:
        super().__init__(codec_name, max_object_bytes)
        if ttl_s is not None and (not isinstance(ttl_s, int) or isinstance(ttl_s, bool) or ttl_s <= 0):
            raise ValueError(f"Redis TTL must be a whole number of seconds > 0, got {ttl_s!r} (--kv-redis-ttl)")
        self.url, self.prefix, self.ttl_s = url, prefix, ttl_s
        self._opts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._cluster = url.startswith(CLUSTER_SCHEME)
        self._lock = threading.Lock()
        self._conn = None if self._cluster else redis.Redis.from_url(url, **self._opts)   # connects on first use

    @property
    def _client(self):
        """The client; Redis Cluster's on first use (its constructor reaches the cluster: one that is down when
        the store or the proxy starts is then a failing tier, not a process that cannot start)."""
        if self._conn is None:
            with self._lock:
                if self._conn is None:
                    self._conn = RedisCluster.from_url("redis://" + self.url[len(CLUSTER_SCHEME):], **self._opts)
        return self._conn

    def put(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """One SET per object on ``_lean_pipeline``, framed by ``redis_wire.set_frames`` (the payload sent from the
        tensor's memory). Redis Cluster and lz4 take the joined blob of ``BlobTier.put``."""
        if self._cluster or self.codec_name != "none":
            return super().put(items)
        fits = [(check_key(k), t) for k, t in items if t.numel() * t.element_size() <= self.max_object_bytes]
        self._stats.add(rejected=len(items) - len(fits))        # no reader would take it back (decode's bound)
        if fits:
            self._guarded(self._set_framed, fits)

    def _set_framed(self, items: list[tuple[str, torch.Tensor]]) -> None:
        sets, nbytes = [], 0
        for key, tensor in items:
            header, payload = codec.encode_parts(tensor, "none", key, sealed_for)
            sets.append(((self.prefix + key).encode(), header, payload))
            nbytes += len(header) + len(payload)
        self._send_read(redis_wire.set_frames(sets, self.ttl_s), len(sets))
        self._stats.add(bytes_in=nbytes)

    def _write(self, blobs: list[tuple[str, bytes]]) -> None:
        if not self._cluster:
            expiry = () if self.ttl_s is None else ("EX", self.ttl_s)
            self._lean_pipeline([("SET", self.prefix + key, blob, *expiry) for key, blob in blobs])
            return
        pipe = self._client.pipeline(transaction=False)
        for key, blob in blobs:
            pipe.set(self.prefix + key, blob, ex=self.ttl_s)
        pipe.execute()

    def _read(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        limit = self.max_blob_bytes                                    # one byte past the limit: cut, refused
        if not self._cluster:
            replies = self._lean_pipeline([("GETRANGE", self.prefix + k, 0, limit) for k in keys],
                                          wrong_type=NOT_AN_OBJECT)
        else:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.getrange(self.prefix + key, 0, limit)
            replies = [_wrong_type(r, NOT_AN_OBJECT) for r in pipe.execute(raise_on_error=False)]
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return [blob or None for blob in replies]                    # a missing key reads as b""

    def _lean_pipeline(self, commands: list[tuple], wrong_type=None) -> list:
        """Send every command at once and read the replies in order on one pooled connection: a pipeline without
        redis-py's per-command layers (callbacks, command stack), which cost more than a 64 KiB read; hiredis
        packs the commands (``redis_wire.packed``) and parses the replies."""
        return self._send_read(redis_wire.packed(commands), len(commands), wrong_type)

    def _send_read(self, frames: list, count: int, wrong_type=None) -> list:
        """Send ``frames`` (RESP of ``count`` commands) on one pooled connection and read the ``count`` replies. A
        WRONGTYPE reply (a value of another type under the key: junk someone planted) is ``wrong_type``; any other
        error reply raises once every reply is read."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(frames)
            replies = [_wrong_type(_read_reply(conn), wrong_type) for _ in range(count)]
        except BaseException:
            conn.disconnect()                      # replies may still be in flight: never reuse this connection
            raise
        finally:
            pool.release(conn)
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
        return replies

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
        if self._conn is not None:
            self._conn.close()


def _wrong_type(reply, replacement):
    """``replacement`` for a WRONGTYPE error reply (when one is given), the reply itself otherwise."""
    if replacement is not None and isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE"):
        return replacement
    return reply


def _read_reply(conn):
    """One reply; an error reply is returned, not raised (it was read whole: the connection stays in step)."""
    try:
        return conn.read_response()
    except redis.ResponseError as exc:
        return exc
