"""Turn one ``SchedulerOutput`` into flat model inputs and attention metadata (no model calls here).

Called by ``ModelRunner.execute`` once per step. Rows are ordered as the scheduler listed the
requests; each request contributes ``num_new_tokens`` rows:

    request r computes tokens [start, start + n) of r.all_token_ids, at positions start..start+n-1;
    its KV goes to slot  block_ids[p // block_size] * block_size + p % block_size  for each position p.
    r is sampled this step iff start + n == r.num_tokens (it reached the end of what it knows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import AttentionMetadata, DecodeBatch, PrefillSeq


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor      # [S] int64: flat row whose logits are sampled
    sample_requests: list          # [S] Request objects, aligned with sample_rows


def build_step_inputs(scheduled, block_size: int) -> StepInputs:
    ids, positions, slots, prefills, decode_items = [], [], [], [], []
    sample_rows, sample_requests = [], []
    row = 0
    for item in scheduled:
        req, start, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
        ctx_slots = _slots(req.block_ids, start + n, block_size)           # [start + n]
        ids.extend(req.all_token_ids[start:start + n])
        positions.append(torch.arange(start, start + n))
        slots.append(ctx_slots[start:])
        if n == 1:
            decode_items.append((row, ctx_slots))
        else:
            prefills.append(PrefillSeq(q_start=row, q_len=n, ctx_slots=ctx_slots))
        row += n
        if start + n == req.num_tokens:
            sample_rows.append(row - 1)
            sample_requests.append(req)
    attn = AttentionMetadata(slot_mapping=torch.cat(slots), prefills=prefills,
                             decodes=_decode_batch(decode_items), block_size=block_size)
    return StepInputs(torch.tensor(ids, dtype=torch.long), torch.cat(positions), attn,
                      torch.tensor(sample_rows, dtype=torch.long), sample_requests)


def _slots(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..num_tokens-1 through the block table."""
    pos = torch.arange(num_tokens)
    table = torch.tensor(block_ids[: (num_tokens + block_size - 1) // block_size], dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def _decode_batch(items: list[tuple[int, torch.Tensor]]) -> DecodeBatch | None:
    if not items:
        return None
    lens = torch.tensor([s.numel() for _, s in items], dtype=torch.long)
    width = int(lens.max())
    slots = torch.zeros(len(items), width, dtype=torch.long)               # [B, L]
    for i, (_, s) in enumerate(items):
        slots[i, : s.numel()] = s
    mask = (torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)).view(len(items), 1, 1, width)
    rows = torch.tensor([r for r, _ in items], dtype=torch.long)
    return DecodeBatch(rows=rows, slots=slots, mask=mask, ctx_lens=lens)
