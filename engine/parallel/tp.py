"""Tensor parallelism: wire one loaded model shard to its TP group's collectives.

The model code stays TP-free (gpt-fast style): ``load_model(..., tp_rank, tp_size)`` builds layers
with this rank's ``ShardSizes`` and reads only its share of every split tensor; ``attach`` then sets
the ``collective`` of the modules that need one (``pdserve.engine.models.layers``):

    column-parallel  q|k|v, gate|up           no communication (each rank owns whole heads / columns)
    row-parallel     o_proj, down             y = all_reduce(x_r W_r^T) + b        [T, D]
    MoE block        each expert's width      y = all_reduce(routed_r + shared_r)  [T, D]  (one per layer; moe.py)
    vocab-parallel   embed_tokens             e = all_reduce(rows of ids in r's vocab range, 0 elsewhere)
    vocab-parallel   lm_head                  logits = all_gather(h W_r^T)[:, :V] along the vocab  [N, V]

A vocabulary that does not divide by tp is padded to ``padded_vocab(V, tp)`` rows (zeros past V); the LM head
cuts the gathered logits back to V columns (``pdserve.engine.models.vocab``).

Each collective records its phase in the rank's heartbeat (``all_reduce`` / ``all_gather``, then back
to ``forward``) so the watchdog can say who is waiting in which collective; with ``--debug-sync`` it
synchronises the device after every collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pdserve.engine.models.layers import Embedding, Linear
from pdserve.engine.models.moe import MoE


class TPGroup:
    """One pipeline stage's tensor-parallel ranks and the heartbeat that sees their collectives."""

    def __init__(self, group, size: int, heartbeat, debug_sync: bool = False):
        self.group, self.size, self.heartbeat, self.debug_sync = group, size, heartbeat, debug_sync

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] partial sums -> [T, D] on every rank
        self.heartbeat.enter("all_reduce")
        dist.all_reduce(x, group=self.group)
        self._after()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, V / tp] -> [N, V], rank order along the last dim
        self.heartbeat.enter("all_gather")
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        self._after()
        return torch.cat(parts, dim=-1)

    def _after(self) -> None:
        if self.debug_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.heartbeat.enter("forward")


def attach(model, tp: TPGroup) -> None:
    """Set the collectives of a shard built with ``ShardSizes.for_tp`` (no-op wiring for ``tp.size == 1``)."""
    if tp.size == 1:
        return
    for module in model.modules():
        if isinstance(module, Linear) and module.split == "row":
            module.collective = tp.all_reduce
        elif isinstance(module, Embedding):
            module.collective = tp.all_reduce
    for module in model.modules():              # after the Linears: the block takes its shared expert's reduce
        if isinstance(module, MoE):
            module.attach_collective(tp.all_reduce)
    if getattr(model, "lm_head", None) is not None:
        model.lm_head.collective = tp.all_gather
