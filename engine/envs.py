"""Every environment variable pdserve reads, parsed once, bad values rejected. Prefix ``PDSERVE_``.

| variable              | meaning                                          | default                    |
| --------------------- | ------------------------------------------------ | -------------------------- |
| PDSERVE_CACHE_DIR     | converted models; the C kernels' private cache (kernels/cpu_cache.py) | ~/.cache/pdserve |
| PDSERVE_NUM_THREADS   | torch intra-op threads per process               | 1                          |
| PDSERVE_LOG_LEVEL     | logging level of pdserve's loggers               | INFO                       |
| PDSERVE_FAULTS        | tests only: faults in tp/pp ranks, engine core   | "" (``parallel/faults.py``)|
| PDSERVE_RANK_GRAPHS_CPU | tests only: 1: CPU tp/pp ranks run the stage function CUDA ranks capture, eagerly, through the replay path (``parallel/graphs.py``) | 0 |
| PDSERVE_COMPILE       | 1: torch.compile on CPU (default of --torch-compile) | 0                      |
| PDSERVE_ENGINE_CORE_PROCESS | 0: `pdserve node` runs its engine core in the HTTP process (the tests set it) | 1 |
| PDSERVE_CPU_LINEAR    | fp32 CPU matmuls: onednn, or torch (F.linear: MKL) | onednn where torch has it |
| PDSERVE_CPU_ISA       | the C kernels' widest build: avx512vl (where the CPU has it), or avx2 (same bits) | avx512vl |
| PDSERVE_KV_AUTH_TOKEN | the cluster's secret: KV store auth and seals (kvstore/auth.py); `pdserve serve` sets it for its children | "" |
| PDSERVE_API_KEY       | default of `--api-key` (node, proxy; several keys separated by whitespace); how `pdserve serve --api-key` reaches its proxy | "" |
| PDSERVE_NODE_API_KEY  | default of the proxy's `--node-api-key` (what `pdserve serve` gives its nodes) | "" |
| PDSERVE_FUSED_NORM    | RMSNorm + residual add as one Triton kernel: auto (CUDA only), 0 never, 1 CPU too (TRITON_INTERPRET=1 tests) | auto |
| PDSERVE_FUSED_ROPE    | q/k rotary embedding as one in-place Triton kernel: auto, 0, 1 (as above; kernels/fused_ops.py) | auto |
| PDSERVE_HOST_MEMORY   | tuned: freed memory stays mapped, KV cache on huge pages; default: the platform's (engine/host_memory.py) | tuned |
"""

from __future__ import annotations

import os
from pathlib import Path


def _int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r} must be 0 or 1")
    return raw == "1"


def _level(name: str, default: str) -> str:
    raw = os.environ.get(name, default).upper()
    if raw not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError(f"{name}={raw!r} must be one of DEBUG, INFO, WARNING, ERROR")
    return raw


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = os.environ.get(name) or default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} must be one of {', '.join(choices)}")
    return raw


PDSERVE_CACHE_DIR = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
PDSERVE_NUM_THREADS = _int("PDSERVE_NUM_THREADS", 1, 1)
PDSERVE_LOG_LEVEL = _level("PDSERVE_LOG_LEVEL", "INFO")
PDSERVE_ENGINE_CORE_PROCESS = _bool("PDSERVE_ENGINE_CORE_PROCESS", True)   # default of --engine-core-process
PDSERVE_COMPILE = _bool("PDSERVE_COMPILE", False)        # default of ExecutionConfig.torch_compile
PDSERVE_CPU_ISA = _choice("PDSERVE_CPU_ISA", "avx512vl", ("avx512vl", "avx2"))   # kernels/cpu_build.isa_order
PDSERVE_HOST_MEMORY = _choice("PDSERVE_HOST_MEMORY", "tuned", ("tuned", "default"))   # engine/host_memory.py
PDSERVE_CPU_LINEAR = _choice("PDSERVE_CPU_LINEAR", "onednn", ("onednn", "torch"))   # engine/models/layers.py
PDSERVE_FUSED_NORM = _choice("PDSERVE_FUSED_NORM", "auto", ("auto", "0", "1"))   # kernels/fused_ops.py
PDSERVE_FUSED_ROPE = _choice("PDSERVE_FUSED_ROPE", "auto", ("auto", "0", "1"))   # kernels/fused_ops.py
PDSERVE_KV_AUTH_TOKEN = os.environ.get("PDSERVE_KV_AUTH_TOKEN", "")   # kvstore/auth.resolve_token; never logged
PDSERVE_API_KEY = os.environ.get("PDSERVE_API_KEY", "")                 # default of --api-key; never logged
PDSERVE_NODE_API_KEY = os.environ.get("PDSERVE_NODE_API_KEY", "")       # the proxy's --node-api-key; never logged
PDSERVE_RANK_GRAPHS_CPU = _bool("PDSERVE_RANK_GRAPHS_CPU", False)   # parallel/graphs.graph_mode (tests)
PDSERVE_FAULTS = os.environ.get("PDSERVE_FAULTS", "")     # parsed and checked by engine/parallel/faults.py
