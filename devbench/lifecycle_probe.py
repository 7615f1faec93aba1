"""What a lifecycle case observes from outside a node: its processes, ports, /dev/shm, a streaming client.

Used by ``parallel_lifecycle.py`` (and through it by tests/test_parallel_lifecycle.py):

    node = Node(model_dir, ["-tp", "2", "-pp", "2"], {"PDSERVE_FAULTS": ...})   # own session, 127.0.0.1
    node.ranks()                 # the launcher's children, in rank order
    node.listening_ports()       # LISTEN sockets of the node and its descendants
    stream = Stream(node.url, 400)   # one streaming completion on a thread; stream.result(timeout)
    node.wait_descendants_gone(10)   # pids still alive (start time checked: never a reused pid)
    node.kill_everything()       # SIGKILL, by pid, whatever this node started and is still alive

Descendants are tracked every 20 ms from the node and from its launcher (a launcher outliving its
node keeps being followed, so ranks it forks after the node died are seen too).
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

_SHM_PREFIXES = ("pdserve-mq", "pdserve-hb")


def shm_entries() -> set[str]:
    """The parallel path's /dev/shm names (rings and heartbeats of builds that used named files)."""
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if p.name.startswith(_SHM_PREFIXES)} if root.is_dir() else set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_time(pid: int) -> int | None:
    """Kernel start time of a live (non-zombie) process, else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _children(pid: int) -> list[int]:
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:                                  # the process is gone: no children
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _listen_inodes() -> dict[int, int]:
    """inode -> port of every LISTEN TCP socket (v4 and v6) in this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":
                out[int(f[9])] = int(f[1].rsplit(":", 1)[1], 16)
    return out


def listening_ports(pids) -> set[int]:
    """Ports of the LISTEN TCP sockets that ``pids`` hold."""
    inodes, ports = _listen_inodes(), set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        ports |= {inodes[int(link[8:-1])] for link in links if link.startswith("socket:[") and int(link[8:-1]) in inodes}
    return ports


class Node:
    def __init__(self, model: str, flags: list[str], env: dict[str, str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tp = int(flags[flags.index("-tp") + 1]) if "-tp" in flags else 1
        pp = int(flags[flags.index("-pp") + 1]) if "-pp" in flags else 1
        self.world_size = tp * pp
        cmd = [sys.executable, "-m", "pdserve.engine.cli", "node", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--num-threads", "1", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/",
                                     env=dict(os.environ, **env), start_new_session=True)
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.tracked: dict[int, int] = {}             # pid -> start time, every descendant ever seen
        self.launcher: int | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._track, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def _track(self) -> None:
        while not self._stop.wait(0.02):
            roots = [self.proc.pid] + ([self.launcher] if self.launcher else [])
            for root in roots:
                for pid in self._descendants(root):
                    start = _start_time(pid)
                    if start is not None and pid not in self.tracked:
                        self.tracked[pid] = start
                    # checked until found, not only when first seen: a fork is named by its exec a moment later
                    if self.launcher is None and pid in self.tracked and b"parallel.launcher" in _cmdline(pid):
                        self.launcher = pid

    def _descendants(self, root: int) -> list[int]:
        out, todo = [], [root]
        while todo:
            kids = _children(todo.pop())
            out += kids
            todo += kids
        return out

    def _alive(self, pid: int) -> bool:
        return _start_time(pid) == self.tracked.get(pid)

    def ranks(self) -> list[int]:
        """Rank pids in rank order (forked in order: start time, then pid)."""
        if self.launcher is None or not self._alive(self.launcher):
            return []
        kids = [p for p in _children(self.launcher) if _start_time(p) is not None]
        return sorted(kids, key=lambda p: (_start_time(p), p))

    def listening_ports(self) -> set[int]:
        return listening_ports([self.proc.pid, *self.tracked])

    @staticmethod
    def ports_listening_now(ports: set[int]) -> set[int]:
        return set(_listen_inodes().values()) & ports

    def wait_for(self, condition, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.02)
        raise TimeoutError(f"not within {timeout}s: {what}; node output:\n" + "\n".join(list(self.lines)[-30:]))

    def wait_healthy(self, timeout: float) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the node exited ({self.proc.returncode}):\n" + "\n".join(self.lines))
            try:
                return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait_for(healthy, timeout, f"{self.url} healthy")

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_descendants_gone(self, timeout: float) -> list[int]:
        """-> the tracked descendants still alive after ``timeout`` s (none: all gone)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [pid for pid in self.tracked if self._alive(pid)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.02)

    def last_line(self) -> str:
        time.sleep(0.1)                                   # let the reader thread take the final lines
        return next((line for line in reversed(self.lines) if line.strip()), "")

    def output(self) -> str:
        return "\n".join(self.lines)

    def error_lines(self) -> list[str]:
        return [line for line in self.lines if " ERROR " in line or line.startswith(("Traceback", "KeyboardInterrupt"))]

    def kill_everything(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        time.sleep(0.05)                                  # the tracker's last sweep
        self._stop.set()
        for pid in self.tracked:
            if self._alive(pid):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Stream(threading.Thread):
    """One streaming completion of ``max_tokens`` (greedy, ignore_eos); counts chunks, keeps how it ended."""

    def __init__(self, url: str, max_tokens: int, prompt_len: int = 20):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.prompt = [(7 * i + 3) % 400 + 3 for i in range(prompt_len)]
        self.tokens, self.outcome, self.ended_at = 0, "", None
        self.finished = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            self.outcome = self._consume(body)
        except httpx.HTTPError as exc:
            self.outcome = f"cut off after {self.tokens} tokens ({type(exc).__name__})"
        finally:
            self.ended_at = time.monotonic()
            self.finished.set()

    def _consume(self, body: dict) -> str:
        import json

        finish, usage = None, None
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.read().decode()[:200]}"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error after {self.tokens} tokens: {event['error'].get('message', event['error'])}"
                for choice in event.get("choices") or []:
                    self.tokens += 1
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
        n = usage["completion_tokens"] if usage else self.tokens
        return f"complete: {n} tokens, finish {finish}" if finish else f"ended without finish after {n} tokens"

    def result(self, timeout: float) -> str:
        return self.outcome if self.finished.wait(timeout) else f"still streaming after {timeout}s ({self.tokens} tokens)"
