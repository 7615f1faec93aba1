"""Serve one completion from an installed wheel (``scripts/wheel_check.sh``): make a tiny model, start
``pdserve serve`` on a free port, ask the proxy, check that every node built and loaded the C kernels (its
start-up line says ``attention=cpu``), stop the cluster with SIGINT. Exits non-zero, saying why, otherwise."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pdserve


def main(work: Path) -> int:
    assert "site-packages" in pdserve.__file__, f"pdserve imported from {pdserve.__file__}, not the installed wheel"
    pdserve_bin = str(Path(sys.executable).with_name("pdserve"))
    model = work / "tiny"
    subprocess.run([pdserve_bin, "make-tiny-model", str(model), "--arch", "llama"], check=True, timeout=300)
    proc = subprocess.Popen([pdserve_bin, "serve", "--model", str(model), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        banner = _banner(proc)
        url, logs = re.search(r"ready: (http://\S+)", banner).group(1), Path(re.search(r"logs\s+(\S+)", banner).group(1))
        body = json.dumps({"prompt": "Hello there", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(req, timeout=120))
        assert answer["usage"]["completion_tokens"] == 4, answer
        for node in ("prefill-0", "decode-0"):
            log = (logs / f"{node}.log").read_text()
            assert "attention=cpu" in log, f"{node} did not load the C attention kernel:\n{log[-3000:]}"
        print(f"wheel check: {pdserve.__file__} served {answer['choices'][0]['text']!r}; C kernels loaded on both nodes")
        return 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _banner(proc: subprocess.Popen, timeout: float = 300.0) -> str:
    lines, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            return "".join(lines)
        if time.monotonic() > deadline:
            break
    raise SystemExit("pdserve serve did not come up:\n" + "".join(lines)[-4000:])


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
