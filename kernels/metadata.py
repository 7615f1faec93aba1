"""Per-step attention metadata, built once per step by the model runner and shared by all layers.

Token rows of one step are flattened: ``T`` = sum of every scheduled request's new tokens.

    flat rows:  | req A: 5 prefill tokens | req B: 1 | req C: 1 |
    A's query rows 0..4 attend to A's cached context (earlier chunks) + those 5 tokens.

``slot_mapping[t]`` = ``block_id * block_size + offset`` where row ``t``'s K/V is written.
Sequences with more than one new token ("prefills") are attended one at a time; single-token
sequences ("decodes") are attended together through a padded ``[B, L]`` slot table. With a
``block_table`` the context is gathered a whole block at a time (4x less gather time on CPU than
token by token: contiguous 16-token rows instead of one row per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    q_start: int                 # first flat row of this sequence
    q_len: int                   # new tokens this step
    ctx_slots: torch.Tensor      # [ctx_len] int64: slots of every token 0..ctx_len-1 (incl. new)
    block_table: torch.Tensor | None = None   # [nb] int64: when set, context is gathered by whole blocks

    @property
    def ctx_len(self) -> int:
        return int(self.ctx_slots.numel())


@dataclass
class DecodeBatch:
    rows: torch.Tensor           # [B] int64: flat row of each decode token
    slots: torch.Tensor | None   # [B, L] int64: context slots, padded with 0 (token-gather path)
    mask: torch.Tensor           # [B, 1, 1, L] bool: True where the key is real
    ctx_lens: torch.Tensor       # [B] int64
    block_table: torch.Tensor | None = None   # [B, L / block_size] int64, padded: block-gather path


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [T] int64
    prefills: list[PrefillSeq] = field(default_factory=list)
    decodes: DecodeBatch | None = None
    block_size: int = 16
