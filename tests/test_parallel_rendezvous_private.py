"""A tp x pp node's ranks meet where no other local user can reach (issue 35, item 6).

The ranks used to meet at a TCPStore on 127.0.0.1 with no authentication: as uid nobody, a process that
rewrote the worker spec in a loop while the node started had the ranks load *its* weights, and the node
served them. With --nnodes 1 the store is a FileStore in a 0700 directory of the node's: the attacker finds
no store port, cannot open or list what the launcher's (world-readable) command line names, and the node
answers with its own model. The directory is gone when the node stops.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from channel_probes import NOBODY, as_nobody, try_list
from conftest import popen_listening, wait_healthy
from hf_reference import hf_greedy, hf_model
from lifecycle_probe import listening_ports
from pdserve.engine.checkpoints.tiny_model import make_tiny_model
from pdserve.engine.text.tokenizer import load_tokenizer
from pdserve.proxy.cluster import terminate

PROMPT, TOKENS = "The quick brown fox", 12
SPEC_KEY = "pdserve/spec"


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _rewrite_spec_until_told(port: int, evil: str, stop_fd: int) -> None:
    """Uid nobody: connect to the store at ``port`` and keep setting a spec naming ``evil`` until ``stop_fd``
    reads EOF (the attack of the issue: the ranks read whichever spec is there when they get to it)."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    spec = json.loads(store.get(SPEC_KEY))
    data = json.dumps({**spec, "model": evil}).encode()
    while not select.select([stop_fd], [], [], 0.001)[0]:
        store.set(SPEC_KEY, data)


def _attack(port: int, evil: str) -> tuple[int, int]:
    """Fork the uid 65534 attacker; -> (its pid, the fd whose close stops it)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(write)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            signal.alarm(300)
            _rewrite_spec_until_told(port, evil, read)
        finally:
            os._exit(0)
    os.close(read)
    return pid, write


def _open(path: str) -> str:
    try:
        with open(path, "rb"):
            return "opened"
    except OSError as exc:
        return type(exc).__name__


def test_another_user_cannot_rewrite_the_ranks_spec(tiny_llama, tmp_path):
    evil = make_tiny_model(tmp_path / "evil", arch="llama", seed=1)        # same shapes, other weights
    tok = load_tokenizer(tiny_llama)
    expected = tok.decode(hf_greedy(hf_model(tiny_llama), tok.encode(PROMPT), TOKENS), skip_special_tokens=True)
    cmd = [sys.executable, "-m", "pdserve.engine.cli", "node", "--model", str(tiny_llama), "--host", "127.0.0.1",
           "--num-threads", "1", "-tp", "2"]
    proc, port = popen_listening(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")
    attacker, stop = None, None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            store_ports = [p for p in listening_ports([proc.pid]) if p != port]     # a TCPStore, if any
            if store_ports:
                attacker, stop = _attack(store_ports[0], str(evil))
                break
            if "--store-file" in _launcher_args(proc.pid):
                break
            time.sleep(0.005)
        args = _launcher_args(proc.pid)                         # its command line is world-readable
        store_file = args[args.index("--store-file") + 1] if "--store-file" in args else ""
        if store_file:
            seen = as_nobody(lambda: [_open(store_file), try_list(os.path.dirname(store_file))])
            assert seen == ["PermissionError", "EACCES"]
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True})
    finally:
        if attacker is not None:
            os.close(stop)
            os.waitpid(attacker, 0)
        terminate(proc, grace_s=15)
        log = proc.stdout.read()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, (r.text, log[-2000:])
    assert attacker is None, "a local user found the ranks' store on a TCP port"
    assert store_file and not os.path.exists(os.path.dirname(store_file))    # removed with the node


def _launcher_args(pid: int) -> list[str]:
    for child in _children(pid):
        args = Path(f"/proc/{child}/cmdline").read_text().split("\0")
        if "pdserve.engine.parallel.launcher" in args:
            return args
    return []


def test_the_launcher_gives_its_ranks_the_hard_open_file_limit():
    """gloo keeps every connection a local user opens to a rank's loopback port; at the soft limit (1024 is
    common) its accept failed and the rank aborted. The launcher lifts the soft limit to the hard one first."""
    import subprocess
    import sys

    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE);"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard));"
            "from pdserve.engine.parallel.launcher import raise_open_file_limit; raise_open_file_limit();"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout.strip() == "True", out.stderr[-2000:]
