"""Plain-torch MLA over the latent cache: the oracle of the MLA kernels (``cpu_mla.py``, ``triton_mla.py``).

The latent cache of one layer is ``cache["latent"]: [num_blocks, block_size, 1, W]`` with ``W = L + R``: each token's
compressed KV (``L = kv_lora_rank`` values) followed by its rotated rope key (``R`` values), nothing per head
(``engine/kv/kv_layout.py``). Called through ``pdserve.kernels.dispatch`` by the MLA attention
(``engine/models/mla.py``), once per layer and step:

    write_latent(latent, cache, slots)           the step's new rows [T, W] -> the cache at their slots (-1 skipped)
    gather_latent(cache, table, seq_len)         one sequence's cached rows [seq_len, W] (the prefill's plain path)
    mla_decode(q, cache, meta, scale, L)         weight-absorbed decode: one query row per sequence

``mla_decode`` is multi-query attention in the latent space: every head's query ``q [B, H, W]`` (``q_nope`` already
absorbed through W_UK, then ``q_pe``) scores against the same cached vectors ``[S, W]``, and the values are the
first ``L`` entries of those vectors; -> ``[B, H, L]``, which the model maps through W_UV per head.
Sequence ``b`` attends to positions ``0 .. seq_lens[b] - 1`` through ``block_table[b]``.
"""

from __future__ import annotations

import torch

from pdserve.kernels.metadata import AttentionMetadata


def write_latent(latent: torch.Tensor, cache: dict, slot_mapping: torch.Tensor) -> None:
    """latent: [T, W] -> cache["latent"] [N, bs, 1, W] at flat slots; slots < 0 (CUDA-graph padding) are skipped
    on the CPU (on a device the check would be a host sync: only graph steps have them, and those run Triton)."""
    slots = slot_mapping.long()
    if slots.device.type == "cpu" and slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, latent = slots[keep], latent[keep]
    flat = cache["latent"].view(-1, cache["latent"].shape[-1])                  # [N * bs, W]
    flat.index_copy_(0, slots, latent.to(flat.dtype))


def gather_latent(cache: dict, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache["latent"] [N, bs, 1, W], table [>= ceil(seq_len / bs)] block ids -> [seq_len, W] (a new tensor)."""
    latent = cache["latent"]
    bs = latent.shape[1]
    blocks = latent.index_select(0, table[: (seq_len + bs - 1) // bs].long())   # [nb, bs, 1, W]
    return blocks.view(-1, latent.shape[-1])[:seq_len]


def mla_decode(q: torch.Tensor, cache: dict, meta: AttentionMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """q: [B, H, W] (one query row per sequence of ``meta``) -> [B, H, L] in q's dtype, one sequence at a time in
    float32: the reference."""
    lens = meta.seq_lens_cpu.tolist()
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for b, n in enumerate(lens):
        ctx = gather_latent(cache, meta.block_table[b], n).float()            # [S, W]
        scores = (q[b].float() @ ctx.t()) * scale                             # [H, S]
        out[b] = (torch.softmax(scores, dim=-1) @ ctx[:, :kv_lora_rank]).to(q.dtype)
    return out
