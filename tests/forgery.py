"""What a local attacker without the cluster key can write into a KV store: objects that look sealed.

Two recipes, both from public information only (the object key, computed from the prompt and the model
fingerprint a prefill answer shows; the KV shape, from the model's config.json):

* ``forge_v1``: the seal pdserve used before keyed MACs -- an xxh3 checksum anyone can compute. On that code it
  passed every check and changed the victim's answer.
* ``forge_keyed``: today's format, MAC'd with a key the attacker made up (the best it can do without ours).

``plant(write, keys, shapes)`` puts junk KV sealed both ways under the victim's object keys.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from pdserve.kvstore.auth import ClusterKey
from pdserve.kvstore.keys import chunk_keys, object_key
from pdserve.kvstore.seal import seal

_V1_HEAD = struct.Struct("<4sHBB6IQ")          # magic, version 1, dtype code, ndim, shape, key hash
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def forge_v1(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """The version-1 seal: header, xxh3_64 of every byte but the checksum slot, payload at byte 128."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    out = torch.zeros(128 + raw.numel(), dtype=torch.uint8)
    out[128:] = raw
    shape = list(tensor.shape) + [0] * (6 - tensor.dim())
    head = _V1_HEAD.pack(b"PDKS", 1, _DTYPE_CODE[tensor.dtype], tensor.dim(), *shape,
                         xxhash.xxh3_64_intdigest(key.encode()))
    view = memoryview(out.numpy())
    view[:_V1_HEAD.size] = head
    h = xxhash.xxh3_64(view[:_V1_HEAD.size])
    h.update(view[_V1_HEAD.size + 8:])
    view[_V1_HEAD.size:_V1_HEAD.size + 8] = struct.pack("<Q", h.intdigest())
    return out


def forge_keyed(key: str, tensor: torch.Tensor) -> torch.Tensor:
    return seal(key, tensor, ClusterKey.random().seal_key)[0]


def victim_keys(prompt: list[int], chunk_tokens: int, fingerprint: str) -> list[str]:
    return chunk_keys(prompt, chunk_tokens, fingerprint, include_partial=True)


def junk(chunk_len: int, kv_shape: tuple[int, int, int], dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Made-up KV for one (chunk, layer): [components, tokens, kv heads, head dim]."""
    c, h, d = kv_shape
    return (torch.randn(c, chunk_len, h, d, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def plant(write, prompt: list[int], chunk_tokens: int, fingerprint: str, num_layers: int,
          kv_shape: tuple[int, int, int], recipe) -> list[str]:
    """``write(object_key, sealed uint8 tensor)`` for every layer of every chunk of ``prompt``; -> the object keys."""
    written = []
    for i, ck in enumerate(victim_keys(prompt, chunk_tokens, fingerprint)):
        n = min(chunk_tokens, len(prompt) - i * chunk_tokens)
        for layer in range(num_layers):
            key = object_key(ck, layer)
            write(key, recipe(key, junk(n, kv_shape, seed=i * 1000 + layer)))
            written.append(key)
    return written
