"""The step's token bitmask and its application to the logits, in one pass over the batch.

    mask = GrammarBitmask.allocate(request_ids, vocab_size)    # the engine core: one row per structured request
    matcher.fill_next_token_bitmask(mask.mask, mask.rows[id])  # (manager.py)
    apply_bitmask(logits, sample_request_ids, mask)            # the model runner, before sampling

Bit ``j`` of a row (int32 word ``j // 32``, bit ``j % 32``) set means token ``j`` may come next; the logits of
a cleared bit become -inf, so greedy sampling is the argmax over the allowed tokens and a seeded draw is
taken over them (the generator makes the same one draw either way). Rows of requests without a constraint
are left alone. A tp x pp node ships each row to the sampling rank as bytes (``row_bytes`` /
``from_row_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class GrammarBitmask:
    rows: dict[str, int]          # request id -> its row of ``mask``
    mask: torch.Tensor            # [B, ceil(V / 32)] int32, CPU

    @classmethod
    def allocate(cls, request_ids: list[str], vocab_size: int) -> "GrammarBitmask":
        mask = torch.full((len(request_ids), bitmask_width(vocab_size)), -1, dtype=torch.int32)
        return cls({rid: i for i, rid in enumerate(request_ids)}, mask)

    def row_bytes(self, request_id: str) -> bytes | None:
        row = self.rows.get(request_id)
        return None if row is None else self.mask[row].numpy().tobytes()

    @classmethod
    def from_row_bytes(cls, rows: dict[str, bytes]) -> "GrammarBitmask | None":
        if not rows:
            return None
        ids = list(rows)
        mask = torch.stack([torch.frombuffer(bytearray(rows[rid]), dtype=torch.int32) for rid in ids])
        return cls({rid: i for i, rid in enumerate(ids)}, mask)


def apply_bitmask(logits: torch.Tensor, request_ids: list[str], bitmask: GrammarBitmask | None) -> None:
    """In place: -inf in ``logits[i]`` ([S, V], row i is ``request_ids[i]``'s) at every token its row forbids.
    CPU: xgrammar's C++ kernel. Elsewhere (CUDA): ``apply_on_device``, plain torch ops -- xgrammar's kernel for
    CUDA is a Triton one that would compile inside the first structured request (nothing warms it)."""
    if bitmask is None:
        return
    hits = [(i, bitmask.rows[rid]) for i, rid in enumerate(request_ids) if rid in bitmask.rows]
    if not hits:
        return
    logit_rows = [i for i, _ in hits]
    words = bitmask.mask[[m for _, m in hits]]                                         # [S', W] int32
    vocab = min(logits.shape[1], words.shape[1] * 32)
    if logits.device.type != "cpu":
        apply_on_device(logits, logit_rows, words, vocab)
        return
    import xgrammar as xgr

    aligned = torch.full((logits.shape[0], words.shape[1]), -1, dtype=torch.int32)    # [S, W]
    aligned[logit_rows] = words
    xgr.apply_token_bitmask_inplace(logits, aligned, vocab_size=vocab, indices=logit_rows)


def apply_on_device(logits: torch.Tensor, logit_rows: list[int], words: torch.Tensor, vocab: int) -> None:
    """``logits`` [S, V] (any device) in place: -inf at each cleared bit of ``words`` [S', W] (int32, CPU; row j is
    logit row ``logit_rows[j]``) among the first ``vocab`` columns. One copy to the device (pinned on CUDA): the
    rows' ids and words as bytes; the bits unpacked there a byte per token ([S', vocab] uint8, a quarter of the
    rows' float32 logits). Little-endian words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7."""
    n = len(logit_rows)
    packed = torch.cat([torch.tensor(logit_rows, dtype=torch.int32).view(n, 1), words], dim=1)   # [S', 1 + W]
    if logits.device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(logits.device, non_blocking=True)
    rows = packed[:, 0].long()                                                          # [S']
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    bits = (packed[:, 1:].contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1   # [S', 4W, 8]
    forbidden = bits.view(n, -1)[:, :vocab] == 0                                        # [S', vocab]
    logits[rows, :vocab] = logits[rows, :vocab].masked_fill(forbidden, float("-inf"))
