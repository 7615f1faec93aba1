"""The KV cache layout: one descriptor read by the paged cache, the attention and the KV store.

A layer's paged cache is one tensor ``[num_blocks, block_size, *token_shape]`` per
component. Standard attention (MHA/GQA) has two components, ``k`` and ``v``, each with
token shape ``[num_kv_heads, head_dim]``. DeepSeek MLA (``KVLayout.mla``) has one component,
``latent``: the compressed KV followed by its rope key, token shape ``[1, kv_lora_rank + rope_dim]``,
nothing per head. The block manager and the scheduler count blocks and never look inside; the runner,
the chunk copies and the store iterate ``components`` and read ``token_shape``. Only the attention
(``engine/models/mla.py``) and the tensor-parallel KV copy (``engine/parallel/kv.py``: ``tp_replicated``,
the latent is the same on every TP rank, so one rank publishes it and every rank loads all of it) care
which kind it is.

    mha:  per layer {"k": [N, bs, Hkv, D], "v": [N, bs, Hkv, D]}   bytes/token/layer = 2 * Hkv * D * size
    mla:  per layer {"latent": [N, bs, 1, L + R]}                   bytes/token/layer = (L + R) * size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.host_memory import zeros_on_hugepages


@dataclass(frozen=True)
class KVLayout:
    kind: str                    # "mha" (K and V per KV head) or "mla" (latent)
    num_layers: int              # layers held by this rank (all layers when not pipelined)
    num_kv_heads: int            # KV heads held by this rank
    head_dim: int
    dtype: torch.dtype
    first_layer: int = 0         # global index of this rank's first layer (pipeline stages)
    rope_dim: int = 0            # mla: the trailing rope part of head_dim (head_dim - rope_dim = kv_lora_rank)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
            first_layer: int = 0) -> "KVLayout":
        """DeepSeek's latent cache: one ``[kv_lora_rank + rope_dim]`` vector per token and layer."""
        return cls(kind="mla", num_layers=num_layers, num_kv_heads=1, head_dim=kv_lora_rank + rope_dim,
                   dtype=dtype, first_layer=first_layer, rope_dim=rope_dim)

    @property
    def kv_lora_rank(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def tp_replicated(self) -> bool:
        """Whether every tensor-parallel rank holds the same cache (MLA) rather than its own KV heads."""
        return self.kind == "mla"

    @property
    def components(self) -> tuple[str, ...]:
        return ("k", "v") if self.kind == "mha" else ("latent",)

    @property
    def token_shape(self) -> tuple[int, int]:
        return (self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV one token occupies across this rank's layers."""
        per_component = self.num_kv_heads * self.head_dim * _itemsize(self.dtype)
        return per_component * len(self.components) * self.num_layers

    def block_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, *self.token_shape)

    def allocate(self, num_blocks: int, block_size: int, device: str | torch.device = "cpu") -> "KVCaches":
        """One ``{component: tensor[num_blocks, block_size, heads, dim]}`` dict per layer, every tensor a
        view of one buffer ``[layers, components, num_blocks, block_size, heads, dim]`` (``.buffer``), so a
        chunk of every layer moves in one gather/scatter (``kernels.chunk_io``)."""
        shape = (self.num_layers, len(self.components), *self.block_shape(num_blocks, block_size))
        if torch.device(device).type == "cpu":
            buffer = zeros_on_hugepages(shape, self.dtype)          # scattered blocks: fewer TLB misses
        else:
            buffer = torch.zeros(shape, dtype=self.dtype, device=device)
        caches = KVCaches({c: buffer[layer, i] for i, c in enumerate(self.components)}
                          for layer in range(self.num_layers))
        caches.buffer = buffer
        return caches

    def describe(self) -> str:
        """Stable text used in model fingerprints (store keys must change when this does)."""
        if self.kind == "mla":
            return f"mla:latent={self.kv_lora_rank}:rope={self.rope_dim}:{self.dtype}"
        return f"{self.kind}:kv_heads={self.num_kv_heads}:head_dim={self.head_dim}:{self.dtype}"


class KVCaches(list):
    """The per-layer cache dicts, plus ``buffer``: the one tensor they are views of."""
    buffer: torch.Tensor


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
