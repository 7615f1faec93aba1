"""Helpers shared by the proxy's process tests (no tests here): a proxy subprocess, its fixture,
and small HTTP/SSE helpers."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from conftest import popen_listening, wait_healthy
from pdserve.proxy.cluster import terminate  # noqa: E402


class ProxyProcess:
    """A `pdserve proxy` subprocess; `.url` is its base URL. Stopped by PID."""

    def __init__(self, model_dir: Path, prefill: list[str], decode: list[str], *extra: str, healthy: bool = True):
        cmd = [sys.executable, "-m", "pdserve.proxy.cli", "proxy", "--model", str(model_dir),
               "--prefill", *prefill, "--decode", *decode, *extra]
        self.log = tempfile.TemporaryFile("w+")              # a pipe nobody reads could fill up and block
        self.proc, self.port = popen_listening(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            if healthy:
                wait_healthy(self.url + "/health", self.proc, timeout=60)
            else:
                _wait_listening(self.url, self.proc)
        except Exception:
            print(self.stop())
            raise

    def stop(self) -> str:
        terminate(self.proc)
        self.log.seek(0)
        return self.log.read()


def _wait_listening(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"proxy exited with {proc.returncode}")
        try:
            httpx.get(url + "/health", timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not listening after {timeout}s")


@pytest.fixture(scope="module")
def proxy_factory():
    started: list[ProxyProcess] = []

    def start(*args, **kwargs) -> ProxyProcess:
        proxy = ProxyProcess(*args, **kwargs)
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


def sse_payloads(response: httpx.Response) -> list:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def request(base: str, path: str, body: dict, **kwargs) -> httpx.Response:
    kwargs.setdefault("timeout", 60)
    return httpx.post(base + path, json=body, **kwargs)
