"""Review 14: ``pdserve --log-level`` does not reach the engine-core process.

The core configures logging from ``PDSERVE_LOG_LEVEL`` only (``engine/core/proc.py``), so with
``pdserve --log-level WARNING node --engine-core-process`` the scheduler's, loader's and engine's INFO lines
still print ("core INFO ..."), and ``--log-level DEBUG`` never shows the engine's debug lines, which now
all live in the core. In-process, the same flag governs every engine logger.

Suggested fix: carry the level in ``StartCore`` (``logging.getLogger().level``) or set
``PDSERVE_LOG_LEVEL`` in the core's environment in ``_spawn`` (the tp x pp launcher then inherits it too).
"""

from __future__ import annotations

import subprocess
import sys

from conftest import free_port, terminate, wait_healthy


def _log_of_node(model_dir, *flags: str) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.engine.cli", "--log-level", "WARNING", "node", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
    finally:
        terminate(proc, grace_s=15)
    return proc.stdout.read()


def test_log_level_reaches_the_engine_core(tiny_llama):
    log = _log_of_node(tiny_llama, "--engine-core-process")
    assert "engine core ready" not in log                      # the API process obeys (sanity)
    info = [line for line in log.splitlines() if " INFO " in line]
    assert info == [], "\n".join(info)
