"""Per-step attention metadata: built once per step by the input batch, read by every attention layer.

Token rows of one step are flattened and ragged: ``T`` = sum of every scheduled sequence's new tokens.

    flat rows:       | seq 0: 5 new tokens | seq 1: 1 | seq 2: 1 |
    query_start_loc: [0,                    5,        6,        7]
    seq_lens:        [12,                   40,       3]          (context incl. the new tokens)

Query row ``i`` of sequence ``b`` (``q_len = qsl[b+1] - qsl[b]``) sits at position
``seq_lens[b] - q_len + i`` and sees keys ``0..`` that position (minus a sliding window).
A sequence with ``q_len == 1`` is a decode row; anything longer a prefill or extend chunk.
Its K/V lives in the paged cache at ``block_table[b, p // block_size] * block_size + p % block_size``.

Everything a kernel reads is a device tensor; the host ints (``max_query_len``, ``max_seq_len``)
size grids without a device sync. ``num_splits`` (Triton only) is set by the runner on decode steps, from
the batch's CUDA-graph bucket, so a replayed and an eager decode step sum in the same order
(``engine/runner/decode_splits.py``); None lets the kernel plan it from the step's lengths. The ``*_cpu``
mirrors hold the same values on the host for the plain-torch backend (its Python loops read them; on CUDA that
costs no sync either).
``layer_hooks`` (eager steps only, never a captured graph): the model calls ``before(i)`` ahead of its i-th
layer and ``after(i)`` once that layer has run (its K/V for the step is in the cache); the KV connector's
layerwise load and publish ride on them.
CUDA-graph padding rows: ``q_len`` 1, ``seq_len`` 1, ``slot_mapping`` -1 (nothing written).

``for_rows(rows)`` re-cuts a step's metadata to some of its flat rows, each a query of its own that sees
its sequence's keys up to its own position (the model's last layer, whose attention only the sampled rows
need, once every row's K/V is in the cache):

    step:        | seq 0: rows 0..4 (positions 7..11) | seq 1: row 5 (position 39) |
    for_rows([4, 5]):  query_start_loc [0, 1, 2], seq_lens [12, 40], block_table rows of seq 0, seq 1
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] int32/int64, device: cache slot of each new row; -1 = padding
    query_start_loc: torch.Tensor       # [B + 1] int32, device
    seq_lens: torch.Tensor              # [B] int32, device
    block_table: torch.Tensor           # [B, max_blocks] int32, device, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_cpu: torch.Tensor   # [B + 1] int32, host mirror
    seq_lens_cpu: torch.Tensor          # [B] int32, host mirror
    backend: str = "torch"              # which kernels attend (``dispatch.py``)
    num_splits: int | None = None       # Triton split-K count fixed by the runner (decode steps), else planned
    derived: dict = field(default_factory=dict, repr=False)   # a backend's per-step memo (built at layer 0)
    layer_hooks: object = None          # ``engine.kv.layer_hooks.LayerHooks`` of the step, or None (see there)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_cpu.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def for_rows(self, rows: torch.Tensor) -> "AttentionMetadata":
        """One query row per flat row in ``rows`` ([S] int64, host, ascending), attending to its sequence's
        keys up to and including its own position; host-side metadata (the CPU backends)."""
        qsl = self.query_start_loc_cpu.long()
        seqs = torch.searchsorted(qsl[1:], rows, right=True)                       # [S] sequence of each row
        lens = (self.seq_lens_cpu.long()[seqs] - (qsl[seqs + 1] - 1 - rows)).to(torch.int32)   # position + 1
        starts = torch.arange(rows.numel() + 1, dtype=torch.int32)
        return AttentionMetadata(self.slot_mapping[rows], starts, lens, self.block_table[seqs], 1,
                                 int(lens.max()) if rows.numel() else 1, self.block_size, starts, lens,
                                 self.backend)

    @staticmethod
    def build(q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: str | torch.device = "cpu", backend: str = "torch") -> "AttentionMetadata":
        """From plain lists (tests, tools): slot_mapping follows from the tables and lengths."""
        qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
        width = max((len(t) for t in block_tables), default=0) or 1
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        slots = []
        for b, (t, n, s) in enumerate(zip(block_tables, q_lens, seq_lens)):
            table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
            pos = torch.arange(s - n, s)
            slots.append(table[b, pos // block_size].long() * block_size + pos % block_size)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        return AttentionMetadata(torch.cat(slots).to(device), qsl.to(device), lens.to(device), table.to(device),
                                 max(q_lens), max(seq_lens), block_size, qsl, lens, backend)
