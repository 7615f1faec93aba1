"""The daemon's side of the arena data plane: MapArena, Reserve, commit (on Put), Lease, Release.

Who calls it: ``KVDaemon`` (daemon.py) on its serve thread only -- one instance per daemon whose store has
an arena (``ArenaTier`` as L1, see arena_tier.py). Requests reach it authenticated (the daemon checks the
session first), so only a client holding the cluster key learns where the arena is.

Per client identity it keeps: the pid the client mapped the arena for (+ its start time), the slots it
reserved and has not committed, and the slots it leased. Whose bytes are whose:
  * A reserved slot belongs to its client until that client's next request: a ``Put(commit=True)``
    serves it (the client wrote it before sending); any other request, the client's death, or
    ``hold_s`` without a word cancel it -- never served, so a client killed mid-put leaves nothing torn.
  * A leased slot is pinned (not evicted, not reused) until the client's next request -- ``Release``,
    sent right after the copy, or anything else -- its death, or ``hold_s`` (a WARNING: a client that
    stalls that long with a lease may read changed bytes, which its seal check turns into a miss).
A client has one request in flight at a time (``DaemonClient`` holds its lock across the copy), so its
next request means it is done with what the previous one reserved or leased.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field

import torch

from pdserve.kvstore import protocol as P
from pdserve.kvstore.shm import NoSegment, process_start_time

log = logging.getLogger(__name__)
HOLD_S = 60.0        # a reservation or lease no request ended in this long is ended by the daemon


@dataclass
class _Client:
    pid: int
    start: int
    reserved: list = field(default_factory=list)
    leased: list = field(default_factory=list)
    since: float = 0.0                    # when the current reservations/leases were made


class ArenaServer:
    def __init__(self, store, hold_s: float = HOLD_S) -> None:
        self.store, self.arena, self.hold_s = store, store.arena, hold_s
        self.gen = secrets.randbits(48) + 1
        self._clients: dict[bytes, _Client] = {}
        self.counters = {"arena_clients": 0, "arena_reserved": 0, "arena_committed": 0, "arena_cancelled": 0,
                         "arena_leased": 0, "arena_expired": 0}

    def before(self, ident: bytes, req) -> None:
        """Any request from ``ident`` ends its leases, and its reservations unless it commits them."""
        client = self._clients.get(ident)
        if client is None:
            return
        if client.leased:
            self.store.unpin(client.leased)
            client.leased = []
        if client.reserved and not (isinstance(req, P.Put) and req.commit):
            self._cancel(client)

    def map(self, ident: bytes, req: P.MapArena) -> P.Reply:
        start = process_start_time(req.pid)
        if start is None:
            raise ValueError(f"pid {req.pid} is not a live process on the daemon's host (the arena needs the same host)")
        self.drop(ident)
        self._clients[ident] = _Client(req.pid, start)
        self.counters["arena_clients"] = len(self._clients)
        return P.Reply(arena=P.ArenaInfo(os.getpid(), self.arena.fd, self.arena.size, self.gen, self.arena.inode))

    def reserve(self, ident: bytes, req: P.Reserve, max_object_bytes: int) -> P.Reply:
        client = self._client(ident, req.gen)
        out = []
        for meta in req.objs:
            P.check_meta(meta, max_object_bytes)
            slot = self.store.reserve(meta)
            if slot is not None:
                client.reserved.append(slot)
            out.append(P.ObjMeta(meta.key, meta.dtype, meta.shape, meta.nbytes,
                                 slot.offset if slot is not None else P.FRAME))
        client.since = time.monotonic()
        self.counters["arena_reserved"] += len(client.reserved)
        return P.Reply(objs=out)

    def commit(self, ident: bytes, gen: int) -> None:
        client = self._client(ident, gen)
        slots, client.reserved = client.reserved, []
        self.store.commit(slots)
        self.counters["arena_committed"] += len(slots)

    def lease(self, ident: bytes, req: P.Lease) -> tuple[P.Reply, list]:
        """Offsets of the slots ``ident`` now leases."""
        client = self._client(ident, req.gen)
        reply, payload, client.leased = self.serve(req.keys, client)
        client.since = time.monotonic()
        self.counters["arena_leased"] += len(client.leased)
        return reply, payload

    def serve(self, keys: list[str], client: _Client | None) -> tuple[P.Reply, list, list]:
        """-> (reply, payload frames, pinned slots). With a mapped ``client``: slots by offset (a frame-backed one
        placed in the arena first; when no room can be made there, a frame of its bytes, still pinned); without (a
        TCP get): slots as frames straight out of the arena (the caller unpins them once zmq has sent them), and
        frame-backed slots as the zmq frames they came in (unpinned now: zmq counts references to those). An object not
        in the arena (a lower tier's that could not be promoted) is a frame of its own bytes."""
        objs, payload, pinned, unpin = [], [], [], []
        for key, found in zip(keys, self.store.lease(keys)):
            if found is None:
                objs.append(None)
                continue
            if hasattr(found, "offset"):
                source = self.store.source_of(found) if client is None else None
                (unpin if source is not None else pinned).append(found)
                if client is not None and self.store.place(found):      # (a frame-backed slot: into the arena)
                    objs.append(P.ObjMeta(key, found.dtype, found.shape, found.nbytes, found.offset))
                    continue
                if source is not None:                     # a frame-backed slot: its own frame, its Put's digest
                    payload.append(source)
                    objs.append(P.ObjMeta(key, found.dtype, found.shape, found.nbytes, P.FRAME, found.digest))
                    continue
                data = self.store.bytes_of(found)          # the slot's bytes in place: no typed tensor built
                payload.append(data)
                objs.append(P.ObjMeta(key, found.dtype, found.shape, found.nbytes, P.FRAME, P.wire_digest(key, data)))
                continue
            data = found.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            payload.append(data)
            objs.append(P.meta_of(key, found, digest=P.wire_digest(key, data)))
        self.store.unpin(unpin)
        return P.Reply(objs=objs), payload, pinned

    def drop(self, ident: bytes) -> None:
        client = self._clients.pop(ident, None)
        if client is not None:
            self._end(client)
        self.counters["arena_clients"] = len(self._clients)

    def reclaim(self) -> int:
        """End what dead clients hold, and what a live one has held past ``hold_s``; how many clients dropped."""
        now = time.monotonic()
        dead = [i for i, c in self._clients.items() if process_start_time(c.pid) != c.start]
        for ident in dead:
            self.drop(ident)
        for client in self._clients.values():
            if (client.reserved or client.leased) and now - client.since > self.hold_s:
                log.warning("KV daemon: a client (pid %d) held %d reserved and %d leased arena slots for over %.0f s; "
                            "ended", client.pid, len(client.reserved), len(client.leased), self.hold_s)
                self.counters["arena_expired"] += 1
                self._end(client)
        return len(dead)

    def close(self) -> None:
        for ident in list(self._clients):
            self.drop(ident)

    def _client(self, ident: bytes, gen: int) -> _Client:
        client = self._clients.get(ident)
        if client is None or gen != self.gen:
            raise NoSegment(f"arena generation {gen} is not this daemon's ({'mapped' if client else 'not mapped'}); "
                            "MapArena again")
        return client

    def _end(self, client: _Client) -> None:
        if client.leased:
            self.store.unpin(client.leased)
            client.leased = []
        self._cancel(client)

    def _cancel(self, client: _Client) -> None:
        if client.reserved:
            self.store.cancel(client.reserved)
            self.counters["arena_cancelled"] += len(client.reserved)
            client.reserved = []
