"""The private link between a node's API process and its engine-core process: two ipc sockets only the
core can use.

    API process (EngineCoreClient)                          engine-core process (proc.serve)
    ch = ApiChannel()        0700 dir, binds ROUTER "down" and "up" in it; ch.start_message(config) -> StartCore
                             (stdin, with a fresh secrets token) ------>  down, up = connect(ctx, start)
                             ch.poll_start() takes Hello(token) <------  Hello on each: DEALER "down", DEALER "up"
                             and once both came, removes the socket files and the dir: no one can connect again
    ch.send(data)            any thread, under the client's lock: to the "down" peer that proved the token
    ch.receive(timeout_ms)   the receiver thread: a CoreMessage from the "up" peer that proved it, else None
    ch.close()               sockets closed, the dir removed if still there (a failed start, a dead core)

Who can reach the sockets: the directory is the node's own (``private_dir``), mode 0700, so the kernel lets
only its user and root connect, or even see the names inside it. It exists from before the core starts until
both of the core's connections proved the token (the core's imports: a second or two, before any model is
loaded), then it is gone; established connections stay. A ROUTER takes any number of connections, so one
made while the directory exists (by the node's own user, who could as well ptrace the node) is merely
ignored: nothing it sends is read as a message until a Hello with the token (compared in constant time), and
frames from any connection but the one that proved the token are dropped; the API process sends only to the
core's "down" connection. An intruder that connects first can neither take the core's place (each connection
is served apart: there is no single peer slot to hold) nor learn anything (Ready and outputs go to the
core's connection only); it can send frames that are dropped and counted, until the node stops. The core's
DEALERs connect to the sockets the API process bound before it started the core: all the core reads comes
from the API process.

A frame that does not decode (garbage, a foreign message, another version) is dropped on either side and
counted, logged at most every DROP_LOG_S (``Drops``): never fatal. Two sockets, not one, because zmq sockets
are not thread-safe: the core's heartbeat thread and its loop, the client's senders and its receiver thread,
each side uses one socket per direction.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time

import zmq

from pdserve.engine import private_dir
from pdserve.engine.core import messages as m
from pdserve.kvstore.zmq_context import shared_context

logger = logging.getLogger(__name__)
DROP_LOG_S = 10.0                 # a dropped frame is logged at most this often (each one is counted)
TOKEN_BYTES = 32
_INTRUDER_QUEUE = 16              # frames a connection that never proves the token may leave queued on "down"


class Drops:
    """Frames dropped on one end of the channel: counted, logged on the first and then at most every DROP_LOG_S."""

    def __init__(self, where: str, log: logging.Logger):
        self.where, self.log, self.count = where, log, 0
        self._logged_at = float("-inf")

    def note(self, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._logged_at >= DROP_LOG_S:
            self.log.warning("%s: dropped a frame (%s); %d dropped so far", self.where, why, self.count)
            self._logged_at = now


class ApiChannel:
    """The API process's end (``EngineCoreClient``)."""

    def __init__(self):
        self.dir: str | None = private_dir.make("pdserve-core-", socket_names=("down", "up"))
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self.drops = Drops("engine-core channel (API process)", logger)
        self._core_down = self._core_up = None                   # routing ids of the core's two connections
        ctx = shared_context()
        self._down, self._up = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        try:
            self._bind(self._down, "down", rcvhwm=_INTRUDER_QUEUE)   # only Hellos are ever read from it
            self._bind(self._up, "up", rcvhwm=0)
        except BaseException:
            self.close()
            raise

    def start_message(self, config) -> m.StartCore:
        return m.StartCore(config, self._address("down"), self._address("up"), self._token)

    @property
    def ready(self) -> bool:
        """Both of the core's connections proved the token."""
        return self._core_down is not None and self._core_up is not None

    def poll_start(self, timeout_ms: int):
        """While starting: take Hellos on both sockets (then ``seal``); -> the core's first message (Ready or
        Fatal), or None."""
        while self._core_down is None and self._down.poll(0):
            self._core_down = self._hello(self._down.recv_multipart()) or None
        msg = self.receive(timeout_ms)
        if self.ready and self.dir is not None:
            self.seal()
        return msg

    def seal(self) -> None:
        """Remove the socket files and the dir (open connections stay, new ones fail). Idempotent."""
        private_dir.remove(self.dir)
        self.dir = None

    def send(self, data: bytes) -> None:
        """To the core's "down" connection (the caller serializes senders); nowhere before it proved the token."""
        if self._core_down is not None:
            self._down.send_multipart([self._core_down, data], copy=False)

    def receive(self, timeout_ms: int):
        """-> the next message from the core's "up" connection, or None (nothing came, or a frame was dropped)."""
        if not self._up.poll(timeout_ms):
            return None
        frames = self._up.recv_multipart()
        if self._core_up is None:
            self._core_up = self._hello(frames) or None
            return None
        if len(frames) != 2 or frames[0] != self._core_up:
            return self.drops.note("not from the engine core's connection")
        try:
            return m.decode_core_message(frames[1])
        except ValueError as exc:                                # msgspec's DecodeError is one
            return self.drops.note(f"undecodable: {exc}")

    def close(self) -> None:
        for sock in (self._down, self._up):
            sock.close(linger=0)
        self.seal()

    def _hello(self, frames: list[bytes]) -> bytes:
        """The routing id of a connection whose first frame is a Hello with the token; b"" otherwise (dropped)."""
        try:
            hello = m.decode_hello(frames[1]) if len(frames) == 2 else None
        except ValueError:
            hello = None
        if hello is None or not hmac.compare_digest(hello.token, self._token):
            self.drops.note("a connection that did not prove the token")
            return b""
        return frames[0]

    def _bind(self, sock: zmq.Socket, name: str, rcvhwm: int) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)                   # the core's queue never drops or blocks
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.bind(self._address(name))

    def _address(self, name: str) -> str:
        return "ipc://" + os.path.join(self.dir, name)


def connect(ctx: zmq.Context, start: m.StartCore) -> tuple[zmq.Socket, zmq.Socket]:
    """The core's end: -> (inbox, outbox) DEALERs connected to the API process's sockets, a Hello queued on each."""
    socks = []
    for address in (start.down_address, start.up_address):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)                      # a last Fatal still reaches the API process
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(address)
        sock.send(m.encode(m.Hello(start.token)))
        socks.append(sock)
    return socks[0], socks[1]


def decode_from_api(frames: list[bytes], drops: Drops):
    """The core's inbox: -> a ClientMessage, or None (dropped and counted)."""
    if len(frames) != 1:
        return drops.note(f"{len(frames)} frames, not 1")
    try:
        return m.decode_client_message(frames[0])
    except ValueError as exc:
        return drops.note(f"undecodable: {exc}")
