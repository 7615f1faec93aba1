"""The node's configuration: one frozen dataclass per concern, composed into ``EngineConfig``.

Built by the CLI (``pdserve node ...``, flags named like vLLM's) or by ``LLM(...)``; read by the
engine. Values measured at run time (the number of KV blocks) live in ``EngineRuntime``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the flag to change."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 2**20   # --kv-cache-memory-bytes
    num_gpu_blocks_override: int | None = None  # --num-gpu-blocks-override (exact block count)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two >= 1, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(f"--num-gpu-blocks-override must be >= 2, got {self.num_gpu_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048   # the chunked-prefill size: tokens computed per step
    max_num_seqs: int = 64
    max_model_len: int | None = None      # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")


CORE_MIN_TIMEOUT_S = 2.0             # 4 x the engine core's heartbeat (engine/core/messages.py HEARTBEAT_S)


@dataclass(frozen=True)
class ParallelConfig:
    """TP x PP worker ranks (``pdserve.engine.parallel``); 1 x 1 runs the model in the engine's process."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    rank_timeout: float = 60.0        # --rank-timeout: seconds a rank may make no progress (or the engine-core
                                      # process say nothing) before it is reported
    debug_sync: bool = False          # --debug-sync: synchronise after every collective, log every phase
    nnodes: int = 1                   # --nnodes: machines the ranks run on
    node_rank: int = 0                # --node-rank: 0 runs the scheduler (driver); others run workers only
    master_addr: str = "127.0.0.1"    # --master-addr: where node 0's rendezvous listens
    master_port: int = 0              # --master-port: 0 picks a free port (single node only)
    dist_backend: str = "auto"        # --dist-backend auto | nccl | gloo: the ranks' collectives (parallel/devices.py)

    def __post_init__(self) -> None:
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-parallel-size", self.pipeline_parallel_size), ("--nnodes", self.nnodes)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.rank_timeout <= 0:
            raise ConfigError(f"--rank-timeout must be > 0 seconds, got {self.rank_timeout}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ConfigError(f"tp x pp = {self.world_size} ranks do not split evenly over --nnodes {self.nnodes}")
        if self.dist_backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"--dist-backend must be auto, nccl or gloo, got {self.dist_backend!r}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigError("--nnodes > 1 needs --master-port (and --master-addr) so the nodes can meet")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


@dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs a step (``--attention-backend``, ``--enforce-eager``)."""
    attention_backend: str | None = None  # cpu | torch | triton; None: PDSERVE_ATTENTION_BACKEND, else triton
                                          # on cuda, cpu where its kernel builds, torch
    enforce_eager: bool = False           # no CUDA graphs for decode steps, no torch.compile on CPU (vLLM's flag)
    torch_compile: bool | None = None     # CPU, tp = pp = 1: compile the layers' non-attention parts
                                          # (engine/runner/compile.py); None: PDSERVE_COMPILE (default off)

    def __post_init__(self) -> None:
        if self.attention_backend not in (None, "cpu", "torch", "triton"):
            raise ConfigError(f"--attention-backend must be cpu, torch or triton, got {self.attention_backend!r}")


@dataclass(frozen=True)
class KVTransferConfig:
    """The node's role and its KV store (``--role``, ``--kv-store``, ``--kv-*``)."""
    role: str = "both"                      # prefill | decode | both
    kv_store: str | None = None             # None: no store; "embedded"; "tcp://host:port" (a daemon)
    kv_chunk_tokens: int = 256
    kv_cpu_bytes: int = 2 << 30             # embedded store's L1 budget
    kv_redis: str | None = None             # embedded store's L2
    kv_redis_prefix: str = "pdkv:"          # its key prefix (the proxy's --kv-redis-prefix for lookups)
    kv_disk_dir: str | None = None          # embedded store's L3
    kv_writethrough_queue_bytes: int = 256 << 20   # embedded store's write-through queue bound
    kv_auth_token: str = field(default="", repr=False)   # the cluster token (kvstore/auth.py); never printed
    kv_shm_bytes: int = 64 << 20            # shared-memory data plane to a local daemon (0: zmq frames)
    kv_publish_buffer_bytes: int = 256 << 20   # publish ring: chunks gathered, not yet sealed (device + pinned twin)
    kv_publish_layerwise: bool = True       # put each layer of a step's chunks while later layers compute
    kv_events_port: int | None = None       # KV events on a 127.0.0.1 PUB socket (0: a free port); None: none
    kv_load_layerwise: bool = False         # loads hand each layer to the model as it lands (decode/layerwise.py)
    kv_load_layerwise_timeout_s: float = 10.0   # a step waits no longer for its loads: they fail, the step goes on

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ConfigError(f"--role must be prefill, decode or both, got {self.role!r}")
        if self.role != "both" and self.store_url is None:
            raise ConfigError(f"--role {self.role} needs a shared KV store: --kv-store tcp://HOST:PORT "
                              f"(a `pdserve kvstore` daemon) or --kv-redis redis://HOST:PORT")
        if self.kv_chunk_tokens < 1:
            raise ConfigError(f"--kv-chunk-tokens must be >= 1, got {self.kv_chunk_tokens}")
        if self.kv_writethrough_queue_bytes < 1:
            raise ConfigError(f"--kv-writethrough-queue-bytes must be >= 1, got {self.kv_writethrough_queue_bytes}")
        if self.kv_publish_buffer_bytes < 1:
            raise ConfigError(f"--kv-publish-buffer-bytes must be >= 1, got {self.kv_publish_buffer_bytes}")
        if not 0 < self.kv_load_layerwise_timeout_s <= 3600:
            raise ConfigError(f"--kv-load-layerwise-timeout must be in (0, 3600] seconds, got "
                              f"{self.kv_load_layerwise_timeout_s}")
        if self.kv_events_port is not None and not (0 <= self.kv_events_port < 65536 and self.kv_auth_token):
            raise ConfigError(f"--kv-events-port {self.kv_events_port} needs a port in [0, 65535] and the cluster "
                              "token (events are signed with it): set PDSERVE_KV_AUTH_TOKEN or --kv-auth-token-file")
        self._check_key()

    def _check_key(self) -> None:
        """A store other processes can reach (a daemon, Redis, a directory) needs the cluster token: every
        object is sealed with it and an object that does not verify is a miss."""
        from pdserve.kvstore.auth import TOKEN_HELP, ClusterKey

        if self.kv_auth_token:
            try:
                ClusterKey(self.kv_auth_token)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        elif self.shared_store:
            raise ConfigError(f"a KV store other processes can reach ({self.shared_store}) needs the cluster's "
                              f"key: {TOKEN_HELP}")

    @property
    def shared_store(self) -> str | None:
        """The flag that makes the store reachable by other processes, or None (none, or memory only)."""
        if self.store_url is not None and self.store_url.startswith("tcp://"):
            return f"--kv-store {self.store_url}"
        return "--kv-redis" if self.kv_redis else "--kv-disk-dir" if self.kv_disk_dir else None

    def cluster_key(self):
        """The ``ClusterKey`` that seals this node's KV objects: the cluster token's; for a store no other
        process reaches, this process's own random key (shared by every engine in it, known to no one else)."""
        from pdserve.kvstore.auth import ClusterKey, process_key

        return ClusterKey(self.kv_auth_token) if self.kv_auth_token else process_key()

    @property
    def store_url(self) -> str | None:
        """What the engine connects to; ``--kv-redis`` alone implies an embedded store over Redis."""
        if self.kv_store is None and (self.kv_redis or self.kv_disk_dir):
            return "embedded"
        return self.kv_store


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    served_model_name: str | None = None
    seed: int = 0
    num_threads: int = 1
    device: str = "cpu"                     # --device cpu | cuda | auto (cuda when available)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    engine_core_process: bool = False       # --engine-core-process: the engine core runs in its own process

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ConfigError(f"--num-threads must be >= 1, got {self.num_threads}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"--device must be cpu, cuda or auto, got {self.device!r}")
        if self.parallel.dist_backend == "nccl" and self.device == "cpu":
            raise ConfigError("--dist-backend nccl needs --device cuda; CPU ranks use gloo")
        if self.engine_core_process and self.parallel.rank_timeout < CORE_MIN_TIMEOUT_S:
            raise ConfigError(f"--rank-timeout {self.parallel.rank_timeout:g} is too short for --engine-core-process "
                              f"(its heartbeat comes every 0.5 s); use >= {CORE_MIN_TIMEOUT_S:g} s, or "
                              "--no-engine-core-process")
        if self.kv_transfer.kv_chunk_tokens % self.cache.block_size:
            raise ConfigError(f"--kv-chunk-tokens {self.kv_transfer.kv_chunk_tokens} must be a multiple of "
                              f"--block-size {self.cache.block_size}")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def compiles_model(self) -> bool:
        """torch.compile runs on the single-process CPU path only, and never under --enforce-eager."""
        from pdserve.engine import envs

        ex = self.execution
        wanted = envs.PDSERVE_COMPILE if ex.torch_compile is None else ex.torch_compile
        return wanted and not ex.enforce_eager and self.resolved_device == "cpu" and self.parallel.world_size == 1

    @property
    def model_name(self) -> str:
        from pathlib import Path
        return self.served_model_name or Path(self.model).name


@dataclass(frozen=True)
class EngineRuntime:
    """What the engine measured at start-up."""
    num_blocks: int
    max_model_len: int
    bytes_per_block: int
