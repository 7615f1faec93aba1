"""``pdserve node`` runs its engine core in a process of its own unless told not to.

The default comes from ``PDSERVE_ENGINE_CORE_PROCESS`` (1 when unset; the test suite sets 0 so that the nodes
it starts need one process, and the engine-core tests ask for the core by flag). ``pdserve serve`` passes
``--engine-core-process`` / ``--no-engine-core-process`` to every node only when given. A node started with
the variable unset shows the core in its log and as a child process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import httpx

from conftest import free_port
from polling import wait_until
from pdserve.proxy.serve import NODE_FLAGS, node_flags


def _parsed_default(env_value: str | None, *flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_ENGINE_CORE_PROCESS"}
    if env_value is not None:
        env["PDSERVE_ENGINE_CORE_PROCESS"] = env_value
    code = ("import sys; from pdserve.engine.cli import build_parser; "
            "print(build_parser().parse_args(['node', '--model', 'x', *sys.argv[1:]]).engine_core_process)")
    return subprocess.run([sys.executable, "-c", code, *flags], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_core_process_is_the_default_and_can_be_turned_off():
    assert _parsed_default(None) == "True"
    assert _parsed_default(None, "--no-engine-core-process") == "False"
    assert _parsed_default("0") == "False"
    assert _parsed_default("0", "--engine-core-process") == "True"


def test_serve_passes_the_flag_only_when_given():
    names = {flag[2:].replace("-", "_"): None for flag, _, _ in NODE_FLAGS}
    assert "--engine-core-process" not in " ".join(node_flags(argparse.Namespace(**names)))
    on = node_flags(argparse.Namespace(**{**names, "engine_core_process": True}))
    off = node_flags(argparse.Namespace(**{**names, "engine_core_process": False, "enforce_eager": False}))
    assert on == ("--engine-core-process",)
    assert off == ("--no-enforce-eager", "--no-engine-core-process")
    assert _parsed_default(None, *off) == "False"


def test_a_node_started_without_the_flag_runs_its_core_in_a_child_process(tiny_llama, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_ENGINE_CORE_PROCESS"}
    port, log = free_port(), tmp_path / "node.log"
    with open(log, "w") as out:
        node = subprocess.Popen([sys.executable, "-m", "pdserve.engine.cli", "node", "--model", str(tiny_llama),
                                 "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def healthy():
            assert node.poll() is None, log.read_text()[-2000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 120, "the node answers /health")
        assert "engine core ready in process" in log.read_text()
        children = subprocess.run(["pgrep", "-P", str(node.pid), "-f", "pdserve.engine.core.proc"],
                                  capture_output=True, text=True).stdout.split()
        assert len(children) == 1, log.read_text()[-2000:]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        node.send_signal(signal.SIGINT)
        node.wait(60)
