"""``pdserve node``: build an ``EngineConfig`` from vLLM-style flags and serve it over HTTP.

Lifecycle (every node, tp1 or tp x pp). SIGINT and SIGTERM are handled from the first line of
``run_node``; the ranks of a tp x pp node ignore both (``parallel/launcher.py``):

    start-up    a signal unwinds the start (the executor stops its ranks on the way) -> exit 0
    serving     the first signal drains: the listening socket closes, in-flight requests finish
                (up to --drain-timeout, then they are cancelled); a second signal stops at once
    stopping    ``AsyncEngine.shutdown``: the engine thread, the KV publisher (queued puts flushed),
                the store, then the ranks in order -> exit 0, or 1 if the engine had failed
                (a dead or stalled rank), so a supervisor restarts it
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import signal
import time
from pathlib import Path

from pdserve.engine import envs, tracing
from pdserve.engine.config import (CacheConfig, EngineConfig, ExecutionConfig, KVTransferConfig, ParallelConfig,
                                   SchedulerConfig)
from pdserve.engine.request_limits import add_limit_flags, limits_from_args
from pdserve.engine.server.auth import api_keys_from_args
from pdserve.engine.server.listen import add_fd_flag, inherited_socket, served_address
from pdserve.engine.server.tools.config import add_tool_arguments, tool_config_from_args
from pdserve.kvstore.auth import add_token_arguments, token_from_args

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("node", help="run one engine node (OpenAI-compatible HTTP server)")
    p.add_argument("--model", required=True, help="local HF model directory")
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    add_fd_flag(p)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes, any KEY given (default: PDSERVE_API_KEY, "
                        "keys separated by whitespace)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="where the model and KV cache live (auto: cuda when available)")
    p.add_argument("--num-threads", type=int, default=envs.PDSERVE_NUM_THREADS,
                   help="torch intra-op threads (default 1: on small boxes more threads thrash)")
    p.add_argument("--max-inflight-requests", type=int, default=1024,
                   help="generation requests served at once; beyond it a request gets 503 + Retry-After (the proxy "
                        "tries another node)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM / SIGINT: seconds in-flight requests may take to finish before they are cancelled")
    p.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction,
                   default=envs.PDSERVE_ENGINE_CORE_PROCESS,
                   help="run the engine core (scheduler, model, KV connector) in a process of its own, beside the "
                        "HTTP process (pdserve.engine.core; default on, PDSERVE_ENGINE_CORE_PROCESS=0 turns it off)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces (OTLP/HTTP) to URL, e.g. http://collector:4318 (vLLM's flag; "
                        "needs pip install 'pdserve[otel]'); off by default")
    _add_engine_flags(p)
    add_limit_flags(p)
    add_tool_arguments(p)
    p.set_defaults(func=run_node)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 * 2**20)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default=None, choices=["cpu", "torch", "triton"],
                   help="attention kernels (default: PDSERVE_ATTENTION_BACKEND, else triton on cuda; on a CPU, "
                        "the cpu kernel where it builds (AVX2 + a C compiler), else torch)")
    p.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU, tp = pp = 1: torch.compile the layers' non-attention parts for steps of >= 64 tokens "
                        "(default: PDSERVE_COMPILE, off: compiled and eager steps round differently, so a prompt's KV "
                        "bytes would depend on how it was chunked)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="no CUDA graphs for decode steps, no torch.compile on CPU")
    p.add_argument("--kv-store", default=None,
                   help="KV store: tcp://HOST:PORT (a `pdserve kvstore` daemon) or 'embedded' "
                        "(required for --role prefill/decode unless --kv-redis is given)")
    p.add_argument("--kv-chunk-tokens", type=int, default=256, help="tokens per stored KV chunk")
    p.add_argument("--kv-cpu-bytes", type=int, default=2 << 30, help="embedded store: L1 memory budget")
    p.add_argument("--kv-redis", default=None, help="embedded store: L2 redis://HOST:PORT/DB")
    p.add_argument("--kv-redis-prefix", default="pdkv:", help="embedded store: the key prefix in Redis (a cluster's "
                   "nodes, and the proxy's --kv-redis-prefix, share it)")
    p.add_argument("--kv-disk-dir", default=None, help="embedded store: L3 directory")
    p.add_argument("--kv-writethrough-queue-bytes", type=int, default=256 << 20,
                   help="embedded store: bytes queued for Redis/disk before writes are dropped "
                        "(an empty queue takes any one batch)")
    p.add_argument("--kv-publish-buffer-bytes", type=int, default=256 << 20,
                   help="prefill/both: device memory (CUDA; plus as much pinned host memory) that holds KV chunks "
                        "between the step that computed them and their put to the store, in whole chunks, outside "
                        "--kv-cache-memory-bytes; when it is full the step waits (docs/kv-guarantees.md)")
    p.add_argument("--kv-load-layerwise", action=argparse.BooleanOptionalAction, default=False,
                   help="a request whose prompt KV is in the store runs at once: the load is read layer by layer and "
                        "layer i's compute waits only for layer i (LMCache's use_layerwise); ignored on tp/pp nodes "
                        "(docs/kv-guarantees.md)")
    p.add_argument("--kv-load-layerwise-timeout", type=float, default=10.0,
                   help="with --kv-load-layerwise: seconds a step waits for its loads; past it they fail and their "
                        "requests recompute, the step goes on (a hung store read stalls no more than this)")
    p.add_argument("--kv-publish-layerwise", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill/both: put each layer of the chunks a step completes as soon as that layer ran, "
                        "while later layers compute (--no-kv-publish-layerwise: after the whole step; tp/pp nodes "
                        "always publish per step; docs/kv-guarantees.md)")
    p.add_argument("--kv-events-port", type=int, default=None, metavar="PORT",
                   help="publish KV events (blocks cached / evicted, signed with the cluster token) on "
                        "tcp://127.0.0.1:PORT for the proxy's kv_aware routing; 0: a free port, named in /v1/models")
    add_token_arguments(p)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--rank-timeout", type=float, default=60.0,
                   help="seconds a TP/PP rank may make no progress (or the --engine-core-process say nothing) before "
                        "the node reports it and shuts down")
    p.add_argument("--debug-sync", action="store_true",
                   help="synchronise after every collective and log each rank's phases (slow; for hangs)")
    p.add_argument("--nnodes", type=int, default=1, help="machines the TP x PP ranks run on")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index; 0 runs the scheduler and HTTP")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0's rendezvous")
    p.add_argument("--master-port", type=int, default=0, help="port of node 0's rendezvous (0: any, one node)")
    p.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"],
                   help="the ranks' collectives with --device cuda; auto: nccl when each rank on a machine has its "
                        "own GPU, else gloo with CUDA tensors (ranks sharing a GPU); CPU ranks always use gloo")


def resolve_model(model: str) -> Path:
    """A local HF directory as is; a known short name (``smollm2-135m-instruct``) downloaded and converted once."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from pdserve.engine.checkpoints.download import download_model

    return download_model(model)


def config_from_args(args) -> EngineConfig:
    return EngineConfig(
        model=str(resolve_model(args.model)), dtype=args.dtype, seed=args.seed, device=args.device,
        served_model_name=args.served_model_name or Path(args.model).name,
        num_threads=args.num_threads,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          num_gpu_blocks_override=args.num_gpu_blocks_override,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len),
        execution=ExecutionConfig(attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                                  torch_compile=args.torch_compile),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                rank_timeout=args.rank_timeout, debug_sync=args.debug_sync,
                                nnodes=args.nnodes, node_rank=args.node_rank,
                                master_addr=args.master_addr, master_port=args.master_port,
                                dist_backend=args.dist_backend),
        kv_transfer=KVTransferConfig(role=args.role, kv_store=args.kv_store, kv_chunk_tokens=args.kv_chunk_tokens,
                                     kv_cpu_bytes=args.kv_cpu_bytes, kv_redis=args.kv_redis,
                                     kv_redis_prefix=args.kv_redis_prefix, kv_disk_dir=args.kv_disk_dir, kv_auth_token=token_from_args(args, "pdserve node"),
                                     kv_writethrough_queue_bytes=args.kv_writethrough_queue_bytes,
                                     kv_publish_buffer_bytes=args.kv_publish_buffer_bytes,
                                     kv_publish_layerwise=args.kv_publish_layerwise,
                                     kv_events_port=args.kv_events_port,
                                     kv_load_layerwise=args.kv_load_layerwise,
                                     kv_load_layerwise_timeout_s=args.kv_load_layerwise_timeout),
        engine_core_process=args.engine_core_process,
    )


class NodeStopped(BaseException):
    """SIGINT / SIGTERM during start-up: unwinds like KeyboardInterrupt (the executor stops its ranks on the way)."""


class _StopSignals:
    """SIGINT and SIGTERM for the node's whole life: raise during start-up, drain while serving, then ignore."""

    def __init__(self, drain_timeout: float):
        self.drain_timeout = drain_timeout
        self.server = None                        # set once serving
        self.stopping = False
        self.first: str | None = None             # the first signal's name, and when it came (monotonic)
        self.since = 0.0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.first is None:
            self.first, self.since = name, time.monotonic()
        if self.stopping:
            logger.warning("%s: already stopping", name)
        elif self.server is None:
            raise NodeStopped(name)
        elif self.server.should_exit:
            logger.warning("%s again: cancelling in-flight requests and stopping now", name)
            self.server.force_exit = True
        else:
            logger.info("%s: draining (no new connections; in-flight requests get up to %.0fs), then stopping",
                        name, self.drain_timeout)
            self.server.should_exit = True


def _server(app, args):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn without its own signal handling: it would re-raise the signal after its shutdown, killing
        the process before the engine and the ranks are stopped."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    # keep-alive 5 s: idle connections do not pile up; h11's incomplete-event bound caps header size
    return Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                 timeout_graceful_shutdown=args.drain_timeout, timeout_keep_alive=5,
                                 h11_max_incomplete_event_size=64 << 10, backlog=4096))


def run_node(args) -> int:
    config = config_from_args(args)
    if config.parallel.node_rank > 0:
        return run_worker_node(config)
    try:
        tools = tool_config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve node: {exc}") from None
    signals = _StopSignals(args.drain_timeout)
    sock = inherited_socket(args.fd)          # checked before the engine starts: a bad --fd fails at once
    tracing.setup_or_exit(f"pdserve-{args.role}", args.otlp_traces_endpoint, "pdserve node")
    engine, healthy = None, True
    try:
        from pdserve.engine.core.async_engine import AsyncEngine
        from pdserve.engine.server import build_app

        engine = AsyncEngine(config)
        gc.freeze()                           # start-up objects (65k KV blocks...): never scanned again, not at exit either
        server = _server(build_app(engine, api_key=api_keys_from_args(args, "pdserve node"),
                                   limits=limits_from_args(args), max_inflight=args.max_inflight_requests,
                                   tools=tools), args)
        logger.info("node (role=%s) serving %s on http://%s:%d", args.role, engine.model_name,
                    *served_address(sock, args.host, args.port))
        signals.server = server
        engine.on_fatal = lambda reason: setattr(server, "should_exit", True)   # exit 1: a supervisor restarts us
        server.run(sockets=[sock] if sock is not None else None)
    except NodeStopped as exc:
        logger.info("%s during start-up: stopping", exc)
    finally:
        signals.stopping = True
        if engine is not None:
            healthy = engine.is_healthy()
            engine.shutdown()
        tracing.shutdown()
    if signals.first is not None:
        state = "during start-up" if engine is None else "healthy" if healthy else "the engine had failed: exit 1"
        logger.info("stopped %.1fs after %s (%s)", time.monotonic() - signals.since, signals.first, state)
    return 0 if healthy else 1


def run_worker_node(config: EngineConfig) -> int:
    """``--node-rank N > 0``: no scheduler, no HTTP; run this machine's slice of the tp x pp ranks."""
    from pdserve.engine.parallel.launcher import launch

    par = config.parallel
    first = par.node_rank * par.ranks_per_node
    logger.info("node %d of %d: ranks [%d, %d) of tp %d x pp %d, driver at %s:%d", par.node_rank, par.nnodes,
                first, first + par.ranks_per_node, par.tensor_parallel_size, par.pipeline_parallel_size,
                par.master_addr, par.master_port)
    return launch(par.master_addr, par.master_port, list(range(first, first + par.ranks_per_node)),
                  node_rank=par.node_rank, world_size=par.world_size)
