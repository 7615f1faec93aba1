"""Deterministic chained hashes of full KV blocks, the keys of the prefix cache.

Called by ``BlockManager`` (``extend_block_hashes`` as a request's tokens grow). The hash of
block i covers every token before it through the chain::

    h_0 = xxh64(seed=HASH_SEED, ROOT        + le_int64(tokens[0 : bs]))
    h_i = xxh64(seed=HASH_SEED, le_u64(h_{i-1}) + le_int64(tokens[i*bs : (i+1)*bs]))

Only full blocks are hashed. The bytes are fixed (little-endian, 8 bytes per token), so a
hash is identical in every process and on every machine; Python's ``hash()`` is never used.
``parent`` lets a caller salt the chain: a request's ``cache_salt`` (vLLM's field) becomes the parent
of its block 0 through ``salt_root``, so two salts never share a block::

    h_0 = xxh64(seed=HASH_SEED, le_u64(salt_root(salt)) + le_int64(tokens[0 : bs]))
    salt_root(salt) = first 8 bytes (little-endian) of sha256(SALT_TAG + utf8(salt))  (surrogatepass)
    salt_root(None) = None: the unsalted chain above, unchanged

The root comes from sha256, not xxh64: a client chooses its salt, and must not be able to pick one whose
root equals a block hash of another chain.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import xxhash

HASH_SEED = 0x70647365_72766531   # b"pdserve1"; changing it invalidates every stored hash
ROOT_PARENT = 0                   # the parent of block 0 when the caller gives none
SALT_TAG = b"pdserve-cache-salt\x00"   # domain of salt_root: no other sha256 input here starts with it


def salt_root(cache_salt: str | None) -> int | None:
    """The parent of block 0 for requests with ``cache_salt``; None (the unsalted chain) without one."""
    if cache_salt is None:
        return None
    if not cache_salt:
        raise ValueError("cache_salt must be a non-empty string when given")
    digest = hashlib.sha256(SALT_TAG + cache_salt.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little")


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    """xxh64 of the parent hash and one block's token ids; an unsigned 64-bit int."""
    h = xxhash.xxh64(seed=HASH_SEED)
    h.update(struct.pack("<Q", ROOT_PARENT if parent is None else parent))
    try:
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error as e:
        raise ValueError(f"token ids must be int64 values; got {list(token_ids)[:8]}...: {e}") from None
    return h.intdigest()


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block is skipped."""
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, block_size, parent=parent)
    return hashes


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int,
                        num_tokens: int | None = None, parent: int | None = None) -> list[int]:
    """Append to ``hashes`` the hashes of full blocks in ``token_ids[:num_tokens]`` it lacks.

    ``hashes`` must be the chain of the first ``len(hashes)`` blocks of the same tokens;
    the work is proportional to the new blocks only. Returns ``hashes``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    end = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    prev = hashes[-1] if hashes else parent
    for start in range(len(hashes) * block_size, end - block_size + 1, block_size):
        prev = hash_block(prev, token_ids[start:start + block_size])
        hashes.append(prev)
    return hashes
