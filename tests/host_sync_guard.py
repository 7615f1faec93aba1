"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: report every device -> host sync a function makes.

Used by ``tests/test_review_graphs.py`` on the function CUDA ranks capture (``StageGraphs._forward``): a sync there
raises during capture on the first CUDA run. On CPU every tensor is a host tensor, so the guard marks which ones
would live on the device: a tensor is a HOST tensor when it was made by a factory call without a ``device``
argument (``torch.arange(n)``, ``torch.ones(b)``: CPU tensors on a CUDA machine too) or computed from host tensors
only; every other tensor (weights, KV cache, the graphs' buffers, anything computed from them) is a DEVICE tensor.
Flagged: ``item`` / ``int()`` / ``bool()`` / ``if t:`` (``_local_scalar_dense``), data-dependent shapes
(``nonzero``, ``masked_select``, ``unique``...) and ``.tolist()`` / ``.numpy()`` / ``.cpu()`` on a device tensor,
called from pdserve code (the Triton interpreter's own host copies are not the kernels' CUDA behaviour).

    guard = HostSyncGuard(host=[...])      # tensors made before that are host tensors
    with guard:
        fn()
    guard.syncs                            # ["aten._local_scalar_dense.default at pdserve/...py:12", ...]
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default,
            aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
            aten.unique_dim.default}
SYNC_METHODS = {"tolist", "numpy", "cpu", "item"}
FACTORIES = {"arange", "ones", "zeros", "empty", "full", "tensor", "scalar_tensor", "linspace", "randn", "rand"}


def _caller() -> str | None:
    """The innermost frame outside torch and this guard (None when the Triton interpreter is on the stack)."""
    frame, where = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/triton/" in name:
            return None
        if where is None and "/torch/" not in name and not name.endswith("host_sync_guard.py"):
            where = f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return where


class HostSyncGuard(TorchDispatchMode):
    def __init__(self, host=()):
        super().__init__()
        self.host = weakref.WeakSet(host)
        self.syncs: list[str] = []

    def _is_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func in SYNC_OPS and any(not self._is_host(t) for t in tensors):
            where = _caller()
            if where is not None:
                self.syncs.append(f"{func} at {where}")
        out = func(*args, **kwargs)
        if tensors:
            host = all(self._is_host(t) for t in tensors)
        else:
            host = func.__name__.split(".")[0] in FACTORIES and kwargs.get("device") is None
        if host:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.host.add(o)
        return out

    def _profile(self, frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") in SYNC_METHODS:
            obj = getattr(arg, "__self__", None)
            if isinstance(obj, torch.Tensor) and not self._is_host(obj):
                where = _caller()
                if where is not None:
                    self.syncs.append(f"Tensor.{arg.__name__}() at {where}")

    def __enter__(self):
        self._old_profile = sys.getprofile()
        sys.setprofile(self._profile)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.setprofile(self._old_profile)
        return super().__exit__(*exc)
