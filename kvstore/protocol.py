"""Messages between ``DaemonClient`` and the daemon (``pdserve kvstore``): one module, typed.

Transport: a zmq DEALER (client) talks to a ROUTER (daemon). A message is multipart:
    [header, payload_0, payload_1, ...]        header = msgpack of one Request / Reply
Payload frames carry raw tensor bytes (no serialisation header: zmq frames arrive whole),
one per ``ObjMeta`` whose ``offset`` is FRAME.

Shared memory (same host only): ``Attach(pid, size)`` asks the daemon to create a
segment; the reply's ``segment`` names its path, size and generation (``gen``: never
reused by a daemon, and randomly based so a restarted daemon does not repeat one).
A Put or Get that uses the segment names that ``gen``; the daemon refuses any other
(reply ``code=NO_SEGMENT``: attach again). Payloads then live in the segment at
``ObjMeta.offset`` and only the header travels over zmq. The daemon reclaims the
segment once process ``pid`` has exited; ``Detach`` drops it at once.

The arena (same host, the daemon's store has one: arena.py, daemon_arena.py): ``MapArena(pid)`` names
the daemon's L1 arena; a put is ``Reserve`` (slots) -> the client writes its bytes there -> ``Put(commit=
True)`` (served from then on; framed objects ride along); a get is ``Lease`` (offsets of leased slots) ->
the client copies them out -> ``Release`` (or any next request) ends the lease. One copy each way, no
digest: a slot is served only once its writer committed it, and the seal is the end-to-end check.

Integrity: every payload carries ``ObjMeta.digest`` = xxh3_64(key utf-8 bytes, then the
payload bytes) -- except a sealed object (seal.py) laid out for its key: its digest is 0 and
nothing is hashed, as the keyed MAC every loader checks covers the key and every byte (see
``wire_digest``). The sender computes it (client on Put, daemon on Get); the receiver
verifies it on its own copy (daemon: Put refused; client: that object is a miss): a sealed
object's header must name the key and the frame's length, else its digest must match.

Order of a session: [Hello] -> [Attach] -> any of Put/Get/Contains/Lookup/Delete/Discard/Stats/Ping ->
[Detach]. Every request carries ``v`` (PROTOCOL_VERSION), ``id`` (echoed in the reply) and
``token``. With a cluster token the daemon first proves it holds the wire key in its Hello reply, and
every other request's ``token`` is a MAC of the daemon's nonce, the client's identity and ``id``
(``session.py``), checked before the rest of the request is even decoded; a request without a valid
one gets ``ok=False`` (``code=NO_SESSION``: say Hello again) and nothing else. Unknown fields are refused.
"""

from __future__ import annotations

from typing import Union

import msgspec
import torch
import xxhash

from pdserve.kvstore.seal import sealed_for

MAX_DIMS = 8        # what every tier can store (kvstore.codec.MAX_DIMS)
PROTOCOL_VERSION = 4             # 4: Hello and signed requests (kvstore/session.py)
FRAME = -1          # ObjMeta.offset: payload is the next zmq frame
KEEP_FRAME_FROM = 64 << 10   # a received frame from this size is kept as an object's bytes; a smaller one is copied:
#                              it may be a slice of zmq's 8 KiB receive buffer, which it would keep alive whole
DEFERRED = -2       # ObjMeta.offset in a Get reply: did not fit in shm this time, ask again
NO_SEGMENT = "no-segment"   # Reply.code: no segment of the request's generation; Attach again
NO_SESSION = "no-session"   # Reply.code: no session for this client (daemon restarted, or forgot it); Hello again
PENDING = "pending"         # Reply.code: a Delete/Discard left L1 and the tiers that were up; a tier that was down
#                             missed it and gets it once it is back (kvstore/removals.py), if the daemon lives
QUEUE_FULL = "queue-full"   # Reply.code: a Delete/Discard refused whole, nothing done: the store's queued removals are at
#                             their bound (tiered.MAX_QUEUED_REMOVALS, a stalled tier); retry once they drain

_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2)}


class ObjMeta(msgspec.Struct, array_like=True, gc=False):
    """One object of a Put or a Get reply. ``gc=False``: a str, ints and a list of ints can form no cycle, so the
    collector does not track it (a Get reply of 1024 objects adds nothing for it to scan)."""
    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    offset: int = FRAME
    digest: int = 0     # xxh3_64(key, payload), or 0 for a sealed object of this key; see wire_digest


class ArenaInfo(msgspec.Struct, array_like=True):
    pid: int            # the daemon's process: the client maps /proc/<pid>/fd/<fd>
    fd: int
    size: int
    gen: int            # names this arena (random per daemon process)
    inode: int = 0      # the memfd's inode: the client checks it maps that very file


class SegmentInfo(msgspec.Struct, array_like=True):
    path: str           # /dev/shm/pdserve-kv-<hex>, made by the daemon; the client unlinks it
    size: int
    gen: int


class _Req(msgspec.Struct, tag_field="op", kw_only=True, forbid_unknown_fields=True):
    v: int = PROTOCOL_VERSION
    id: int = 0
    token: str = ""


class Put(_Req, tag="put"):
    objs: list[ObjMeta]
    gen: int = 0        # segment generation; required when an object's offset is in the segment
    commit: bool = False   # arena: first serve this client's reserved slots (written by now); gen = the arena's


class Get(_Req, tag="get"):
    keys: list[str]
    gen: int = 0        # 0: payloads as frames; else the daemon writes them into that segment


class Contains(_Req, tag="contains"):
    keys: list[str]


class Lookup(_Req, tag="lookup"):
    chunk_keys: list[str]
    num_layers: int


class Delete(_Req, tag="delete"):
    keys: list[str]


class Discard(_Req, tag="discard"):
    """A loader refused these objects (their seal failed): the daemon removes only the copies whose ``digest_of``
    is the refused one's -- another tier's intact copy stays (``TieredStore.discard``). A daemon from before this
    op answers an error; the client then sends Delete."""
    keys: list[str]
    digests: list[int]


class Stats(_Req, tag="stats"):
    pass


class Ping(_Req, tag="ping"):
    pass


class Attach(_Req, tag="attach"):
    pid: int            # the client's process: its segment is reclaimed once it is gone
    size: int


class Detach(_Req, tag="detach"):
    pass


class MapArena(_Req, tag="map-arena"):
    pid: int            # the client's process: its reservations and leases end when it does


class Reserve(_Req, tag="reserve"):
    objs: list[ObjMeta]     # key, dtype, shape, nbytes; the reply's offsets are arena slots (FRAME: no room)
    gen: int


class Lease(_Req, tag="lease"):
    keys: list[str]     # reply: objs at arena offsets, leased until this client's next request
    gen: int


class Release(_Req, tag="release"):
    pass                # ends this client's leases now (sent without waiting for the reply)


class Hello(_Req, tag="hello"):
    nonce: bytes        # the client's challenge (16..64 bytes); the reply proves the daemon holds the wire key


class Envelope(msgspec.Struct):
    """What the daemon reads of a request before it is authenticated (the rest is skipped, not built)."""
    op: str = ""
    v: int = PROTOCOL_VERSION
    id: int = 0
    token: str = ""


Request = Union[Put, Get, Contains, Lookup, Delete, Discard, Stats, Ping, Attach, Detach, Hello, MapArena, Reserve, Lease,
                Release]


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: int = 0
    ok: bool = True
    error: str = ""
    code: str = ""                        # machine-readable error kind (NO_SEGMENT) or ""
    objs: list[ObjMeta | None] = []
    present: list[bool] = []
    count: int = 0
    stats: dict[str, dict[str, int]] = {}
    segment: SegmentInfo | None = None    # Attach reply
    arena: ArenaInfo | None = None        # MapArena reply
    nonce: bytes = b""                    # Hello reply: the daemon process's nonce
    proof: bytes = b""                    # Hello reply: MAC(wire key, the client's nonce, the daemon's)


REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
REPLY_DECODER = msgspec.msgpack.Decoder(Reply)
ENCODER = msgspec.msgpack.Encoder()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def meta_of(key: str, tensor: torch.Tensor, offset: int = FRAME, digest: int = 0) -> ObjMeta:
    return ObjMeta(key, dtype_name(tensor.dtype), list(tensor.shape), tensor.numel() * tensor.element_size(),
                   offset, digest)


def digest_of(key: str, payload) -> int:
    """xxh3_64 over the key's utf-8 bytes then ``payload`` (any contiguous buffer)."""
    h = xxhash.xxh3_64(key.encode())
    h.update(payload)
    return h.intdigest()


def wire_digest(key: str, payload) -> int:
    """What ``ObjMeta.digest`` carries: 0 for a sealed object laid out for ``key`` (``seal.sealed_for``: its MAC,
    which every loader checks, covers the key and every byte; hashing it again here would only cost a pass over
    the bytes on each side), else ``digest_of`` -- any other object (not a KV object, or not sealed) keeps it."""
    return 0 if sealed_for(key, payload) else digest_of(key, payload)


def check_digest(meta: ObjMeta, payload) -> bool:
    """The receiver's check: a digest of 0 stands only for a sealed object of ``meta.key`` whose header matches the
    payload's length (a corrupted header, or another key's frame, is then checked against 0 -- and fails)."""
    if meta.digest == 0 and sealed_for(meta.key, payload):
        return True
    return digest_of(meta.key, payload) == meta.digest


def nbytes_of(meta: ObjMeta) -> int:
    """The bytes ``meta``'s dtype and shape take (-1 for an unknown dtype, too many or negative dims)."""
    shape = meta.shape
    if meta.dtype == "uint8" and len(shape) == 1:      # a sealed object (seal.py): the common case, in one step
        return shape[0] if shape[0] >= 0 else -1
    if meta.dtype not in _DTYPE_NAMES or len(meta.shape) > MAX_DIMS or any(d < 0 for d in meta.shape):
        return -1
    numel = 1
    for d in meta.shape:
        numel *= d
    return numel * _DTYPE_NAMES[meta.dtype].itemsize


def check_meta(meta: ObjMeta, max_object_bytes: int) -> None:
    """Reject a meta whose size disagrees with its dtype/shape or exceeds the limit."""
    shape = meta.shape
    if not (meta.dtype == "uint8" and len(shape) == 1 and shape[0] == meta.nbytes >= 0):   # (a sealed object: one step)
        dtype_of(meta.dtype)
        if len(shape) > MAX_DIMS:
            raise ValueError(f"object {meta.key!r} has {len(shape)} dimensions; the store keeps at most {MAX_DIMS}")
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        if meta.nbytes != nbytes_of(meta):
            raise ValueError(f"object {meta.key!r}: {meta.nbytes} bytes does not match {meta.dtype}{shape}")
    if meta.nbytes > max_object_bytes:
        raise ValueError(f"object {meta.key!r} has {meta.nbytes} bytes; limit is {max_object_bytes} "
                         "(--kv-max-object-bytes)")


def frame_tensor(frame) -> torch.Tensor:
    """uint8 [len(frame)] over a received zmq frame's own memory (no copy: the frame is ours alone, writable,
    and lives as long as the tensor) -- from ``KEEP_FRAME_FROM`` bytes; a smaller frame is copied (kept, it could
    hold zmq's whole receive buffer: a 100-byte object ~9 KiB)."""
    if len(frame) >= KEEP_FRAME_FROM:
        return torch.frombuffer(frame.buffer, dtype=torch.uint8)
    return torch.frombuffer(bytearray(frame.buffer), dtype=torch.uint8) if len(frame) else \
        torch.empty(0, dtype=torch.uint8)
