"""Per-row counts of the generated tokens, kept on the persistent input batch for presence / frequency penalties.

    InputBatch._sync   counts.note(row, ids)        the output tokens it appends to a penalised request's row
    InputBatch.remove  counts.clear(row)            the row is given back (finished, aborted, preempted)
    ModelRunner        counts.gather(rows, vocab)   [M, V] float32 for the sampler (``penalties.apply_penalties``)

The table is [rows, V] int32 on the step's device, made at the first ``gather`` (so a node whose requests never
use a penalty never allocates it, and a step without penalised rows never touches it). Noted ids wait on the host
and land in one ``index_put_`` (accumulate) at the next ``gather``: a decode step adds one id per penalised row,
a row synced from scratch (a preempted request recomputed, a decode node's request holding the prefill node's
first token) adds all its output tokens at once. A row's counts are exactly the counts of the output ids its
request has, so they equal ``penalties.counts_from_ids`` of them (``tests/test_penalties.py`` checks both).
"""

from __future__ import annotations

import numpy as np
import torch


class OutputCounts:
    def __init__(self, device: torch.device):
        self.device = device
        self.table: torch.Tensor | None = None           # [rows, V] int32
        self._pending: list[tuple[int, np.ndarray]] = []
        self._dirty: set[int] = set()                    # rows with counts (or pending ids) to clear

    def note(self, row: int, ids: np.ndarray) -> None:
        """``ids`` (output tokens newly appended to ``row``) count from the next ``gather`` on."""
        if len(ids):
            self._pending.append((row, np.array(ids, np.int64)))
            self._dirty.add(row)

    def clear(self, row: int) -> None:
        """Forget ``row``'s counts: it is given back and may be taken by another request."""
        if row not in self._dirty:
            return
        self._dirty.discard(row)
        self._pending = [(r, ids) for r, ids in self._pending if r != row]
        if self.table is not None and row < self.table.shape[0]:
            with torch.inference_mode():          # made in a step (inference mode); cleared from release() too
                self.table[row].zero_()

    def gather(self, rows: list[int], vocab: int) -> torch.Tensor:
        """[len(rows), vocab] float32 counts of those rows' output tokens."""
        self._fit(max([*rows, *(r for r, _ in self._pending)]) + 1, vocab)
        self._flush(vocab)
        index = torch.tensor(rows, dtype=torch.long).to(self.device)
        return self.table.index_select(0, index).float()

    def _fit(self, num_rows: int, vocab: int) -> None:
        if self.table is not None and self.table.shape[1] != vocab:
            raise ValueError(f"output counts hold {self.table.shape[1]} tokens per row, the logits {vocab}")
        have = 0 if self.table is None else self.table.shape[0]
        if num_rows > have:
            grown = torch.zeros(max(num_rows, 2 * have), vocab, dtype=torch.int32, device=self.device)
            if self.table is not None:
                grown[:have] = self.table
            self.table = grown

    def _flush(self, vocab: int) -> None:
        if not self._pending:
            return
        rows = np.concatenate([np.full(len(ids), r, np.int64) for r, ids in self._pending])
        ids = np.concatenate([ids for _, ids in self._pending])
        self._pending = []
        keep = (ids >= 0) & (ids < vocab)
        rows, ids = torch.from_numpy(rows[keep]).to(self.device), torch.from_numpy(ids[keep]).to(self.device)
        self.table.index_put_((rows, ids), torch.ones(len(ids), dtype=torch.int32, device=self.device),
                              accumulate=True)
