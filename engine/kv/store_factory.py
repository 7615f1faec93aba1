"""Build the KV store a node talks to from its ``KVTransferConfig`` (embedded, or a daemon client).

Who calls it: ``LLMEngine`` once at start, with the size of its largest store object (one layer of one
chunk, sealed): an embedded store reads nothing larger back from Redis or disk. A daemon client carries the
cluster token's wire key (``kvstore.session``: the daemon proves it first, every request is signed).
"""

from __future__ import annotations

from pdserve.engine.config import KVTransferConfig


def object_bytes(layout, chunk_tokens: int) -> int:
    """Bytes of the largest object this node stores: one layer of one full chunk, sealed."""
    from pdserve.kvstore.seal import SEAL_BYTES

    return SEAL_BYTES + len(layout.components) * chunk_tokens * layout.num_kv_heads * layout.head_dim * \
        layout.dtype.itemsize


def build_node_store(cfg: KVTransferConfig, max_object_bytes: int | None = None):
    """``None`` when the node has no store; otherwise a ``pdserve.kvstore.KVStore``."""
    url = cfg.store_url
    if url is None:
        return None
    if url == "embedded":
        from pdserve.kvstore.codec import DEFAULT_MAX_OBJECT_BYTES
        from pdserve.kvstore.config import KVStoreConfig, build_store

        return build_store(KVStoreConfig(cpu_bytes=cfg.kv_cpu_bytes, redis_url=cfg.kv_redis,
                                         redis_prefix=cfg.kv_redis_prefix,
                                         disk_dir=cfg.kv_disk_dir, queue_bytes=cfg.kv_writethrough_queue_bytes,
                                         max_object_bytes=max_object_bytes or DEFAULT_MAX_OBJECT_BYTES))
    if url.startswith("tcp://"):
        from pdserve.kvstore.client import DaemonClient

        return DaemonClient(url, token=cfg.kv_auth_token, shm_bytes=cfg.kv_shm_bytes, timeout_s=2.0)
    raise ValueError(f"--kv-store {url!r}: want 'embedded' or tcp://HOST:PORT")
