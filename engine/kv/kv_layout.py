"""The KV cache layout: one descriptor read by the paged cache, the attention and the KV store.

A layer's paged cache is one tensor ``[num_blocks, block_size, *token_shape]`` per
component. Standard attention (MHA/GQA) has two components, ``k`` and ``v``, each with
token shape ``[num_kv_heads, head_dim]``. DeepSeek MLA will have one component, the
latent vector plus its rope part, token shape ``[1, kv_lora_rank + rope_dim]``. Nothing
outside this module needs to know which one it is: it iterates ``components``.
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
        return f"{self.kind}:kv_heads={self.num_kv_heads}:head_dim={self.head_dim}:{self.dtype}"


class KVCaches(list):
    """The per-layer cache dicts, plus ``buffer``: the one tensor they are views of."""
    buffer: torch.Tensor


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
