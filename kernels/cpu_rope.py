"""The CPU rotary embedding: ``cpu_rope.c`` built like the attention kernel, called through ctypes.

    out = rotary(x, cos, sin)     # x [T, H, D] float32 CPU, cos/sin [T, D]: one C call, or None (use torch)

``engine.models.rope.apply_rotary`` calls it for float32 CPU tensors outside ``torch.compile``; it
returns None where the library cannot be built (no AVX2, no compiler: the reason is logged once by
``load``) or the layout does not fit, and the caller keeps the torch expression. The bits are the
torch expression's (same operations, same order; tests/test_cpu_rope.py). On a 2048-token prompt
step of the tiny model it is ~6x faster than the torch expression, whose broadcasts over heads and
``cat`` cost a pass over q and k each; at decode batch sizes it saves the per-op dispatch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from pdserve.kernels import cpu_attention

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_rope.c")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None (reason logged once) where it cannot be built or loaded here."""
    reason = cpu_attention._unsupported(cpu_attention._cpu_flags(), cpu_attention.CPU_FLAGS)
    if reason is None:
        try:
            lib = ctypes.CDLL(str(cpu_attention._build([], SOURCE, "pd_rotary")))
        except (OSError, subprocess.SubprocessError) as e:
            reason = f"build failed: {e}"
        else:
            p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
            lib.pd_rotary.argtypes = [p, i64, p, p, p, i64, i32, i32]
            lib.pd_rotary.restype = i32
            return lib
    log.warning("cpu rotary kernel unavailable (%s); rotary embeddings use torch", reason)
    return None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x: [T, H, D] float32 CPU (rows may be strided, heads contiguous); cos, sin: [T, D] float32.
    -> a new contiguous [T, H, D], or None where this path does not apply."""
    T, H, D = x.shape
    if not (x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu" and D % 2 == 0
            and x.stride(2) == 1 and x.stride(1) == D and cos.shape == sin.shape == (T, D)
            and cos.is_contiguous() and sin.is_contiguous()):
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty((T, H, D), dtype=torch.float32)
    rc = lib.pd_rotary(x.data_ptr(), x.stride(0) if T > 1 else H * D, out.data_ptr(), cos.data_ptr(),
                       sin.data_ptr(), T, H, D)
    if rc:
        raise RuntimeError(f"cpu rotary kernel failed on x {tuple(x.shape)}")
    return out
