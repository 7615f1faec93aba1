"""The store daemon (``pdserve kvstore``): a zmq ROUTER serving one ``TieredStore``.

Who calls it: ``cli.run`` builds the store and a ``KVDaemon`` and calls ``serve``;
clients are ``DaemonClient``s (see protocol.py for the wire format). One thread serves
requests in arrival order; the store's write-through thread feeds Redis/disk behind it.
Every message gets exactly one reply: a malformed, oversized or unauthorised message
gets ``ok=False`` with the reason, and the daemon keeps serving. With a cluster token
(``auth.py``) every operation -- Put, Get, Contains, Lookup, Delete, Stats, Attach, even
Ping -- must be signed in a session the client opened with Hello (``session.py``); only the
request's envelope (op, id, token) is decoded before that check. Without a token the daemon
serves anyone who reaches it, so it warns loudly, and refuses to listen beyond loopback
unless ``allow_unauthenticated``. A Put whose digest
does not match its bytes stores nothing. Shared-memory segments (shm.py) are created
by this daemon on Attach and looked up by (client identity, generation); segments of
dead client processes are reclaimed on Attach at the limit and every
``DaemonLimits.shm_reclaim_s`` in the serve loop. A store whose L1 is an arena (arena_tier.py) also
serves MapArena/Reserve/Lease/Release (daemon_arena.py): local clients then write and read L1 in place.
A Delete or Discard is answered once the store has removed the lower tiers' copies too, but the serve thread does
not wait for that (``_held``): the store's write-through worker does it, and other clients are served meanwhile.
A lower tier that was down for it has the removal kept and retried once it is back (tiered.py), and the reply says so
(ok=False, ``P.PENDING``). At stop, a held reply whose removal is not done within ``HELD_GRACE_S`` is answered
ok=False, not left to time out.
TCP payloads go out zero-copy: an arena slot sent as a frame stays pinned until zmq's I/O thread is done
with it (``_sending``: trackers swept by the serve thread; at most ``DaemonLimits.max_send_pinned_bytes`` in
flight, the rest sent as copies), and a put's frames are given to L1 as they are (``keep_frames``: no copy; a
frame-backed slot is copied into the arena only when a shared-memory client leases it, arena_tier.py). A TCP get
sends a frame-backed slot as the very frame it came in (zmq counts references to its bytes, which never change),
unpinned: it holds no arena bytes, and L1 evicting it only drops L1's reference (a reader that stopped reading then
keeps alive what zmq queued for it -- as it would the copies sent past the budget -- never arena slots).
Standalone: ``python -m pdserve.kvstore --port 5557`` (same flags as ``pdserve kvstore``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq

from pdserve.kvstore import protocol as P
from pdserve.kvstore.auth import ClusterKey, check_exposure
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.codec import DEFAULT_MAX_OBJECT_BYTES, tensor_bytes
from pdserve.kvstore.daemon_arena import ArenaServer
from pdserve.kvstore.keys import check_key
from pdserve.kvstore.session import Sessions, SessionError
from pdserve.kvstore.tiered import RemovalQueueFull
from pdserve.kvstore.shm import MAP_GRACE_S, NoSegment, SegmentTable, ShmSegment, align
from pdserve.kvstore.zmq_context import recv_frames, send_frames, shared_context

log = logging.getLogger(__name__)
HELD_GRACE_S = 1.0          # at stop, how long held Delete/Discard replies wait for the store to finish their removal
CLOSE_LINGER_MS = 500       # at close, how long zmq may still spend sending the replies already queued
TRACK_FROM = 32 << 10       # arena frames from this size are sent in place (tracked: ~6 us a frame); smaller ones are copied
#                             (a 64 KiB copy took ~17 us here: devbench/kvstore_tcp_profile.py --track-from for an A/B)


@dataclass(frozen=True)
class DaemonLimits:
    max_batch: int = 4096                 # objects (or keys) per request
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES   # one payload frame / object
    max_header_bytes: int = 2 << 20       # a request's msgpack header: 4096 keys of 200 characters fit
    max_shm_bytes: int = 4 << 30          # one client's segment
    max_shm_clients: int = 64             # attached segments (a live client's is never evicted)
    max_shm_total_bytes: int | None = None   # all segments together (None: half of /dev/shm's free space)
    shm_reclaim_s: float = 5.0            # how often segments of dead or unmapping clients are looked for
    shm_map_grace_s: float = MAP_GRACE_S  # a new segment's process has this long to map it
    max_send_pinned_bytes: int | None = None   # arena bytes TCP replies keep pinned while zmq sends them in place
    #                                            (None: a quarter of the arena); past it a reply goes as a copy


class KVDaemon:
    def __init__(self, store: KVStore, host: str = "127.0.0.1", port: int = 5557, token: str = "",
                 limits: DaemonLimits = DaemonLimits(), allow_unauthenticated: bool = False) -> None:
        """``token``: the cluster token (``kvstore.auth``); "" serves anyone who can connect."""
        check_exposure(token, host, allow_unauthenticated)
        self.store, self.limits = store, limits
        self._sessions = Sessions(ClusterKey(token).wire_key) if token else None
        self._sock = shared_context().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, limits.max_object_bytes + limits.max_header_bytes)
        self._sock.bind(f"tcp://{host}:{port}" if port else f"tcp://{host}:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._segments = SegmentTable(limits.max_shm_clients, limits.max_shm_bytes, limits.max_shm_total_bytes,
                                      limits.shm_map_grace_s)
        self._counters = {"requests": 0, "errors": 0, "checksum_failures": 0, "sends_copied": 0}
        self._arena = ArenaServer(store) if getattr(store, "arena", None) is not None else None
        self._sending: list = []          # (zmq MessageTrackers, arena slots they send, bytes): unpinned once sent
        self._sending_bytes = 0           # the slots' bytes in _sending
        self._send_budget = limits.max_send_pinned_bytes if limits.max_send_pinned_bytes is not None else \
            (self._arena.arena.size // 4 if self._arena is not None else 0)
        self._pinned_reply: list = []     # slots the reply being built sends (handler -> serve)
        self._held_until: list = []       # the Removals the reply being built waits for (handler -> serve): a
        #                                   Delete's or Discard's, set once the store has been over the lower tiers
        self._held: collections.deque = collections.deque()   # (ident, reply frames, those Removals), in the order
        #                                   the store's single worker sets them: sent from the left once set
        self._handlers = {P.Put: self._put, P.Get: self._get, P.Contains: self._contains,
                          P.Lookup: self._lookup, P.Delete: self._delete, P.Discard: self._discard,
                          P.Stats: self._stats,
                          P.Ping: lambda req, ident, frames: (P.Reply(), []),
                          P.Attach: self._attach, P.Detach: self._detach, P.Hello: self._hello,
                          P.MapArena: self._map_arena, P.Reserve: self._reserve, P.Lease: self._lease,
                          P.Release: lambda req, ident, frames: (P.Reply(), [])}

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set (checked every 100 ms)."""
        log.info("KV store daemon listening on %s", self.endpoint)
        next_reclaim = time.monotonic() + self.limits.shm_reclaim_s
        while not stop.is_set():
            if time.monotonic() >= next_reclaim:
                self._reclaim()
                next_reclaim = time.monotonic() + self.limits.shm_reclaim_s
            self._sweep_sent()
            self._answer_held()
            if not self._sock.poll(100 if not (self._sending or self._held) else 1):
                continue
            frames = recv_frames(self._sock)
            ident, body = frames[0].bytes, frames[1:]
            reply = self.handle(ident, body)
            held, self._held_until = self._held_until, []
            if held:
                self._held.append((ident, reply, held))    # the serve thread goes on; answered once it is done
                self._answer_held()
                continue
            pinned, self._pinned_reply = self._pinned_reply, []
            if pinned:
                reply = self._pinned_frames(reply, pinned)
            send_frames(self._sock, [ident, *reply])
            del reply                     # our Frames: a tracker is done only once nothing here refers to its bytes
        self._answer_held_at_stop()

    def _pinned_frames(self, reply: list, pinned: list) -> list:
        """A reply whose payload is arena slots' bytes: sent in place, the slots unpinned once zmq is done with
        them -- while the slots in flight stay under ``_send_budget``. Past it the bytes go as a copy and the slots
        are unpinned now: a client that stopped reading (SIGSTOP, a frozen container, a link gone without a reset)
        holds what zmq queued for it until it reads or its connection drops, and must not pin the arena full."""
        nbytes = sum(s.nbytes for s in pinned)
        if self._sending_bytes + nbytes > self._send_budget:
            self._counters["sends_copied"] += 1
            frames = [reply[0], *_copies(reply[1:])]
            self.store.unpin(pinned)
            return frames
        frames = [reply[0], *(p if isinstance(p, zmq.Frame) else zmq.Frame(p, track=True) if p.nbytes >= TRACK_FROM
                              else zmq.Frame(p.tobytes()) for p in reply[1:])]   # a small one: a copy costs less
        #                                                   than tracking it; a received frame (frame-backed) is itself
        self._sending.append(([f.tracker for f in frames[1:] if f.tracker is not None], pinned, nbytes))
        self._sending_bytes += nbytes
        return frames

    def _answer_held(self) -> None:
        """Send the replies of Deletes and Discards whose lower-tier removal the store has done (tiered.py): a
        client's Delete returns once it is done, and the serve thread never waits for it."""
        while self._held and self._held[0][2][-1].is_set():
            ident, reply, held = self._held.popleft()
            send_frames(self._sock, [ident, *_settled(reply, held)])

    def _answer_held_at_stop(self) -> None:
        """Stopping: the held replies whose removal the store finishes within ``HELD_GRACE_S`` go out as done; the
        rest as a failure that says so, so their clients hear now rather than at their timeout (the store's close
        may still finish those removals)."""
        deadline = time.monotonic() + HELD_GRACE_S
        while self._held:
            ident, reply, held = self._held.popleft()
            done = held[-1].wait(max(0.0, deadline - time.monotonic()))
            reply = _settled(reply, held) if done else \
                _failed(reply, "the daemon stopped before the lower tiers' copies were removed", "")
            send_frames(self._sock, [ident, *reply])

    def _sweep_sent(self) -> None:
        """Unpin the slots of every reply zmq is done with, in whatever order they finish: a reply stuck on one
        client (a stopped process, a slow link) must not keep later replies' slots to other clients pinned."""
        if not self._sending:
            return
        still = []
        for trackers, slots, nbytes in self._sending:
            if all(t is None or t.done for t in trackers):
                self.store.unpin(slots)
                self._sending_bytes -= nbytes
            else:
                still.append((trackers, slots, nbytes))
        self._sending = still

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
        self._segments.close()
        self._sock.close(linger=CLOSE_LINGER_MS)     # (the last replies, _answer_held_at_stop's, still leave)

    def handle(self, ident: bytes, frames: list) -> list:
        """One request's frames -> the reply's frames; never raises."""
        self._counters["requests"] += 1
        req_id = 0
        try:
            env = self._envelope(frames)
            req_id = env.id
            self._admit(ident, env)
            req = self._parse(frames)
            if self._arena is not None:
                self._arena.before(ident, req)
            reply, payload = self._handlers[type(req)](req, ident, frames[1:])
        except Exception as exc:  # noqa: BLE001 - every bad message gets an error reply
            self._counters["errors"] += 1
            log.debug("KV daemon: bad request: %s: %s", type(exc).__name__, exc)
            reply, payload = P.Reply(ok=False, error=f"{type(exc).__name__}: {exc}"), []
            if self._pinned_reply:
                self.store.unpin(self._pinned_reply)
                self._pinned_reply = []
            reply.code = P.NO_SEGMENT if isinstance(exc, NoSegment) else \
                P.NO_SESSION if isinstance(exc, SessionError) and exc.no_session else \
                P.QUEUE_FULL if isinstance(exc, RemovalQueueFull) else ""
        reply.id = req_id
        return [P.ENCODER.encode(reply), *payload]

    def _parse(self, frames: list):
        try:
            return P.REQUEST_DECODER.decode(frames[0].buffer)
        except msgspec.ValidationError:
            _check_version(frames[0].buffer)        # an old client: say so rather than "unknown field"
            raise

    def _envelope(self, frames: list) -> P.Envelope:
        """op, v, id and token of a request, the rest of its header skipped (nothing built for it)."""
        if not frames or len(frames[0]) > self.limits.max_header_bytes:
            raise ValueError(f"header missing or over {self.limits.max_header_bytes} bytes")
        return P.ENVELOPE_DECODER.decode(frames[0].buffer)

    def _admit(self, ident: bytes, env: P.Envelope) -> None:
        """Raise unless the request speaks our version and, with a token, is signed in a live session."""
        _check_version(env)
        if self._sessions is not None and env.op != "hello":
            self._sessions.admit(ident, env.id, env.token)

    def _hello(self, req: P.Hello, ident: bytes, frames: list):
        if self._sessions is None:
            return P.Reply(), []                          # no token: nothing to prove
        return P.Reply(nonce=self._sessions.nonce, proof=self._sessions.hello(ident, req.nonce)), []

    def _check_batch(self, n: int) -> None:
        if n > self.limits.max_batch:
            raise ValueError(f"batch of {n} objects; limit is {self.limits.max_batch}")

    def _put(self, req: P.Put, ident: bytes, frames: list):
        self._check_batch(len(req.objs))
        for meta in req.objs:
            P.check_meta(meta, self.limits.max_object_bytes)
        framed = [m for m in req.objs if m.offset == P.FRAME]
        if len(framed) != len(frames):
            raise ValueError(f"{len(framed)} objects expect payload frames but {len(frames)} frames came")
        if req.commit:
            self._arena_server().commit(ident, req.gen)
        seg = self._segments.get(ident, req.gen) if len(framed) < len(req.objs) else None
        payload = iter(frames)
        if self._arena is not None and seg is None:
            checked = [(meta, self._checked(meta, frame)) for meta, frame in zip(req.objs, payload)]
            self.store.keep_frames(checked)       # every digest first: a bad one stores nothing
            return P.Reply(), []
        items = [(m.key, self._read_payload(m, seg, payload)) for m in req.objs]
        self.store.adopt(items)
        return P.Reply(), []

    def _checked(self, meta: P.ObjMeta, frame: zmq.Frame) -> zmq.Frame:
        """``frame`` itself, once its length and digest match its meta."""
        buf = frame.buffer
        if len(buf) != meta.nbytes:
            raise ValueError(f"object {meta.key!r}: frame has {len(buf)} bytes, meta says {meta.nbytes}")
        if not P.check_digest(meta, buf):
            self._counters["checksum_failures"] += 1
            raise ValueError(f"object {meta.key!r}: digest {meta.digest:#x} does not match its "
                             f"{meta.nbytes} bytes; nothing stored")
        return frame

    def _read_payload(self, meta: P.ObjMeta, seg: ShmSegment | None, frames) -> torch.Tensor:
        """A private copy of one object's bytes, its digest verified on that copy."""
        if meta.offset == P.FRAME:
            frame = next(frames)
            if len(frame) != meta.nbytes:
                raise ValueError(f"object {meta.key!r}: frame has {len(frame)} bytes, meta says {meta.nbytes}")
            raw = P.frame_tensor(frame)           # a large frame's own memory (L1 keeps it, no copy)
        else:
            raw = seg.read(meta.offset, meta.nbytes)
        if not P.check_digest(meta, raw.numpy()):
            self._counters["checksum_failures"] += 1
            raise ValueError(f"object {meta.key!r}: digest {meta.digest:#x} does not match its "
                             f"{meta.nbytes} bytes; nothing stored")
        return raw.view(P.dtype_of(meta.dtype)).reshape(meta.shape)

    def _get(self, req: P.Get, ident: bytes, frames: list):
        self._check_batch(len(req.keys))
        seg = self._segments.get(ident, req.gen) if req.gen else None
        if self._arena is not None and seg is None:
            reply, payload, self._pinned_reply = self._arena.serve(req.keys, None)
            return reply, payload
        objs, payload, offset = [], [], 0
        with self.store.borrow(req.keys) as tensors:
            for key, tensor in zip(req.keys, tensors):
                if tensor is None:
                    objs.append(None)
                    continue
                data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                meta = P.meta_of(key, tensor)
                objs.append(meta)
                if seg is None:
                    payload.append(data)
                elif offset + meta.nbytes <= seg.size:
                    seg.write(offset, data)
                    meta.offset, offset = offset, align(offset + meta.nbytes)
                else:
                    meta.offset = P.DEFERRED        # the client asks again; no digest yet
                    continue
                meta.digest = P.wire_digest(key, data)
        return P.Reply(objs=objs), payload

    def _arena_server(self) -> ArenaServer:
        if self._arena is None:
            raise ValueError("this daemon's store has no shared-memory arena (started with --no-kv-shm-arena)")
        return self._arena

    def _map_arena(self, req: P.MapArena, ident: bytes, frames: list):
        return self._arena_server().map(ident, req), []

    def _reserve(self, req: P.Reserve, ident: bytes, frames: list):
        self._check_batch(len(req.objs))
        return self._arena_server().reserve(ident, req, self.limits.max_object_bytes), []

    def _lease(self, req: P.Lease, ident: bytes, frames: list):
        self._check_batch(len(req.keys))
        return self._arena_server().lease(ident, req)

    def _contains(self, req: P.Contains, ident: bytes, frames: list):
        self._check_batch(len(req.keys))
        return P.Reply(present=self.store.contains(req.keys)), []

    def _lookup(self, req: P.Lookup, ident: bytes, frames: list):
        self._check_batch(len(req.chunk_keys) * max(1, req.num_layers))
        return P.Reply(count=self.store.lookup(req.chunk_keys, req.num_layers)), []

    def _delete(self, req: P.Delete, ident: bytes, frames: list):
        self._check_batch(len(req.keys))
        done = self.store.delete_nowait(req.keys)         # answered once done; the serve thread goes on
        self._held_until = [done] if done is not None else []
        return P.Reply(), []

    def _discard(self, req: P.Discard, ident: bytes, frames: list):
        self._check_batch(len(req.keys))
        if len(req.digests) != len(req.keys):
            raise ValueError(f"discard of {len(req.keys)} keys with {len(req.digests)} digests")
        for key in req.keys:
            check_key(key)
        held = self.store.discards_nowait(                   # all or none (RemovalQueueFull); queued in order:
            [(key, lambda copy, k=key, d=digest: P.digest_of(k, tensor_bytes(copy)) == d)   # the last one done,
             for key, digest in zip(req.keys, req.digests)])                                # all are
        self._held_until = [r for r in held if r is not None]
        return P.Reply(), []

    def _stats(self, req: P.Stats, ident: bytes, frames: list):
        t = self._segments
        shm = {"shm_clients": len(t), "shm_reclaimed": t.reclaimed, "shm_refused": t.refused,
               **(self._arena.counters if self._arena is not None else {})}
        return P.Reply(stats={**self.store.stats(), "daemon": {**self._counters, **shm}}), []

    def _attach(self, req: P.Attach, ident: bytes, frames: list):
        seg = self._segments.attach(ident, req.pid, req.size)
        return P.Reply(segment=P.SegmentInfo(str(seg.path), seg.size, seg.gen)), []

    def _detach(self, req: P.Detach, ident: bytes, frames: list):
        self._segments.drop(ident)
        if self._arena is not None:
            self._arena.drop(ident)
        return P.Reply(), []

    def _reclaim(self) -> None:
        n = self._segments.reclaim_dead()
        if self._arena is not None and self._arena.reclaim():
            log.info("KV daemon: ended the arena reservations and leases of exited clients")
        if n:
            log.info("KV daemon: reclaimed %d shm segments of exited clients", n)


def _settled(reply: list, held: list) -> list:
    """A held Delete's or Discard's reply once its removals are set: as built, or -- a lower tier was down for one of
    them -- ok=False naming the tiers (``P.PENDING``: kept for them, retried once they are back)."""
    missed = sorted({tier for removal in held for tier in removal.missed})
    if not missed:
        return reply
    return _failed(reply, f"removed from L1 and the tiers that were up; {', '.join(missed)} missed it (down): "
                          "retried once back, while this daemon runs", P.PENDING)


def _failed(reply: list, error: str, code: str) -> list:
    """``reply`` (built, encoded) as a failure with ``error``: the same request id."""
    return [P.ENCODER.encode(P.Reply(id=P.REPLY_DECODER.decode(reply[0]).id, ok=False, error=error, code=code))]


def _copies(payload: list) -> list:
    """Frames of copies of ``payload``'s arrays, one copy per distinct range of memory (a reply that names one key
    a thousand times holds one copy of it, not a thousand)."""
    made: dict[tuple[int, int], bytes] = {}
    out = []
    for array in payload:
        if isinstance(array, zmq.Frame):          # a frame-backed slot's own frame: its bytes never change
            out.append(array)
            continue
        span = (array.__array_interface__["data"][0], array.nbytes)
        if span not in made:
            made[span] = array.tobytes()
        out.append(zmq.Frame(made[span]))
    return out


class _Version(msgspec.Struct):
    v: int = P.PROTOCOL_VERSION


def _check_version(req) -> None:
    """``req``: a decoded request, or header bytes that did not decode (read leniently)."""
    if not hasattr(req, "v"):
        try:
            req = msgspec.msgpack.decode(req, type=_Version)
        except msgspec.DecodeError:
            return
    if req.v != P.PROTOCOL_VERSION:
        raise ValueError(f"protocol version {req.v}; this daemon speaks {P.PROTOCOL_VERSION}")


if __name__ == "__main__":      # the flags and the runner are cli.py's, which imports this module: no circle
    raise SystemExit("run the daemon with `python -m pdserve.kvstore` or `pdserve kvstore` (same flags)")
