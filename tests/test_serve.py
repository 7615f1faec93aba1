"""`pdserve serve` (the README's run command) brings the whole cluster up, answers, and stops it all on Ctrl-C."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys

import httpx

from conftest import free_port
from polling import wait_until


def test_serve_answers_and_ctrl_c_stops_everything(tiny_llama):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.cli", "serve", "--model", str(tiny_llama),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        output = "".join(lines)
        assert f"pdserve is ready: http://127.0.0.1:{port}" in output, output
        assert "curl -s" in output
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", output)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        wait_until(lambda: not any(_listening(p) for p in ports), 10,
                   "every child of `pdserve serve` stopped listening")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
