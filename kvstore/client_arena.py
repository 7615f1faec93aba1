"""A ``DaemonClient``'s puts and gets through the daemon's arena: one copy each way.

Who calls it: ``DaemonClient`` (client.py), under its lock, with the ``ArenaMap`` it mapped (arena.py).

    put:  Reserve(metas) -> slots ; copy each tensor into its slot (the one copy) ; Put(commit=True, frames)
    get:  Lease(keys) -> offsets ; copy each slot out into a fresh tensor (the one copy) ; Release (no wait)

Whose bytes: the client writes only the slots the daemon reserved for it, and only between the Reserve
reply and the commit; it reads only slots it leased, and only before its next request (the daemon ends a
client's reservations and leases at its next request: see daemon_arena.py). Objects the arena has no room
for travel as zmq frames in the same requests (with their xxh3 digest, as on the frames path). A reply
naming another key, or a range outside the arena, is a counted miss, never a read out of bounds.
"""

from __future__ import annotations

import logging

import torch

from pdserve.kvstore import client_segment
from pdserve.kvstore import protocol as P
from pdserve.kvstore.arena import ArenaMap

log = logging.getLogger(__name__)


def put_batch(client, objs: list, start: int, amap: ArenaMap) -> int:
    """Put objs[start:] up to the client's batch limit; the next start."""
    batch = objs[start:start + client.max_batch]
    bare = [P.ObjMeta(m.key, m.dtype, m.shape, m.nbytes) for m, _ in batch]
    placed = client._call(P.Reserve(objs=bare, gen=amap.gen))[0].objs
    if len(placed) != len(batch):
        raise client.error(f"answered {len(placed)} slots for {len(batch)} objects")
    framed, frames = [], []
    for (meta, data), slot in zip(batch, placed):
        if slot is not None and slot.offset >= 0 and slot.key == meta.key and slot.nbytes == meta.nbytes:
            amap.write(slot.offset, data)
        else:
            meta.offset, meta.digest = P.FRAME, P.wire_digest(meta.key, data)
            framed.append(meta)
            frames.append(data)
    client._count(len(batch) - len(frames), len(frames))
    client._call(P.Put(objs=framed, gen=amap.gen, commit=True), frames)
    return start + len(batch)


def get_batch(client, keys: list[str], amap: ArenaMap) -> list[torch.Tensor | None]:
    reply, frames = client._call(P.Lease(keys=keys, gen=amap.gen))
    try:
        if len(reply.objs) != len(keys):
            raise client.error(f"answered {len(reply.objs)} objects for {len(keys)} keys")
        frames = iter(frames)
        return [None if meta is None else _one(client, key, meta, frames, amap) for key, meta in zip(keys, reply.objs)]
    finally:
        client._post(P.Release())            # the copies are done: let the daemon evict those slots again


def _one(client, key: str, meta: P.ObjMeta, frames, amap: ArenaMap) -> torch.Tensor | None:
    if meta.offset == P.FRAME:
        return client_segment.own(client, key, meta, client_segment.payload(client, meta, frames, None))
    if meta.key != key or P.nbytes_of(meta) != meta.nbytes or not 0 <= meta.offset <= amap.size - meta.nbytes:
        client._counters["checksum_failures"] += 1
        log.warning("KV daemon at %s: arena reply for key %r names %r at [%d, +%d) (%s%s); treated as a miss",
                    client.url, key[:80], meta.key[:80], meta.offset, meta.nbytes, meta.dtype, meta.shape[:8])
        return None
    client._count(1, 0)
    return amap.read(meta.offset, meta.nbytes).view(P.dtype_of(meta.dtype)).reshape(meta.shape)


def open_arena(info: P.ArenaInfo | None) -> ArenaMap:
    if info is None:
        raise ValueError("MapArena reply names no arena")
    return ArenaMap.open(info.pid, info.fd, info.size, info.gen, info.inode)
