"""Review 40: a hung store daemon freezes a node's engine loop for the lookup's timeout, stalling every stream on it.

engine/kv/kv_connector.py:140 (``num_loadable_tokens``) calls ``ChunkLoader.lookup`` -> ``DaemonClient.lookup`` on
the engine thread, while it schedules a new request; the node's client waits up to 2 s (store_factory.py:37) for a
daemon that does not answer (SIGSTOPped, a frozen container, a partition without a reset). Meanwhile no step runs:
every request already decoding on that node stops streaming for 2 s -- and again at each health probe (2, 4, 8, 16,
30 s back-off), on every node. Routing by cache makes this the common path: every ``store_hit`` / ``decode_local``
request arrives at a decode node as a plain request that looks the store up there. (Loads were already taken off
the engine thread for this reason: test_review_layerwise's hung-store case.)

Correct: a store that does not answer costs the new request's hit, never the other requests' progress (the lookup
bounded far below a decode step's budget, or made off the engine thread).
Real daemon process with the cluster token, a real ``--role decode`` node (tiny llama) taking plain requests as
the skip paths send them, SIGSTOP/SIGCONT.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from conftest import NodeProcess
from kvstore_fixtures import TOKEN, DaemonProcess


def test_a_hung_daemon_does_not_stall_the_nodes_running_streams(tiny_llama, monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_AUTH_TOKEN", TOKEN)
    daemon = DaemonProcess("--kv-cpu-bytes", str(64 << 20), token=TOKEN)
    node = None
    stopped = False
    try:
        node = NodeProcess(tiny_llama, "--role", "decode", "--kv-store", daemon.url, "--block-size", "4", "--kv-chunk-tokens", "8")
        body = {"prompt": "a long answer streams while another request arrives", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        gaps: list[float] = []
        started = threading.Event()

        def stream():
            last = None
            with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if len(gaps) == 5:
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60), "the stream started"
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        stopped = True
        other = httpx.post(node.url + "/v1/completions", json={"prompt": "a new request looks the store up " * 3,
                                                                "max_tokens": 2, "temperature": 0}, timeout=60)
        os.kill(daemon.proc.pid, signal.SIGCONT)
        stopped = False
        reader.join(120)
        assert other.status_code == 200, other.text
        worst = max(gaps)
        assert worst < 1.0, f"a running stream stopped for {worst:.2f} s while a new request looked up a hung store"
    finally:
        if stopped:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        if node is not None:
            node.stop()
        daemon.stop()
