"""The CPU path of weight-absorbed MLA decode: batched torch over the latent cache (``mla_reference.py`` semantics).

Called through ``dispatch.mla_decode`` for the ``cpu`` and ``torch`` backends (no C kernel: the work is two batched
matmuls per group, which oneDNN/MKL already run well). As the GQA reference does (``reference.py``), decode rows are
sorted by context length and taken in groups of ``GROUP``; each group gathers the blocks its longest member needs
once, straight into a workspace allocated at the first layer of the step and reused by the others (the plan lives in
``meta.derived["mla_cpu"]``):

    ctx    [b, S, W]   every member's latent rows (whole blocks; positions >= its length masked)
    scores [b, H, S] = q [b, H, W] @ ctx^T * scale          one bmm: MQA, no head is expanded
    out    [b, H, L] = softmax(scores) @ ctx[:, :, :L]      values are the latent part of the same rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.metadata import AttentionMetadata

GROUP = 8


@dataclass
class _Group:
    rows: torch.Tensor           # [b] long: query rows of the members
    table: torch.Tensor          # [b, nb] long: blocks up to the group's longest context
    lens: torch.Tensor           # [b] long


@dataclass
class _Plan:
    groups: list[_Group]
    max_blocks: int
    workspace: torch.Tensor | None = None

    def buffer(self, latent: torch.Tensor) -> torch.Tensor:
        """[max_blocks, bs, 1, W] in the cache's dtype, made once per step (every layer's cache has one shape)."""
        ws = self.workspace
        if ws is None or ws.shape[1:] != latent.shape[1:] or ws.dtype != latent.dtype:
            ws = self.workspace = latent.new_empty(self.max_blocks, *latent.shape[1:])
        return ws


def mla_decode(q: torch.Tensor, cache: dict, meta: AttentionMetadata, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """q: [B, H, W], one query row per sequence of ``meta`` -> [B, H, L] in q's dtype (softmax in float32)."""
    plan = meta.derived.get("mla_cpu")
    if plan is None:
        plan = meta.derived["mla_cpu"] = _plan(meta)
    latent = cache["latent"]
    ws = plan.buffer(latent)
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    for g in plan.groups:
        nb = g.table.shape[1]
        blocks = torch.index_select(latent, 0, g.table.reshape(-1), out=ws[: g.table.numel()])
        ctx = blocks.view(g.table.shape[0], nb * latent.shape[1], latent.shape[-1])       # [b, S, W]
        qg = q[g.rows]                                                                     # [b, H, W]
        if ctx.dtype != qg.dtype:
            ctx = ctx.to(qg.dtype)
        scores = torch.bmm(qg, ctx.transpose(1, 2)).float() * scale                       # [b, H, S]
        pos = torch.arange(ctx.shape[1]).unsqueeze(0)                                      # [1, S]
        scores.masked_fill_((pos >= g.lens.unsqueeze(1)).unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(qg.dtype)
        out[g.rows] = torch.bmm(probs, ctx[:, :, :kv_lora_rank])                           # [b, H, L]
    return out


def _plan(meta: AttentionMetadata) -> _Plan:
    lens = meta.seq_lens_cpu.tolist()
    bs, table = meta.block_size, meta.block_table.long()
    order = sorted(range(len(lens)), key=lambda b: lens[b])
    groups = []
    for i in range(0, len(order), GROUP):
        members = order[i:i + GROUP]
        nb = (max(lens[b] for b in members) + bs - 1) // bs
        idx = torch.tensor(members, dtype=torch.long)
        groups.append(_Group(idx, table[idx, :nb], torch.tensor([lens[b] for b in members], dtype=torch.long)))
    return _Plan(groups, max((g.table.numel() for g in groups), default=0))
