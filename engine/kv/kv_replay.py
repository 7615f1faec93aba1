"""KV-event replay: a node tells a subscriber that just joined (or lost events) its whole block set at once.

Events only tell what changes, so a proxy that subscribes late, or forgets a node after a gap or a new epoch, would
credit the node with nothing it cached before until it caches it again. Like vLLM's replay endpoint, each publisher
also binds a ZMQ ROUTER on 127.0.0.1 (the card's ``kv.replay``) that answers an authenticated request with the
blocks it has announced and still holds, and the sequence number that set corresponds to; the subscriber applies it,
then live batches after that number (``proxy.kv_events``).

Who calls what:

    KVEventPublisher._send (its thread)   BlockMirror.apply(seq, cleared, stored, removed): the set the batch leaves
    ReplayServer (own thread)             request -> verify -> BlockMirror.snapshot() -> signed ReplayState
    proxy.kv_events (proxy loop)          request_frames / decode_reply

Transport: the ROUTER is a CURVE server with the cluster's key pair (``kv_curve``): a peer without the token
cannot complete the handshake, so nothing it sends -- not even one message of millions of empty frames, which
ZMQ would buffer whole -- reaches this thread. The MACs below stay as a second layer (they bind a reply to its
request and its socket, which CURVE does not). Without a token (dev mode) the socket is plain, as it was.

Wire:   request  [b"kv-replay", nonce (16 bytes), mac(replay_key, b"request" + nonce)]
        reply    [b"kv-replay", payload = msgpack(ReplayState), mac(replay_key, b"reply" + payload)]
``replay_key`` is derived from the events key (the cluster token's), apart from it, so neither message can pass for
an event batch or for the other; the reply carries the request's nonce (an old reply cannot be replayed) and the
PUB endpoint it describes (a reply relayed from another node's port is refused, as batches are). A request without
the MAC gets no answer, and a flood of them costs a counter and one warning per ``LOG_EVERY_S``, not a log line each;
a signed request whose nonce was seen before (one captured, e.g. by squatting a dead node's replay port -- which
CURVE now keeps a peer without the token from: it never completes the handshake with the proxy -- and sent again)
gets no answer either, and the node answers at most ``MAX_REPLIES_PER_S`` a second (each is a snapshot of up to
1.2 MB; a proxy asks at most once a second per node). ``ReplayServer.counts`` says what the thread did with each
message it took from its socket. Bounded: the mirror keeps at most
``MAX_REPLAY_BLOCKS`` (131072 hashes, the most recently stored; about 1.2 MB of msgpack), more than any node's prefix
cache we run -- a node with more blocks replays the newest ones, which only costs routing hits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import blake3
import msgspec
import zmq

from pdserve.engine.kv.kv_curve import CurveKeys, serve

logger = logging.getLogger(__name__)
TOPIC = b"kv-replay"
REPLAY_CONTEXT = "pdserve kv events replay v1"
REPLAY_VERSION = 1
MAX_REPLAY_BLOCKS = 1 << 17
MAX_REPLY_BYTES = 2 << 20            # 131072 x 9-byte ints + the rest, with room
NONCE_BYTES = 16
MAX_FRAME_BYTES = 512                # what the node reads: requests ~60 bytes, CURVE's INITIATE ~300 (also the PUB's)
LOG_EVERY_S = 10.0                   # at most one warning this often about dropped requests
MAX_REPLIES_PER_S = 8                # answers a second (a token bucket of as many)
RECENT_NONCES = 4096                 # nonces answered, remembered to refuse a copy of their request


class ReplayState(msgspec.Struct, frozen=True):
    epoch: str
    started: float
    seq: int                          # the last batch whose effect ``blocks`` includes (0: none sent yet)
    blocks: list[int]                 # public hashes, at most MAX_REPLAY_BLOCKS
    endpoint: str                     # the PUB endpoint these are the events of
    nonce: str                        # the request's, hex
    version: int = REPLAY_VERSION


def replay_key(events_key: bytes) -> bytes:
    return blake3.blake3(events_key, derive_key_context=REPLAY_CONTEXT).digest()


def _mac(key: bytes, kind: bytes, data: bytes) -> bytes:
    return blake3.blake3(kind + data, key=key).digest()


def request_frames(key: bytes, nonce: bytes) -> list[bytes]:
    return [TOPIC, nonce, _mac(key, b"request", nonce)]


def verify_request(key: bytes, frames: list[bytes]) -> bytes | None:
    """The nonce of a signed request, None for anything else."""
    import hmac

    if len(frames) != 3 or frames[0] != TOPIC or len(frames[1]) != NONCE_BYTES:
        return None
    return frames[1] if hmac.compare_digest(_mac(key, b"request", frames[1]), frames[2]) else None


def reply_frames(key: bytes, state: ReplayState) -> list[bytes]:
    payload = msgspec.msgpack.encode(state)
    return [TOPIC, payload, _mac(key, b"reply", payload)]


def decode_reply(key: bytes, frames: list[bytes], nonce: bytes, endpoint: str) -> ReplayState:
    """The state in a reply to the request with ``nonce`` about the events on ``endpoint``; ValueError otherwise."""
    import hmac

    if len(frames) != 3 or frames[0] != TOPIC or len(frames[1]) > MAX_REPLY_BYTES:
        raise ValueError(f"not a kv-replay reply ({len(frames)} frames)")
    if not hmac.compare_digest(_mac(key, b"reply", frames[1]), frames[2]):
        raise ValueError("kv-replay reply fails its MAC")
    try:
        state = msgspec.msgpack.decode(frames[1], type=ReplayState)
    except msgspec.DecodeError as exc:
        raise ValueError(f"kv-replay reply does not decode: {exc}") from None
    if state.version != REPLAY_VERSION or len(state.blocks) > MAX_REPLAY_BLOCKS or state.nonce != nonce.hex() \
            or state.endpoint != endpoint:
        raise ValueError("kv-replay reply answers another request or another socket, or is out of bounds")
    return state


class BlockMirror:
    """The public hashes the publisher's batches leave stored, and the last batch's seq (under one lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.seq = 0

    def apply(self, seq: int, cleared: bool, stored: list[int], removed: list[int]) -> None:
        with self._lock:
            if cleared:
                self._blocks.clear()
            for h in removed:
                self._blocks.pop(h, None)
            for h in stored:
                self._blocks.pop(h, None)
                self._blocks[h] = None
            while len(self._blocks) > MAX_REPLAY_BLOCKS:
                self._blocks.popitem(last=False)
            self.seq = seq

    def snapshot(self) -> tuple[int, list[int]]:
        with self._lock:
            return self.seq, list(self._blocks)


class ReplayServer:
    """A ROUTER on 127.0.0.1 answering signed replay requests from its own thread."""

    def __init__(self, events_key: bytes, curve: CurveKeys | None, mirror: BlockMirror, describe):
        """``curve``: the cluster's server keys (``kv_curve``; None: a plain socket, dev mode);
        ``describe(seq, blocks, nonce)`` -> the ``ReplayState`` to send."""
        self._key, self._mirror, self._describe = replay_key(events_key), mirror, describe
        self._guard = _RequestGuard()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        serve(self._sock, curve)
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-replay", daemon=True)
        self._thread.start()

    @property
    def counts(self) -> dict[str, int]:
        """Messages the replay thread took from its socket, by what it did with them (answered, or why not)."""
        return dict(self._guard.counts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(200):
                continue
            frames = self._sock.recv_multipart()
            nonce = self._guard.admit(verify_request(self._key, frames[1:]))
            if nonce is None:
                continue
            seq, blocks = self._mirror.snapshot()
            try:
                self._sock.send_multipart([frames[0], *reply_frames(self._key, self._describe(seq, blocks, nonce))],
                                          flags=zmq.NOBLOCK)
            except zmq.Again:
                pass


class _RequestGuard:
    """Which verified requests the replay thread answers: not a nonce seen before, not beyond MAX_REPLIES_PER_S;
    the dropped ones are counted and logged at most once per LOG_EVERY_S."""

    def __init__(self):
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
        self._tokens, self._refilled = float(MAX_REPLIES_PER_S), time.monotonic()
        self.counts = {"answered": 0, "unsigned": 0, "repeated": 0, "over rate": 0}
        self._logged = -LOG_EVERY_S

    def admit(self, nonce: bytes | None) -> bytes | None:
        now = time.monotonic()
        self._tokens = min(float(MAX_REPLIES_PER_S), self._tokens + (now - self._refilled) * MAX_REPLIES_PER_S)
        self._refilled = now
        why = "unsigned" if nonce is None else "repeated" if nonce in self._nonces else \
            "over rate" if self._tokens < 1.0 else None
        self.counts[why or "answered"] += 1
        if why is None:
            self._tokens -= 1.0
            self._nonces[nonce] = None
            if len(self._nonces) > RECENT_NONCES:
                self._nonces.popitem(last=False)
            return nonce
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            logger.warning("dropped KV replay requests (unsigned with the cluster's key, a copy of one answered "
                           "before, or over %d a second) -- so far: %s", MAX_REPLIES_PER_S, self.counts)
        return None
