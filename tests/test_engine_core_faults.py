"""A node with ``--engine-core-process`` when one of its two processes dies (issue 14).

SIGKILL the engine core mid-request: the request gets 503, the node exits non-zero without waiting for
its drain timeout and names the killed process; SIGKILL the API process: the core follows
(PR_SET_PDEATHSIG, stdin lifeline). Either way no process of the node is left, checked by PID. No clock:
each wait is a deadline far beyond the path it checks (issue 15: "exits within 5 s" was a clock).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx

from conftest import NodeProcess
from polling import wait_until

BODY = {"prompt": "The quick brown fox", "max_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
DRAIN_TIMEOUT_S = 300                    # a node that waited for its drain could not exit within DEADLINE_S
DEADLINE_S = 60


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _gone(pid: int) -> bool:
    """Exited and reaped."""
    return not Path(f"/proc/{pid}").exists()


def _exited(pid: int) -> bool:
    """Exited: reaped, or a zombie waiting for init (the pid's new parent once its own parent died)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _core_of(node: NodeProcess) -> int:
    [core] = _children(node.proc.pid)
    assert "pdserve.engine.core.proc" in Path(f"/proc/{core}/cmdline").read_text()
    assert _children(core) == []                            # tp1: the core starts nothing of its own
    return core


def _running(url: str) -> bool:
    text = httpx.get(url + "/metrics", timeout=5).text
    return any(line.startswith("vllm:num_requests_running{") and float(line.rsplit(" ", 1)[1]) >= 1
               for line in text.splitlines())


def test_a_killed_engine_core_fails_requests_and_stops_the_node(tiny_llama):
    """Mutation caught: ``engine.on_fatal`` not stopping the server (engine/node.py) -> the node never exits."""
    node = NodeProcess(tiny_llama, "--engine-core-process", "--drain-timeout", str(DRAIN_TIMEOUT_S))
    try:
        core = _core_of(node)
        answer = {}
        asker = threading.Thread(target=lambda: answer.update(r=httpx.post(node.url + "/v1/completions", json=BODY,
                                                                           timeout=60)))
        asker.start()
        wait_until(lambda: _running(node.url), 30, "the request is running in the core")
        os.kill(core, signal.SIGKILL)
        asker.join(timeout=DEADLINE_S)
        assert answer["r"].status_code == 503, answer["r"].text
        assert "killed by SIGKILL" in answer["r"].json()["error"]["message"]
        assert node.proc.wait(timeout=DEADLINE_S) == 1
        assert _gone(core)
    finally:
        log = node.stop()
    assert f"the engine-core process (pid {core}) was killed by SIGKILL" in log, log[-3000:]


def test_a_killed_api_process_takes_its_engine_core_along(tiny_llama):
    node = NodeProcess(tiny_llama, "--engine-core-process")
    try:
        core = _core_of(node)
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=10)
        wait_until(lambda: _exited(core), DEADLINE_S, f"engine core {core} exited with its API process")
    finally:
        node.stop()
