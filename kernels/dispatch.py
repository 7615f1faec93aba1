"""The one place that picks the attention backend; the model's attention layers call ``paged_attention``.

    backend = resolve_backend(config_value, device)     # the runner, once at start-up
    meta.backend = backend                               # every step's metadata names it
    out = paged_attention(q, k, v, cache, meta, scale, window)   # each layer: dispatched here

Backends: ``cpu`` (``cpu_attention.c``, an AVX2 kernel built with the machine's compiler: the CPU
path), ``torch`` (``reference.py``: plain torch, the oracle, and the CPU path where the kernel cannot be
built) and ``triton`` (``triton_attention.py``: the CUDA path; on CPU only under ``TRITON_INTERPRET=1``,
for tests). Chosen by ``--attention-backend``, else ``PDSERVE_ATTENTION_BACKEND``, else triton on CUDA,
cpu on a CPU where the kernel builds, torch otherwise. The Triton module is imported only when chosen.
A cache the cpu kernel does not take (head or block size not a multiple of 8) goes to ``torch``.

DeepSeek's MLA (``engine/models/mla.py``) calls ``write_latent`` (every row of the step) and ``mla_decode`` (its
decode rows: weight-absorbed attention over the latent cache): Triton ``triton_mla.py``, the CPU path ``cpu_mla.py``
(batched torch) for ``cpu``, the reference ``mla_reference.py`` for ``torch``. Its prefill rows take the plain path
in the model (``mla_reference.gather_latent``, then attention over the decompressed K/V).
The MoE layer's routed experts (``engine.models.moe.MoE``) call ``fused_moe``: the Triton grouped GEMM
(``triton_moe.py``) for CUDA tensors, the torch grouped matmul (``moe_ops.grouped_moe``) elsewhere; ``backend``
"triton" forces the kernel (tests, under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from pdserve.kernels import cpu_attention, cpu_mla, cpu_ops, mla_reference, moe_ops, reference

BACKENDS = ("cpu", "torch", "triton")


def resolve_backend(requested: str | None, device: str) -> str:
    """``requested`` (a flag value, or None) -> the backend name; raises ValueError naming the flag."""
    name = requested or os.environ.get("PDSERVE_ATTENTION_BACKEND") or _default(device)
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend / PDSERVE_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}, "
                         f"got {name!r}")
    if name == "triton" and device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton on CPU runs only under TRITON_INTERPRET=1 (tests); "
                         "use --attention-backend torch")
    if name == "cpu" and (device != "cpu" or cpu_attention.load() is None):
        raise ValueError(f"--attention-backend cpu needs a CPU device with AVX2/FMA/F16C and a cached build or a C "
                         f"compiler (device {device}; see the log for why the kernel did not load); use torch")
    return name


def _default(device: str) -> str:
    if device == "cuda":
        return "triton"
    return "cpu" if device == "cpu" and cpu_attention.load() is not None else "torch"


def paged_attention(q, k, v, cache: dict, meta, scale: float, sliding_window: int | None = None):
    """Write the step's K/V into ``cache`` and attend; ``meta.backend`` picks the implementation."""
    if meta.backend == "triton":
        from pdserve.kernels import triton_attention

        return triton_attention.paged_attention(q, k, v, cache, meta, scale, sliding_window)
    if meta.backend == "cpu" and cpu_attention.supports(cache):
        return cpu_attention.paged_attention(q, k, v, cache, meta, scale, sliding_window)
    return reference.paged_attention(q, k, v, cache, meta, scale, sliding_window)


def write_to_cache(k, v, cache: dict, slot_mapping, backend: str = "torch") -> None:
    """Only the write of ``paged_attention`` (the same bytes): the step's K/V at ``slot_mapping``."""
    if backend == "cpu" and cpu_ops.write_kv(k, v, cache, slot_mapping):
        return
    if backend == "triton":
        from pdserve.kernels import triton_cache

        return triton_cache.write_to_cache(k, v, cache, slot_mapping)
    return reference.write_to_cache(k, v, cache, slot_mapping)


def write_latent(latent, cache: dict, slot_mapping, backend: str = "torch") -> None:
    """MLA: the step's latent rows [T, W] into ``cache["latent"]`` at ``slot_mapping``."""
    if backend == "triton":
        from pdserve.kernels import triton_mla

        return triton_mla.write_latent(latent, cache, slot_mapping)
    return mla_reference.write_latent(latent, cache, slot_mapping)


def mla_decode(q, cache: dict, meta, scale: float, kv_lora_rank: int):
    """MLA decode rows: q [B, H, W] (absorbed) over the latent cache -> [B, H, kv_lora_rank]."""
    if meta.backend == "triton":
        from pdserve.kernels import triton_mla

        return triton_mla.mla_decode(q, cache, meta, scale, kv_lora_rank)
    if meta.backend == "cpu":
        return cpu_mla.mla_decode(q, cache, meta, scale, kv_lora_rank)
    return mla_reference.mla_decode(q, cache, meta, scale, kv_lora_rank)


def fused_moe(x, w13, w2, weights, ids, backend: str | None = None):
    """x: [T, H] through each row's k routed experts (``moe_ops``' shapes) -> [T, H]. Inside torch.compile (the
    layers' compiled pieces, fullgraph) it is one opaque op, ``pdserve::fused_moe``: its data-dependent segments do
    not trace."""
    if torch.compiler.is_compiling():
        return torch.ops.pdserve.fused_moe(x, w13, w2, weights, ids)
    return _fused_moe(x, w13, w2, weights, ids, backend)


def _fused_moe(x, w13, w2, weights, ids, backend: str | None = None):
    if backend == "triton" or (backend is None and x.device.type == "cuda"):
        from pdserve.kernels import triton_moe

        return triton_moe.fused_moe(x, w13, w2, weights, ids)
    return moe_ops.grouped_moe(x, w13, w2, weights, ids)


@torch.library.custom_op("pdserve::fused_moe", mutates_args=())
def _fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    return _fused_moe(x, w13, w2, weights, ids)


@_fused_moe_op.register_fake
def _(x, w13, w2, weights, ids):
    return torch.empty_like(x)
