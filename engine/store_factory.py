"""Build the KV store a node talks to from its ``KVTransferConfig`` (embedded, or a daemon client)."""

from __future__ import annotations

from pdserve.engine.config import KVTransferConfig


def build_node_store(cfg: KVTransferConfig):
    """``None`` when the node has no store; otherwise a ``pdserve.kvstore.KVStore``."""
    url = cfg.store_url
    if url is None:
        return None
    if url == "embedded":
        from pdserve.kvstore.config import KVStoreConfig, build_store

        return build_store(KVStoreConfig(cpu_bytes=cfg.kv_cpu_bytes, redis_url=cfg.kv_redis,
                                         disk_dir=cfg.kv_disk_dir, queue_bytes=cfg.kv_writethrough_queue_bytes))
    if url.startswith("tcp://"):
        from pdserve.kvstore.client import DaemonClient

        return DaemonClient(url, token=cfg.kv_auth_token, shm_bytes=cfg.kv_shm_bytes, timeout_s=2.0)
    raise ValueError(f"--kv-store {url!r}: want 'embedded' or tcp://HOST:PORT")
