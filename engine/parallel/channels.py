"""The driver's queues to and from the ranks, created once by ``ParallelExecutor``.

    broadcast   driver -> every rank       ring for the driver's machine + zmq XPUB for the others
    results     last stage tp 0 -> driver  ring when that rank is on the driver's machine, else zmq PULL
    kv_parts    rank r -> driver           one per rank, the same rule
    mirror      other launchers -> driver  heartbeat mirrors (zmq PULL; only with --nnodes > 1)

Handles go to the ranks inside the ``WorkerSpec``; the rings themselves are anonymous shared files
(``shm.py``) whose fds (``fds``) the executor passes to the launcher, then ``release``s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pdserve.engine.parallel.broadcast import MessageQueue, QueueHandle, release


@dataclass
class Channels:
    broadcast: QueueHandle
    results: QueueHandle
    kv_parts: list[QueueHandle]
    mirror: QueueHandle | None
    _released: bool = field(default=False, repr=False)

    @classmethod
    def create(cls, world_size: int, local: list[int], results_rank: int, host: str) -> Channels:
        def inbound(rank: int) -> QueueHandle:
            return MessageQueue.create(1) if rank in local else MessageQueue.create_inbound(host)

        return cls(broadcast=MessageQueue.create(len(local), world_size - len(local), bind_host=host),
                   results=inbound(results_rank), kv_parts=[inbound(r) for r in range(world_size)],
                   mirror=MessageQueue.create_inbound(host) if len(local) < world_size else None)

    def spec_fields(self) -> dict:
        return {"broadcast": msgspec.to_builtins(self.broadcast), "results": msgspec.to_builtins(self.results),
                "kv_parts": [msgspec.to_builtins(h) for h in self.kv_parts],
                "heartbeat_mirror": msgspec.to_builtins(self.mirror) if self.mirror else {}}

    @staticmethod
    def read(handle: QueueHandle) -> MessageQueue:
        """The driver's end of an inbound channel (ring reader 0, or the bound PULL socket)."""
        return MessageQueue.reader(handle, -1 if handle.inbound else 0)

    def fds(self) -> list[int]:
        """The rings' fds, for the launcher's ``pass_fds`` (its forked ranks inherit them)."""
        return [h.fd for h in (self.broadcast, self.results, *self.kv_parts) if h.fd >= 0]

    def release(self) -> None:
        """Close the creator's fds (once; the mappings made before stay valid)."""
        if not self._released:
            self._released = True
            for handle in (self.broadcast, self.results, *self.kv_parts):
                release(handle)
