"""What one node's prefix cache holds, as its KV events tell the proxy (``engine.kv.kv_events``).

Owned by ``nodes.Node`` (``node.kv``); fed by ``kv_events.EventSubscriber`` with verified batches, read by the
``kv_aware`` policy and the P/D decision (``kv_routing``). Runs on the proxy's event loop only: no locks.

Epochs and sequence numbers (each node process draws a random epoch and numbers its batches 1, 2, ...):
    a batch of a new epoch started later than the one known   -> forget everything (the node restarted), apply
    a batch of an older or the same-start other epoch         -> dropped ("stale": a replay of a dead process),
                                                                 unless the current epoch is silent (``SILENT_S``):
                                                                 a restart across a clock stepped back
    a batch of an epoch the node had before                   -> dropped ("stale")
    seq <= the last seen                                      -> dropped ("stale": a replay)
    seq  > the last seen + 1                                  -> events were lost: forget everything, apply
    ``cleared``                                               -> forget everything, then apply its events
    a replay (``restore``: the node's whole set at seq S)      -> replaces what is known; batches of its epoch up
                                                                 to S are dropped ("replayed": already in it)
A gap, or a new epoch first heard after its batch 1, sets ``needs_replay``: the subscriber asks the node for its set.
Forgetting is always safe: it costs cache hits in routing, never a wrong answer (the node checks its own cache).
A node silent for ``SILENT_S`` (no batch, not even its heartbeat every ``HEARTBEAT_S``: its publisher died, the
socket broke, the process is stopped) is credited with nothing until it speaks again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.kv.kv_events import HEARTBEAT_S

SILENT_S = 10 * HEARTBEAT_S   # no batch for this long: what the node announced is not assumed
MAX_RETIRED = 64              # past epochs remembered per node (refused if they come back)
MAX_BLOCKS = 1 << 20          # per node; more than any node's KV cache announces (a flood is forgotten, not kept)


@dataclass
class NodeKVState:
    epoch: str = ""
    started: float = 0.0
    seq: int = 0
    blocks: set[int] = field(default_factory=set)     # public hashes of the blocks the node has cached
    resets: int = 0                                   # times the state was forgotten (restart, gap, clear)
    heard: float = 0.0                                # monotonic time of its last verified batch
    retired: frozenset = frozenset()                  # epochs this node had before (never taken back)
    needs_replay: bool = False                        # events were missed: ask the node for its whole set
    replayed_seq: int = 0                             # the seq the last replay of this epoch stood at

    def apply(self, batch) -> str:
        """Apply one verified ``EventBatch``; returns "accepted", "stale" or "reset" (accepted after forgetting)."""
        outcome = "accepted"
        if batch.epoch != self.epoch:
            if batch.epoch in self.retired or self.epoch and batch.started <= self.started and not self._silent():
                return "stale"
            first = not self.epoch
            self._enter(batch.epoch, batch.started)
            if not first:
                outcome = self._forget()
            self.needs_replay = batch.seq > 1
        elif batch.seq <= self.seq:
            return "replayed" if batch.seq <= self.replayed_seq else "stale"
        elif batch.seq > self.seq + 1:
            outcome = self._forget()
            self.needs_replay = True
        self.seq = batch.seq
        if batch.cleared and self.blocks:
            outcome = self._forget()
        self.heard = time.monotonic()
        self.blocks.difference_update(batch.removed)
        self.blocks.update(batch.stored)
        if len(self.blocks) > MAX_BLOCKS:
            outcome = self._forget()
        return outcome

    def restore(self, state) -> str:
        """Apply a verified ``kv_replay.ReplayState``: the node's whole set as of its batch ``state.seq``;
        "replayed", or "stale" for an epoch this node had before or one older than the current."""
        if state.epoch != self.epoch:
            if state.epoch in self.retired or self.epoch and state.started < self.started:
                return "stale"
            self._enter(state.epoch, state.started)
        self.seq = self.replayed_seq = state.seq
        self.blocks = set(state.blocks)
        self.heard = time.monotonic()
        self.needs_replay = False
        return "replayed"

    def _enter(self, epoch: str, started: float) -> None:
        if self.epoch:
            self.retired = (self.retired | {self.epoch}) if len(self.retired) < MAX_RETIRED else {self.epoch}
        self.epoch, self.started, self.seq, self.replayed_seq = epoch, started, 0, 0

    def forget(self) -> None:
        """The node is gone (or its events are): nothing it announced is assumed any more. Its epoch is kept:
        an older process's batches stay refused."""
        self._forget()

    def leading_blocks(self, public_hashes: list[int]) -> int:
        """How many of a prompt's blocks, from the first on, the node holds (the chain breaks at the first miss);
        0 while the node is silent."""
        if self._silent():
            return 0
        count = 0
        for h in public_hashes:
            if h not in self.blocks:
                break
            count += 1
        return count

    def _silent(self) -> bool:
        return time.monotonic() - self.heard > SILENT_S

    def _forget(self) -> str:
        if self.blocks:
            self.blocks = set()
        self.resets += 1
        return "reset"
