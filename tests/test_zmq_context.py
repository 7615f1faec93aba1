"""Objects that hold zmq sockets, dropped without ``close()`` inside a reference cycle, must not hang the
garbage collector. With a context per object they did: the collector clears the context's weak list of
sockets before finalizers run, so the context's finalizer finds no socket to close and ``term()`` waits
forever for the one still open. The full suite hung this way inside an unrelated hypothesis test. The
fix is ``kvstore.zmq_context.shared_context`` (the engine core's client uses it too). Mutation caught: a
``zmq.Context()`` per DaemonClient or KVDaemon."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = {
    "store client": "from pdserve.kvstore.client import DaemonClient; obj = DaemonClient('tcp://127.0.0.1:9', timeout_s=1)",
    "store daemon": "from pdserve.kvstore.daemon import KVDaemon; from pdserve.kvstore.memory import MemoryTier; "
                    "obj = KVDaemon(MemoryTier(1 << 20), port=0)",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_socket_owner_dropped_in_a_cycle_is_collected_without_a_hang(case):
    code = (f"import gc, warnings; warnings.simplefilter('ignore'); {CASES[case]}; obj.cycle = obj; del obj; "
            "gc.collect(); print('collected')")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, cwd="/")
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: gc.collect() hung on a dropped, unclosed socket owner")
    assert out.returncode == 0 and "collected" in out.stdout, out.stderr[-2000:]

