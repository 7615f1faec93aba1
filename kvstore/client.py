"""``DaemonClient``: the ``KVStore`` interface over a store daemon (``--kv-store tcp://...``).

Who calls it: an engine whose store lives in another process (its publisher, loader, lookup and
kv-stats threads share one client, never its engine thread: ``decode/loader.py``), the bench, tests. Daemon errors raise ``DaemonError``; a silent
daemon raises ``TimeoutError`` naming the URL -- the caller treats both as a store miss.

Who owns what (issue 9):
  * ``_lock`` serialises whole requests: one request in flight per client, so one per
    segment. A put holds it from the segment write to the reply; a get from the send to
    the last copy out of the segment. No thread touches the socket, the segment or the
    counters without it; ``close`` takes it too, so it is safe from any thread, and
    idempotent.
  * The segment is the daemon's (it creates, reserves and names it on ``Attach``); the
    client maps it and unlinks the name. A region of it belongs to the request holding
    the lock and is reused only after that request's reply has been consumed.
  * A request that times out may still run in the daemon later, so its segment is
    abandoned (never written again) and the next put/get attaches a new one with a new
    generation; the daemon refuses requests naming an old generation. Replies are
    matched by request id, so a late reply is discarded.
  * When the daemon has no segment of ours (restarted, or reclaimed it) the request is
    retried once after a fresh ``Attach``. A refused ``Attach`` (limit reached, no room in
    /dev/shm) means zmq frames, and another try after ``SHM_RETRY_S``.
With a cluster token, the client first makes whoever answers on the daemon's port prove it holds the
wire key, then signs every request for that daemon process (``session.py``): nothing it sends can be
reused by a process that takes the port while the daemon is down, and the token never leaves this process. Every payload carries an xxh3 digest of key + bytes (see protocol.py; a sealed
object of its key carries 0 instead, as its MAC covers both): an accident check, not a seal -- the keyed MAC inside each object (``seal.py``) is what a loader trusts. A
get whose bytes do not match, or whose frame does not hold the bytes its meta names, is a miss, logged
and counted under ``stats()["client"]``. Objects larger
than the segment travel as zmq frames; batches are split to the daemon's limits.
With ``shm_bytes`` > 0 the client first asks for the daemon's arena (its L1 in shared memory,
client_arena.py: one copy each way, no digest -- a slot is served only once committed); a daemon
without one (``--no-kv-shm-arena``, or a plain store) gets a segment of ``shm_bytes`` as before.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import secrets
import threading
import time

import torch
import zmq

from pdserve.kvstore import client_arena, client_segment
from pdserve.kvstore import protocol as P
from pdserve.kvstore.arena import ArenaMap
from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.session import daemon_proof, new_nonce, request_token
from pdserve.kvstore.base import KVStore, StatsDict
from pdserve.kvstore.codec import tensor_bytes
from pdserve.kvstore.keys import check_key
from pdserve.kvstore.shm import ShmSegment
from pdserve.kvstore.zmq_context import recv_frames, send_frames, shared_context

log = logging.getLogger(__name__)
SHM_RETRY_S = 30.0      # after a refused Attach, use frames this long before asking again
_COUNTERS = ("checksum_failures", "timeouts", "arena_maps", "shm_attaches", "shm_refused", "shm_abandoned",
             "shm_objects", "frame_objects", "daemon_auth_failures")
MAX_FRAME_BYTES = 1 << 30   # no reply frame larger (a frame is one object, or the header of a batch)
COPY_BELOW = 128 << 10      # a put's payload frame under this size is copied into zmq, a larger one sent in place:
#                             pyzmq's zero-copy send (a Frame, its release through pyzmq's garbage-collector thread)
#                             cost more CPU than a memcpy of 64 KiB here -- ~600 vs ~400 us/MiB for 64 KiB frames,
#                             while from 256 KiB zero-copy costs less (devbench/kvstore_tcp_profile.py --copy-below for an A/B)


class DaemonError(RuntimeError):
    """The daemon answered ``ok=False``; the message is its reason."""


class RemovalPending(DaemonError):
    """A Delete or Discard left L1 and the tiers that were up; a tier that was down gets it once back (``P.PENDING``)."""


class RemovalRefused(DaemonError):
    """A Delete or Discard refused whole, nothing done: the daemon's queued removals are at their bound
    (``P.QUEUE_FULL``: a stalled tier); retry once they drain."""


class _SegmentLost(DaemonError):
    """The daemon has no segment of our generation (restarted, or reclaimed it)."""


class _NoSession(DaemonError):
    """The daemon has no session for us (restarted, or forgot it): say Hello again."""


class DaemonClient(KVStore):
    name = "daemon"

    def __init__(self, url: str, token: str = "", shm_bytes: int = 0, timeout_s: float = 30.0,
                 max_batch: int = 1024) -> None:
        """``token``: the cluster token (``kvstore.auth``), "" for a daemon without one."""
        self.url, self.timeout_ms, self.max_batch = url, int(timeout_s * 1000), max_batch
        self._wire_key = ClusterKey(token).wire_key if token else None
        self._daemon_nonce: bytes | None = None          # the daemon process this client's session is with
        self._ident = secrets.token_bytes(16)
        self._sock = shared_context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self._ident)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)   # a reply frame: one object, or one header
        self._sock.copy_threshold = COPY_BELOW
        self._sock.connect(url)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._shm_bytes, self._seg = shm_bytes, None    # arena or segment, mapped lazily by the first put/get
        self._try_arena = True                          # until a daemon says it has none
        self._attach_at = 0.0 if shm_bytes else float("inf")
        self._counters = dict.fromkeys(_COUNTERS, 0)

    def put(self, items: list[tuple[str, torch.Tensor]]) -> None:
        objs = [(P.meta_of(check_key(key), tensor), tensor_bytes(tensor)) for key, tensor in items]
        done = 0
        while done < len(objs):
            done = self._with_segment(lambda seg: self._put_batch(objs, done, seg))

    def get(self, keys: list[str]) -> list[torch.Tensor | None]:
        return [t for b in self._batches(keys) for t in self._with_segment(lambda seg: self._get_batch(b, seg))]

    def contains(self, keys: list[str]) -> list[bool]:
        return [p for b in self._batches(keys) for p in self._request(P.Contains(keys=b))[0].present]

    def lookup(self, chunk_keys: list[str], num_layers: int) -> int:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        per = max(1, self.max_batch // num_layers)      # the daemon takes chunks x layers <= its max_batch keys
        found = 0
        for start in range(0, len(chunk_keys), per):
            batch = chunk_keys[start:start + per]
            count = self._request(P.Lookup(chunk_keys=batch, num_layers=num_layers))[0].count
            found += count
            if count < len(batch):
                break
        return found

    def delete(self, keys: list[str]) -> None:
        """Every batch is sent; a batch a down tier missed (``RemovalPending``) is raised once all were sent: the
        later batches are deleted too (tests/test_review42_delete_batches_pending.py). Any other failure -- a batch
        refused whole (``RemovalRefused``), a timeout -- raises at once: the batches before it are done, the later
        ones not sent."""
        pending = None
        for b in self._batches(keys):
            try:
                self._request(P.Delete(keys=b))
            except RemovalPending as exc:
                pending = pending or exc
        if pending is not None:
            raise pending

    def discard(self, key: str, refused: torch.Tensor) -> None:
        """Only the daemon's copies of ``refused``'s bytes (``P.Discard``); a daemon without Discard: Delete."""
        self._batches([key])
        try:
            self._request(P.Discard(keys=[key], digests=[P.digest_of(key, tensor_bytes(refused))]))
        except (RemovalPending, RemovalRefused):
            raise                       # (a Delete instead would also remove the copies that are intact)
        except DaemonError:
            self.delete([key])

    def stats(self) -> StatsDict:
        with self._lock:
            self._check_open()
            return {**self._call(P.Stats())[0].stats, "client": dict(self._counters)}

    def ping(self) -> bool:
        return self._request(P.Ping())[0].ok

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._seg is not None:
                try:
                    self.timeout_ms = min(self.timeout_ms, 1000)
                    self._call(P.Detach())
                except (TimeoutError, DaemonError):
                    pass
                self._drop_segment()
            self._sock.close(linger=0)

    # --- under the lock ------------------------------------------------------------

    def _with_segment(self, fn):
        """``fn(segment or None)`` under the lock; once more after re-attaching if the
        daemon lost our segment."""
        with self._lock:
            self._check_open()
            try:
                return fn(self._segment())
            except _SegmentLost as exc:
                self._abandon(str(exc))
                return fn(self._segment())

    def _put_batch(self, objs: list, start: int, seg: ShmSegment | ArenaMap | None) -> int:
        """Send objs[start:] up to the batch limit (and what fits in ``seg``); the next start."""
        return (client_arena if isinstance(seg, ArenaMap) else client_segment).put_batch(self, objs, start, seg)

    def _get_batch(self, keys: list[str], seg: ShmSegment | ArenaMap | None) -> list[torch.Tensor | None]:
        return (client_arena if isinstance(seg, ArenaMap) else client_segment).get_batch(self, keys, seg)

    def _segment(self) -> ShmSegment | ArenaMap | None:
        """The mapped arena or attached segment, mapping when due; None means zmq frames."""
        if self._seg is None and time.monotonic() >= self._attach_at:
            if not (self._try_arena and self._map_arena()):
                self._attach()
        return self._seg

    def _map_arena(self) -> bool:
        try:
            self._seg = client_arena.open_arena(self._call(P.MapArena(pid=os.getpid()))[0].arena)
            self._counters["arena_maps"] += 1
            return True
        except TimeoutError:
            raise
        except (DaemonError, OSError, ValueError) as exc:
            self._try_arena = False
            log.info("KV daemon at %s: no arena (%s); using a shared-memory segment", self.url, exc)
            return False

    def _attach(self) -> None:
        try:
            info = self._call(P.Attach(pid=os.getpid(), size=self._shm_bytes))[0].segment
            if info is None:
                raise DaemonError(f"KV daemon at {self.url}: Attach reply names no segment")
            self._seg = ShmSegment.open(info.path, info.size, info.gen)
            self._counters["shm_attaches"] += 1
        except TimeoutError:
            raise                       # a silent daemon is not a refusal: attach again next time
        except (DaemonError, OSError, ValueError) as exc:
            self._attach_at = time.monotonic() + SHM_RETRY_S
            self._counters["shm_refused"] += 1
            log.warning("KV daemon at %s: no shared memory (%s); using zmq frames, next try in %.0f s",
                        self.url, exc, SHM_RETRY_S)

    def _abandon(self, why: str) -> None:
        """Never touch the segment again: the daemon may still act on a request naming it. (A lost arena --
        a restarted daemon -- is simply mapped again; our old slots there are cancelled or ended.)"""
        if isinstance(self._seg, ArenaMap):
            log.info("KV daemon at %s: mapping its arena again (%s)", self.url, why)
            self._drop_segment()
            self._attach_at = 0.0
        elif self._seg is not None:
            log.warning("KV daemon at %s: abandoning shm segment generation %d (%s)", self.url, self._seg.gen, why)
            self._counters["shm_abandoned"] += 1
            self._drop_segment()
            self._attach_at = 0.0

    def _drop_segment(self) -> None:
        self._seg.close()
        self._seg = None

    def _call(self, req, frames=()) -> tuple[P.Reply, list]:
        """One signed request, one reply; says Hello first (and again, once, when the daemon lost the session)."""
        try:
            return self._signed(req, frames)
        except _NoSession:
            self._daemon_nonce = None
            return self._signed(req, frames)

    def _signed(self, req, frames) -> tuple[P.Reply, list]:
        self._sign(req)
        return self._exchange(req, frames)

    def _sign(self, req) -> None:
        if self._wire_key is not None and self._daemon_nonce is None:
            self._hello()
        req.id = next(self._ids)
        if self._wire_key is not None:
            req.token = request_token(self._wire_key, self._daemon_nonce, self._ident, req.id)

    def _post(self, req) -> None:
        """Send a signed request without waiting: its reply is discarded by the next exchange (ids differ)."""
        try:
            self._sign(req)
            self._sock.send_multipart([P.ENCODER.encode(req)], copy=False)
        except (zmq.ZMQError, DaemonError, TimeoutError) as exc:
            log.debug("KV daemon at %s: %s not sent (%s)", self.url, type(req).__name__, exc)

    def error(self, what: str) -> DaemonError:
        return DaemonError(f"KV daemon at {self.url} {what}")

    def _hello(self) -> None:
        """Make whoever answers on the port prove it holds the wire key; nothing else is sent until it does."""
        nonce = new_nonce()
        req = P.Hello(nonce=nonce)
        req.id = next(self._ids)
        reply, _ = self._exchange(req, ())
        if not reply.nonce or not hmac.compare_digest(reply.proof, daemon_proof(self._wire_key, nonce, reply.nonce)):
            self._counters["daemon_auth_failures"] += 1
            raise DaemonError(f"the process answering at {self.url} does not hold the cluster's key (a daemon with "
                              "another token, none, or not the daemon at all); nothing was sent to it")
        self._daemon_nonce = reply.nonce

    def _exchange(self, req, frames) -> tuple[P.Reply, list]:
        """One request, one reply (matched by id; late replies are discarded)."""
        send_frames(self._sock, [P.ENCODER.encode(req), *frames])
        return self._await(req)

    def _call_many(self, reqs):
        """``reqs``: (request, frames) pairs, made as they are sent -- back to back, so the daemon works on one
        while the next is on the wire and this thread prepares the one after; -> their replies, in order, as
        they come (so the caller checks one while the next arrives). Says Hello again once if the daemon lost
        the session (it then did nothing: every request was refused)."""
        sent = [self._send_signed(req, frames) for req, frames in reqs]
        try:
            first = self._await(sent[0][0])
        except _NoSession:
            self._daemon_nonce = None
            sent = [self._send_signed(req, frames) for req, frames in sent]
            first = self._await(sent[0][0])
        yield first
        for req, _ in sent[1:]:
            yield self._await(req)

    def _send_signed(self, req, frames) -> tuple:
        self._sign(req)
        send_frames(self._sock, [P.ENCODER.encode(req), *frames])
        return req, frames

    def _await(self, req) -> tuple[P.Reply, list]:
        """The reply to ``req`` (earlier, late replies are discarded); raises what it says."""
        while True:
            if not self._sock.poll(self.timeout_ms):
                self._counters["timeouts"] += 1
                if getattr(req, "gen", 0) or isinstance(req, P.MapArena):
                    self._abandon(f"{type(req).__name__} timed out")
                raise TimeoutError(f"KV daemon at {self.url} did not answer {type(req).__name__} "
                                   f"within {self.timeout_ms} ms")
            reply_frames = recv_frames(self._sock)
            reply = P.REPLY_DECODER.decode(reply_frames[0].buffer)
            if reply.id == req.id:
                break
        if not reply.ok:
            kind = {P.NO_SEGMENT: _SegmentLost, P.NO_SESSION: _NoSession, P.PENDING: RemovalPending,
                    P.QUEUE_FULL: RemovalRefused}.get(reply.code, DaemonError)
            raise kind(f"KV daemon at {self.url}: {reply.error}")
        return reply, reply_frames[1:]

    def _request(self, req) -> tuple[P.Reply, list]:
        with self._lock:
            self._check_open()
            return self._call(req)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"DaemonClient for {self.url} is closed")

    def _count(self, shm: int, frames: int) -> None:
        self._counters["shm_objects"] += shm
        self._counters["frame_objects"] += frames

    def _batches(self, keys: list[str]):
        for key in keys:
            check_key(key)
        return [keys[i:i + self.max_batch] for i in range(0, len(keys), self.max_batch)]
