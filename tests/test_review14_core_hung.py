"""Review 14: a stopped (hung) engine-core process is never noticed; /health keeps answering 200.

With ``--engine-core-process`` the client notices only a core that *exits* (``waitpid``). A core that
stops making progress (SIGSTOP here; a deadlock, a wedged device sync or swap thrash in production)
leaves the API process answering ``/health`` 200 and ``/metrics`` frozen at its last report (0 waiting
while requests pile up), so a proxy keeps routing to a node whose requests never return. In-process, a
SIGSTOPped node stops answering /health altogether and is taken out; a stalled tp x pp rank is reported
after ``--rank-timeout``. The core already sends a ``CoreOutputs`` every step and at least every
IDLE_POLL_S (0.5 s) when idle, so silence is cheap to detect.

Suggested fix: the receiver thread records when the last message came; silence longer than
``--rank-timeout`` (or a dedicated --core-timeout) is a failure like an exit: ``_fail("the engine-core
process (pid N) sent nothing for T s")``: streams get 503, /health 503, the node exits 1 (and kills the
core on its way out).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
from conftest import NodeProcess
from polling import wait_until

RANK_TIMEOUT_S = 5
DEADLINE_S = 60                 # far beyond --rank-timeout


def _core_of(node: NodeProcess) -> int:
    [core] = [int(c) for task in Path(f"/proc/{node.proc.pid}/task").iterdir()
              for c in (task / "children").read_text().split()]
    assert "pdserve.engine.core.proc" in Path(f"/proc/{core}/cmdline").read_text()
    return core


def _unhealthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code != 200
    except httpx.HTTPError:
        return True


def test_a_stopped_engine_core_makes_the_node_unhealthy(tiny_llama):
    node = NodeProcess(tiny_llama, "--engine-core-process", "--rank-timeout", str(RANK_TIMEOUT_S))
    core = _core_of(node)
    answer = {}
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0}
    asker = threading.Thread(target=lambda: answer.update(
        r=httpx.post(node.url + "/v1/completions", json=body, timeout=DEADLINE_S + 30)), daemon=True)
    try:
        os.kill(core, signal.SIGSTOP)
        asker.start()                                   # a request the stopped core never answers
        wait_until(lambda: _unhealthy(node.url), DEADLINE_S, "the node reports its stopped engine core")
        asker.join(timeout=DEADLINE_S)
        assert answer["r"].status_code == 503, answer["r"].text
    finally:
        try:
            os.kill(core, signal.SIGCONT)
        except ProcessLookupError:
            pass
        node.stop()
