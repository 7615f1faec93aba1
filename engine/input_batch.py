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

    def to(self, device: torch.device) -> "StepInputs":
        """The same inputs on ``device`` (built on the CPU, moved once per step)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        attn = self.attn
        prefills = [PrefillSeq(p.q_start, p.q_len, move(p.ctx_slots), move(p.block_table)) for p in attn.prefills]
        d = attn.decodes
        decodes = None if d is None else DecodeBatch(move(d.rows), move(d.slots), move(d.mask), move(d.ctx_lens),
                                                     move(d.block_table))
        meta = AttentionMetadata(move(attn.slot_mapping), prefills, decodes, attn.block_size)
        return StepInputs(move(self.input_ids), move(self.positions), meta, move(self.sample_rows),
                          self.sample_requests)


def build_step_inputs(scheduled, block_size: int) -> StepInputs:
    ids, positions, slots, prefills, decode_items = [], [], [], [], []
    sample_rows, sample_requests = [], []
    row = 0
    for item in scheduled:
        req, start, n = item.request, item.request.num_computed_tokens, item.num_new_tokens
        table = torch.tensor(req.block_ids[: (start + n + block_size - 1) // block_size], dtype=torch.long)
        ctx_slots = _slots(table, start + n, block_size)                    # [start + n]
        ids.extend(req.all_token_ids[start:start + n])
        positions.append(torch.arange(start, start + n))
        slots.append(ctx_slots[start:])
        if n == 1:
            decode_items.append((row, table, start + n))
        else:
            prefills.append(PrefillSeq(q_start=row, q_len=n, ctx_slots=ctx_slots, block_table=table))
        row += n
        if start + n == req.num_tokens:
            sample_rows.append(row - 1)
            sample_requests.append(req)
    attn = AttentionMetadata(slot_mapping=torch.cat(slots), prefills=prefills,
                             decodes=_decode_batch(decode_items, block_size), block_size=block_size)
    return StepInputs(torch.tensor(ids, dtype=torch.long), torch.cat(positions), attn,
                      torch.tensor(sample_rows, dtype=torch.long), sample_requests)


def _slots(table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..num_tokens-1 through the block table."""
    pos = torch.arange(num_tokens)
    return table[pos // block_size] * block_size + pos % block_size


def _decode_batch(items: list[tuple[int, torch.Tensor, int]], block_size: int) -> DecodeBatch | None:
    """Decodes share one padded block table [B, nb]; padding points at block 0 and is masked out."""
    if not items:
        return None
    lens = torch.tensor([n for _, _, n in items], dtype=torch.long)
    nb = max(t.numel() for _, t, _ in items)
    table = torch.zeros(len(items), nb, dtype=torch.long)                  # [B, nb]
    for i, (_, t, _) in enumerate(items):
        table[i, : t.numel()] = t
    width = nb * block_size
    mask = (torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)).view(len(items), 1, 1, width)
    rows = torch.tensor([r for r, _, _ in items], dtype=torch.long)
    return DecodeBatch(rows=rows, slots=None, mask=mask, ctx_lens=lens, block_table=table)
