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
to ``forward``) so the watchdog can say who is waiting in which collective; with ``--debug-sync`` the
heartbeat synchronises the device as each phase ends. Backends (``devices.py``): gloo on CPU; nccl with one
GPU per rank (collectives device to device); gloo when ranks share a GPU (``via_host``): each collective copies
its CUDA tensor to the host, runs gloo there and copies back (gloo's own CUDA support is partial: all-reduce yes,
all_gather and send/recv no; one rule for all is simpler and costs what gloo's CUDA all-reduce copies anyway).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pdserve.engine.models.layers import Embedding, Linear
from pdserve.engine.models.moe import MoE


class TPGroup:
    """One pipeline stage's tensor-parallel ranks and the heartbeat that sees their collectives."""

    def __init__(self, group, size: int, heartbeat, via_host: bool = False):
        self.group, self.size, self.heartbeat = group, size, heartbeat
        self.via_host = via_host          # gloo over CUDA tensors (ranks share a GPU): collectives through the host

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] partial sums -> [T, D] on every rank
        self.heartbeat.enter("all_reduce")
        if self.via_host:
            host = x.cpu()
            dist.all_reduce(host, group=self.group)
            x.copy_(host)
        else:
            dist.all_reduce(x, group=self.group)
        self._after()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, V / tp] -> [N, V], rank order along the last dim
        self.heartbeat.enter("all_gather")
        device, x = x.device, (x.cpu() if self.via_host else x.contiguous())
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        self._after()
        return torch.cat(parts, dim=-1).to(device)

    def _after(self) -> None:
        self.heartbeat.enter("forward")          # --debug-sync: the heartbeat synchronises the device first


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
