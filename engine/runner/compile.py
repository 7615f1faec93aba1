"""``torch.compile`` (inductor) of the decoder layers' non-attention parts; attention stays eager between them.

Built by ``ModelRunner`` at start-up on the single-process CPU path (tp = pp = 1) when asked for (``--torch-compile``
or ``PDSERVE_COMPILE=1``; off by default: compiled and eager steps round differently, so a prompt's KV bytes would
depend on how it was chunked) and not ``--enforce-eager``; the runner asks for the pieces of
every step and passes them to the model (``LlamaForCausalLM.forward(..., pieces=...)``):

    layer i:   h --[before_attention: norm, qkv, q/k norm, RoPE]--> q, k, v      compiled
               q, k, v --[paged attention, KV cache write]--> attn_out           eager (the graph's break)
               h, attn_out --[after_attention: o_proj, residual, norm, MLP]--> h compiled

    pieces     each function is compiled once and shared by every layer (its parameters are graph
               inputs), with the token dimension dynamic: no recompile per size
    warm-up    ``compile_layers`` runs the pieces through every layer at two token counts (attention
               replaced by its own q, no KV cache touched), so no request pays the compile; the time
               is logged once
    dispatch   ``pieces_for(num_tokens)``: steps below ``min_tokens`` run eagerly, where compiled
               code measured no faster (``devbench/cpu_compile.py``)
    cache      inductor's caches live under PDSERVE_CACHE_DIR/inductor (TORCHINDUCTOR_CACHE_DIR, when
               set, wins); a warm cache leaves dynamo's tracing only

Embedding, RoPE tables, the final norm and the LM head stay eager (once per step, not per layer).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import torch

from pdserve.engine import envs
from pdserve.engine.config import ConfigError
from pdserve.engine.models.llama import DecoderLayer, LayerPieces

logger = logging.getLogger(__name__)

# Steps with fewer tokens run eagerly. devbench/cpu_compile.py (2-core x86, 1 thread, torch 2.13): the
# compiled parts alone are 3-17 % faster at 32..2048 rows, but a whole decode step at 32 rows measured
# 1.00-1.02x eager (attention is ~85 % of it), at 128-256 rows 0.95-1.01x, a 2048-token prefill 0.90-0.94x.
MIN_TOKENS = 64
WARMUP_TOKENS = (16, 64)    # the first compiles with a dynamic token dimension; the second must not recompile


class CompiledLayers:
    """The compiled ``LayerPieces`` of one model, warmed up; ``pieces_for`` picks them per step."""

    def __init__(self, model, min_tokens: int = MIN_TOKENS):
        self.model, self.min_tokens = model, max(min_tokens, 2)
        self.pieces = LayerPieces(torch.compile(DecoderLayer.before_attention, fullgraph=True),
                                  torch.compile(DecoderLayer.after_attention, fullgraph=True))

    def pieces_for(self, num_tokens: int) -> LayerPieces | None:
        """The compiled pieces for a step of ``num_tokens`` rows, or None (run it eagerly)."""
        return self.pieces if num_tokens >= self.min_tokens else None

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, dynamic: bool) -> None:
        """One dummy forward of every layer's pieces; attention's output is stood in for by q."""
        m = self.model
        positions = torch.arange(num_tokens, device=m.rotary.inv_freq.device)
        cos, sin = m.rotary(positions)                                            # [T, Dh]
        h = torch.zeros(num_tokens, m.config.hidden_size, dtype=m.config.dtype, device=positions.device)
        for layer in m.layers:
            if dynamic:
                for x in (h, cos, sin):
                    torch._dynamo.mark_dynamic(x, 0)
            q, _, _ = self.pieces.before_attention(layer, h, cos, sin)             # q: [T, H, Dh]
            if dynamic:
                torch._dynamo.mark_dynamic(q, 0)
            h = self.pieces.after_attention(layer, h, q)                          # [T, D]


def compile_layers(model, min_tokens: int = MIN_TOKENS) -> CompiledLayers:
    """Compile and warm up ``model``'s layer pieces; logs the time (and whether the cache was warm)."""
    cache_dir = use_cache_dir()
    start, before = time.monotonic(), _graphs_compiled()
    compiled = CompiledLayers(model, min_tokens)
    compiled.warm_up(WARMUP_TOKENS[0], dynamic=True)
    first = _graphs_compiled()
    compiled.warm_up(WARMUP_TOKENS[1], dynamic=False)
    if _graphs_compiled() != first:
        logger.warning("torch.compile recompiled the layer pieces for a second token count: the token "
                       "dimension is not dynamic, so every new step size will compile (use --enforce-eager)")
    logger.info("torch.compile of the non-attention parts of %d layers: %d graphs in %.1f s (steps of >= %d "
                "tokens run compiled; inductor cache %s)", len(model.layers), first - before,
                time.monotonic() - start, compiled.min_tokens, cache_dir)
    return compiled


def use_cache_dir() -> str:
    """Point inductor's on-disk caches under PDSERVE_CACHE_DIR unless TORCHINDUCTOR_CACHE_DIR says otherwise."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor_config.compile_threads = 1   # no pool of compile workers: the node keeps one thread per process
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == os.path.abspath(default_cache_dir()):   # unset, or torch's own default
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _private_inductor_dir()
    cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    try:                                  # inductor's own failure names neither the variable nor the way out
        os.makedirs(cache_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=cache_dir).close()
    except OSError as exc:
        raise ConfigError(f"torch.compile's cache directory {cache_dir} is not writable ({exc.strerror}); set "
                          "PDSERVE_CACHE_DIR (or TORCHINDUCTOR_CACHE_DIR) to a writable directory, or run "
                          "eagerly with --enforce-eager / PDSERVE_COMPILE=0") from exc
    return cache_dir


def _private_inductor_dir() -> str:
    """PDSERVE_CACHE_DIR/inductor where only this user can write it (inductor loads what it finds there as
    code: the same rule as the C kernels' cache, kernels/cpu_cache.py), else a private folder for this process."""
    from pdserve.kernels import cpu_cache

    fd = cpu_cache.open_subdir("inductor", "torch.compile cache", "this process compiles into a private "
                               "temporary folder")
    if fd is None:
        return tempfile.mkdtemp(prefix="pdserve-inductor-")
    os.close(fd)
    return str(envs.PDSERVE_CACHE_DIR / "inductor")


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
