"""A fused q/k/v projection run in two parts: K and V for every row, Q for some rows only.

Called by ``Attention.project_rows`` for the last layer of a step that keeps only its sampled rows
(``LogitRows``): every row's K/V goes into the cache, but only the kept rows need a query, so the Q columns
of the other rows (half of a Llama's q/k/v matmul) are not computed.

    split = SplitQKV.of(attn.qkv, q_size)      # None where the parts would not give the fused call's bits
    q = split.q(x[rows]); kv = split.kv(x)     # [S, q_size], [T, 2 * kv_size]

The parts are ``Linear``s over views of the fused weight (and bias), so they take the same paths (oneDNN,
the few-row kernel); each output is the same sum whichever columns share the call on the oneDNN builds
measured, but that is oneDNN's choice, not a contract -- so ``of`` checks it on this machine once per weight
(random inputs at 1..100 rows against the fused call, bit for bit) and keeps the fused call where any bit
differs. Rebuilt when the fused layer's weight copies are (``Linear._copies``: a new or reloaded weight) or its
bias changes; dropped by ``Linear.forget_reordered``. ``ModelRunner`` builds the last layer's at start-up (the
parts' oneDNN copies and panels: about twice that layer's q/k/v weight), so no request pays for it.
"""

from __future__ import annotations

import torch

from pdserve.engine.models.layers import Linear

PROBE_ROWS = (1, 2, 3, 8, 17, 32, 33, 64, 100)


class SplitQKV:
    def __init__(self, fused: Linear, q_size: int):
        w, b = fused.weight, fused.bias
        self.q = _part(w[:q_size], None if b is None else b[:q_size])
        self.kv = _part(w[q_size:], None if b is None else b[q_size:])
        self.q_size = q_size

    @staticmethod
    def of(fused: Linear, q_size: int) -> SplitQKV | None:
        """The checked split of ``fused`` (cached on it until its weight copies or its bias change), or None:
        also where ``fused`` itself gives a row other bits at another row count (``rows_independent``)."""
        if not fused.rows_independent():
            fused._split_qkv = None                   # nothing old kept alive (a weight moved to another dtype)
            return None
        key = (fused._copies(), q_size, _bias_key(fused.bias))
        cached = fused._split_qkv
        if cached is None or cached[0] is not key[0] or cached[1:3] != key[1:]:
            split = SplitQKV(fused, q_size)
            cached = fused._split_qkv = (*key, split if split.matches(fused) else None)
        return cached[3]

    @torch.inference_mode()
    def matches(self, fused: Linear) -> bool:
        """Whether both parts, at each of PROBE_ROWS rows, give the bits the fused call gives those rows inside
        a call of max(PROBE_ROWS) rows (the kept rows' Q against the full step's)."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(max(PROBE_ROWS), fused.in_size, generator=g, dtype=fused.weight.dtype)
        whole = fused(x)
        return all(torch.equal(self.q(x[:m]), whole[:m, :self.q_size])
                   and torch.equal(self.kv(x[:m]), whole[:m, self.q_size:]) for m in PROBE_ROWS)


def _bias_key(bias: torch.Tensor | None) -> tuple:
    """A replaced or re-pointed bias makes a new split (the parts hold views of the one they were made from)."""
    if bias is None:
        return ()
    return (id(bias), bias.data_ptr(), -1 if bias.is_inference() else bias._version)


def _part(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    part = Linear(weight.shape[1], weight.shape[0], bias is not None, weight.dtype)
    part.weight = torch.nn.Parameter(weight, requires_grad=False)          # views: no copy of the weight
    if bias is not None:
        part.bias = torch.nn.Parameter(bias, requires_grad=False)
    return part
