"""Compile at start-up every Triton kernel a request can need: none compiles inside a request (~2.5 s each).

Called by ``ModelRunner`` on CUDA, whatever the attention backend, before the decode graphs are captured (with or
without ``--enforce-eager``); a no-op anywhere else:

    warm_up(runner)             all three of these:
    warm_attention(runner)      Triton backend: one fake step per entry of warmup_steps(model_shape(runner)), the time
                                logged; any other backend: one fake step. The forwards also compile the fused norm /
                                rope kernels (PDSERVE_FUSED_NORM/ROPE: on for CUDA tensors whatever the attention
                                backend), whose row counts are not specialised either (``triton_norm``)
    warm_transfer(buffer)       one gather and one scatter of the KV transfer kernels (``triton_transfer``: ``ChunkIO``
                                uses them on CUDA with any attention backend) over a skipped slot (-1): they compile
                                here, not in a request's first publish or load
    warm_moe(runner)            the fused MoE's variants (kernel_variants.MOE_BLOCK_MS x its two GEMMs) for each
                                distinct expert shape of the model's MoE layers, called on fake routings

``warmup_steps`` is ``kernel_variants.attention_steps``: each tile choice the planner can make for the model's
dtype, head dim and GQA ratio (decode and prefill), with and without a key split. A fake step is one sequence of
``max_query_len`` new tokens at positions 0.., staged like a real step (``StepStaging``: the same int32 tensors)
with every slot -1 (nothing is written into the KV cache) and its split count fixed in the metadata, run through
the model's own forward: each layer launches the cache write, the attention kernel and (split) its reduce with
a request's very arguments, windows and strides included. Step lengths, split counts and the alignment of the
step's metadata views are not specialised by the kernels (``triton_attention.STEP_INTS``), so these launches
compile every kernel a step of any shape launches. An MLA model (DeepSeek) warms its latent decode kernel with and
without a split and its latent write instead (``mla_steps``).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch

from pdserve.engine.runner.staging import StepArrays, StepStaging
from pdserve.kernels.kernel_variants import (MOE_BLOCK_MS, AttentionStep, ModelShape, attention_steps, mla_splits,
                                             moe_rows)

logger = logging.getLogger(__name__)
OTHER_BACKEND_STEP = SimpleNamespace(max_query_len=16, num_splits=None)   # a fake step for a non-Triton backend


def model_shape(runner) -> ModelShape:
    """The model's attention as the planner sees it (its first layer's heads, window; the cache's dtype)."""
    attn, cache = runner.model.layers[0].attn, runner.kv_caches[0]["k"]
    fp32 = torch.float32 in (cache.dtype, runner.model.config.dtype)
    return ModelShape(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                      "float32" if fp32 else str(cache.dtype).removeprefix("torch."), runner.block_size,
                      attn.sliding_window)


def warmup_steps(shape: ModelShape) -> list[AttentionStep]:
    """Every attention kernel variant the planner can pick for ``shape``, as a fake step that picks it."""
    return attention_steps(shape)


def warm_up(runner) -> None:
    """Every Triton kernel a request on this CUDA runner can launch, compiled now (nothing on another device)."""
    if runner.device.type != "cuda":
        return
    warm_attention(runner)
    warm_transfer(getattr(runner.kv_caches, "buffer", None))
    warm_moe(runner)


def warm_attention(runner) -> float | None:
    """Run the fake steps on CUDA (Triton backend: every attention variant; else one step, for the fused norm /
    rope kernels); -> seconds taken, or None where there is nothing to do."""
    if runner.device.type != "cuda" or not runner.model.layers:
        return None
    triton = runner.attention_backend == "triton"
    mla = getattr(getattr(runner, "layout", None), "kind", None) == "mla"
    if not triton:
        steps = [OTHER_BACKEND_STEP]
    else:
        steps = mla_steps() if mla else warmup_steps(model_shape(runner))
    start = time.monotonic()
    run_fake_steps(runner, steps)
    torch.cuda.synchronize()
    took = time.monotonic() - start
    if triton:
        logger.info("warmed %d Triton attention kernel variants (decode and prefill, split and not) in %.1f s",
                    len(steps), took)
    else:
        logger.info("warmed the fused norm / rope kernels (attention backend %s) in %.1f s", runner.attention_backend,
                    took)
    return took


class MLAStep(NamedTuple):
    """A fake step of an MLA model: its decode kernel is fixed by the latent's dims and dtype and whether the keys
    split (``kernel_variants.mla_splits``); a prefill step launches the latent write and torch ops only."""
    max_query_len: int
    num_splits: int


def mla_steps() -> list[MLAStep]:
    return [MLAStep(1, splits) for splits in mla_splits()] + [MLAStep(2, 1)]


def warm_transfer(buffer: torch.Tensor | None) -> None:
    """Compile both directions of the chunk gather/scatter for the cache ``buffer`` [L, C, N, bs, Hkv, D] (None:
    caches not made by ``KVLayout.allocate``, nothing to do). The one slot is -1: nothing is read or written in
    the cache; the gathered object is zeros. The chunk length is not specialised (``triton_transfer``)."""
    if buffer is None:
        return
    from pdserve.kernels import triton_transfer

    start = time.monotonic()
    skipped = torch.full((1,), -1, dtype=torch.int64, device=buffer.device)
    obj = triton_transfer.gather_chunk(buffer, skipped)
    triton_transfer.scatter_chunk(buffer, skipped, obj)
    if buffer.device.type == "cuda":
        torch.cuda.synchronize()
    logger.info("warmed the KV transfer gather/scatter kernels in %.1f s", time.monotonic() - start)


@torch.inference_mode()
def warm_moe(runner) -> float | None:
    """Launch the fused MoE at each BLOCK_M once per distinct expert shape (the fake steps above are decode-sized:
    they reach BLOCK_M 16 only); on CUDA. The experts are called straight (``dispatch.fused_moe``), not the layer:
    no collective runs. -> seconds taken, or None where there is nothing to do."""
    from pdserve.engine.models.moe import MoE
    from pdserve.kernels.dispatch import fused_moe

    if runner.device.type != "cuda":
        return None
    shapes = {(m.w13.shape, m.w13.dtype): m for m in runner.model.modules() if isinstance(m, MoE)}
    if not shapes:
        return None
    start = time.monotonic()
    for module in shapes.values():
        for x, weights, ids in moe_warmup_inputs(module):
            fused_moe(x, module.w13, module.w2, weights, ids)
    torch.cuda.synchronize()
    took = time.monotonic() - start
    logger.info("warmed the fused MoE kernels of %d expert shape(s) in %.1f s", len(shapes), took)
    return took


def moe_warmup_inputs(module) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x [T, H], weights [T, k], ids [T, k]) per BLOCK_M: T tokens whose T*k rows make ``triton_moe.moe_tiles``
    pick it, each token on k distinct experts."""
    E, k = module.cfg.num_experts, module.cfg.top_k
    dev, H = module.w13.device, module.w13.shape[2]
    out = []
    for block_m in MOE_BLOCK_MS:
        T = max(1, moe_rows(block_m, E) // k)
        ids = (torch.arange(T * k, device=dev) % E).view(T, k)
        out.append((torch.zeros(T, H, dtype=module.w13.dtype, device=dev),
                    torch.full((T, k), 1.0 / k, device=dev), ids))
    return out


@torch.inference_mode()
def run_fake_steps(runner, steps: list[AttentionStep]) -> None:
    """Each step through the model's forward; a later pipeline stage (no embedding) gets zero hidden states."""
    staging, model = StepStaging(runner.device), runner.model
    for step in steps:
        inputs = staging.stage(fake_step(step.max_query_len, runner.block_size), [], runner.block_size,
                               runner.attention_backend)
        inputs.attn.num_splits = step.num_splits
        args = (inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attn)
        if getattr(model, "is_first", True):
            model(*args)
        else:
            model(*args, hidden=torch.zeros(step.max_query_len, model.config.hidden_size, dtype=model.config.dtype,
                                            device=runner.device))                     # [T, D]


def fake_step(num_tokens: int, block_size: int) -> StepArrays:
    """One sequence of ``num_tokens`` new tokens at positions 0.., every slot -1 and its block table all block 0."""
    n = num_tokens
    return StepArrays(input_ids=np.zeros(n, np.int64), positions=np.arange(n, dtype=np.int64),
                      slot_mapping=np.full(n, -1, np.int64), query_start_loc=np.array([0, n], np.int32),
                      seq_lens=np.array([n], np.int32), block_table=np.zeros((1, -(-n // block_size)), np.int32),
                      sample_rows=np.zeros(0, np.int64))
