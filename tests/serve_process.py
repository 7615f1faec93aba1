"""Start `pdserve serve` as the README does and read its banner (shared by the serve tests)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys


@contextlib.contextmanager
def serve(model_dir, *flags: str, port: int = 0):
    """-> (process, banner text up to "Ctrl-C stops everything"); on exit the cluster is stopped as Ctrl-C does,
    and only then killed (a SIGKILLed `serve` would orphan its nodes). Port 0: the cluster binds a free one
    (read it with ``banner_url``) -- a port picked here could be taken before `serve` binds it."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.cli", "serve", "--model", str(model_dir),
                             "--port", str(port), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        yield proc, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def banner_url(output: str) -> str:
    match = re.search(r"pdserve is ready: (http://127\.0\.0\.1:\d+)", output)
    assert match, output
    return match.group(1)
