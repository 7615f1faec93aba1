"""Reusable staging buffers for one KV chunk of every layer, allocated once and viewed per chunk.

Who calls it: ``ChunkIO`` (``kernels/chunk_io.py``) builds them for the publish ring (``publish_ring.py``: engine
thread gathers into a slot, publisher thread reads it) and for the loader's double-buffered scatter
(``scatter_pipe.py``: the loader thread alone). Nothing here is thread-safe: each buffer has one owner at a time,
handed over by whoever holds it (a ring slot, a pipe turn).

    Staging.view(n)   a contiguous [L, C, n, Hkv, D] view of the first n tokens' worth of the flat buffer
                      (a partial chunk is a prefix, never a strided slice: the seal and the copies see plain memory)

``allocate`` is the one place staging memory is made (tests count calls to it: no allocation per chunk).
"""

from __future__ import annotations

import torch


def allocate(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """A flat uninitialised tensor: pinned host memory when ``pin`` (a CUDA node's host side)."""
    if device.type == "cpu":
        return torch.empty(numel, dtype=dtype, pin_memory=pin)
    return torch.empty(numel, dtype=dtype, device=device)


class Staging:
    """Room for ``tokens`` tokens of one chunk: ``lead`` = (L, C), ``token`` = (Hkv, D); ``flat`` is its memory
    (``numel(lead, token, tokens)`` elements: its own allocation, or a slice of a ring's one)."""

    def __init__(self, lead: tuple[int, int], token: tuple[int, int], tokens: int, flat: torch.Tensor):
        if flat.numel() != numel(lead, token, tokens):
            raise ValueError(f"{flat.numel()} elements for {tokens} tokens of {lead} x {token}")
        self.lead, self.token, self.tokens, self.flat = lead, token, tokens, flat

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def view(self, n: int) -> torch.Tensor:
        if not 0 <= n <= self.tokens:
            raise ValueError(f"a chunk of {n} tokens does not fit a staging buffer of {self.tokens}")
        L, C = self.lead
        return self.flat[:L * C * n * self.token[0] * self.token[1]].view(L, C, n, *self.token)


def numel(lead: tuple[int, int], token: tuple[int, int], tokens: int) -> int:
    return lead[0] * lead[1] * tokens * token[0] * token[1]


class SlotIndex:
    """Room for ``len(flat)`` flat cache slots (int64); ``view(n)`` is the first n."""

    def __init__(self, flat: torch.Tensor):
        self.flat = flat

    def view(self, n: int) -> torch.Tensor:
        return self.flat[:n]
