"""Every Triton attention variant the planner can pick for one model: the start-up warm-up list and the compile matrix.

Called by ``engine/runner/kernel_warmup.py`` at start-up on CUDA (one fake step per variant, so no request waits
for a compile) and by ``offline_compile.py`` (each variant built for sm_90 and checked for register spills and
shared memory; ``tests/test_kernel_compile.py``, ``devbench/compile_table.py``). No triton import.

    shape = ModelShape(num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16, window=None)
    attention_steps(shape)   -> [AttentionStep(max_query_len, num_splits, tiles)], one per compiled kernel
    MLAShape(kv_lora_rank=512, rope_dim=64, dtype="bfloat16")   DeepSeek's latent decode: ``mla_splits()`` variants

A compiled attention kernel is fixed by the model (dtype, head dim, block size, window) and the plan's tiles
plus whether the keys split (``attention_plan.py``); the head group, the step's lengths and the split count
itself are runtime arguments Triton does not specialise on (``triton_attention.STEP_INTS``). ``tiles`` depends on
the step through ``max_query_len`` alone and saturates once BLOCK_M reaches its cap (at most TILE_ROWS // 16
rows), so walking max_query_len 1..TILE_ROWS // 16 meets every tile choice. Each is listed with and without a
split (a prefill of one long prompt splits its keys too), so a step of any shape finds its kernel compiled.

The fused MoE (``triton_moe.py``) compiles per dtype, BLOCK_M (``MOE_BLOCK_MS``, picked from the mean rows per
expert) and launch (the gate/up GEMM, the weighted down GEMM); ``moe_rows(block_m, num_experts)`` is a row count
(T*k) that picks ``block_m``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kernels.attention_plan import TILE_ROWS, Tiles, tiles

SPLIT_REPRESENTATIVE = 2    # any count > 1 runs the same compiled kernel (num_splits is not specialised)
MOE_BLOCK_MS = (16, 32, 64)     # fused MoE rows per block: decode-sized segments waste less padding at 16


@dataclass(frozen=True)
class ModelShape:
    """What a model's attention kernels are compiled for."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str                    # the KV cache's torch dtype name: "bfloat16", "float16" or "float32"
    block_size: int = 16
    window: int | None = None     # sliding window (a constexpr of the kernel), None for full attention

    @property
    def fp32(self) -> bool:
        return self.dtype == "float32"

    @property
    def qpk(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class AttentionStep:
    """One attention kernel variant, as the step that makes the planner pick it: a single sequence of
    ``max_query_len`` new tokens whose keys split ``num_splits`` ways. ``query_lens``: the steps' longest query
    lengths that get these tiles, (first, last), last None for no bound (1 is a decode step)."""
    max_query_len: int
    num_splits: int
    tiles: Tiles
    query_lens: tuple[int, int | None]

    @property
    def kind(self) -> str:
        """"decode": the tiles of a decode step (which short prefill chunks share), else "prefill"."""
        return "decode" if self.query_lens[0] == 1 else "prefill"


def attention_steps(shape: ModelShape) -> list[AttentionStep]:
    """Each distinct (tiles, split) of ``shape``, at the shortest query length that picks those tiles."""
    seen: dict[Tiles, list[int]] = {}
    bound = TILE_ROWS // 16
    for max_query_len in range(1, bound + 1):
        seen.setdefault(tiles(shape.qpk, shape.head_dim, max_query_len, shape.fp32), []).append(max_query_len)
    return [AttentionStep(lens[0], splits, t, (lens[0], None if lens[-1] == bound else lens[-1]))
            for t, lens in seen.items() for splits in (1, SPLIT_REPRESENTATIVE)]


@dataclass(frozen=True)
class MLAShape:
    """What a DeepSeek model's MLA decode kernels are compiled for (heads per rank are a runtime argument)."""
    kv_lora_rank: int
    rope_dim: int
    dtype: str                    # the latent cache's torch dtype name
    block_size: int = 16

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


MLA_SHAPES = ((512, 64),)         # (kv_lora_rank, qk_rope_head_dim) of DeepSeek V2, V2-Lite and V3


def mla_splits() -> tuple[int, ...]:
    """The MLA decode kernel's variants: one split (it normalises itself) and split-K (partials + the reduce)."""
    return (1, SPLIT_REPRESENTATIVE)
def moe_rows(block_m: int, num_experts: int) -> int:
    """A step's (token, slot) row count whose mean per expert makes ``triton_moe.moe_tiles`` pick ``block_m``."""
    return block_m * num_experts
