"""A ``DaemonClient``'s puts and gets as zmq frames or through a per-client segment (shm.py), and the checks
every received payload passes.

Who calls it: ``DaemonClient`` (client.py) under its lock when the daemon has no arena or the client no
shared memory (a TCP client: frames only); ``own`` and ``payload`` also check the frames of the arena path
(client_arena.py). Over TCP a put goes as requests of about ``PART_BYTES`` and a get as ``GET_PARTS`` requests,
all sent back to back; each get reply is checked in one pass (``framed_objects``).
The segment belongs to the request holding the client's lock: a put writes its objects at 64-byte aligned
offsets, a get's reply names where the daemon wrote them; what does not fit goes as frames (a get's
DEFERRED objects are asked again). Every payload carries the xxh3 digest of key + bytes (0 for a sealed object of its key:
protocol.wire_digest): a mismatch, a frame of the wrong length or a reply naming another key is a counted miss.
"""

from __future__ import annotations

import logging

import torch

from pdserve.kvstore import protocol as P
from pdserve.kvstore.seal import sealed_for
from pdserve.kvstore.shm import ShmSegment, align

log = logging.getLogger(__name__)


PART_BYTES = 4 << 20      # frames: a put batch goes as requests of about this many bytes, sent back to back; each
#                           reply is waited for with the client's timeout, so a slow link need only move a part within
#                           it. One request per 64 MiB batch measured within the noise of this (devbench/
#                           kvstore_tcp_parts.py, median x raw pyzmq over 100-150 alternated calls: 1 MiB objects
#                           0.82-0.91 in 4 MiB parts, 0.88-0.92 as one; 8 MiB objects 1.03 against 0.95) and would
#                           need a link 16x faster to meet the same timeout.
GET_PARTS = 8             # frames: a get batch is asked as this many requests (of 8 keys at least), back to back:
#                           each reply is waited for with the client's timeout, and pins an eighth of the daemon's
#                           send budget (tests/test_review40c_*). One request measured faster on an idle box (1 MiB
#                           objects: median 0.93 x raw pyzmq against 0.81) but turns a slow link's long batch into a
#                           timeout, and a batch over the budget into a full copy.


def put_batch(client, objs: list, start: int, seg: ShmSegment | None) -> int:
    """Send objs[start:] up to the batch limit and what fits in ``seg``; the next start."""
    if seg is None:
        return _put_frames(client, objs, start)
    metas, frames, offset = [], [], 0
    for meta, data in objs[start:start + client.max_batch]:
        meta.digest = P.wire_digest(meta.key, data)
        if seg is not None and meta.nbytes <= seg.size:
            if offset + meta.nbytes > seg.size:
                break
            seg.write(offset, data)
            meta.offset, offset = offset, align(offset + meta.nbytes)
        else:
            meta.offset = P.FRAME
            frames.append(data)
        metas.append(meta)
    client._count(len(metas) - len(frames), len(frames))
    client._call(P.Put(objs=metas, gen=seg.gen if len(frames) < len(metas) else 0), frames)
    return start + len(metas)


def _put_frames(client, objs: list, start: int) -> int:
    """objs[start:] up to the batch limit as frames, in parts sent back to back (each part's digests are computed
    while the previous part is on the wire, and checked by the daemon while the next one arrives)."""
    batch = objs[start:start + client.max_batch]
    parts, size = [[]], 0
    for meta, data in batch:
        if parts[-1] and size + meta.nbytes > PART_BYTES:
            parts.append([])
            size = 0
        parts[-1].append((meta, data))
        size += meta.nbytes

    def requests():
        for part in parts:
            for meta, data in part:
                meta.offset, meta.digest = P.FRAME, P.wire_digest(meta.key, data)
            yield P.Put(objs=[m for m, _ in part]), [d for _, d in part]
    for _ in client._call_many(requests()):
        pass
    client._count(0, len(batch))
    return start + len(batch)


def _get_frames(client, keys: list[str]) -> list[torch.Tensor | None]:
    """Frames for ``keys`` in parts asked back to back: one part is checked while the next arrives."""
    step = max(8, -(-len(keys) // GET_PARTS))
    parts = [keys[i:i + step] for i in range(0, len(keys), step)]
    out: list[torch.Tensor | None] = []
    for part, (reply, frames) in zip(parts, client._call_many((P.Get(keys=p), []) for p in parts)):
        out += framed_objects(client, part, reply.objs, frames)
    return out


def framed_objects(client, keys: list[str], objs: list, frames: list) -> list[torch.Tensor | None]:
    """A frames-only Get reply's objects (``objs``: its metas, one per key; every payload a frame, in order): what
    ``own(payload(...))`` gives each -- a sealed object (uint8, 1-D) is the frame's own tensor, no typed view built.
    A reply whose frames do not pair with its metas raises (the caller: a store miss)."""
    if len(objs) != len(keys):
        raise client.error(f"answered {len(objs)} objects for {len(keys)} keys")
    if len(frames) != sum(m is not None for m in objs) or any(m is not None and m.offset != P.FRAME for m in objs):
        raise client.error(f"answered {len(frames)} frames for {sum(m is not None for m in objs)} framed objects")
    frames = iter(frames)
    return [None if meta is None else _framed(client, key, meta, next(frames)) for key, meta in zip(keys, objs)]


def _framed(client, key: str, meta: P.ObjMeta, frame) -> torch.Tensor | None:
    """``own(payload(client, meta, iter([frame]), None))``, with fewer steps; a sealed object of ``key`` (what every
    node stores) in one: its frame's own tensor, once the frame's length and seal header match."""
    buf, n = frame.buffer, meta.nbytes
    if meta.digest == 0 and meta.key == key and meta.dtype == "uint8" and len(buf) == n >= P.KEEP_FRAME_FROM \
            and meta.shape == [n] and sealed_for(key, buf):
        client._count(0, 1)
        return torch.frombuffer(buf, dtype=torch.uint8)
    if len(frame) != meta.nbytes or P.nbytes_of(meta) != meta.nbytes:
        return _bad_frame(client, meta, frame)
    client._count(0, 1)
    if not P.check_digest(meta, frame.buffer):
        return _bad_digest(client, meta)
    raw = own(client, key, meta, P.frame_tensor(frame))
    if raw is None or (meta.dtype == "uint8" and len(meta.shape) == 1):
        return raw                                  # (uint8 [nbytes]: the frame's tensor is the object)
    return raw.view(P.dtype_of(meta.dtype)).reshape(meta.shape)


def get_batch(client, keys: list[str], seg: ShmSegment | None) -> list[torch.Tensor | None]:
    if seg is None:
        return _get_frames(client, keys)
    out: list[torch.Tensor | None] = [None] * len(keys)
    todo = list(range(len(keys)))
    while todo:
        reply, frames = client._call(P.Get(keys=[keys[i] for i in todo], gen=seg.gen if seg else 0))
        if len(reply.objs) != len(todo):
            raise client.error(f"answered {len(reply.objs)} objects for {len(todo)} keys")
        frames, deferred = iter(frames), []
        for i, meta in zip(todo, reply.objs):
            if meta is not None and meta.offset == P.DEFERRED:
                deferred.append(i)
            elif meta is not None:
                out[i] = own(client, keys[i], meta, payload(client, meta, frames, seg))
        seg = seg if len(deferred) < len(todo) else None    # nothing fit: fall back to frames
        todo = deferred
    return out


def own(client, key: str, meta: P.ObjMeta, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The object only if the reply names the key that was asked for (else a counted miss)."""
    if tensor is not None and meta.key != key:
        client._counters["checksum_failures"] += 1
        log.warning("KV daemon at %s answered object %r for key %r; treated as a miss", client.url,
                    meta.key[:80], key)
        return None
    return tensor


def payload(client, meta: P.ObjMeta, frames, seg: ShmSegment | None) -> torch.Tensor | None:
    """One object's bytes (a received frame's own memory, or a copy out of the segment); None (a counted miss)
    when its digest is wrong."""
    if meta.offset == P.FRAME:
        frame = next(frames)
        if len(frame) != meta.nbytes or P.nbytes_of(meta) != meta.nbytes:
            return _bad_frame(client, meta, frame)
        raw = P.frame_tensor(frame)
    else:
        raw = seg.read(meta.offset, meta.nbytes)
    client._count(meta.offset != P.FRAME, meta.offset == P.FRAME)
    if not P.check_digest(meta, raw.numpy()):
        return _bad_digest(client, meta)
    return raw.view(P.dtype_of(meta.dtype)).reshape(meta.shape)


def _bad_frame(client, meta: P.ObjMeta, frame) -> None:
    client._counters["checksum_failures"] += 1
    log.warning("KV daemon at %s: object %r has a %d-byte frame for %d bytes of %s%s; treated as a "
                "miss", client.url, meta.key[:80], len(frame), meta.nbytes, meta.dtype, meta.shape[:8])


def _bad_digest(client, meta: P.ObjMeta) -> None:
    client._counters["checksum_failures"] += 1
    log.warning("KV daemon at %s: object %r failed its digest check (%d bytes); treated as a miss",
                client.url, meta.key, meta.nbytes)
