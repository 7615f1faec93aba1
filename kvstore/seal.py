"""Sealed KV objects: the end-to-end integrity check between a prefill node and a decode node.

Who calls it: the prefill publisher (``seal`` on its thread, right before ``store.adopt``) and the
decode loader (``unseal`` on its thread, before a single block is scattered). The store in between
(memory, Redis, disk, the daemon over TCP or shared memory) only moves bytes; whatever goes wrong
there -- a get answered with another key's object, a torn write, a stale segment -- is caught here,
because the seal names the key the object was written for and checksums that name with the bytes.

    offset  size  field
    0       4     magic b"PDKS"
    4       2     SEAL_VERSION
    6       1     dtype code (codec._DTYPES order)
    7       1     ndim (<= 6)
    8       24    shape, 6 x uint32
    32      8     key hash: xxh3_64 of the object key (utf-8)
    40      8     checksum: xxh3_64 of every other byte of the object (header, padding, payload)
    48      80    zero padding (the payload starts 128-byte aligned)
    128           payload: the tensor's raw bytes, row-major

A sealed object is a 1-D uint8 tensor; ``unseal`` returns a zero-copy typed view of its payload.
The checksum doubles as the object's digest: a prefill node sends the digests of the chunks it
published in ``kv_transfer_params.chunk_digests`` so the decode node can tell a valid object that
some other writer stored under the same key from the one this prefill computed.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from pdserve.kvstore.codec import _DTYPE_CODE, _DTYPES

MAGIC = b"PDKS"
SEAL_VERSION = 1
SEAL_BYTES = 128
_MAX_DIMS = 6
_HEAD = struct.Struct("<4sHBB6IQ")            # everything the checksum covers besides the payload
_SUM = struct.Struct("<Q")


class SealError(ValueError):
    """A loaded object is not the object written under its key (or not a sealed object at all)."""


def key_hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def seal(key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """-> (sealed uint8 tensor [SEAL_BYTES + nbytes], its checksum). ``tensor`` must be on the CPU."""
    if tensor.dtype not in _DTYPE_CODE or tensor.dim() > _MAX_DIMS:
        raise ValueError(f"cannot seal dtype {tensor.dtype} with {tensor.dim()} dims (max {_MAX_DIMS})")
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    out = torch.zeros(SEAL_BYTES + raw.numel(), dtype=torch.uint8)
    out[SEAL_BYTES:] = raw
    shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    head = _HEAD.pack(MAGIC, SEAL_VERSION, _DTYPE_CODE[tensor.dtype], tensor.dim(), *shape, key_hash(key))
    view = out.numpy()
    view[:_HEAD.size] = memoryview(head)
    checksum = _checksum(out)
    view[_HEAD.size:_HEAD.size + _SUM.size] = memoryview(_SUM.pack(checksum))
    return out, checksum


def unseal(key: str, obj: torch.Tensor) -> tuple[torch.Tensor, int]:
    """-> (typed view of the payload, checksum) after checking magic, key, shape and checksum."""
    if obj.dtype != torch.uint8 or obj.dim() != 1 or obj.numel() < SEAL_BYTES:
        raise SealError(f"object {key}: not a sealed object ({obj.dtype}, shape {tuple(obj.shape)})")
    head = obj[:_HEAD.size].numpy().tobytes()
    magic, version, dcode, ndim, *rest = _HEAD.unpack(head)
    dims, stored_key = rest[:_MAX_DIMS], rest[_MAX_DIMS]
    if magic != MAGIC or version != SEAL_VERSION or dcode >= len(_DTYPES) or ndim > _MAX_DIMS:
        raise SealError(f"object {key}: bad seal (magic {magic!r}, version {version}, dtype {dcode}, ndim {ndim})")
    if stored_key != key_hash(key):
        raise SealError(f"object {key}: sealed for another key (hash {stored_key:016x})")
    (checksum,) = _SUM.unpack(obj[_HEAD.size:_HEAD.size + _SUM.size].numpy().tobytes())
    payload = obj[SEAL_BYTES:]
    if _checksum(obj) != checksum:
        raise SealError(f"object {key}: checksum mismatch (bytes changed after sealing)")
    dtype, shape = _DTYPES[dcode], tuple(dims[:ndim])
    if payload.numel() != _numel(shape) * dtype.itemsize:
        raise SealError(f"object {key}: {payload.numel()} payload bytes do not match {dtype} {shape}")
    return payload.view(dtype).reshape(shape), checksum


def chunk_digest(checksums: list[int]) -> str:
    """One chunk's digest: xxh3_64 over its layer objects' checksums, in layer order (16 hex)."""
    return xxhash.xxh3_64_hexdigest(b"".join(_SUM.pack(c) for c in checksums))


def _checksum(obj: torch.Tensor) -> int:
    """xxh3_64 of the sealed object with its checksum slot skipped."""
    raw = memoryview(obj.numpy())
    h = xxhash.xxh3_64(raw[:_HEAD.size])
    h.update(raw[_HEAD.size + _SUM.size:])
    return h.intdigest()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
