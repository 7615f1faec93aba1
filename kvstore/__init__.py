"""pdserve.kvstore: the tiered KV store prefill nodes publish to and decode nodes load from.

Who calls it: the engine's KV connector (prefill: ``put``; decode: ``lookup`` then
``borrow``/``get``), the proxy (``chunk_keys`` for prefix routing), ``pdserve kvstore``
(the daemon) and the bench. Start with ``base.KVStore`` (the one interface).

    auth.py        the cluster token: the wire key and the seal key derived from it (BLAKE3)
    session.py     daemon and client prove the wire key to each other; every request signed for one daemon process
    keys.py        chunk keys (chained sha256 salted with the model fingerprint and cache_salt), object keys
    codec.py       header + raw bytes (+ lz4 over byte-shuffled data), checksum; never pickle
    base.py        KVStore interface, TierStats counters
    memory.py      L1: CPU tensors, byte budget, LRU, pinning
    blob.py        shared byte-tier logic (encode/decode, corrupt -> counted miss + delete)
    redis_tier.py  L2: Redis / Redis Cluster, pipelined
    disk.py        L3: files, atomic writes, byte budget, LRU
    health.py      tier up/down with back-off and probes
    tiered.py      TieredStore: L1 -> L2 -> L3, async write-through, promotion
    config.py      KVStoreConfig (frozen) and build_store
    protocol.py    daemon wire messages (msgspec msgpack + raw frames)
    shm.py         per-client shared-memory segments (the data plane when the daemon has no arena)
    arena.py       the daemon's L1 arena: a sealed memfd, its extent allocator, a client's mapping
    arena_tier.py  L1 in the arena: reserved -> committed slots, pins (leases, sends, write-through), LRU
    daemon.py      KVDaemon (zmq ROUTER);  daemon_arena.py  its MapArena/Reserve/Lease/Release side
    client.py      DaemonClient (same interface);  client_arena.py  its one-copy put/get through the arena;
                   client_segment.py  its put/get as frames or through a segment, and the payload checks
    tiered_arena.py  TieredStore's slot methods for an arena L1 (write-through straight from the arena)
    cli.py         ``pdserve kvstore`` flags;  metrics.py  Prometheus export
    accounting.py  per-request hit/load/recompute accounting (need_to_load never < 0)
    seal.py        sealed objects: a keyed MAC checked end to end (publisher -> every loader)
    stats_cache.py store stats refreshed off the event loop (the node's /metrics)
    zmq_context.py the process's one zmq context (a context per object can hang the garbage collector)
"""

from __future__ import annotations

_HOMES = {"KVAccounting": "accounting", "account": "accounting", "KVStore": "base", "TierStats": "base",
          "KVStoreConfig": "config", "build_store": "config", "chunk_keys": "keys", "model_fingerprint": "keys",
          "object_key": "keys"}                  # the package's names -> the module each lives in
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    # Lazy: the proxy needs only ``keys`` (prefix routing), and ``base`` imports torch.
    if name not in _HOMES:
        raise AttributeError(name)
    import importlib
    return getattr(importlib.import_module(f"pdserve.kvstore.{_HOMES[name]}"), name)
