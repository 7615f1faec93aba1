"""Serialisation of one KV object: a fixed header + raw (optionally compressed) bytes.

Who calls it: the byte-storing tiers (Redis, disk) on put/get. The memory tier keeps
tensors and never serialises. Never pickle: the format is this header and the bytes.

    offset  size  field
    0       4     magic  b"PDKV"
    4       2     format version (FORMAT_VERSION)
    6       1     codec  (0 none, 1 lz4 over byte-shuffled data)
    7       1     dtype code (_DTYPES)
    8       1     ndim (<= 8)
    9       1     flags (FLAG_SEALED)
    10      2     padding
    12      64    shape, 8 x uint64 (unused dims 0)
    76      8     key hash: xxh3_64 of the store key (utf-8) the object was written for
    84      8     payload length (bytes after the header)
    92      8     raw length (numel * itemsize)
    100     8     xxh3_64 of bytes 0..99 and the payload (FLAG_SEALED: and the payload's first SEALED_HEAD bytes)
    108           payload

``decode(blob, key, max_bytes)`` raises ``CorruptObject`` for a bad magic/version/codec/dtype, a
truncated payload, a checksum mismatch or a size mismatch, and its subclass ``KeyMismatch`` when the
object is intact but was written for another key (a value copied or misplaced between keys);
tiers turn either into a counted miss and delete the object.

Bounded before anything is allocated: the header's raw length must equal its dtype and shape, be at
most ``max_bytes`` (the tier's ``--kv-max-object-bytes``) and, for lz4, at most what the payload can
expand to (lz4 expands at most ``LZ4_MAX_RATIO`` x): a small value in Redis or on disk that claims a
huge shape is refused, never inflated. The checksum is an accident check, not a seal: anyone can
compute it; what makes a stored object trustworthy is the keyed MAC inside it (``seal.py``).

Sealed objects (FLAG_SEALED, codec "none" only): when the writer says the payload is a sealed object laid out for
its key (``seal.sealed_for``; the tier checks it, this module does not import seal), the checksum covers the
header and the seal's head (its first SEALED_HEAD bytes: magic, shape, key hash, MAC), not the payload, and
``decode`` hands the payload out only if the same check passes on the bytes read. The payload's bytes are then
checked once, by the keyed MAC every loader verifies (``seal.unseal``, before a block is scattered), which
covers the key and every byte: a flipped payload byte fails the seal there (the loader counts it and deletes the
object); a flipped header or seal-head byte, another key's object, a short or long read fail here as before.
Hashing the payload here too would only cost a pass over every byte of every put and get.
"""

from __future__ import annotations

import struct
import warnings

import lz4.block
import numpy as np
import torch
import xxhash

# decode hands out tensors over a private ``bytes`` (see _to_tensor); torch notes that once per process: spend
# that note here, silenced, so it never shows
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)
MAGIC = b"PDKV"
FORMAT_VERSION = 3                     # 2: key hash in the header; 3: the flags byte (FLAG_SEALED)
READ_VERSIONS = (2, FORMAT_VERSION)    # format 2 is format 3 with byte 9 always 0 (padding): still read, never
                                       # deleted, so an upgraded node keeps the objects older peers wrote. Not the
                                       # other way: an older node refuses every format 3 object it reads (bad
                                       # version) and deletes it -- during a rolling upgrade an old node's reads
                                       # cost the new nodes' KV (a recompute, never a wrong answer)
CODECS = {"none": 0, "lz4": 1}
_CODEC_CODES = frozenset(CODECS.values())
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_UINT8 = _DTYPE_CODE[torch.uint8]
_HEADER = struct.Struct("<4sHBBBB2x8QQQQQ")
FLAG_SEALED = 1                        # the payload is a sealed object for the key: checksum over header + seal head
_FLAGS = {CODECS["none"]: (0, FLAG_SEALED), CODECS["lz4"]: (0,)}     # the flags each codec may carry
SEALED_HEAD = 128                      # the payload bytes a sealed object's checksum covers (seal.SEAL_BYTES)
HEADER_BYTES = _HEADER.size
MAX_DIMS = 8
LZ4_MAX_RATIO = 255                    # an lz4 block never decompresses to more than ~255x its size
DEFAULT_MAX_OBJECT_BYTES = 64 << 20    # --kv-max-object-bytes: one (chunk, layer) object; 256 tokens of a
                                       # 70B model's layer are 1 MiB


def max_blob_bytes(max_bytes: int) -> int:
    """The largest encoded object (header + payload) an object of ``max_bytes`` raw bytes can make (lz4's
    worst case adds 1/255 + 16 bytes): what a tier reads at most for one object."""
    return HEADER_BYTES + max_bytes + max_bytes // 255 + 16


class CorruptObject(ValueError):
    """A stored object failed validation; the caller counts a miss and deletes it."""


class KeyMismatch(CorruptObject):
    """An intact object read under a key other than the one it was written for."""


def key_hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def encode(tensor: torch.Tensor, codec: str, key: str, sealed_for=None) -> bytes:
    """Header + payload for one CPU tensor (any shape, dtypes in _DTYPES) stored under ``key``."""
    return b"".join(encode_parts(tensor, codec, key, sealed_for))


def encode_parts(tensor: torch.Tensor, codec: str, key: str, sealed_for=None) -> tuple[bytes, memoryview | np.ndarray]:
    """(header, payload) of ``encode`` without joining them: the payload is the tensor's own memory for codec
    "none" (a writer that can send two buffers -- the Redis tier's framed SET, ``redis_wire`` -- copies nothing).
    ``sealed_for`` (``seal.sealed_for``, from the tier: this module does not import seal): a 1-D uint8 tensor it
    says is a sealed object laid out for ``key`` is written, with codec "none", as FLAG_SEALED (module docstring)."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {sorted(CODECS)} (--kv-codec)")
    if tensor.dtype not in _DTYPE_CODE or tensor.dim() > MAX_DIMS:
        raise ValueError(f"cannot store dtype {tensor.dtype} with {tensor.dim()} dims (max {MAX_DIMS})")
    raw = tensor_bytes(tensor)
    payload = raw if codec == "none" else lz4.block.compress(_shuffle(raw, tensor.element_size()), store_size=False)
    flags = FLAG_SEALED if codec == "none" and _sealed(tensor, key, raw, sealed_for) else 0
    shape = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    fields = (MAGIC, FORMAT_VERSION, CODECS[codec], _DTYPE_CODE[tensor.dtype], tensor.dim(), flags, *shape,
              key_hash(key), len(payload), len(raw))
    checked = payload[:SEALED_HEAD] if flags else payload
    return _HEADER.pack(*fields, _checksum(_HEADER.pack(*fields, 0), checked)), payload


def decode(blob: bytes | memoryview, key: str, max_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
           sealed_for=None) -> torch.Tensor:
    """The tensor stored in ``blob`` under ``key`` (a fresh, writable tensor of at most ``max_bytes``), or raise
    CorruptObject -- before allocating anything when the header's sizes are wrong or too large. An object flagged
    FLAG_SEALED is handed out only if ``sealed_for(key, payload)`` (``seal.sealed_for``) says it is laid out as a
    sealed object for ``key``; its payload bytes are the loader's MAC to check (module docstring)."""
    if len(blob) < HEADER_BYTES:
        raise CorruptObject(f"object of {len(blob)} bytes is shorter than the {HEADER_BYTES}-byte header")
    fields = _HEADER.unpack_from(blob)
    magic, version, codec, dcode, ndim, flags = fields[:6]
    stored_key_hash, payload_len, raw_len, checksum = fields[6 + MAX_DIMS:]
    if magic != MAGIC or version not in READ_VERSIONS or (version == 2 and flags):
        raise CorruptObject(f"bad magic/version {magic!r}/{version} (want {MAGIC!r}/{READ_VERSIONS}) "
                            f"or flags {flags} in a format 2 object")
    if codec not in _CODEC_CODES or dcode >= len(_DTYPES) or ndim > MAX_DIMS or flags not in _FLAGS[codec]:
        raise CorruptObject(f"bad codec {codec}, dtype code {dcode}, ndim {ndim} or flags {flags}")
    if len(blob) - HEADER_BYTES != payload_len:
        raise CorruptObject(f"payload is {len(blob) - HEADER_BYTES} bytes, header says {payload_len} (truncated?)")
    dtype, dims = _DTYPES[dcode], fields[6:6 + ndim]
    _check_sizes(raw_len, dtype.itemsize * _numel(dims), payload_len, codec, max_bytes)
    if flags and payload_len < SEALED_HEAD:
        raise CorruptObject(f"sealed payload of {payload_len} bytes is shorter than its {SEALED_HEAD}-byte head")
    if _stored_sum(blob, SEALED_HEAD if flags else payload_len) != checksum:
        raise CorruptObject("payload checksum mismatch")
    if stored_key_hash != key_hash(key):
        raise KeyMismatch(f"object was written for another key (key hash {stored_key_hash:#018x}), "
                          f"read as {key!r} (key hash {key_hash(key):#018x})")
    payload = memoryview(blob)[HEADER_BYTES:]
    if flags and not (dcode == _UINT8 and ndim == 1 and sealed_for is not None and sealed_for(key, payload)):
        raise CorruptObject(f"object is flagged sealed but is not a sealed object laid out for {key!r}")
    flat = _to_tensor(payload, codec, raw_len, dtype.itemsize, isinstance(blob, bytes))
    return flat if dcode == _UINT8 and ndim == 1 else flat.view(dtype).reshape(dims)   # a sealed object: as it is


def _sealed(tensor: torch.Tensor, key: str, raw: memoryview, sealed_for) -> bool:
    """Whether ``tensor`` (its bytes: ``raw``) is a sealed object laid out for ``key``: a 1-D uint8 tensor of at
    least SEALED_HEAD bytes that ``sealed_for`` accepts."""
    return (sealed_for is not None and tensor.dtype == torch.uint8 and tensor.dim() == 1 and len(raw) >= SEALED_HEAD
            and sealed_for(key, raw))


def _stored_sum(blob: bytes | memoryview, covered: int) -> int:
    """The checksum of a stored object: xxh3_64 over its header fields (checksum slot excluded) and the first
    ``covered`` payload bytes -- the seal head of a sealed object (FLAG_SEALED), else the whole payload. Slices of a
    ``bytes`` blob are bytes already (``bytes()`` copies nothing); a short range is hashed in one call."""
    fields = bytes(blob[:HEADER_BYTES - 8])
    if covered <= SEALED_HEAD:
        return xxhash.xxh3_64_intdigest(fields + bytes(blob[HEADER_BYTES:HEADER_BYTES + covered]))
    h = xxhash.xxh3_64(fields)
    h.update(memoryview(blob)[HEADER_BYTES:HEADER_BYTES + covered])
    return h.intdigest()


def _check_sizes(raw_len: int, shape_bytes: int, payload_len: int, codec: int, max_bytes: int) -> None:
    """The header's sizes agree with each other and stay in bounds (nothing allocated yet)."""
    if raw_len != shape_bytes:
        raise CorruptObject(f"raw length {raw_len} does not match its shape's {shape_bytes} bytes")
    if raw_len > max_bytes:
        raise CorruptObject(f"object of {raw_len} bytes; the limit is {max_bytes} (--kv-max-object-bytes)")
    if codec == CODECS["none"] and payload_len != raw_len:
        raise CorruptObject(f"uncompressed payload of {payload_len} bytes for {raw_len} raw bytes")
    if codec == CODECS["lz4"] and raw_len > LZ4_MAX_RATIO * payload_len + 64:
        raise CorruptObject(f"lz4 payload of {payload_len} bytes cannot expand to {raw_len} bytes")


def _checksum(header: bytes | memoryview, payload: bytes | memoryview) -> int:
    """xxh3_64 over the header fields (checksum slot excluded) and the payload (a short one -- a seal head -- in one
    call over both: the same digest, fewer calls)."""
    fields = bytes(header[:HEADER_BYTES - 8])
    if len(payload) <= SEALED_HEAD:
        return xxhash.xxh3_64_intdigest(fields + bytes(payload))
    h = xxhash.xxh3_64(fields)
    h.update(payload)
    return h.intdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is already contiguous."""
    if tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.is_contiguous() and not tensor.requires_grad:
        return memoryview(tensor.numpy())            # a sealed object, say: already its own bytes (fewer torch calls)
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _to_tensor(payload: memoryview, codec: int, raw_len: int, itemsize: int, private: bool) -> torch.Tensor:
    """The payload's raw bytes as a uint8 tensor. ``private``: the blob is a ``bytes`` nobody else holds (a Redis
    reply, a file's contents), so an uncompressed payload is used in place -- no copy; the tensor keeps it alive."""
    if codec == CODECS["none"] and private and raw_len:
        return torch.frombuffer(payload, dtype=torch.uint8)
    out = torch.empty(raw_len, dtype=torch.uint8)
    if codec == CODECS["none"]:
        out.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        return out
    try:
        shuffled = lz4.block.decompress(payload, uncompressed_size=raw_len)
    except lz4.block.LZ4BlockError as exc:
        raise CorruptObject(f"lz4 payload does not decompress: {exc}") from None
    if len(shuffled) != raw_len:
        raise CorruptObject(f"lz4 payload gave {len(shuffled)} bytes, want {raw_len}")
    out.numpy()[:] = _unshuffle(shuffled, itemsize)
    return out


def _shuffle(raw: memoryview, itemsize: int) -> np.ndarray:
    """Byte-shuffle: all first bytes of every element, then all second bytes, ..."""
    arr = np.frombuffer(raw, dtype=np.uint8)
    return np.ascontiguousarray(arr.reshape(-1, itemsize).T) if itemsize > 1 else arr


def _unshuffle(shuffled: bytes, itemsize: int) -> np.ndarray:
    arr = np.frombuffer(shuffled, dtype=np.uint8)
    return arr.reshape(itemsize, -1).T.reshape(-1) if itemsize > 1 else arr


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
