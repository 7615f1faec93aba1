"""Heartbeats across machines, and the remote launcher's duty to stop its ranks when the node fails.

    launcher on node N (N > 0)                     driver (node 0)
    --------------------------                     ---------------
    every 0.1 s: HeartbeatMirror(N, export())  ─>  MirrorReceiver: heartbeat.absorb(records),
                                                   watchdog.saw_mirror(N, ranks)
    every 0.5 s: store has FAILED_KEY, or the      ParallelExecutor._fail: store.set(FAILED_KEY, report)
    store is gone -> SIGKILL this node's ranks
    (``launcher.Children.kill_all``: only ranks not reaped yet)

Records travel as ages (monotonic clocks do not compare across machines) and carry whether the
rank's process is stopped (the driver cannot read another machine's /proc).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from pdserve.engine.parallel import messages as m
from pdserve.engine.parallel.broadcast import MessageQueue

logger = logging.getLogger(__name__)
FAILED_KEY = "pdserve/failed"


class MirrorSender(threading.Thread):
    """Runs in a launcher on another machine, after it forked its ranks."""

    def __init__(self, heartbeat, node_rank: int, ranks: list[int], handle, store, kill_ranks: Callable[[], None]):
        super().__init__(name="pdserve-mirror", daemon=True)
        self.heartbeat, self.node_rank, self.ranks, self.store = heartbeat, node_rank, ranks, store
        self.kill_ranks = kill_ranks
        self.queue = MessageQueue.writer(handle)
        self.stop = threading.Event()

    def run(self) -> None:
        checked = 0.0
        while not self.stop.wait(0.1):
            self.send()
            if time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                self._check_node()

    def send(self) -> None:
        self.queue.enqueue(m.encode(m.HeartbeatMirror(self.node_rank, self.heartbeat.export(self.ranks))))

    def _check_node(self) -> None:
        try:
            failed = self.store.check([FAILED_KEY])
        except Exception as exc:                           # the driver (which hosts the store) is gone
            failed = True
            logger.error("node %d: the driver's rendezvous store is unreachable (%s)", self.node_rank, exc)
        if failed:
            logger.error("node %d: the node failed; killing ranks %s", self.node_rank, self.ranks)
            self.kill_ranks()
            self.stop.set()


class MirrorReceiver(threading.Thread):
    """Runs in the driver: copies other machines' records into its heartbeat file."""

    def __init__(self, handle, heartbeat, watchdog):
        super().__init__(name="pdserve-mirror-rx", daemon=True)
        self.queue = MessageQueue.reader(handle, -1)       # binds now, before any launcher connects
        self.heartbeat, self.watchdog = heartbeat, watchdog
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            data = self.queue.dequeue(timeout=0.2)
            if data is None:
                continue
            mirror = m.decode_mirror(data)
            self.heartbeat.absorb(mirror.records)
            self.watchdog.saw_mirror(mirror.node_rank, [r[0] for r in mirror.records])
