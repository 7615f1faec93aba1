"""The one place that picks the attention backend; the model's attention layers call ``paged_attention``.

    backend = resolve_backend(config_value, device)     # the runner, once at start-up
    meta.backend = backend                               # every step's metadata names it
    out = paged_attention(q, k, v, cache, meta, scale, window)   # each layer: dispatched here

Backends: ``torch`` (``reference.py``: plain torch, the CPU path and the oracle) and ``triton``
(``triton_attention.py``: the CUDA path; on CPU only under ``TRITON_INTERPRET=1``, for tests).
Chosen by ``--attention-backend``, else ``PDSERVE_ATTENTION_BACKEND``, else triton on CUDA and torch
on CPU. The Triton module is imported only when chosen.
"""

from __future__ import annotations

import os

from pdserve.kernels import reference

BACKENDS = ("torch", "triton")


def resolve_backend(requested: str | None, device: str) -> str:
    """``requested`` (a flag value, or None) -> the backend name; raises ValueError naming the flag."""
    name = requested or os.environ.get("PDSERVE_ATTENTION_BACKEND") or ("triton" if device == "cuda" else "torch")
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend / PDSERVE_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}, "
                         f"got {name!r}")
    if name == "triton" and device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton on CPU runs only under TRITON_INTERPRET=1 (tests); "
                         "use --attention-backend torch")
    return name


def paged_attention(q, k, v, cache: dict, meta, scale: float, sliding_window: int | None = None):
    """Write the step's K/V into ``cache`` and attend; ``meta.backend`` picks the implementation."""
    if meta.backend == "triton":
        from pdserve.kernels import triton_attention

        return triton_attention.paged_attention(q, k, v, cache, meta, scale, sliding_window)
    return reference.paged_attention(q, k, v, cache, meta, scale, sliding_window)


def write_to_cache(k, v, cache: dict, slot_mapping, backend: str = "torch") -> None:
    if backend == "triton":
        from pdserve.kernels import triton_cache

        return triton_cache.write_to_cache(k, v, cache, slot_mapping)
    return reference.write_to_cache(k, v, cache, slot_mapping)
