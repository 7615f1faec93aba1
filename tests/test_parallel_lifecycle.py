"""A tp2 x pp2 node stopped from outside: the cheapest cases of bench/parallel_lifecycle.py's matrix.

The whole matrix (start-up / idle / load x SIGINT / SIGTERM / SIGKILL, a rank SIGKILLed or
SIGSTOPped, a 70 s pipeline stage) is ``python bench/parallel_lifecycle.py --model DIR``. Every
case here must leave no process, no listening port and no /dev/shm file behind:

- SIGTERM under load (a service manager's stop): the stream in flight completes; exit 0      (issues 5, 11)
- SIGINT to the node's process group under load (Ctrl-C): the same, and no rank sees it     (issue 5)
- SIGKILL while the ranks load (PDSERVE_FAULTS=slow_start): the launcher and ranks follow   (issue 4)
- a tp1 node drains on SIGTERM too                                                          (issue 11)
"""

from __future__ import annotations

import pytest

from pdserve.bench.parallel_lifecycle import run_case

MAX_TOKENS = 120


@pytest.mark.parametrize("case", ["node-SIGTERM-load", "node-SIGINT-load"])
def test_a_signal_under_load_drains_then_exits_0(tiny_llama, case):
    out = run_case(str(tiny_llama), case, max_tokens=MAX_TOKENS)
    assert out.client == f"complete: {MAX_TOKENS} tokens, finish length", out
    assert out.exit_status == "0" and out.errors == [], out
    assert out.clean, out


def test_sigkill_during_start_up_leaves_nothing_behind(tiny_llama):
    out = run_case(str(tiny_llama), "node-SIGKILL-start-up")
    assert out.exit_status == "-9 (SIGKILL)"
    assert out.clean, out
    assert out.report_s < 10, out


def test_a_single_rank_node_drains_on_sigterm(tiny_llama):
    out = run_case(str(tiny_llama), "node-SIGTERM-load", layout=("-tp", "1"), max_tokens=MAX_TOKENS)
    assert out.client == f"complete: {MAX_TOKENS} tokens, finish length", out
    assert out.exit_status == "0" and out.errors == [] and out.clean, out
