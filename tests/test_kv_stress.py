"""Concurrency stress of the store path in CI (issue 9): many engines, one daemon, faults injected.

Three prefill and three decode engines share one ``pdserve kvstore`` daemon process (shared memory,
TCP, and one ``DaemonClient`` shared by a prefill and a decode engine); prompts with shared prefixes
and fresh ones; publishes and loads overlap; requests are aborted on both sides; the daemon is
SIGSTOPped past the clients' timeout twice. Every answer must equal the colocated reference and no
object may fail its seal. ``python devbench/kv_stress.py --model DIR --requests 1000`` is the long run.

Before the fixes of issue 9 this failed: the shared client's segment was overwritten by concurrent
gets and puts (objects sealed for another key, or -- without the seal -- wrong tokens), and a put
that timed out was later stored with the next request's bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kv_stress import StressConfig, run_stress
from pdserve.proxy.cluster import terminate


N = 140


TOKEN = "kv-stress-cluster-token-0123456789"      # auth and keyed seals on, as `pdserve serve` runs them


@pytest.fixture()
def daemon_proc():
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.kvstore", "--port", "0", "--log-level", "ERROR"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PDSERVE_KV_AUTH_TOKEN": TOKEN})
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    yield proc, line.split()[1]
    terminate(proc)


@pytest.mark.parametrize("pauses", [0, 2])
def test_many_engines_one_daemon_every_answer_equals_colocated(tiny_llama, daemon_proc, pauses):
    proc, url = daemon_proc
    report = run_stress(StressConfig(model=str(tiny_llama), daemon_url=url, daemon_pid=proc.pid,
                                     requests=N, stop_daemon=pauses, token=TOKEN))
    print(report)
    assert report.mismatches == 0, report.mismatch_ids
    assert report.integrity_failures == 0 and report.digest_mismatches == 0
    assert report.failed == 0
    assert report.compared + report.aborted == report.requests
    assert 0 < report.aborted <= N // 7          # an abort that comes after the answer is a no-op
    assert report.daemon_pauses == pauses
    assert report.loads > 0 and report.published_chunks > 0
    if not pauses:
        assert report.load_failures == 0 and report.publish_failures == 0
