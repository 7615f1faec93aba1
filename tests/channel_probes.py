"""What a local attacker can see of a node's local channels, and a way to act as another user.

    names = unix_names([api_pid, core_pid])      # the AF_UNIX names those processes' sockets are bound to, as
                                                 # /proc/net/unix (world-readable) lists them: "@x" is abstract
    as_nobody(fn, *args) -> fn's JSON result     # in a forked child that dropped to uid/gid 65534 (tests run as root)
    try_connect(name) -> "connected" | errno name
    Intruder(names)                              # zmq sockets of every kind that fits, connected to each name
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

import zmq

NOBODY = 65534
# frames that are no message of either side: the review's nine bytes, empty, not msgpack, truncated msgpack,
# a map, an array, a tag no message has
GARBAGE = [b"\x01garbage", b"", b"\xff" * 9, b"\x92\x01", b"\x81\xa4type\xaaAddRequest", b"\x93\x01\x02\x03",
           b"\x82\xa4type\xa5Bogus\xa7version\x05"]


def unix_names(pids: list[int]) -> list[str]:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    names = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            names.add(fields[7])
    return sorted(names)


def address(name: str) -> str:
    """The name as an AF_UNIX address ("@x" -> abstract "\\0x")."""
    return "\0" + name[1:] if name.startswith("@") else name


def try_connect(name: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(address(name))
            return "connected"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))


def try_list(path: str) -> str:
    try:
        return f"listed {os.listdir(path)}"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def as_nobody(fn, *args):
    """``fn(*args)`` in a forked child running as uid/gid 65534 with no groups; -> its JSON-able result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, json.dumps(fn(*args)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the uid 65534 child failed"
    return json.loads(data)


class Intruder:
    """Sockets of each kind that can talk to one of the node's sockets, connected to every name: PULL / DEALER
    read what a peer pushes or routes to them, PUSH / DEALER send. ``sent`` frames went to every name."""

    KINDS = (zmq.PULL, zmq.PUSH, zmq.DEALER)

    def __init__(self, names: list[str]):
        self.ctx = zmq.Context()
        self.socks = []
        for name in names:
            for kind in self.KINDS:
                sock = self.ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect("ipc://" + name)
                self.socks.append(sock)

    def send(self, frames: list[bytes]) -> None:
        for sock in self.socks:
            if sock.type != zmq.PULL:
                for frame in frames:
                    try:
                        sock.send(frame, zmq.NOBLOCK)
                    except zmq.Again:                   # no peer ever accepted: nothing to send to
                        break

    def received(self, timeout_ms: int) -> list[bytes]:
        """Everything a reading socket got (waiting up to ``timeout_ms`` on each)."""
        got = []
        for sock in self.socks:
            if sock.type == zmq.PUSH:
                continue
            while sock.poll(timeout_ms):
                got += sock.recv_multipart()
                timeout_ms = 0
        return got

    def close(self) -> None:
        self.ctx.destroy(linger=0)
