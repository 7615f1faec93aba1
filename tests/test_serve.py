"""`pdserve serve` (the README's run command) brings the whole cluster up, answers, and stops it all on Ctrl-C."""

from __future__ import annotations

import re
import signal
import socket

import httpx

from polling import wait_until
from serve_process import banner_url, serve


def test_serve_answers_and_ctrl_c_stops_everything(tiny_llama):
    with serve(tiny_llama) as (proc, output):
        url = banner_url(output)
        assert "curl -s" in output
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        metrics = re.findall(r"(http://\S+)/metrics", output)          # every process's, printed (issue 42)
        texts = [httpx.get(m + "/metrics", timeout=10).text for m in metrics]
        assert len(metrics) == 3 and metrics[0] == url and "pdserve_proxy_requests_total" in texts[0]
        assert all("vllm:num_requests_running{" in t for t in texts[1:])
        ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", output)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        wait_until(lambda: not any(_listening(p) for p in ports), 10,
                   "every child of `pdserve serve` stopped listening")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_supervise_restarts_a_dead_child_with_doubling_backoff(tmp_path):
    """``pdserve serve`` brings back a child that exited (a node whose engine died exits non-zero).

    Mutation caught: the old loop stopped the whole cluster when any child exited.
    """
    from pdserve.proxy.cluster import BACKOFF_MAX_S, LocalCluster

    cluster = LocalCluster("unused", log_dir=tmp_path)
    child = cluster._spawn("flaky", ["no-such-subcommand"])       # argparse exits 2 at once
    try:
        now, delays = 1000.0, []
        for _ in range(3):
            assert child.proc.wait(timeout=60) == 2
            assert cluster.supervise(now) == []                    # exit seen: restart scheduled
            delays.append(child.restart_at - now)
            assert cluster.supervise(child.restart_at - 0.01) == []
            now = child.restart_at
            assert cluster.supervise(now) == ["flaky"]
        assert delays == [1.0, 2.0, 4.0]
        child.proc.wait(timeout=60)
        child.restarts = 10
        cluster.supervise(now)
        assert child.restart_at - now == BACKOFF_MAX_S             # capped
        child.restart_at, child.started_at = None, now - 61.0      # it had stayed up a minute: back-off resets
        cluster.supervise(now)
        assert child.restart_at - now == 1.0
        assert child.log.read_text().count("invalid choice") == 4  # every start logged to the same file
    finally:
        cluster.stop()


def test_a_killed_decode_node_comes_back_and_the_cluster_serves_again(tiny_llama):
    """End to end: SIGKILL the decode node; ``supervise()`` starts it again on the same port, the
    proxy's probes see it healthy again and a request through the proxy is answered."""
    from pdserve.proxy.cluster import ClusterSpec, LocalCluster

    body = {"prompt": "hello there", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    with LocalCluster(str(tiny_llama), ClusterSpec()) as cluster:
        decode = next(c for c in cluster.children if c.name.startswith("decode"))
        old_pid = decode.proc.pid
        decode.proc.kill()
        decode.proc.wait()
        wait_until(lambda: cluster.supervise() == ["decode-0"] or decode.proc.pid != old_pid, 30, "decode restarted")
        wait_until(lambda: httpx.get(cluster.url + "/health", timeout=5).json().get("decode_healthy"), 120,
                   "the proxy sees the restarted decode node healthy")
        r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert decode.restarts == 1
