"""A tp2 x pp2 node stopped from outside: the cheapest cases of devbench/parallel_lifecycle.py's matrix.

The whole matrix (start-up / idle / load x SIGINT / SIGTERM / SIGKILL, a rank SIGKILLed or
SIGSTOPped, a 70 s pipeline stage) is ``python devbench/parallel_lifecycle.py --model DIR``. Every
case here must leave no process, no listening port and no /dev/shm file behind:

- SIGTERM under load (a service manager's stop): the stream in flight completes; exit 0      (issues 5, 11)
- SIGINT to the node's process group under load (Ctrl-C): the same, and no rank sees it     (issue 5)
- SIGKILL while the ranks load (PDSERVE_FAULTS=slow_start): the launcher and ranks follow   (issue 4)
- a tp1 node drains on SIGTERM too                                                          (issue 11)
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

import lifecycle_probe
import parallel_lifecycle
from parallel_lifecycle import run_case
from polling import wait_until

MAX_TOKENS = 120


@pytest.fixture
def at_signal(monkeypatch) -> dict:
    """What the client's stream had when the node was signalled: {"tokens": n, "finished": bool}."""
    seen: dict = {}
    real = parallel_lifecycle._signal_node

    def signal_node(node, sig, stream):
        if stream is not None:
            seen.update(tokens=stream.tokens, finished=stream.finished.is_set())
        return real(node, sig, stream)

    monkeypatch.setattr(parallel_lifecycle, "_signal_node", signal_node)
    return seen


def _assert_in_flight(at_signal: dict) -> None:
    """Else the drain had nothing to drain and the test proved nothing."""
    assert not at_signal["finished"] and 0 < at_signal["tokens"] < MAX_TOKENS, at_signal


@pytest.mark.parametrize("case", ["node-SIGTERM-load", "node-SIGINT-load"])
def test_a_signal_under_load_drains_then_exits_0(tiny_llama, case, at_signal):
    out = run_case(str(tiny_llama), case, max_tokens=MAX_TOKENS)
    _assert_in_flight(at_signal)
    assert out.client == f"complete: {MAX_TOKENS} tokens, finish length", out
    assert out.exit_status == "0" and out.errors == [], out
    assert out.clean, out


# clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ...): Python's time.sleep (C++ sleeps use CLOCK_REALTIME, 0)
_CLOCK_NANOSLEEP = {"x86_64": "230", "aarch64": "115"}


def _in_time_sleep(pid: int) -> bool:
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return call[:3] == [_CLOCK_NANOSLEEP.get(platform.machine(), "?"), "0x1", "0x1"]


def _ranks_asleep_in_their_load(node, moment, max_tokens) -> None:
    """In place of the bench's ``_reach`` for "start-up" (which waits only for the ranks' fork)."""
    def asleep() -> bool:
        if node.launcher is None:              # the probe names it at first sight, which may precede its exec
            node.launcher = next((pid for pid in list(node.tracked)
                                  if b"parallel.launcher" in lifecycle_probe._cmdline(pid)), None)
        ranks = node.ranks()
        return len(ranks) == node.world_size and all(map(_in_time_sleep, ranks))

    try:
        wait_until(asleep, 120, "every rank asleep in its model load")
    except TimeoutError:
        states = {pid: Path(f"/proc/{pid}/syscall").read_text().strip() for pid in node.ranks()}
        raise AssertionError(f"ranks not all in time.sleep: {states}\n{node.output()[-3000:]}") from None


def test_sigkill_during_start_up_leaves_nothing_behind(tiny_llama, monkeypatch):
    """SIGKILL once every rank sleeps in its model load (slow_start=60; before, the signal came as soon as the
    ranks were forked, and ranks that could not reach the dead node's store quit on their own): only the
    lifeline can end them and their launcher within the 30 s that ``clean`` waits. How fast is
    devbench/parallel_lifecycle.py's business (no clock here: ``report_s < 10`` was one). Mutation caught: the
    launcher not watching the lifeline (``if lifeline_fd >= 0:`` -> ``if False:`` in
    engine/parallel/launcher.py) -> the ranks and their launcher outlive the node: not clean."""
    if platform.machine() not in _CLOCK_NANOSLEEP:
        pytest.skip(f"no clock_nanosleep syscall number for {platform.machine()}")
    monkeypatch.setattr(parallel_lifecycle, "_reach", _ranks_asleep_in_their_load)
    out = run_case(str(tiny_llama), "node-SIGKILL-start-up")
    assert out.exit_status == "-9 (SIGKILL)"
    assert out.clean, out


def test_a_single_rank_node_drains_on_sigterm(tiny_llama, at_signal):
    out = run_case(str(tiny_llama), "node-SIGTERM-load", layout=("-tp", "1"), max_tokens=MAX_TOKENS)
    _assert_in_flight(at_signal)
    assert out.client == f"complete: {MAX_TOKENS} tokens, finish length", out
    assert out.exit_status == "0" and out.errors == [] and out.clean, out
