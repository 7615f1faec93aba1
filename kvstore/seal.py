"""Sealed KV objects: the keyed, end-to-end check between the node that wrote an object and the one that loads it.

Who calls it: the prefill publisher (``seal`` on its thread, right before ``store.adopt``) and every loader
(``unseal`` on its thread, before a single block is scattered -- on a decode node and on a prefill node that
loads a store hit alike). The store in between (memory, Redis, disk, the daemon over TCP or shared memory)
only moves bytes; whatever goes wrong there -- a get answered with another key's object, a torn write, a stale
segment, or an object someone without the cluster key wrote -- is caught here: the seal is a BLAKE3 keyed MAC
(the cluster's seal key, ``auth.ClusterKey``) over the key the object was written for, its header and every
payload byte. Without the key nobody can make an object that passes, however they reach the store.

    offset  size  field
    0       4     magic b"PDKS"
    4       2     SEAL_VERSION
    6       1     dtype code (codec._DTYPES order)
    7       1     ndim (<= 6)
    8       24    shape, 6 x uint32
    32      8     key hash: xxh3_64 of the object key (a fast "written for another key" diagnosis)
    40      32    MAC: BLAKE3 keyed with the seal key over (uint16 key length, key utf-8, bytes 0..39, payload)
    72      56    zero padding (the payload starts 128-byte aligned)
    128           payload: the tensor's raw bytes, row-major

A sealed object is a 1-D uint8 tensor; ``unseal`` returns a zero-copy typed view of its payload and the MAC.
The MACs of a chunk's layer objects make its digest (``chunk_digest``): a prefill node sends the digests of the
chunks it published in ``kv_transfer_params.chunk_digests`` so the decode node can tell the object this prefill
computed from another valid one written under the same key (by another cluster member, say after a restart).
"""

from __future__ import annotations

import hmac
import struct

import blake3
import torch
import xxhash

from pdserve.kvstore.codec import _DTYPE_CODE, _DTYPES

MAGIC = b"PDKS"
SEAL_VERSION = 2                                # 2: a keyed BLAKE3 MAC (1: an xxh3 checksum anyone could compute)
SEAL_BYTES = 128
MAC_BYTES = 32
_MAX_DIMS = 6
_ITEMSIZE = tuple(d.itemsize for d in _DTYPES)
_HEAD = struct.Struct("<4sHBB6IQ")             # everything the MAC covers besides the key and the payload
_KEY_LEN = struct.Struct("<H")


class SealError(ValueError):
    """A loaded object is not the object written under its key (or not a sealed object at all)."""


def key_hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def seal(key: str, tensor: torch.Tensor, seal_key: bytes) -> tuple[torch.Tensor, bytes]:
    """-> (sealed uint8 tensor [SEAL_BYTES + nbytes], its MAC). ``tensor`` must be on the CPU."""
    if tensor.dtype not in _DTYPE_CODE or tensor.dim() > _MAX_DIMS:
        raise ValueError(f"cannot seal dtype {tensor.dtype} with {tensor.dim()} dims (max {_MAX_DIMS})")
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    shape = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    head = _HEAD.pack(MAGIC, SEAL_VERSION, _DTYPE_CODE[tensor.dtype], tensor.dim(), *shape, key_hash(key))
    mac = _mac(seal_key, key, head, raw.numpy())
    out = torch.empty(SEAL_BYTES + raw.numel(), dtype=torch.uint8)
    view = out.numpy()
    view[:SEAL_BYTES] = 0
    view[:_HEAD.size] = memoryview(head)
    view[_HEAD.size:_HEAD.size + MAC_BYTES] = memoryview(mac)
    out[SEAL_BYTES:] = raw
    return out, mac


def unseal(key: str, obj: torch.Tensor, seal_key: bytes) -> tuple[torch.Tensor, bytes]:
    """-> (typed view of the payload, MAC) after checking magic, key, shape and the MAC."""
    if obj.dtype != torch.uint8 or obj.dim() != 1 or obj.numel() < SEAL_BYTES:
        raise SealError(f"object {key}: not a sealed object ({obj.dtype}, shape {tuple(obj.shape)})")
    raw = obj.numpy()
    head = raw[:_HEAD.size].tobytes()
    magic, version, dcode, ndim, *rest = _HEAD.unpack(head)
    dims, stored_key = rest[:_MAX_DIMS], rest[_MAX_DIMS]
    if magic != MAGIC or version != SEAL_VERSION or dcode >= len(_DTYPES) or ndim > _MAX_DIMS:
        raise SealError(f"object {key}: bad seal (magic {magic!r}, version {version}, dtype {dcode}, ndim {ndim})")
    if stored_key != key_hash(key):
        raise SealError(f"object {key}: sealed for another key (hash {stored_key:016x})")
    mac = raw[_HEAD.size:_HEAD.size + MAC_BYTES].tobytes()
    if not hmac.compare_digest(_mac(seal_key, key, head, raw[SEAL_BYTES:]), mac):
        raise SealError(f"object {key}: MAC mismatch (changed after sealing, or sealed without this "
                        "cluster's key)")
    dtype, shape = _DTYPES[dcode], tuple(dims[:ndim])
    payload = obj[SEAL_BYTES:]
    if payload.numel() != _numel(shape) * dtype.itemsize:
        raise SealError(f"object {key}: {payload.numel()} payload bytes do not match {dtype} {shape}")
    return payload.view(dtype).reshape(shape), mac


def sealed_for(key: str, payload) -> bool:
    """Whether ``payload`` (any contiguous buffer) is laid out as a sealed object written for ``key``: magic,
    version, dtype, dims, the key's hash and a length that matches them -- the header only, no MAC (that needs
    the seal key, and is the loader's ``unseal``). The transport (protocol.wire_digest) skips its xxh3 for such
    an object: the MAC every loader checks covers the key and every byte, so whatever the digest would catch --
    a flipped byte, a frame given to another key, a torn or short copy -- fails the seal (or this check) instead."""
    view = memoryview(payload)                    # (on every object a TCP get moves, both sides: kept to ~0.5 us)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    nbytes = view.nbytes
    if nbytes < SEAL_BYTES:
        return False
    head = _HEAD.unpack_from(view)                # magic, version, dtype code, ndim, dims x6, key hash
    dcode, ndim = head[2], head[3]
    if head[0] != MAGIC or head[1] != SEAL_VERSION or dcode >= len(_ITEMSIZE) or ndim > _MAX_DIMS:
        return False
    return nbytes == SEAL_BYTES + _numel(head[4:4 + ndim]) * _ITEMSIZE[dcode] and head[4 + _MAX_DIMS] == key_hash(key)


def chunk_digest(macs: list[bytes]) -> str:
    """One chunk's digest: xxh3_64 over its layer objects' MACs, in layer order (16 hex)."""
    return xxhash.xxh3_64_hexdigest(b"".join(macs))


def _mac(seal_key: bytes, key: str, head: bytes, payload) -> bytes:
    name = key.encode()
    h = blake3.blake3(key=seal_key)
    h.update(_KEY_LEN.pack(len(name)))
    h.update(name)
    h.update(head)
    h.update(memoryview(payload))
    return h.digest()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
