"""A 1,000-request soak through a local cluster in CI (issue 11: load and lifecycle).

Short streamed requests with 8 clients, a fifth of them abandoned mid-stream, a store daemon with an
8 MiB budget (so it evicts): no request fails, every node's free KV blocks come back to their starting
count, no store object stays pinned. ``python devbench/soak.py --model DIR --requests 10000`` is the long
run (RSS per process after warm-up and at the end in its report).
"""

from __future__ import annotations

from soak import run_soak


def test_thousand_requests_with_disconnects_leave_nothing_behind(tiny_llama):
    report = run_soak(str(tiny_llama), requests=1000, concurrency=8, disconnect=0.2)
    print(report)
    assert report.failed == 0, report.errors[:5]
    assert report.completed + report.disconnected == 1000 and report.disconnected > 100
    assert report.blocks_back and report.pinned_end == 0
