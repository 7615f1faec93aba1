"""``pdserve kvstore``: flags -> KVStoreConfig -> TieredStore -> KVDaemon.serve.

Who calls it: the ``pdserve`` CLI calls ``register(subparsers)`` and later
``args.func(args)``; ``main(argv)`` runs the same thing standalone
(``python -m pdserve.kvstore``).
On start it prints one line ``READY tcp://host:port`` to stdout (tests and ``pdserve
serve`` wait for it); SIGINT/SIGTERM stop it cleanly. The cluster token comes from
``--kv-auth-token-file``, ``PDSERVE_KV_AUTH_TOKEN`` or ``--kv-auth-token`` (``auth.resolve_token``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import torch

from pdserve.engine import host_memory
from pdserve.kvstore.auth import add_token_arguments, token_from_args
from pdserve.kvstore.config import KVStoreConfig, build_store
from pdserve.kvstore.daemon import DaemonLimits, KVDaemon


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = KVStoreConfig()
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (beyond loopback needs the cluster token or --allow-unauthenticated)")
    p.add_argument("--port", type=int, default=5557, help="0 picks a free port")
    p.add_argument("--kv-cpu-bytes", type=int, default=d.cpu_bytes, help="L1 memory budget")
    p.add_argument("--kv-redis", default=None, help="redis://host:port/db or redis+cluster://host:port")
    p.add_argument("--kv-redis-prefix", default=d.redis_prefix)
    p.add_argument("--kv-redis-ttl", type=int, default=None, help="seconds")
    p.add_argument("--kv-disk-dir", default=None)
    p.add_argument("--kv-disk-bytes", type=int, default=d.disk_bytes)
    p.add_argument("--kv-codec", choices=["none", "lz4"], default=d.codec, help="codec for Redis and disk")
    p.add_argument("--kv-writethrough-queue-bytes", type=int, default=d.queue_bytes,
                   help="bytes queued for Redis/disk; an empty queue takes any batch, a full one drops (counted)")
    p.add_argument("--kv-max-object-bytes", type=int, default=DaemonLimits.max_object_bytes,
                   help="the largest object put, or read back from Redis or disk")
    p.add_argument("--kv-max-shm-bytes", type=int, default=DaemonLimits.max_shm_bytes,
                   help="largest shared-memory segment one client may attach")
    p.add_argument("--kv-max-shm-clients", type=int, default=DaemonLimits.max_shm_clients,
                   help="attached segments; past it a new client uses zmq frames (live clients keep theirs)")
    p.add_argument("--kv-max-shm-total-bytes", type=int, default=None,
                   help="all clients' shared-memory segments together (default: half of /dev/shm's free space)")
    p.add_argument("--no-kv-shm-arena", dest="kv_shm_arena", action="store_false",
                   help="keep L1 in private memory: local clients then copy through per-client segments")
    add_token_arguments(p)
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="listen beyond loopback without a token (anyone who reaches it reads and writes the KV)")
    p.add_argument("--log-level", default="INFO")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kvstore", help="run the KV store daemon (pyzmq, shared-memory data plane)")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> KVStoreConfig:
    return KVStoreConfig(cpu_bytes=args.kv_cpu_bytes, redis_url=args.kv_redis, redis_prefix=args.kv_redis_prefix,
                         redis_ttl_s=args.kv_redis_ttl, disk_dir=args.kv_disk_dir, disk_bytes=args.kv_disk_bytes,
                         codec=args.kv_codec, queue_bytes=args.kv_writethrough_queue_bytes,
                         max_object_bytes=args.kv_max_object_bytes)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    host_memory.tune()            # as a node's engine: freed frames and copies stay mapped (no fault per page per get)
    limits = DaemonLimits(max_object_bytes=args.kv_max_object_bytes, max_shm_bytes=args.kv_max_shm_bytes,
                          max_shm_clients=args.kv_max_shm_clients, max_shm_total_bytes=args.kv_max_shm_total_bytes)
    token = token_from_args(args, "pdserve kvstore")
    store = build_store(config_from_args(args), arena=args.kv_shm_arena)
    try:
        daemon = KVDaemon(store, args.host, args.port, token, limits, args.allow_unauthenticated)
    except ValueError as exc:
        store.close()
        print(f"pdserve kvstore: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"READY {daemon.endpoint}", flush=True)
    try:
        daemon.serve(stop)
    finally:
        daemon.close()
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve kvstore", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))
