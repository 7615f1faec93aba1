"""The daemon owns its shared-memory segments (issue 9, bug 5).

Before the fix the daemon mapped a file the client had made and ftruncate'd (which
reserves nothing): a client file shorter than announced, or a full /dev/shm, ended in
a SIGBUS that took the store down for every node. Now the daemon creates each segment
itself, reserves its pages with posix_fallocate (no room -> an error reply at Attach),
and refuses an Attach that names a path.
"""

from __future__ import annotations

import os
from pathlib import Path
import re
import select
import shutil
import subprocess
import sys
import threading

import msgspec
import pytest
import zmq

from pdserve.kvstore import protocol as P
from pdserve.kvstore.daemon import DaemonLimits, KVDaemon
from pdserve.kvstore.memory import MemoryTier
from pdserve.kvstore.shm import ShmSegment
from pdserve.proxy.cluster import terminate

NAME = re.compile(r"^/dev/shm/pdserve-kv-[0-9a-f]+$")


@pytest.fixture
def endpoint():
    daemon = KVDaemon(MemoryTier(1 << 20), port=0, limits=DaemonLimits(max_shm_bytes=8 << 20))
    stop = threading.Event()
    thread = threading.Thread(target=daemon.serve, args=(stop,))
    thread.start()
    yield daemon.endpoint
    stop.set()
    thread.join()
    daemon.close()


@pytest.fixture
def sock_to():
    ctx, socks = zmq.Context(), []

    def connect(url: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(url)
        socks.append(sock)
        return sock
    yield connect
    for sock in socks:
        sock.close()
    ctx.term()


def _ask(sock, header: bytes) -> P.Reply:
    sock.send_multipart([header])
    assert sock.poll(10_000), "daemon did not answer"
    return P.REPLY_DECODER.decode(sock.recv_multipart()[0])


def _attach(sock, size: int) -> P.Reply:
    return _ask(sock, P.ENCODER.encode(P.Attach(id=2, pid=os.getpid(), size=size)))


def _ping_ok(sock) -> bool:
    return _ask(sock, P.ENCODER.encode(P.Ping(id=9))).ok


def test_attach_reply_names_a_daemon_made_segment_with_its_pages_reserved(endpoint, sock_to):
    """Before the fix Attach carried the client's path; with ftruncate instead of
    posix_fallocate the file has no blocks (st_blocks == 0) and this fails."""
    sock, size = sock_to(endpoint), 1 << 20
    seg = _attach(sock, size).segment
    assert NAME.match(seg.path) and seg.size == size and seg.gen > 0
    st = os.stat(seg.path)
    assert st.st_size == size and st.st_blocks * 512 >= size and st.st_mode & 0o777 == 0o600
    again = _attach(sock, size).segment                   # re-attach: the old one is dropped and unlinked
    assert again.gen > seg.gen and not os.path.exists(seg.path)
    assert _ask(sock, P.ENCODER.encode(P.Detach(id=4))).ok and not os.path.exists(again.path)


def test_attach_over_the_size_limit_is_an_error_reply(endpoint, sock_to):
    sock = sock_to(endpoint)
    reply = _attach(sock, 9 << 20)
    assert not reply.ok and "limit is 8388608 (--kv-max-shm-bytes)" in reply.error and reply.segment is None
    assert _ping_ok(sock)


def test_attach_naming_a_client_made_path_is_refused(endpoint, sock_to):
    """The old protocol shape (the client names its own file) must not reach the daemon's mmap."""
    sock = sock_to(endpoint)
    hostile = {"op": "attach", "v": P.PROTOCOL_VERSION, "id": 3, "token": "",
               "path": "/dev/shm/pdserve-kv-0123456789abcdef", "pid": os.getpid(), "size": 4096}
    reply = _ask(sock, msgspec.msgpack.encode(hostile))
    assert (reply.ok, reply.id) == (False, 3) and "unknown field `path`" in reply.error
    assert reply.segment is None and _ping_ok(sock)


def test_client_checks_the_segment_size_and_unlinks_the_name():
    seg = ShmSegment.create(4096, gen=1)
    try:
        with pytest.raises(ValueError, match="has 4096 bytes, daemon says 8192"):
            ShmSegment.open(str(seg.path), 8192, gen=1)
        assert not seg.path.exists()
        with pytest.raises(ValueError, match="not a pdserve segment"):
            ShmSegment.open("/etc/passwd", 4096, gen=1)
    finally:
        seg.unlink()
        seg.close()


def test_client_maps_only_a_private_file_never_through_a_link(tmp_path):
    """A review's attack: whoever answered Attach on the daemon's port named /dev/shm/pdserve-kv-<hex>, a symlink
    to a file the node's user could write, and the node wrote its KV over that file. The client now opens the
    name without following links and maps only a regular 0600 file of its own user, with one link."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"A" * 4096)
    link = Path(f"/dev/shm/pdserve-kv-{os.urandom(8).hex()}")
    os.symlink(victim, link)
    try:
        with pytest.raises(OSError):
            ShmSegment.open(str(link), 4096, gen=1)
    finally:
        link.unlink(missing_ok=True)
    for mode, hardlink in ((0o644, False), (0o600, True)):       # readable by others; a second name elsewhere
        path = Path(f"/dev/shm/pdserve-kv-{os.urandom(8).hex()}")
        extra = Path(f"/dev/shm/pdserve-test-{os.urandom(8).hex()}")
        path.write_bytes(b"B" * 4096)
        os.chmod(path, mode)
        if hardlink:
            os.link(path, extra)
        try:
            with pytest.raises(ValueError, match="not a private file"):
                ShmSegment.open(str(path), 4096, gen=1)
        finally:
            path.unlink(missing_ok=True)
            extra.unlink(missing_ok=True)
    assert victim.read_bytes() == b"A" * 4096


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.fixture
def small_shm_daemon():
    """A daemon process whose /dev/shm is a private 1 MiB tmpfs (user + mount namespace)."""
    if not _unshare_works():
        pytest.skip("needs `unshare -rm` (user namespaces) to give a daemon a small private /dev/shm")
    script = 'mount -t tmpfs -o size=1m pdserve-test /dev/shm && exec "$@"'
    proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", script, "sh", sys.executable, "-m", "pdserve.kvstore",
                             "--port", "0", "--kv-cpu-bytes", str(1 << 20), "--log-level", "ERROR",
                             "--kv-max-shm-total-bytes", str(64 << 20)],   # past the tmpfs: fallocate refuses
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            pytest.skip(f"daemon in a private mount namespace did not start: {line!r}")
        yield line.split()[1]
    finally:
        terminate(proc)


def test_attach_larger_than_free_shm_is_an_error_reply_not_a_sigbus(small_shm_daemon, sock_to):
    """Before the fix (ftruncate) the 4 MiB Attach 'succeeded' on a 1 MiB tmpfs and the
    first write past 1 MiB would SIGBUS; now it is refused at Attach."""
    sock = sock_to(small_shm_daemon)
    reply = _attach(sock, 4 << 20)
    assert not reply.ok and "cannot reserve a 4194304-byte shm segment" in reply.error
    assert _ping_ok(sock)
    assert _attach(sock, 256 << 10).ok                    # what fits is still served
