"""One shm ``DaemonClient`` under concurrency and timeouts, against a daemon process.

Bug 1 (issue 9): a publisher and a loader thread sharing one client overwrote each
other's bytes in the segment (gets returned another key's bytes, puts stored wrong ones).
Bug 2 (issue 9): a timed-out request stayed queued; the next one reused the segment, so
the daemon later stored the old key with the new payload.
"""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest
import torch

from kvstore_fixtures import DaemonProcess, unique_prefix
from pdserve.kvstore.client import DaemonClient


@pytest.fixture(scope="module", params=["arena", "segments"])
def mem_daemon(request):
    """Both shared-memory data planes: the daemon's arena (its default) and per-client segments."""
    flags = ["--no-kv-shm-arena"] if request.param == "segments" else []
    proc = DaemonProcess(*flags, "--kv-cpu-bytes", str(256 << 20), "--log-level", "ERROR")
    proc.mode = request.param
    yield proc
    proc.stop()


def _maps(counters: dict, mode: str) -> int:
    """How often the client mapped shared memory (arena maps, or segment attaches)."""
    return counters["arena_maps" if mode == "arena" else "shm_attaches"]


def _content(key_index: int, numel: int) -> torch.Tensor:
    """Distinct bytes per key: every element names its key, so a swap cannot compare equal."""
    return torch.full((numel,), float(key_index), dtype=torch.float32) + torch.arange(numel) * 1e-3


def test_threads_sharing_one_shm_client_never_see_another_keys_bytes(mem_daemon):
    """Bug 1: two putters and two getters share one shm client; every get is bit-identical
    to what was put under its key, or None (before the fix: other keys' bytes)."""
    prefix, n_keys, numel = unique_prefix(), 48, 16_384          # 64 KiB objects, 256 KiB segment
    want = {f"{prefix}-{i}:0": _content(i, numel) for i in range(n_keys)}
    keys, errors = list(want), []
    with DaemonClient(mem_daemon.url, shm_bytes=256 << 10, timeout_s=20) as client:
        def putter(mine):
            try:
                for i in range(0, len(mine), 3):
                    client.put([(k, want[k]) for k in mine[i:i + 3]])
            except Exception as exc:  # noqa: BLE001 - reported by the assert below
                errors.append(repr(exc))

        def getter(seed):
            rng = random.Random(seed)
            for _ in range(60):
                ask = rng.sample(keys, 3)
                for key, got in zip(ask, client.get(ask)):
                    if got is not None and not torch.equal(got, want[key]):
                        errors.append(key)

        threads = [threading.Thread(target=putter, args=(keys[j::2],)) for j in range(2)]
        threads += [threading.Thread(target=getter, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"{len(errors)} wrong gets or failed puts: {errors[:3]}"
        for key, got in zip(keys, client.get(keys)):
            assert got is not None and torch.equal(got, want[key]), key
        counters = client.stats()["client"]
        assert counters["checksum_failures"] == 0, "a digest caught another key's bytes: the race is still there"
        assert counters["frame_objects"] == 0 and _maps(counters, mem_daemon.mode) == 1


def test_timed_out_put_never_stores_the_next_requests_payload(mem_daemon):
    """Bug 2: with the daemon stopped, put(k1, A) and put(k2, B) time out; after SIGCONT
    k1 is A or absent, never B (before the fix: B), and the client keeps working on shm."""
    prefix, pid = unique_prefix(), mem_daemon.proc.pid
    a, b = torch.full((1024,), 1.0), torch.full((1024,), 2.0)
    with DaemonClient(mem_daemon.url, shm_bytes=64 << 10, timeout_s=0.5) as client:
        client.put([(f"{prefix}-warm:0", a)])                    # segment attached, daemon alive
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                client.put([(f"{prefix}-1:0", a)])
            try:
                client.put([(f"{prefix}-2:0", b)])
            except TimeoutError:
                pass
        finally:
            os.kill(pid, signal.SIGCONT)
        client.timeout_ms = 20_000
        got = client.get([f"{prefix}-1:0"])[0]
        assert got is None or torch.equal(got, a), "the timed-out put stored the next request's bytes"
        client.put([(f"{prefix}-3:0", b)])
        assert torch.equal(client.get([f"{prefix}-3:0"])[0], b)
        counters = client.stats()["client"]
        assert (_maps(counters, mem_daemon.mode), counters["frame_objects"]) == (2, 0)
        assert counters["shm_abandoned"] == (mem_daemon.mode == "segments")
