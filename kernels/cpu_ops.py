"""The model's elementwise and per-row ops on CPU float32: ``cpu_ops.c`` built like the attention kernel.

    out = rotary(x, cos, sin)         # engine/models/rope.py: apply_rotary
    y = rms_norm(x, weight, eps)      # engine/models/layers.py: RMSNorm
    y = silu_and_mul(gate_up)         # engine/models/layers.py: GatedMLP
    done = write_kv(k, v, cache, slot_mapping)   # kernels/cpu_attention.py: the step's K/V into the cache

Each returns a new contiguous tensor (``write_kv``: True), or None (False) where its path does not apply
(not float32 on CPU, a layout it does not take, or no library: no AVX2/FMA/F16C, or neither a cached build nor
a compiler, logged once by ``load``); the caller then runs its torch expression. The callers skip it inside
``torch.compile`` (the graph keeps torch's ops).

Bits: ``rotary`` gives the torch expression's bits (same operations, same order; a NaN is NaN, its sign
not matched). ``rms_norm`` differs from torch only in its sum of squares (in double, rounded once: at
most ~4 ulp from torch's at any width), ``silu_and_mul`` in its exp (~2 ulp); no result depends on the
other rows, so a prompt's KV does not depend on how it was batched or chunked. Tests:
tests/test_cpu_ops.py. Speed, tiny model, 2048-token prompt step (torch -> C): rotary 0.96 -> 0.12 ms a
layer, the step's 4 RMSNorms 5 -> 1.7 ms; each also saves several op dispatches per decode step.
``write_kv`` copies (index_copy_'s bits): a 2048-token step of the tiny model, 0.66 -> 0.07 ms a layer
(K and V).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pdserve.kernels import cpu_build

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_ops.c")
_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGS = {"pd_rotary": [_p, _i64, _p, _p, _p, _i64, _i32, _i32],         # every symbol: load checks them all
         "pd_rms_norm": [_p, _i64, _p, _p, _i64, _i32, _f32],
         "pd_silu_and_mul": [_p, _i64, _p, _i64, _i32],
         "pd_write_kv": [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _i64]}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None (reason logged once) where it cannot be built or loaded here."""
    lib, _, reasons = cpu_build.load_best(SOURCE, list(_ARGS), {"avx2": ((), cpu_build.CPU_FLAGS)}, None,
                                          "cpu ops kernels")
    if lib is None:
        log.warning("cpu ops kernels unavailable (%s); rotary, RMSNorm and SiLU use torch", "; ".join(reasons))
    return None if lib is None else _bind(lib)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, args in _ARGS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _i32
    return lib


def _f32_cpu(*xs: torch.Tensor) -> bool:
    """Plain float32 CPU tensors whose data pointer holds their values: not a lazily negated view (its memory
    holds -x) and not a ZeroTensor (no memory at all)."""
    return all(x.dtype == torch.float32 and x.device.type == "cpu" and not x.is_neg() and not x._is_zerotensor()
               for x in xs)


def _shares_storage(xs, ys) -> bool:
    return any(x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for x in xs for y in ys)


def _row_stride(x: torch.Tensor, row_elems: int) -> int:
    return x.stride(0) if x.shape[0] > 1 else row_elems


def _dense(x: torch.Tensor, dim: int, step: int) -> bool:
    """Whether moving one along ``dim`` moves ``step`` elements (any stride does where the size is 1)."""
    return x.shape[dim] <= 1 or x.stride(dim) == step


def _check(rc: int, what: str, x: torch.Tensor) -> None:
    if rc:
        raise RuntimeError(f"cpu {what} kernel failed on {tuple(x.shape)}")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x: [T, H, D] (rows may be strided, heads contiguous); cos, sin: [T, D] contiguous -> [T, H, D]."""
    T, H, D = x.shape
    if not (_f32_cpu(x, cos, sin) and H > 0 and D > 0 and D % 2 == 0 and _dense(x, 2, 1) and _dense(x, 1, D)
            and cos.shape == sin.shape == (T, D) and cos.is_contiguous() and sin.is_contiguous()):
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty((T, H, D), dtype=torch.float32)
    _check(lib.pd_rotary(x.data_ptr(), _row_stride(x, H * D), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, H,
                         D), "rotary", x)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x: [N, D] (rows may be strided); weight: [D] -> [N, D]."""
    if not (x.dim() == 2 and x.shape[1] > 0 and _f32_cpu(x, weight) and _dense(x, 1, 1) and weight.is_contiguous()
            and weight.shape == (x.shape[1],)):
        return None
    lib = load()
    if lib is None:
        return None
    N, D = x.shape
    out = torch.empty((N, D), dtype=torch.float32)
    _check(lib.pd_rms_norm(x.data_ptr(), _row_stride(x, D), weight.data_ptr(), out.data_ptr(), N, D, eps),
           "rms_norm", x)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up: [N, 2I] (gate | up; rows may be strided) -> silu(gate) * up: [N, I]."""
    if not (gate_up.dim() == 2 and gate_up.shape[1] > 0 and _f32_cpu(gate_up) and _dense(gate_up, 1, 1)
            and gate_up.shape[1] % 2 == 0):
        return None
    lib = load()
    if lib is None:
        return None
    N, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((N, I), dtype=torch.float32)
    _check(lib.pd_silu_and_mul(gate_up.data_ptr(), _row_stride(gate_up, 2 * I), out.data_ptr(), N, I),
           "silu_and_mul", gate_up)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: dict, slot_mapping: torch.Tensor) -> bool:
    """k, v: [T, Hkv, D] float32 (rows may be strided) -> cache["k"/"v"] ([num_blocks, block_size, Hkv, D],
    float32, contiguous) at flat slots (negative: padding, skipped). False where this path does not apply (the
    caller runs ``reference.write_to_cache``); IndexError, the cache untouched, for a slot past the cache."""
    kc, vc = cache["k"], cache["v"]
    if not (_f32_cpu(k, v, kc, vc) and k.dim() == 3 and v.shape == k.shape and kc.dim() == 4 and vc.shape == kc.shape
            and kc.shape[2:] == k.shape[1:] and kc.is_contiguous() and vc.is_contiguous()
            and all(_dense(x, 2, 1) and _dense(x, 1, x.shape[2]) for x in (k, v))
            and slot_mapping.device.type == "cpu" and slot_mapping.shape == (k.shape[0],)
            and slot_mapping.dtype in (torch.int32, torch.int64) and not _shares_storage((k, v), (kc, vc))):
        return False                          # (k or v inside the cache: torch's index_copy_ refuses it or orders it)
    lib = load()
    if lib is None:
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    row = k.shape[1] * k.shape[2]
    num_slots = kc.shape[0] * kc.shape[1]
    rc = lib.pd_write_kv(k.data_ptr(), _row_stride(k, row), v.data_ptr(), _row_stride(v, row), slots.data_ptr(),
                         k.shape[0], kc.data_ptr(), vc.data_ptr(), row, num_slots)
    if rc == 2:
        raise IndexError(f"slot_mapping holds a slot past the KV cache's {num_slots} slots (max "
                         f"{int(slots.max())})")
    _check(rc, "write_kv", k)
    return True
