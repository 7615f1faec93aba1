"""Where is the scheduler output broadcast to the workers? Here: one message queue, one writer, N readers.

``ParallelExecutor.execute`` (the driver, on the engine thread) encodes each step's ``StepMessage``
once and ``enqueue``s the bytes; every worker rank's main loop (``worker.py``) ``dequeue``s every
message, in order. The same class carries the step results back (writer: the last pipeline stage's
tensor-parallel rank 0; reader: the driver).

    driver ── enqueue(bytes) ─┬─> shared-memory ring (an inherited memfd) ──> readers on this machine
                              └─> zmq XPUB tcp://host:port ─────────────────> SUB readers on other machines

Ring layout (one anonymous shared file, ``shm.py``: created by ``MessageQueue.create``, whose caller
passes its fd to the processes that attach and then ``release``s it; nothing in /dev/shm to leak):

    [write_seq, writer_pid] [read_seq_0, pid_0] ... [read_seq_{R-1}, pid_{R-1}] [slot 0] ... [slot S-1]
    slot = [u32 payload length, u32 more-frames flag, payload <= slot_bytes]

Frame ``seq`` lives in slot ``seq % S``. The writer may write frame ``seq`` once every reader's
``read_seq > seq - S`` (no slot is overwritten before all readers copied it); a reader may read
frame ``seq`` once ``write_seq > seq``. Counters are aligned int64s written by one process each
(single writer per counter), payload before counter. A message larger than a slot spans several
frames, so any size streams through the ring. Waiting backs off from yielding to 1 ms sleeps.

The reverse direction (many writers anywhere -> the one reader that created the queue: step
results and KV parts from ranks on other machines, heartbeat mirrors) is ``create_inbound``: the
reader binds a zmq PULL socket and writers connect PUSH sockets; no ring.

Failures are named, never hangs: a writer blocked on a full ring raises ``ReaderDeadError`` when
the lagging reader's process is gone; a reader raises ``WriterDeadError`` when the writer's process
is gone. Whether a live reader that reads nothing is stalled is not the ring's call (it cannot tell
a stuck rank from one inside a long step): the writer waits until its caller's ``abort`` gives a
reason (the executor passes the watchdog's report, judged from heartbeats) and raises
``QueueAborted`` with it; only an explicit ``timeout`` raises ``ReaderStalledError``.
Messages are bytes (msgspec-encoded by the caller), never pickle.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np
import zmq

from pdserve.engine.parallel import shm

_FRAME = struct.Struct("<II")           # payload length, more-frames flag


class QueueError(RuntimeError):
    """Base of the queue's failures; the message names the reader or writer and the limit."""


class ReaderDeadError(QueueError):
    pass


class ReaderStalledError(QueueError):
    pass


class WriterDeadError(QueueError):
    pass


class QueueAborted(QueueError):
    """The writer's ``abort`` callback gave a reason to stop waiting (e.g. the watchdog's report)."""


class QueueHandle(msgspec.Struct, frozen=True):
    """Everything a process needs to attach (sent as JSON through the rendezvous store); a ring reader or
    writer must also have inherited ``fd`` (the launcher and its ranks do)."""
    fd: int                       # the ring: an anonymous file at this fd number in every local process (-1: none)
    num_slots: int
    slot_bytes: int
    num_local_readers: int
    zmq_addr: str = ""            # XPUB address for remote readers ("" when there are none)
    num_remote_readers: int = 0
    inbound: bool = False         # create_inbound: the reader binds PULL at zmq_addr, writers PUSH to it


class MessageQueue:
    """Create with ``create`` (the owner), then ``writer(handle)`` / ``reader(handle, index)`` anywhere."""

    def __init__(self, handle: QueueHandle, role: str, index: int = -1):
        self.handle, self.role, self.index = handle, role, index
        self._seq = 0
        self._mm = self._counters = None
        self._sock = None
        if handle.fd >= 0 and not (role == "reader" and index < 0):
            self._map(handle)

    # -- construction ---------------------------------------------------------------------------

    @staticmethod
    def create(num_local_readers: int, num_remote_readers: int = 0, num_slots: int = 16,
               slot_bytes: int = 1 << 18, bind_host: str = "127.0.0.1") -> QueueHandle:
        """Allocate the ring; the caller passes ``handle.fd`` to the local processes that attach (``pass_fds``,
        or fork), then ``release``s it. Remote readers get an address to connect to."""
        if num_slots < 2 or slot_bytes < 64:
            raise ValueError(f"a ring needs >= 2 slots of >= 64 bytes, got {num_slots} x {slot_bytes}")
        fd = -1
        if num_local_readers:
            fd = shm.create(_header_bytes(num_local_readers) + num_slots * (slot_bytes + _FRAME.size), "pdserve-mq")
        zmq_addr = ""
        if num_remote_readers:
            zmq_addr = f"tcp://{bind_host}:{_free_port(bind_host)}"
        return QueueHandle(fd, num_slots, slot_bytes, num_local_readers, zmq_addr, num_remote_readers)

    @staticmethod
    def create_inbound(bind_host: str) -> QueueHandle:
        """A queue read by the creator's process only, written from anywhere (zmq PUSH -> PULL)."""
        return QueueHandle(-1, 0, 0, 0, f"tcp://{bind_host}:{_free_port(bind_host)}", 0, inbound=True)

    @classmethod
    def writer(cls, handle: QueueHandle) -> MessageQueue:
        q = cls(handle, "writer")
        if q._counters is not None:
            q._counters[1] = os.getpid()
        if handle.inbound:
            q._sock = zmq.Context.instance().socket(zmq.PUSH)
            q._sock.setsockopt(zmq.SNDHWM, 0)
            q._sock.setsockopt(zmq.LINGER, 2000)            # never block exit on a reader that is gone
            q._sock.connect(handle.zmq_addr)
        elif handle.num_remote_readers:
            q._sock = zmq.Context.instance().socket(zmq.XPUB)
            q._sock.setsockopt(zmq.SNDHWM, 0)
            q._sock.setsockopt(zmq.XPUB_VERBOSE, 1)         # count every subscriber, not every topic
            q._sock.bind(handle.zmq_addr)
        return q

    @classmethod
    def reader(cls, handle: QueueHandle, index: int) -> MessageQueue:
        """``index`` in [0, num_local_readers) reads the ring; -1 is a remote reader over zmq (or the
        inbound queue's reader)."""
        if not -1 <= index < handle.num_local_readers:
            raise ValueError(f"reader index {index} is outside [-1, {handle.num_local_readers})")
        q = cls(handle, "reader", index)
        if handle.inbound:
            q._sock = zmq.Context.instance().socket(zmq.PULL)
            q._sock.setsockopt(zmq.RCVHWM, 0)
            q._sock.bind(handle.zmq_addr)
        elif index >= 0:
            q._counters[2 + 2 * index + 1] = os.getpid()
            q._seq = int(q._counters[2 + 2 * index])
        else:
            q._sock = zmq.Context.instance().socket(zmq.SUB)
            q._sock.setsockopt(zmq.RCVHWM, 0)
            q._sock.setsockopt(zmq.SUBSCRIBE, b"")
            q._sock.connect(handle.zmq_addr)
        return q

    def wait_for_remote_readers(self, timeout: float) -> None:
        """Writer: block until every remote reader subscribed (messages before that would be lost)."""
        deadline, seen = time.monotonic() + timeout, 0
        while seen < self.handle.num_remote_readers:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                raise ReaderStalledError(f"{seen} of {self.handle.num_remote_readers} remote readers "
                                         f"subscribed to {self.handle.zmq_addr} within {timeout}s")
            if self._sock.recv()[:1] == b"\x01":
                seen += 1

    def _map(self, handle: QueueHandle) -> None:
        self._mm = shm.map(handle.fd)
        self._counters = np.frombuffer(self._mm, dtype=np.int64, count=2 + 2 * handle.num_local_readers)
        self._slots_at = _header_bytes(handle.num_local_readers)

    # -- writer ---------------------------------------------------------------------------------

    def enqueue(self, data: bytes, timeout: float | None = None, abort: Callable[[], str | None] | None = None) -> None:
        """Hand ``data`` to every reader; blocks while the ring is full, as long as the lagging reader lives,
        ``abort()`` (checked every few ms) returns None and, if given, a read came within ``timeout`` s."""
        if self._sock is not None:
            self._sock.send(data, copy=False)
        if self._mm is None:
            return
        view, step = memoryview(data), self.handle.slot_bytes
        starts = range(0, max(len(data), 1), step)
        for i, start in enumerate(starts):
            self._wait_for_space(timeout, abort)
            self._write_frame(view[start:start + step], more=i < len(starts) - 1)

    def _wait_for_space(self, timeout: float | None, abort: Callable[[], str | None] | None) -> None:
        c, n, backoff = self._counters, self.handle.num_local_readers, _Backoff()
        last_min, since = -1, time.monotonic()
        while True:
            reads = c[2:2 + 2 * n:2]
            lowest = int(reads.min())
            if self._seq - lowest < self.handle.num_slots:
                return
            if lowest != last_min:
                last_min, since = lowest, time.monotonic()
            lagging = int(reads.argmin())
            pid = int(c[2 + 2 * lagging + 1])
            if pid and not _alive(pid):
                raise ReaderDeadError(f"reader {lagging} (pid {pid}) exited; it last read frame {lowest}, "
                                      f"the writer is at frame {self._seq}")
            reason = abort() if abort is not None else None
            if reason:
                raise QueueAborted(reason)
            if timeout is not None and time.monotonic() - since > timeout:
                raise ReaderStalledError(f"reader {lagging} (pid {pid}) read nothing for {timeout:.1f}s "
                                         f"(frame {lowest}, writer at {self._seq}; ring of {self.handle.num_slots})")
            backoff.wait()

    def _write_frame(self, payload: memoryview, more: bool) -> None:
        at = self._slot_offset(self._seq)
        _FRAME.pack_into(self._mm, at, len(payload), int(more))
        self._mm[at + _FRAME.size: at + _FRAME.size + len(payload)] = payload
        self._seq += 1
        self._counters[0] = self._seq                       # publish after the payload

    # -- reader ---------------------------------------------------------------------------------

    def dequeue(self, timeout: float | None = None) -> bytes | None:
        """The next message, or None after ``timeout`` seconds without one (None: wait forever)."""
        if self._sock is not None:
            if not self._sock.poll(None if timeout is None else int(timeout * 1000)):
                return None
            return self._sock.recv()
        parts, deadline = [], None if timeout is None else time.monotonic() + timeout
        while True:
            if not self._wait_for_frame(deadline if not parts else None):
                return None
            payload, more = self._read_frame()
            parts.append(payload)
            if not more:
                return b"".join(parts)

    def _wait_for_frame(self, deadline: float | None) -> bool:
        c, backoff, checked = self._counters, _Backoff(), time.monotonic()
        while int(c[0]) <= self._seq:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                return False
            if now - checked > 0.5:
                checked = now
                pid = int(c[1])
                if pid and not _alive(pid):
                    raise WriterDeadError(f"the writer (pid {pid}) exited; reader {self.index} is at frame {self._seq}")
            backoff.wait()
        return True

    def _read_frame(self) -> tuple[bytes, bool]:
        at = self._slot_offset(self._seq)
        length, more = _FRAME.unpack_from(self._mm, at)
        if length > self.handle.slot_bytes:
            raise QueueError(f"frame {self._seq} claims {length} bytes; slots hold {self.handle.slot_bytes}")
        payload = bytes(self._mm[at + _FRAME.size: at + _FRAME.size + length])
        self._seq += 1
        self._counters[2 + 2 * self.index] = self._seq          # release the slot after the copy
        return payload, bool(more)

    def _slot_offset(self, seq: int) -> int:
        return self._slots_at + (seq % self.handle.num_slots) * (self.handle.slot_bytes + _FRAME.size)

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._counters = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def release(handle: QueueHandle) -> None:
    """The creator's fd of the ring (call once, after the last child that needs it was started); mappings
    stay valid and the memory goes with the last process that holds one."""
    if handle.fd >= 0:
        shm.close(handle.fd)


class _Backoff:
    """Yield first (a step is usually a few ms away), then sleep up to 1 ms (10 ms after a second idle)."""

    def __init__(self):
        self.n, self.start = 0, time.monotonic()

    def wait(self) -> None:
        self.n += 1
        if self.n < 50:
            time.sleep(0)
        elif time.monotonic() - self.start < 1.0:
            time.sleep(min(1e-3, 1e-5 * (self.n - 49)))
        else:
            time.sleep(0.01)


def _header_bytes(num_readers: int) -> int:
    return 8 * (2 + 2 * num_readers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
