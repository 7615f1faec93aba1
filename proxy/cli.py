"""``pdserve proxy``: the public OpenAI endpoint in front of prefill and decode nodes.

    pdserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
                  --model DIR --port 8000 [--api-key KEY [KEY ...] [--cache-salt-from-api-key]]
                  [--[no-]expose-kv-accounting] [--prefill-policy prefix_aware]
                  [--routing-policy kv_aware --kv-store tcp://HOST:PORT --local-prefill-threshold N]

``register(subparsers)`` is called by ``pdserve.engine.cli``; ``python -m pdserve.proxy.cli ...``
runs it stand-alone through ``main(argv)``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from pdserve.engine import envs, tracing
from pdserve.engine.request_limits import add_limit_flags, limits_from_args
from pdserve.engine.server.tools.config import add_tool_arguments, tool_config_from_args
from pdserve.engine.server.auth import api_keys_from_args
from pdserve.engine.server.listen import add_fd_flag, inherited_socket, served_address
from pdserve.kvstore.auth import add_token_arguments, token_from_args
from pdserve.proxy.config import POLICIES, ProxyConfig
from pdserve.proxy.tenants import load_secret

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("proxy", help="OpenAI-compatible router: prefill node, then decode node")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill node base URLs")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode node base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_fd_flag(p)
    p.add_argument("--model", required=True, help="tokenizer directory: the model directory the nodes load")
    p.add_argument("--served-model-name", default=None, help="default: the nodes' model name")
    p.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes, KEY any of those given (default: "
                        "PDSERVE_API_KEY, keys separated by whitespace)")
    p.add_argument("--node-api-key", default=None, metavar="KEY",
                   help="the nodes' --api-key, sent to them on every call (default: PDSERVE_NODE_API_KEY)")
    p.add_argument("--cache-salt-from-api-key", action="store_true",
                   help="each API key is a tenant: a salt derived from its key (mixed with the request's "
                        "cache_salt) keeps its prefix cache and store KV apart from every other tenant's")
    p.add_argument("--cache-salt-secret-file", default=None, metavar="PATH",
                   help="the key of the tenant salts' HMAC (>= 16 bytes); default: random per start")
    p.add_argument("--expose-kv-accounting", action=argparse.BooleanOptionalAction, default=False,
                   help="include the nodes' usage.kv_transfer (prefix-cache and store hits, loads) in answers")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces (OTLP/HTTP) to URL, e.g. http://collector:4318 (vLLM's flag; "
                        "needs pip install 'pdserve[otel]'): a span per request, W3C traceparent to the nodes")
    p.add_argument("--trust-traceparent", action=argparse.BooleanOptionalAction, default=True,
                   help="a client's W3C traceparent parents the request's span (default, as vLLM); "
                        "--no-trust-traceparent: every request starts a trace of its own, so a client can neither "
                        "force sampling (its sampled flag, a trace id it picks) nor join another trace")
    p.add_argument("--prefill-policy", default=None, choices=POLICIES, help="default: prefix_aware")
    p.add_argument("--decode-policy", default=None, choices=POLICIES, help="default: least_loaded")
    p.add_argument("--routing-policy", default=None, choices=POLICIES,
                   help="both phases' policy at once (--prefill-policy / --decode-policy override it); kv_aware: "
                        "by the nodes' KV events, the store's lookup and load (docs/routing.md)")
    p.add_argument("--kv-store", default=None, metavar="tcp://HOST:PORT",
                   help="the store daemon the nodes use: the proxy looks each prompt up (needs the cluster token: "
                        "PDSERVE_KV_AUTH_TOKEN or --kv-auth-token-file, which also verifies the nodes' KV events); "
                        "or, for nodes with embedded stores sharing Redis, that Redis (redis://HOST:PORT/DB): "
                        "the proxy asks Redis itself")
    p.add_argument("--kv-redis-prefix", default="pdkv:",
                   help="with a Redis --kv-store: the key prefix the nodes store under (their --kv-redis-prefix)")
    p.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS",
                   help="a prompt of which fewer tokens are uncached (in the store or the decode node's prefix cache) "
                        "is prefilled by the decode node itself; 0: never")
    p.add_argument("--skip-prefill-on-store-hit", action=argparse.BooleanOptionalAction, default=True,
                   help="with --kv-store: a prompt the store holds all but the last block of skips the prefill node")
    add_token_arguments(p)
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health probes")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a node call may take")
    p.add_argument("--max-attempts", type=int, default=3, help="nodes tried per phase before failing")
    p.add_argument("--prefix-chunk-tokens", type=int, default=256, help="chunk size of prefix-routing keys")
    p.add_argument("--max-node-connections", type=int, default=1024,
                   help="connections to the nodes the proxy keeps open at most (health probes have their own)")
    p.add_argument("--timeout-keep-alive", type=float, default=75.0,
                   help="seconds an idle client connection stays open; keep it above the clients' own idle limit "
                        "(httpx 5 s, aiohttp 15 s, a load balancer's 60 s)")
    add_limit_flags(p)
    add_tool_arguments(p)
    p.set_defaults(func=run_proxy)


def config_from_args(args) -> ProxyConfig:
    return ProxyConfig(
        prefill_urls=tuple(u.rstrip("/") for u in args.prefill), decode_urls=tuple(u.rstrip("/") for u in args.decode),
        model=args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_keys=api_keys_from_args(args, "pdserve proxy"), cache_salt_from_api_key=args.cache_salt_from_api_key,
        node_api_key=args.node_api_key or envs.PDSERVE_NODE_API_KEY or None,
        cache_salt_secret_file=args.cache_salt_secret_file, expose_kv_accounting=args.expose_kv_accounting,
        trust_traceparent=args.trust_traceparent,
        prefill_policy=args.prefill_policy or args.routing_policy or "prefix_aware",
        decode_policy=args.decode_policy or args.routing_policy or "least_loaded",
        kv_store=args.kv_store, kv_redis_prefix=args.kv_redis_prefix, kv_auth_token=token_from_args(args, "pdserve proxy"),
        local_prefill_threshold=args.local_prefill_threshold,
        skip_prefill_on_store_hit=args.skip_prefill_on_store_hit,
        health_interval_s=args.health_interval, request_timeout_s=args.request_timeout,
        max_attempts=args.max_attempts, prefix_chunk_tokens=args.prefix_chunk_tokens,
        max_node_connections=args.max_node_connections, timeout_keep_alive_s=args.timeout_keep_alive,
        limits=limits_from_args(args), tools=tool_config_from_args(args))


def run_proxy(args) -> int:
    import uvicorn

    from pdserve.engine.node import resolve_model
    from pdserve.engine.text.tokenizer import load_tokenizer
    from pdserve.proxy.app import build_app

    try:
        config = config_from_args(args)
        load_secret(config.cache_salt_secret_file)          # a bad file fails here, before the model loads
    except ValueError as exc:
        raise SystemExit(f"pdserve proxy: {exc}") from None
    sock = inherited_socket(args.fd)
    tracing.setup_or_exit("pdserve-proxy", args.otlp_traces_endpoint, "pdserve proxy")
    tokenizer = load_tokenizer(resolve_model(config.model))
    app = build_app(config, tokenizer)
    logger.info("proxy on http://%s:%d: prefill %s (%s), decode %s (%s)",
                *served_address(sock, config.host, config.port), list(config.prefill_urls), config.prefill_policy,
                list(config.decode_urls), config.decode_policy)
    gc.freeze()        # start-up objects (torch, transformers): never scanned again -- no long pauses mid-request
    # access_log=False: at log level warning uvicorn logs no access line, but it built each one's arguments;
    # proxy_headers=False: nothing here reads the client's address, so X-Forwarded-For need not be parsed.
    # uvloop and httptools (dependencies) are uvicorn's "auto" choice where installed.
    # timeout_keep_alive: a client reuses an idle connection up to its own limit (httpx: 5 s, uvicorn's default
    # here too). One this side closes as a request goes out on it is reset, and the client's request fails with
    # a ReadError (a busy loop runs the expired timer before it reads the request). Longer here: the client
    # lets go first.
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                           access_log=False, proxy_headers=False,
                                           timeout_keep_alive=config.timeout_keep_alive_s))
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        tracing.shutdown()
    return 0 if server.started else 3          # 3: uvicorn's start-up failure (the port taken...)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "proxy" not in argv[:3]:                    # `python -m pdserve.proxy.cli --prefill ...` works too
        argv.insert(next((i for i, a in enumerate(argv) if not a.startswith("--log-level")), 0), "proxy")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
