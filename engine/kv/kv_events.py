"""KV events: a node tells the proxy which blocks its prefix cache gained and lost (vLLM's ``--kv-events-config``).

Who calls what:

    BlockManager (engine thread)   appends ("stored", hash) / ("removed", hash) / ("cleared",) to ``events``
    LLMEngine.step (engine thread) publisher.publish(block_manager.take_events())
    KVEventPublisher (own thread)  batches them, signs each batch, sends it on a ZMQ PUB bound to 127.0.0.1;
                                   an empty batch every ``HEARTBEAT_S`` says the node is alive and which epoch it is
    proxy.kv_events (proxy loop)   SUB: verify -> decode -> ``proxy.kv_state`` (per-node cached blocks)

Wire (one ZMQ multipart message per batch):  [b"kv-events", payload, mac]
    payload = msgpack(EventBatch)      epoch: 16 random bytes (hex) per process; seq: 1, 2, ... within it;
                                       endpoint: the socket it was sent on (the proxy refuses a batch that
                                       arrives on another: one relayed from another node's socket)
    mac     = BLAKE3-keyed(events_key, payload), 32 bytes; events_key = derive_key(cluster token, EVENTS_CONTEXT)

Who may publish and subscribe: the socket binds 127.0.0.1 only and is a CURVE server with the cluster's key pair
(``kv_curve``): a local user without the token cannot complete the handshake, so can neither read the batches nor
send the socket anything (a PUB takes subscriptions from its peers: without CURVE any local user could grow the
node's subscription table without bound, 1M made-up ones cost 153 MB). Only a holder of the token can make a
batch the proxy accepts (the MAC), and a proxy only reads a node that completes the handshake (a squatter on a
dead node's port cannot). Beneath CURVE, what a reader sees stays opaque: every block hash leaves the node as
``public_hash`` -- a keyed hash of it -- so even a leaked CURVE key does not let one test whether a prompt they
guess is cached. Without a token (dev mode; the CLI refuses events then) the socket is plain, as before. Block
hashes are already salted per tenant (``sched.hashing.salt_root``). The first batch of an epoch carries
``cleared``: a restarted node's state starts empty. A subscriber that joins late or lost events asks the
publisher's replay socket for the whole set (``kv_replay``). See docs/threat-model.md.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import blake3
import msgspec
import zmq

from pdserve.engine.kv.kv_curve import serve, server_keys
from pdserve.engine.kv.kv_replay import MAX_FRAME_BYTES, BlockMirror, ReplayServer, ReplayState

logger = logging.getLogger(__name__)
TOPIC = b"kv-events"
EVENTS_CONTEXT = "pdserve kv events v1"
EVENTS_VERSION = 1
HEARTBEAT_S = 0.5
MAX_EVENTS_PER_BATCH = 8192
MAX_BATCH_BYTES = 1 << 20


class EventBatch(msgspec.Struct, frozen=True):
    epoch: str                     # 32 hex chars, new per node process
    started: float                 # the process's start (wall clock): an older epoch never replaces a newer one
    seq: int                       # 1, 2, ... within the epoch: a gap means lost events
    cleared: bool = False          # every block this node announced before is gone (new epoch, cache reset)
    stored: list[int] = []         # public hashes of blocks newly cached, in order
    removed: list[int] = []        # public hashes of blocks evicted
    version: int = EVENTS_VERSION
    endpoint: str = ""             # the PUB socket's endpoint (the card's kv.events): signed with the rest


def events_key(token: str) -> bytes:
    """32 bytes derived from the cluster token; neither the token nor its other keys follow from it."""
    return blake3.blake3(token.encode(), derive_key_context=EVENTS_CONTEXT).digest()


def public_hash(key: bytes, block_hash: int) -> int:
    """What leaves the node for ``block_hash``: a 63-bit keyed hash (the proxy computes the same)."""
    digest = blake3.blake3(block_hash.to_bytes(8, "little"), key=key).digest(8)
    return int.from_bytes(digest, "little") >> 1


def sign(key: bytes, payload: bytes) -> bytes:
    return blake3.blake3(payload, key=key).digest()


def encode_batch(key: bytes, batch: EventBatch) -> list[bytes]:
    payload = msgspec.msgpack.encode(batch)
    return [TOPIC, payload, sign(key, payload)]


def decode_batch(key: bytes, frames: list[bytes]) -> EventBatch:
    """The batch in ``frames``; ValueError when it is not a signed batch (forged, truncated, another key)."""
    if len(frames) != 3 or frames[0] != TOPIC or len(frames[1]) > MAX_BATCH_BYTES:
        raise ValueError(f"not a kv-events message ({len(frames)} frames)")
    if not _equal(sign(key, frames[1]), frames[2]):
        raise ValueError("kv-events batch fails its MAC (not signed with this cluster's key)")
    try:
        batch = msgspec.msgpack.decode(frames[1], type=EventBatch)
    except msgspec.DecodeError as exc:
        raise ValueError(f"kv-events batch does not decode: {exc}") from None
    if batch.version != EVENTS_VERSION or len(batch.stored) + len(batch.removed) > MAX_EVENTS_PER_BATCH:
        raise ValueError(f"kv-events batch version {batch.version} or size out of bounds")
    return batch


def _equal(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


class KVEventPublisher:
    """Binds a PUB socket on 127.0.0.1 (``port`` 0: a free one; ``endpoint`` names it) and sends what
    ``publish`` hands it from its own thread; a replay ROUTER beside it (``replay_endpoint``, ``kv_replay``)."""

    def __init__(self, token: str, port: int = 0):
        self._key = events_key(token)
        curve = server_keys(token)                    # None without a token: plain sockets (dev mode)
        self._epoch, self._started, self._seq = os.urandom(16).hex(), time.time(), 0
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 1000)     # a slow subscriber loses batches (it sees the seq gap)
        # What a PUB reads: subscriptions (the proxy's is 1 byte) and, before that, the handshake -- which ZMQ
        # buffers whole before CURVE looks at it: uncapped, a peer without any key made the node hold a 200 MB
        # "HELLO" per connection until the handshake timed out (tests/test_review_curve.py).
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        serve(self._sock, curve)                      # only token holders subscribe (``kv_curve``)
        self._sock.bind(f"tcp://127.0.0.1:{port or '*'}")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._pending_clear = True                    # the first batch of an epoch clears the subscriber's view
        self._mirror = BlockMirror()                  # what the batches sent leave stored: the replay's answer
        self._replay = ReplayServer(self._key, curve, self._mirror, self._describe)
        self.replay_endpoint = self._replay.endpoint
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events on %s (epoch %s)", self.endpoint, self._epoch[:8])

    def publish(self, events: list[tuple]) -> None:
        """Engine thread: ``events`` from ``BlockManager.take_events`` (may be empty: nothing is queued)."""
        if events:
            self._inbox.put(events)

    def close(self) -> None:
        self._stop.set()
        self._inbox.put([])
        self._thread.join(timeout=2.0)
        self._replay.close()
        self._sock.close()

    def _describe(self, seq: int, blocks: list[int], nonce: bytes) -> ReplayState:
        return ReplayState(self._epoch, self._started, seq, blocks, self.endpoint, nonce.hex())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._inbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                events = []
            while True:                               # everything queued so far goes in one batch
                try:
                    events = events + self._inbox.get_nowait()
                except queue.Empty:
                    break
            for start in range(0, max(len(events), 1), MAX_EVENTS_PER_BATCH):
                self._send(events[start:start + MAX_EVENTS_PER_BATCH])

    def _send(self, events: list[tuple]) -> None:
        cleared = self._pending_clear or any(e[0] == "cleared" for e in events)
        after = max((i for i, e in enumerate(events) if e[0] == "cleared"), default=-1) + 1
        stored, removed = _net(events[after:])
        stored = [public_hash(self._key, h) for h in stored]
        removed = [public_hash(self._key, h) for h in removed]
        self._seq += 1
        self._mirror.apply(self._seq, any(e[0] == "cleared" for e in events), stored, removed)
        batch = EventBatch(self._epoch, self._started, self._seq, cleared, stored, removed, endpoint=self.endpoint)
        try:
            self._sock.send_multipart(encode_batch(self._key, batch), flags=zmq.NOBLOCK)
            self._pending_clear = False
        except zmq.Again:                             # nobody reads fast enough: the seq gap tells them
            pass


def _net(events: list[tuple]) -> tuple[list[int], list[int]]:
    """(stored, removed) with the batch's order folded in: a subscriber removes, then stores. A block stored and
    evicted within the batch is only removed; one evicted and stored again is in both (it ends up stored)."""
    stored: dict[int, None] = {}
    removed: dict[int, None] = {}
    for event in events:
        if event[0] == "stored":
            stored[event[1]] = None
        elif event[0] == "removed":
            stored.pop(event[1], None)
            removed[event[1]] = None
    return list(stored), list(removed)
