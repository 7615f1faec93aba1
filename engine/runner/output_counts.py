"""Per-row counts of the generated tokens, kept on the persistent input batch for presence / frequency penalties.

    InputBatch._sync   counts.note(row, ids)        the output tokens it appends to a penalised request's row
    InputBatch.remove  counts.clear(row)            the row is given back (finished, aborted, preempted)
    ModelRunner        counts.plan(rows, vocab)     a ``CountsPlan`` for the sampler: its host arrays travel in the
                                                    step's one packed copy (``sample_batch.SampleBatch``), then
                                                    ``plan.resolve(views)`` -> [M, V] float32 on the device
                       counts.gather(rows, vocab)   the same [M, V] with a copy of its own (tests)

The table is [rows, V] int32 on the step's device, made at the first ``gather`` (so a node whose requests never
use a penalty never allocates it, and a step without penalised rows never touches it). Noted ids wait on the host
and land in one ``index_put_`` (accumulate) when the next plan is resolved: a decode step adds one id per penalised row,
a row synced from scratch (a preempted request recomputed, a decode node's request holding the prefill node's
first token) adds all its output tokens at once. A row's counts are exactly the counts of the output ids its
request has, so they equal ``penalties.counts_from_ids`` of them (``tests/test_penalties.py`` checks both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass
class CountsPlan:
    """A step's counts in two halves: ``host`` (named int arrays, exact in the sampler's float64 packing) goes to the
    device in the step's one copy; ``resolve`` takes their device views -> [M, V] float32 counts of the rows."""
    host: dict[str, np.ndarray]
    resolve: Callable[[dict[str, torch.Tensor]], torch.Tensor]

    def on_device(self, device: torch.device) -> torch.Tensor:
        """Resolved with a copy of its own (no sampler to share one with)."""
        return self.resolve({k: torch.from_numpy(v).to(device) for k, v in self.host.items()})


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
        return self.plan(rows, vocab).on_device(self.device)

    def plan(self, rows: list[int], vocab: int) -> CountsPlan:
        """The counts of ``rows`` as a ``CountsPlan``; the ids noted so far are added to the table when it is
        resolved (not before: a plan that is never resolved, a failed step's, loses nothing)."""
        self._fit(max([*rows, *(r for r, _ in self._pending)]) + 1, vocab)
        taken = len(self._pending)
        new_rows, new_ids = self._noted(vocab)
        host = {"count_rows": np.asarray(rows, np.int64), "count_new_rows": new_rows, "count_new_ids": new_ids}

        def resolve(views: dict[str, torch.Tensor]) -> torch.Tensor:
            if len(new_ids):
                ids = views["count_new_ids"].long()
                self.table.index_put_((views["count_new_rows"].long(), ids),
                                      torch.ones(len(new_ids), dtype=torch.int32, device=self.device), accumulate=True)
            del self._pending[:taken]
            return self.table.index_select(0, views["count_rows"].long()).float()     # [M, V]
        return CountsPlan(host, resolve)

    def _fit(self, num_rows: int, vocab: int) -> None:
        if self.table is not None and self.table.shape[1] != vocab:
            raise ValueError(f"output counts hold {self.table.shape[1]} tokens per row, the logits {vocab}")
        have = 0 if self.table is None else self.table.shape[0]
        if num_rows > have:
            grown = torch.zeros(max(num_rows, 2 * have), vocab, dtype=torch.int32, device=self.device)
            if self.table is not None:
                grown[:have] = self.table
            self.table = grown

    def _noted(self, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, ids) of the ids noted and not yet in the table, those in [0, vocab)."""
        if not self._pending:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        rows = np.concatenate([np.full(len(ids), r, np.int64) for r, ids in self._pending])
        ids = np.concatenate([ids for _, ids in self._pending])
        keep = (ids >= 0) & (ids < vocab)
        return rows[keep], ids[keep]
