"""The watchdog's verdicts on hand-written heartbeat records: culprit, coordinates, phase, the others.

Processes here are real (``sleep``), the heartbeat file is real; only the records are written by
the test instead of worker ranks. The end-to-end SIGKILL / SIGSTOP tests are in test_parallel_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from pdserve.engine.parallel.watchdog import PHASES, Heartbeat, RankInfo, Watchdog, _ranges


@pytest.fixture()
def sleepers():
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(4)]
    yield procs
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


@pytest.fixture()
def board(sleepers):
    """tp 2 x pp 2: ranks 0, 1 in stage 0, ranks 2, 3 in stage 1."""
    fd = Heartbeat.create(4)
    hb = Heartbeat(fd)
    os.close(fd)                                 # the mapping keeps the records
    ranks = [RankInfo(r, r % 2, r // 2) for r in range(4)]
    yield hb, ranks
    hb.close()


def _set(hb: Heartbeat, rank: int, step: int, phase: str, seq: int, age_s: float, pid: int) -> None:
    hb._rec[rank] = [step, PHASES.index(phase), seq, time.monotonic_ns() - int(age_s * 1e9), pid, 0, 0]


def test_exited_rank_is_named_with_its_phase_and_the_others(board, sleepers):
    hb, ranks = board
    for r in range(4):
        _set(hb, r, 7, "all_reduce" if r < 2 else "recv_from_prev_stage", 3, 0.1, sleepers[r].pid)
    _set(hb, 1, 7, "forward", 2, 0.1, sleepers[1].pid)
    sleepers[1].kill()
    hb.record_exit(1, os.waitstatus_to_exitcode(os.waitpid(sleepers[1].pid, 0)[1]))   # what the launcher does
    report = Watchdog(hb, ranks, timeout=30).check(busy_since=None)
    assert report == ("rank 1 (tp 1, pp 0) exited (killed by SIGKILL) in step 7 at phase forward; "
                      "rank 0 is waiting in all_reduce; ranks 2-3 are waiting in recv_from_prev_stage")


def test_stall_reported_only_when_nothing_moved_for_the_timeout(board, sleepers):
    hb, ranks = board
    dog = Watchdog(hb, ranks, timeout=5)
    for r in range(4):
        _set(hb, r, 12, "recv_from_prev_stage" if r >= 2 else "recv_scheduler_output", 1, 9.0, sleepers[r].pid)
    _set(hb, 0, 11, "forward", 4, 9.0, sleepers[0].pid)          # behind, busy: the one everybody waits for
    assert dog.check(busy_since=None) is None                     # the driver is not waiting: idle, not stuck
    assert dog.check(busy_since=time.monotonic()) is None         # just sent a step
    report = dog.check(busy_since=time.monotonic() - 9)
    assert report.startswith("rank 0 (tp 0, pp 0) stalled in step 11 at phase forward for 9.0s; ")
    assert report.endswith("rank 1 is waiting in recv_scheduler_output; ranks 2-3 are waiting in recv_from_prev_stage")
    _set(hb, 3, 12, "all_reduce", 2, 0.5, sleepers[3].pid)       # one rank moved recently: progress
    assert dog.check(busy_since=time.monotonic() - 9) is None


def test_stopped_process_is_the_culprit_even_inside_a_collective(board, sleepers):
    hb, ranks = board
    for r in range(4):
        _set(hb, r, 3, "all_reduce", 5, 8.0, sleepers[r].pid)
    os.kill(sleepers[3].pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    report = None
    while report is None or "process stopped" not in report:     # /proc shows T once the signal landed
        assert time.monotonic() < deadline, report
        report = Watchdog(hb, ranks, timeout=5).check(busy_since=time.monotonic() - 8)
    assert report == ("rank 3 (tp 1, pp 1) stalled in step 3 at phase all_reduce for 8.0s (process stopped); "
                      "ranks 0-2 are waiting in all_reduce")


def test_all_waiting_blames_the_earliest_stage_then_the_least_progress(board, sleepers):
    hb, ranks = board
    _set(hb, 0, 4, "all_reduce", 6, 7.0, sleepers[0].pid)
    _set(hb, 1, 4, "all_reduce", 5, 7.0, sleepers[1].pid)        # entered fewer phases: the late one
    _set(hb, 2, 4, "recv_from_prev_stage", 1, 7.0, sleepers[2].pid)
    _set(hb, 3, 4, "recv_from_prev_stage", 1, 7.0, sleepers[3].pid)
    report = Watchdog(hb, ranks, timeout=5).check(busy_since=time.monotonic() - 7)
    assert report.startswith("rank 1 (tp 1, pp 0) stalled in step 4 at phase all_reduce")


def test_launcher_exit_is_reported(board, sleepers):
    hb, ranks = board
    for r in range(4):
        _set(hb, r, 2, "forward", 1, 0.1, sleepers[r].pid)
    launcher = subprocess.Popen(["sleep", "600"])
    dog = Watchdog(hb, ranks, timeout=30, launcher=launcher)
    assert dog.check(busy_since=None) is None
    launcher.kill()
    launcher.wait()
    assert dog.check(busy_since=None) == (f"the rank launcher (pid {launcher.pid}) exited (killed by SIGKILL); "
                                          "ranks 0-3 are in forward")


def test_rank_ranges():
    assert _ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert _ranges([3]) == "3"
