"""The broadcast queue: many steps, small and large messages, slow / dead / stopped readers, zmq readers.

Readers are real processes (``python -c``) that read ``count`` messages and print a digest of
each, so the test compares what every reader saw with what the writer sent. They inherit the
ring's fd (``pass_fds``), as the launcher and the ranks do.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from pdserve.engine.parallel.broadcast import (MessageQueue, QueueAborted, QueueHandle, ReaderDeadError,
                                               ReaderStalledError, WriterDeadError, release)

READER = """
import hashlib, sys, time, msgspec
from pdserve.engine.parallel.broadcast import MessageQueue, QueueHandle
handle = msgspec.json.decode(sys.argv[1].encode(), type=QueueHandle)
q = MessageQueue.reader(handle, int(sys.argv[2]))
print("ready", flush=True)
for i in range(int(sys.argv[3])):
    data = q.dequeue()
    print(hashlib.sha1(data).hexdigest(), len(data), flush=True)
    time.sleep(float(sys.argv[4]))
"""


def _fds(handle: QueueHandle) -> list[int]:
    return [handle.fd] if handle.fd >= 0 else []


def _messages(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        size = 3_000_000 if i % 97 == 5 else (i * 37) % 700       # a few span the whole ring many times
        out.append(os.urandom(size))
    return out


class Readers:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, handle: QueueHandle, index: int, count: int, delay: float = 0.0) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", READER, msgspec.json.encode(handle).decode(), str(index),
                              str(count), str(delay)], stdout=subprocess.PIPE, text=True, pass_fds=_fds(handle))
        self.procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture()
def readers():
    r = Readers()
    yield r
    r.stop()


@pytest.fixture()
def ring():
    handles = []

    def make(**kw) -> QueueHandle:
        handles.append(MessageQueue.create(**kw))
        return handles[-1]

    yield make
    for h in handles:
        release(h)


def _digests(msgs):
    return [f"{hashlib.sha1(m).hexdigest()} {len(m)}" for m in msgs]


def test_many_steps_small_and_large_messages_reach_every_reader(ring, readers):
    handle = ring(num_local_readers=2, num_remote_readers=2, num_slots=8, slot_bytes=4096)
    writer = MessageQueue.writer(handle)
    msgs = _messages(400)
    procs = [readers.start(handle, 0, len(msgs)), readers.start(handle, 1, len(msgs), delay=0.002),  # 1 is slow
             readers.start(handle, -1, len(msgs)), readers.start(handle, -1, len(msgs))]             # zmq readers
    writer.wait_for_remote_readers(timeout=30)
    for m in msgs:
        writer.enqueue(m, timeout=30)
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert out.split("\n")[:-1] == _digests(msgs)
    writer.close()


def test_dead_reader_is_named(ring, readers):
    handle = ring(num_local_readers=2, num_slots=4, slot_bytes=256)
    writer = MessageQueue.writer(handle)
    alive = readers.start(handle, 0, 1000)
    dead = readers.start(handle, 1, 1000)
    dead.kill()
    dead.wait()
    with pytest.raises(ReaderDeadError, match=rf"reader 1 \(pid {dead.pid}\) exited"):
        for _ in range(100):
            writer.enqueue(b"x" * 100, timeout=30)
    assert alive.poll() is None
    writer.close()


def test_stopped_reader_is_reported_after_the_timeout_and_slow_one_is_not(ring, readers):
    handle = ring(num_local_readers=1, num_slots=4, slot_bytes=256)
    writer = MessageQueue.writer(handle)
    slow = readers.start(handle, 0, 30, delay=0.05)          # behind, but reading: never an error
    for _ in range(30):
        writer.enqueue(b"y" * 300, timeout=2.0)
    slow.communicate(timeout=60)
    handle2 = ring(num_local_readers=1, num_slots=4, slot_bytes=256)
    writer2 = MessageQueue.writer(handle2)
    stopped = readers.start(handle2, 0, 100)
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ReaderStalledError, match=r"reader 0 .* read nothing for 1.0s"):
            for _ in range(100):
                writer2.enqueue(b"z", timeout=1.0)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    writer.close()
    writer2.close()


def test_writer_waits_on_a_live_reader_until_its_caller_aborts(ring, readers):
    """No stall verdict from the ring itself: a stopped reader is waited for (no timeout) until ``abort``
    gives a reason, as the executor's watchdog does from heartbeats."""
    handle = ring(num_local_readers=1, num_slots=4, slot_bytes=256)
    writer = MessageQueue.writer(handle)
    stopped = readers.start(handle, 0, 100)
    os.kill(stopped.pid, signal.SIGSTOP)
    start = time.monotonic()
    verdict = lambda: "rank 0 stalled (the watchdog's report)" if time.monotonic() - start > 1.0 else None  # noqa: E731
    try:
        with pytest.raises(QueueAborted, match=r"rank 0 stalled \(the watchdog's report\)"):
            for _ in range(100):
                writer.enqueue(b"w", abort=verdict)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    assert time.monotonic() - start > 1.0
    writer.close()


def test_inbound_queue_carries_many_writers_to_one_reader(ring):
    """Each writer stays alive until the reader has every message (it blocks on stdin, closed by the test):
    a writer that exits at once may lose what zmq had not sent within its 2 s linger on a loaded machine."""
    handle = MessageQueue.create_inbound("127.0.0.1")
    reader = MessageQueue.reader(handle, -1)
    code = ("import sys, msgspec\nfrom pdserve.engine.parallel.broadcast import MessageQueue, QueueHandle\n"
            "q = MessageQueue.writer(msgspec.json.decode(sys.argv[1].encode(), type=QueueHandle))\n"
            "for i in range(50): q.enqueue(sys.argv[2].encode() * (1 + i * 1000))\n"
            "sys.stdin.read()\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, msgspec.json.encode(handle).decode(), tag],
                              stdin=subprocess.PIPE) for tag in "ab"]
    got = []
    try:
        while len(got) < 100:
            message = reader.dequeue(timeout=120)
            assert message is not None, f"only {len(got)} of 100 messages arrived"
            got.append(message)
    finally:
        for p in procs:
            p.stdin.close()
    for p in procs:
        assert p.wait(timeout=60) == 0
    for tag in (b"a", b"b"):
        assert [len(m) for m in got if m[:1] == tag] == [1 + i * 1000 for i in range(50)]   # in order per writer
    assert reader.dequeue(timeout=0.1) is None
    reader.close()


def test_reader_notices_a_dead_writer(ring):
    handle = ring(num_local_readers=1)
    code = ("import sys, msgspec\nfrom pdserve.engine.parallel.broadcast import MessageQueue, QueueHandle\n"
            "MessageQueue.writer(msgspec.json.decode(sys.argv[1].encode(), type=QueueHandle)).enqueue(b'one')\n")
    subprocess.run([sys.executable, "-c", code, msgspec.json.encode(handle).decode()], check=True,
                   pass_fds=_fds(handle))
    reader = MessageQueue.reader(handle, 0)
    assert reader.dequeue(timeout=5) == b"one"
    with pytest.raises(WriterDeadError, match="the writer .* exited"):
        reader.dequeue(timeout=60)                       # None (a failed raises) if the death went unnoticed
    reader.close()
