"""Which rank is dead or stuck, where, and for how long: a shared-memory heartbeat per rank + its reader.

Each worker rank (``worker.py``) writes its record at every phase boundary, and ``tick``s inside long
phases (every decoder layer), so a slow step that keeps moving is never reported. The record is plain
shared memory written by the rank's main thread: a thread blocked anywhere (a gloo wait, a CUDA
synchronise, an NCCL call, a SIGSTOP) simply stops moving it, and the age grows. With --debug-sync the
rank synchronises its device as each phase ends (``sync``), so a rank stuck in a GPU collective shows
that collective's phase; without it, NCCL ops are asynchronous and the host blocks at the step's next
synchronisation (sampling, the stage hand-off), whose phase is the one named:

    record[rank] = [step, phase, seq (moves within the step), monotonic ns of the last move, pid, exit, stopped]

``phase`` is an index into PHASES, or REPLAY + b while the rank replays its decode graph of bucket b
(``replaying``; named ``graph replay (bucket b)``, a waiting phase: the replay holds the step's all-reduces).

``exit`` is written by the rank launcher (``launcher.py``, the ranks' parent) when it reaps the rank:
0 while running, code + 1 after a normal exit, -signal after a kill.

The driver's ``Watchdog.check`` (``ParallelExecutor``'s watchdog thread, every 0.2 s) reports:

* a rank whose process exited (or the launcher that is their parent), at once (when several did: a
  killed one, else one that was not waiting on a peer):
  ``rank 3 (tp 1, pp 1) exited (killed by SIGKILL) in step 12 at phase forward; ranks 0-2 are waiting in all_reduce``
* while the driver waits for a step: no rank moved for ``--rank-timeout`` seconds ->
  ``rank 6 (tp 0, pp 3) stalled in step 1234 at phase recv_from_prev_stage for 30.0s; ranks 0-5 are waiting in all_reduce``

The stalled rank is the one the others wait for: a stopped process (``/proc`` state T), else among
the ranks at the lowest step the one not in a waiting phase, else the earliest pipeline stage, else
the rank that moved least within the step. Each machine has its own file; a launcher on another
machine mirrors its ranks' records to the driver as ages (``export`` -> ``absorb``, ``mirror.py``),
since monotonic clocks compare only on one machine; ``stopped`` is set by that mirror.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.engine.parallel import shm

logger = logging.getLogger(__name__)

PHASES = ("starting", "recv_scheduler_output", "recv_from_prev_stage", "forward", "all_reduce", "all_gather",
          "send_to_next_stage", "sample", "kv_load", "kv_save")
WAITING = frozenset({"recv_scheduler_output", "recv_from_prev_stage", "all_reduce", "all_gather",
                     "send_to_next_stage"})
REPLAY = 1000                 # phase code REPLAY + b: "graph replay (bucket b)" (``Heartbeat.replaying``)
_FIELDS = 7                                       # step, phase, seq, t_ns, pid, exit, stopped


def phase_name(code: int) -> str:
    """A record's phase code -> its name: ``PHASES[code]``, or ``graph replay (bucket b)`` for REPLAY + b."""
    return f"graph replay (bucket {code - REPLAY})" if code >= REPLAY else PHASES[code]


def is_waiting(phase: str) -> bool:
    """A phase in which a rank waits on a peer: a graph replay holds the step's all-reduces, so it counts."""
    return phase in WAITING or phase.startswith("graph replay")


@dataclass(frozen=True)
class RankState:
    step: int
    phase: str
    seq: int
    age_s: float            # seconds since the rank last moved
    pid: int
    exit: int               # 0: running; code + 1; -signal
    stopped: bool           # mirrored from another machine (local ranks: read /proc instead)


class Heartbeat:
    """``create`` (driver) the shared records of ``world_size`` ranks -> an fd its descendants inherit
    (``shm.py``); a rank maps it with its index and writes, the launcher and the driver map it to read."""

    def __init__(self, fd: int, rank: int | None = None, log_phases: bool = False, coords: str = "", sync=None):
        self.fd, self.rank, self.log_phases, self.coords = fd, rank, log_phases, coords
        self.sync = sync                  # --debug-sync: synchronise the device as each phase ends (worker.py)
        self._mm = shm.map(fd)
        self._rec = np.frombuffer(self._mm, dtype=np.int64).reshape(-1, _FIELDS)
        self.step = 0
        self._held = False                # inside ``replaying``: phases and ticks of the replayed code are not written
        if rank is not None:
            self._rec[rank, 4] = os.getpid()
            self.enter("starting")

    @staticmethod
    def create(world_size: int) -> int:
        return shm.create(world_size * _FIELDS * 8, "pdserve-hb")

    @property
    def world_size(self) -> int:
        return self._rec.shape[0]

    def begin_step(self, step: int) -> None:
        self.step = step

    def enter(self, phase: str) -> None:
        if not self._held:
            self._enter(PHASES.index(phase))

    def _enter(self, code: int) -> None:
        r = self._rec[self.rank]
        if self.sync is not None and r[3]:          # the phase ending is recorded while its work drains
            self.sync()
            logger.info("rank %d (%s) step %d: device synchronised after %s", self.rank, self.coords, self.step,
                        phase_name(int(r[1])))
        if self.log_phases:
            logger.info("rank %d (%s) step %d: %s -> %s", self.rank, self.coords, self.step, phase_name(int(r[1])),
                        phase_name(code))
        r[2] = r[2] + 1 if r[0] == self.step else 0
        r[0], r[1], r[3] = self.step, code, time.monotonic_ns()

    @contextmanager
    def replaying(self, bucket: int, after: str = "forward"):
        """The phase ``graph replay (bucket b)`` around a replay (``parallel/graphs.py``), then ``after``.

        Inside, ``enter`` and ``tick`` write nothing: a CUDA replay repeats no host code, so the collectives'
        own phases (``tp.py``) and the layers' ticks are skipped on CPU (the stand-in) and at capture too, where
        a --debug-sync device synchronise would break the capture. Leaving, ``after`` is entered: under
        --debug-sync that synchronises the device and logs ``device synchronised after graph replay (bucket b)``."""
        self._enter(REPLAY + bucket)
        self._held = True
        try:
            yield
        finally:
            self._held = False
        self.enter(after)

    @contextmanager
    def capturing(self):
        """Nothing written and no device synchronise while a CUDA graph is captured (host code runs once)."""
        held, self._held = self._held, True
        try:
            yield
        finally:
            self._held = held

    def record_exit(self, rank: int, status: int) -> None:
        """The launcher reaped ``rank``: ``status`` as ``os.waitstatus_to_exitcode`` gives it."""
        self._rec[rank, 5] = status + 1 if status >= 0 else status

    def tick(self) -> None:
        """Progress inside a phase (a decoder layer finished)."""
        if self._held:
            return
        r = self._rec[self.rank]
        r[2] += 1
        r[3] = time.monotonic_ns()

    def states(self) -> list[RankState]:
        now = time.monotonic_ns()
        return [RankState(int(r[0]), phase_name(int(r[1])), int(r[2]), (now - int(r[3])) / 1e9 if r[3] else 0.0,
                          int(r[4]), int(r[5]), bool(r[6])) for r in self._rec.copy()]

    def export(self, ranks: list[int]) -> list[list[int]]:
        """Records of ``ranks`` with ages instead of clock values, for another machine's ``absorb``."""
        now = time.monotonic_ns()
        return [[rank, *map(int, r[:3]), now - int(r[3]) if r[3] else -1, int(r[4]), int(r[5]), int(_stopped(int(r[4])))]
                for rank, r in zip(ranks, self._rec[ranks].copy())]

    def absorb(self, records: list[list[int]]) -> None:
        now = time.monotonic_ns()
        for rank, step, phase, seq, age, pid, exit_, stopped in records:
            self._rec[rank] = [step, phase, seq, now - age if age >= 0 else 0, pid, exit_, stopped]

    def close(self) -> None:
        self._rec = None
        self._mm.close()


@dataclass(frozen=True)
class RankInfo:
    rank: int
    tp: int
    pp: int
    local: bool = True                 # on the driver's machine: in the heartbeat file

    def name(self) -> str:
        return f"rank {self.rank} (tp {self.tp}, pp {self.pp})"


class Watchdog:
    def __init__(self, heartbeat: Heartbeat, ranks: list[RankInfo], timeout: float, launcher=None):
        self.heartbeat, self.ranks, self.timeout = heartbeat, ranks, timeout
        self.launcher = launcher           # subprocess.Popen of the ranks' parent, if any
        self._mirrors: dict[int, tuple[list[int], float]] = {}   # node -> (its ranks, monotonic last mirror)

    def saw_mirror(self, node_rank: int, ranks: list[int]) -> None:
        """A heartbeat mirror from another machine arrived (``mirror.py``)."""
        self._mirrors[node_rank] = (ranks, time.monotonic())

    def check(self, busy_since: float | None) -> str | None:
        """A report if a rank exited, or if the driver has waited on a step (since monotonic ``busy_since``)
        while no rank moved for ``timeout`` seconds; else None."""
        states = self.heartbeat.states()
        exited = [i for i in self.ranks if states[i.rank].exit]
        if exited:
            info = min(exited, key=lambda i: _exit_rank(states[i.rank]))
            e = states[info.rank].exit
            return self._report(info, states, f"exited ({_exit_text(e - 1 if e > 0 else e)})", "")
        if self.launcher is not None and self.launcher.poll() is not None:
            others = _group_by_phase([(i.rank, states[i.rank].phase) for i in self.ranks])
            return f"the rank launcher (pid {self.launcher.pid}) exited ({_exit_text(self.launcher.poll())}); {others}"
        for node, (ranks, seen) in list(self._mirrors.items()):
            if time.monotonic() - seen > self.timeout:
                return (f"node {node} (ranks {_ranges(ranks)}) sent no heartbeat for {time.monotonic() - seen:.1f}s "
                        f"(its launcher, machine or network is gone)")
        if busy_since is None:
            return None
        quiet = min(min(s.age_s for s in states), time.monotonic() - busy_since)
        if quiet <= self.timeout:
            return None
        culprit = self._culprit(states)
        stopped = " (process stopped)" if self._is_stopped(culprit, states) else ""
        return self._report(culprit, states, "stalled", f" for {states[culprit.rank].age_s:.1f}s{stopped}")

    def _culprit(self, states: list[RankState]) -> RankInfo:
        stopped = [i for i in self.ranks if self._is_stopped(i, states)]
        if stopped:
            return stopped[0]
        low = min(states[i.rank].step for i in self.ranks)
        behind = [i for i in self.ranks if states[i.rank].step == low]
        busy = [i for i in behind if not is_waiting(states[i.rank].phase)]
        if busy:
            return busy[0]
        first_stage = min(i.pp for i in behind)
        stage = [i for i in behind if i.pp == first_stage]
        return min(stage, key=lambda i: states[i.rank].seq)

    @staticmethod
    def _is_stopped(info: RankInfo, states: list[RankState]) -> bool:
        return _stopped(states[info.rank].pid) if info.local else states[info.rank].stopped

    def _report(self, culprit: RankInfo, states: list[RankState], what: str, tail: str) -> str:
        s = states[culprit.rank]
        head = f"{culprit.name()} {what} in step {s.step} at phase {s.phase}{tail}"
        others = _group_by_phase([(i.rank, states[i.rank].phase) for i in self.ranks if i.rank != culprit.rank])
        return f"{head}; {others}" if others else head


def _group_by_phase(pairs: list[tuple[int, str]]) -> str:
    by_phase: dict[str, list[int]] = {}
    for rank, phase in pairs:
        by_phase.setdefault(phase, []).append(rank)
    parts = []
    for phase, ranks in by_phase.items():
        word = "ranks" if len(ranks) > 1 else "rank"
        verb = "are" if len(ranks) > 1 else "is"
        how = "waiting in" if is_waiting(phase) else "in"
        parts.append(f"{word} {_ranges(ranks)} {verb} {how} {phase}")
    return "; ".join(parts)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    ranks = sorted(ranks)
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _exit_rank(state: RankState) -> tuple[int, int]:
    """Which exit caused the others: a killed rank before one that failed, and a rank that failed
    while working before one that failed while waiting (its peer's death broke a collective)."""
    return (0 if state.exit < 0 else 1, 1 if is_waiting(state.phase) else 0)


def _exit_text(code: int) -> str:
    """``code``: -signal or an exit code (``Popen.returncode`` convention)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stopped(pid: int) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
