"""Vocab-parallel padding: how many rows each TP rank's embedding / LM head holds, and reading them.

Called by ``llama.ShardSizes.for_tp`` (``padded_vocab``) and by ``layers.Embedding`` / ``layers.LMHead``'s loads
(``vocab_rows``). A vocabulary V that does not divide by the TP size is padded as vLLM pads it: every rank holds
R = Vp / tp rows, rank r rows [r*R, (r+1)*R) of the padded table; rows past V are zeros, never looked up (ids are
checked at the edge), and ``LMHead`` cuts the gathered logits back to V columns, so the sampler, logprobs,
penalties, logit_bias and grammar bitmasks never see a padded id:

    ids   0 .................... V-1 | V ...... Vp-1        Vp = padded_vocab(V, tp)
    rows  rank 0 [0, R) | rank 1 [R, 2R) ... | zeros          R = Vp / tp
"""

from __future__ import annotations

import math

import torch

# A padded vocabulary is a multiple of 64 (vLLM's DEFAULT_VOCAB_PADDING_SIZE: whole tiles for the LM head's GEMM)
# and of the TP size (equal shards).
VOCAB_PADDING = 64


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """Rows of a vocab-parallel embedding / LM head over ``tp_size`` ranks, all shards together: ``vocab_size``
    itself on one rank, else rounded up to a multiple of lcm(VOCAB_PADDING, tp_size)."""
    if tp_size == 1:
        return vocab_size
    step = math.lcm(VOCAB_PADDING, tp_size)
    return -(-vocab_size // step) * step


def vocab_rows(src, name: str, start: int, rows: int, vocab_size: int) -> torch.Tensor:
    """Rows [start, start + rows) of checkpoint tensor ``name`` ([vocab_size, D]): those past ``vocab_size`` (a
    padded vocabulary's) are zeros; a shard wholly past it is all zeros. -> [rows, D]"""
    real = max(0, min(start + rows, vocab_size) - start)
    if real == rows:
        return src.get_slice(name, 0, start, start + rows)
    head = src.get_slice(name, 0, start, start + real) if real else None
    width = src.shape(name)[1]
    pad = torch.zeros(rows - real, width, dtype=torch.float32 if head is None else head.dtype)
    return pad if head is None else torch.cat([head, pad])
