"""Plain-torch paged attention: the reference every kernel (Triton, the cpu C kernel) is tested against, and
the CPU path where the cpu kernel cannot be built (no AVX2 or no C compiler; a head or block size not a
multiple of 8).

Called once per attention layer per step by the model (through ``pdserve.kernels.paged_attention``):

    1. write the step's new K/V rows into the paged cache at ``meta.slot_mapping`` (-1: skipped)
    2. each prefill/extend sequence: its context gathered a whole block at a time, causal attention
       (a first chunk with no cached context attends to the new K/V directly: no gather, no mask), on SDPA's
       unfused math path (the fused kernel's bits depend on the chunk's length: see ``_heads_first``)
    3. the decode rows: sorted by context length in groups of 8, each group gathers only the blocks
       its longest member needs; one SDPA per group with GQA folded into the query rows (each
       sequence's query heads viewed [Hkv, H/Hkv], so the K/V heads are never expanded)

The per-step plan (which rows are decodes, the groups, each prefill's table) is derived from the
metadata's host mirrors once, at the first layer, and reused by the others (``meta.derived``).
Every gather of the step (all layers, all groups) copies into one workspace the plan owns, sized
for the largest: a fresh 2 MB buffer per gather cost its page faults, half the gather's time.

``devbench/cpu_attention.py`` times the alternatives (issue 14; 1 thread, 32-256 decodes of ~550 tokens):
groups of 8 with the workspace and folded GQA run 1.07-1.35x the old path; groups of 4 or 16 are
about even, one group for the whole step 1.5-5x slower (its gather leaves the cache); matmul +
softmax by hand is slower than SDPA; compiled flex attention on the paged cache (no gather) is not
faster at batch 256 or with 9 heads and costs a 3-23 s compile, so it is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.metadata import AttentionMetadata

DECODE_GROUP = 8   # decodes attended together; sorted by context length so each group pads little


def write_to_cache(k: torch.Tensor, v: torch.Tensor, cache: dict, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] -> cache["k"/"v"]: [num_blocks, block_size, Hkv, D] at flat slots.

    Padding rows (slot < 0, only CUDA-graph steps have them, and those run the Triton backend) are
    skipped on the CPU; on a device the check would be a host sync, so it is not made there."""
    slots = slot_mapping.long()
    if slots.device.type == "cpu" and slots.numel() and int(slots.min()) < 0:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    for name, x in (("k", k), ("v", v)):
        flat = cache[name].view(-1, *cache[name].shape[2:])
        flat.index_copy_(0, slots, x.to(flat.dtype))


def paged_attention(q, k, v, cache: dict, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; returns [T, H, D]."""
    write_to_cache(k, v, cache, meta.slot_mapping)
    plan = meta.derived.get("torch")
    if plan is None:
        plan = meta.derived["torch"] = _plan(meta, q.device)
    ws = plan.workspace(cache)
    out = torch.empty_like(q)
    for p in plan.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        if p.seq_len == p.q_len and sliding_window is None:   # no cached context: plain causal
            out[rows] = _causal(q[rows], k[rows], v[rows], scale)
        else:
            out[rows] = _prefill(q[rows], cache, ws, p, scale, sliding_window)
    for g in plan.decode_groups:
        out[g.rows] = _decode_blocks(q[g.rows], cache, ws, g, scale, sliding_window)
    return out


@dataclass
class _Prefill:
    q_start: int
    q_len: int
    seq_len: int
    table: torch.Tensor          # [nb] long: the blocks covering positions [0, seq_len)


@dataclass
class _DecodeGroup:
    rows: torch.Tensor           # [b] long: flat rows (one query each)
    table: torch.Tensor          # [b, nb] long: blocks up to the group's longest context
    lens: torch.Tensor           # [b] long


@dataclass
class _Plan:
    prefills: list[_Prefill]
    decode_groups: list[_DecodeGroup]
    gather_blocks: int           # the most blocks one gather takes (a prefill's or a group's table)
    _workspace: dict | None = None

    def workspace(self, cache: dict) -> dict:
        """{"k", "v"}: [gather_blocks, block_size, Hkv, D] each, allocated at the first layer, reused
        by the others (again if a cache of another shape or dtype comes: none does in one model)."""
        ws, k = self._workspace, cache["k"]
        if ws is None or ws["k"].shape[1:] != k.shape[1:] or ws["k"].dtype != k.dtype or ws["k"].device != k.device:
            ws = self._workspace = {c: cache[c].new_empty(self.gather_blocks, *cache[c].shape[1:]) for c in ("k", "v")}
        return ws


def _plan(meta: AttentionMetadata, device) -> _Plan:
    qsl, lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    bs = meta.block_size
    table = meta.block_table.long()
    prefills, decodes = [], []
    for b, s in enumerate(lens):
        start, n = qsl[b], qsl[b + 1] - qsl[b]
        if n == 1:
            decodes.append(b)
        else:
            prefills.append(_Prefill(start, n, s, table[b, : (s + bs - 1) // bs]))
    decodes.sort(key=lambda b: lens[b])
    groups = []
    for i in range(0, len(decodes), DECODE_GROUP):
        members = decodes[i:i + DECODE_GROUP]
        nb = (max(lens[b] for b in members) + bs - 1) // bs
        idx = torch.tensor(members, dtype=torch.long, device=device)
        groups.append(_DecodeGroup(rows=torch.tensor([qsl[b] for b in members], dtype=torch.long, device=device),
                                   table=table[idx, :nb],
                                   lens=torch.tensor([lens[b] for b in members], dtype=torch.long, device=device)))
    gather_blocks = max([p.table.numel() for p in prefills] + [g.table.numel() for g in groups], default=0)
    return _Plan(prefills, groups, gather_blocks)


def _causal(q, k, v, scale) -> torch.Tensor:
    # q: [Q, H, D]; k, v: [Q, Hkv, D], the whole sequence: no gather, no explicit mask
    o = _math_sdpa(_heads_first(q), _heads_first(k), _heads_first(v), None, scale)
    return o[0].transpose(0, 1)


def _math_sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """SDPA's unfused math path, called directly: bit for bit what ``F.scaled_dot_product_attention`` gives
    under ``sdpa_kernel(SDPBackend.MATH)`` (a boolean mask made additive as SDPA makes it), without that
    context manager, which sets process-global backend flags: two threads prefilling at once interleaved its
    save/restore, left flash / mem-efficient / cuDNN SDPA off for the whole process, and switched other
    threads' SDPA calls (decode rows, another engine's) to the math path while one thread was inside.
    ``mask`` None: causal."""
    if mask is not None:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, 0.0, mask is None, None,
                                                             scale=scale, enable_gqa=True)[0]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D]. Prefill SDPA runs the unfused math path on 4-D inputs: 1.8x faster than on
    3-D ones (512 tokens, 4 heads) and bit-identical to them. SDPA's fused CPU kernel was 1.2x faster still
    end to end but tiles queries by the chunk's length: two engines chunking one prompt differently then
    publish different KV bytes for the same prefix, which the decode node's digest check rejects."""
    return x.transpose(0, 1).unsqueeze(0)


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hkv, D], table [...] -> [..., bs * len, Hkv, D] (whole blocks, in table order),
    a view of ``workspace`` [>= table.numel(), bs, Hkv, D]: valid until the next gather into it."""
    blocks = torch.index_select(cache, 0, table.reshape(-1), out=workspace[: table.numel()])
    return blocks.view(*table.shape[:-1], table.shape[-1] * cache.shape[1], *cache.shape[2:])


def _prefill(q, cache, ws, p: _Prefill, scale, window) -> torch.Tensor:
    # q: [Q, H, D]; context K/V: [C, Hkv, D] with C >= Q; query i sits at position C - Q + i
    keys = _gather_blocks(cache["k"], p.table, ws["k"])[: p.seq_len]
    values = _gather_blocks(cache["v"], p.table, ws["v"])[: p.seq_len]
    q_pos = torch.arange(p.seq_len - p.q_len, p.seq_len, device=q.device).unsqueeze(1)   # [Q, 1]
    k_pos = torch.arange(p.seq_len, device=q.device).unsqueeze(0)                        # [1, C]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    o = _math_sdpa(_heads_first(q), _heads_first(keys), _heads_first(values), mask, scale)
    return o[0].transpose(0, 1)                                               # [Q, H, D]


def _decode_blocks(q, cache, ws, g: _DecodeGroup, scale, window) -> torch.Tensor:
    """q: [b, H, D] -> [b, H, D]; one query per sequence over its gathered blocks."""
    keys = _gather_blocks(cache["k"], g.table, ws["k"])                                       # [b, W, Hkv, D]
    values = _gather_blocks(cache["v"], g.table, ws["v"])
    b, W, Hkv, D = keys.shape
    k_pos = torch.arange(W, device=q.device).unsqueeze(0)                                      # [1, W]
    mask = k_pos < g.lens.unsqueeze(1)
    if window is not None:
        mask &= k_pos > (g.lens - 1 - window).unsqueeze(1)
    o = F.scaled_dot_product_attention(                       # query head h reads KV head h // (H / Hkv)
        q.view(b, Hkv, -1, D), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask.view(b, 1, 1, W), scale=scale)                                          # [b, Hkv, H/Hkv, D]
    return o.reshape(b, -1, D)
