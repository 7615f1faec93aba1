"""Chunk keys and object keys: the store's address space.

Who calls it: the prefill node (to name the chunks it publishes), the decode node and
the proxy (to look chunks up), the tests. Keys must be identical in every process and on
every machine, so they are built from sha256 only -- never Python's ``hash()``.

    prompt tokens  |<- chunk 0 ->|<- chunk 1 ->|<- chunk 2 (partial) ->|
    key_0 = H(root,  tokens[0:C])
    key_1 = H(key_0, tokens[C:2C])
    key_2 = H(key_1, tokens[2C:])        only with include_partial=True

``root = H("pdserve-kv-root", fingerprint)``, and for a request with a ``cache_salt`` (tenant
isolation, vLLM's field) ``root = H("pdserve-kv-salt", H("pdserve-kv-root", fingerprint), salt)``:
two salts never name the same chunk, and no salt gives the keys of before. Every node and the
proxy pass the request's salt, so they agree on its keys. Tokens are hashed as little-endian int64,
so the chunk length is part of what is hashed (a partial chunk never collides with a
full one). Keys are 32 hex characters (128 bits of sha256).
One stored object holds one layer of one chunk: ``object_key(chunk_key, layer)``.
"""

from __future__ import annotations

import hashlib
import re
import struct

KEY_FORMAT_VERSION = 2
_ROOT_TAG = b"pdserve-kv-root"
_SALT_TAG = b"pdserve-kv-salt"
_KEY_HEX_CHARS = 32
_VALID_KEY = re.compile(r"[A-Za-z0-9_.:\-]{1,200}")      # fullmatch: "^...$" let a key end in a newline ("$" matches before one)


def model_fingerprint(
    architecture: str, weights_id: str, dtype: str, kv_layout_text: str, format_version: int,
    config_id: str = "",
) -> str:
    """A salt that changes whenever the KV bytes of a prompt could change.

    ``config_id`` hashes the model config's KV-relevant fields (RoPE theta and scaling, norm eps,
    sliding window, ...): two checkpoints with identical weights but another RoPE must not share keys.
    """
    fields = [architecture, weights_id, dtype, kv_layout_text, f"v{format_version}", f"k{KEY_FORMAT_VERSION}",
              f"c{config_id}"]
    return hashlib.sha256("\x1f".join(fields).encode()).hexdigest()[:_KEY_HEX_CHARS]


def chunk_keys(
    token_ids: list[int], chunk_tokens: int, fingerprint: str, include_partial: bool = False,
    cache_salt: str | None = None,
) -> list[str]:
    """Keys of the prompt's chunks, in order (the last partial chunk only if asked)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens} (--kv-chunk-tokens)")
    parent = _root(fingerprint, cache_salt)
    keys: list[str] = []
    for start in range(0, len(token_ids), chunk_tokens):
        chunk = token_ids[start:start + chunk_tokens]
        if len(chunk) < chunk_tokens and not include_partial:
            break
        parent = hashlib.sha256(parent + _token_bytes(chunk)).digest()
        keys.append(parent.hex()[:_KEY_HEX_CHARS])
    return keys


def _root(fingerprint: str, cache_salt: str | None) -> bytes:
    """The parent of chunk 0: the fingerprint's root, salted when a salt is given (32 bytes either way,
    so the salt's bytes start at a fixed offset and no two (root, salt) pairs hash the same input)."""
    root = hashlib.sha256(_ROOT_TAG + fingerprint.encode()).digest()
    if cache_salt is None:
        return root
    if not cache_salt:
        raise ValueError("cache_salt must be a non-empty string when given")
    return hashlib.sha256(_SALT_TAG + root + cache_salt.encode("utf-8", "surrogatepass")).digest()


def object_key(chunk_key: str, layer: int) -> str:
    """Key of one stored object: one layer (all KV heads) of one chunk."""
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    return f"{chunk_key}:{layer}"


def check_key(key: str) -> str:
    """Reject keys that could escape a file name or a Redis prefix; returns the key."""
    if not isinstance(key, str) or not _VALID_KEY.fullmatch(key):
        raise ValueError(f"invalid store key {key!r}: want 1-200 chars of [A-Za-z0-9_.:-]")
    return key


def _token_bytes(tokens: list[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be int64, got {tokens[:8]}...: {exc}") from None
