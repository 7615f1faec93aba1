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
differs. Rebuilt when the fused layer's weight copies are (``Linear._copies``: a new or reloaded weight).
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
        """The checked split of ``fused`` (cached on it until its weight copies change), or None."""
        copies = fused._copies()
        if copies is None or fused.collective is not None:
            return None
        cached = getattr(fused, "_split_qkv", None)
        if cached is None or cached[0] is not copies or cached[1] != q_size:
            split = SplitQKV(fused, q_size)
            cached = (copies, q_size, split if split.matches(fused) else None)
            fused._split_qkv = cached
        return cached[2]

    @torch.inference_mode()
    def matches(self, fused: Linear) -> bool:
        """Whether both parts give the fused call's bits at PROBE_ROWS rows of random input."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(max(PROBE_ROWS), fused.in_size, generator=g, dtype=fused.weight.dtype)
        for m in PROBE_ROWS:
            whole = fused(x[:m])
            if not (torch.equal(self.q(x[:m]), whole[:, :self.q_size])
                    and torch.equal(self.kv(x[:m]), whole[:, self.q_size:])):
                return False
        return True


def _part(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    part = Linear(weight.shape[1], weight.shape[0], bias is not None, weight.dtype)
    part.weight = torch.nn.Parameter(weight, requires_grad=False)          # views: no copy of the weight
    if bias is not None:
        part.bias = torch.nn.Parameter(bias, requires_grad=False)
    return part
