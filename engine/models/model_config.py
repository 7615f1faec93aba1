"""What a checkpoint directory says about its model: ``ModelConfig.from_dir(path, dtype)``.

Read by the loader (``pdserve.engine.models.loader``) to build the model, by the engine for the KV
layout (``config.kv_layout()``), EOS ids and ``max_position_embeddings``. Parses a local HF
directory's ``config.json`` (+ ``generation_config.json``) as written by transformers 4.x
(``rope_theta`` / ``rope_scaling``) or 5.x (``rope_parameters``). Architecture quirks become
flags here (Qwen2's q/k/v bias, Qwen3's q/k norm, Mistral's sliding window) so that the model
code has one path. DeepSeek V2/V3 add ``mla`` (``mla_config.MLAConfig``: latent attention dims, the softmax
scale); their ``head_dim`` is the rotary part of a head (``qk_rope_head_dim``), as in transformers, and their KV
layout is one latent component per token (``kv_layout``). An MoE model's routing and expert layout become ``moe``
(``moe_config.MoEConfig``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.kv.kv_layout import KVLayout
from pdserve.engine.models.mla_config import MLAConfig
from pdserve.engine.models.moe_config import MoEConfig, MoEConfigError
from pdserve.engine.models.registry import check_supported

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


class ModelConfigError(ValueError):
    """config.json is missing, malformed or asks for something pdserve does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope.py`` turns them into inverse frequencies."""
    rope_type: str = "default"                      # one of ROPE_TYPES
    theta: float = 10000.0
    factor: float | None = None                     # linear, dynamic, llama3, yarn
    original_max_position_embeddings: int | None = None   # llama3, yarn
    low_freq_factor: float | None = None            # llama3
    high_freq_factor: float | None = None           # llama3
    attention_factor: float | None = None           # yarn: None -> derived from factor / mscale
    beta_fast: float | None = None                  # yarn (None -> 32)
    beta_slow: float | None = None                  # yarn (None -> 1)
    mscale: float | None = None                     # yarn
    mscale_all_dim: float | None = None             # yarn
    truncate: bool = True                           # yarn


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool                 # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool                    # bias on o_proj (Llama/Qwen3 ``attention_bias``)
    mlp_bias: bool                       # bias on gate/up/down (Llama ``mlp_bias``)
    qk_norm: bool                        # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None           # window in tokens for "sliding_attention" layers
    layer_types: tuple[str, ...]         # per layer: "full_attention" | "sliding_attention"
    eos_token_ids: tuple[int, ...]       # generation_config's first, then config.json's
    bos_token_id: int | None
    checkpoint_dtype: torch.dtype | None  # what config.json says the weights are
    dtype: torch.dtype                   # what we compute in (resolved ``--dtype``)
    mla: MLAConfig | None = None         # DeepSeek V2/V3: multi-head latent attention; None: per-head K/V
    moe: MoEConfig | None = None         # the MoE layers' layout; None for a dense model

    @classmethod
    def from_dir(cls, path: str | Path, dtype: str = "auto", device: str = "cpu") -> ModelConfig:
        path = Path(path)
        cfg = _read_json(path / "config.json", required=True)
        gen = _read_json(path / "generation_config.json", required=False)
        return _parse(path, cfg, gen, dtype, device)

    def sliding_window_for(self, layer: int) -> int | None:
        """Window of global layer ``layer``, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def kv_layout(self, num_kv_heads: int | None = None, num_layers: int | None = None,
                  first_layer: int = 0) -> KVLayout:
        """KV layout of one rank; defaults cover every KV head of every layer. MLA: one latent vector per token
        and layer, the same on every tensor-parallel rank (``num_kv_heads`` does not apply)."""
        if self.mla is not None:
            return KVLayout.mla(num_layers or self.num_layers, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim,
                                self.dtype, first_layer)
        return KVLayout(kind="mha", num_layers=num_layers or self.num_layers,
                        num_kv_heads=num_kv_heads or self.num_kv_heads, head_dim=self.head_dim,
                        dtype=self.dtype, first_layer=first_layer)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype | None = None,
                  device: str = "cpu") -> torch.dtype:
    """``--dtype`` -> torch dtype. "auto": float32 on CPU; on GPUs the checkpoint's half type
    (bfloat16 when the checkpoint is float32 or does not say)."""
    if name == "auto":
        if str(device).startswith("cpu"):
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if name not in _DTYPES:
        raise ModelConfigError(f"--dtype {name!r} is not one of auto, float32, bfloat16, float16")
    return _DTYPES[name]


def _parse(path: Path, cfg: dict, gen: dict, dtype: str, device: str) -> ModelConfig:
    arch = _architecture(path, cfg)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{path}/config.json: hidden_act {act!r} is not supported (only 'silu')")
    sliding_window, layer_types = _sliding(arch, cfg, num_layers)
    checkpoint_dtype = _DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")))
    rope = _parse_rope(path, cfg)
    mla = MLAConfig.from_hf(arch, cfg, rope)
    return ModelConfig(
        model_dir=str(path), architecture=arch, hidden_size=hidden, num_layers=num_layers,
        num_heads=heads, num_kv_heads=heads if mla else _kv_heads(path, cfg, heads),   # MLA: no KV heads
        head_dim=mla.qk_rope_head_dim if mla else _head_dim(path, cfg, hidden, heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope, max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))),
        o_proj_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        and bool(cfg.get("attention_bias", False)),
        mlp_bias=arch in ("LlamaForCausalLM", "DeepseekV2ForCausalLM") and bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), sliding_window=sliding_window,
        layer_types=layer_types, moe=_moe(path, arch, cfg),
        eos_token_ids=_eos_ids(gen, cfg), bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
        checkpoint_dtype=checkpoint_dtype, dtype=resolve_dtype(dtype, checkpoint_dtype, device), mla=mla)


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ModelConfigError(f"{path} not found: a model directory needs an HF config.json")
        return {}
    return json.loads(path.read_text())


def _architecture(path: Path, cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelConfigError(f"{path}/config.json has no 'architectures' entry")
    check_supported(archs[0])
    return archs[0]


def _kv_heads(path: Path, cfg: dict, heads: int) -> int:
    """KV heads; each serves the same number of query heads (GQA), or attention could not group them."""
    kv = int(cfg.get("num_key_value_heads") or heads)
    if kv < 1 or heads < 1 or heads % kv:
        raise ModelConfigError(f"{path}/config.json: num_attention_heads {heads} is not a multiple of "
                               f"num_key_value_heads {kv}; every KV head must serve the same number of query heads")
    return kv


def _head_dim(path: Path, cfg: dict, hidden: int, heads: int) -> int:
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if hidden % heads:
        raise ModelConfigError(f"{path}/config.json: hidden_size {hidden} is not a multiple of "
                               f"num_attention_heads {heads} and no head_dim is given")
    return hidden // heads


def _sliding(arch: str, cfg: dict, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """Mistral, Mixtral (Qwen3-MoE with ``use_sliding_window``): every layer slides when ``sliding_window`` is set.
    Qwen2/3: only with ``use_sliding_window``, on ``layer_types`` (or layers >= ``max_window_layers``); Qwen2-MoE:
    on ``layer_types`` (or even layers below ``max_window_layers``)."""
    window = cfg.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") or (arch == "Qwen3MoeForCausalLM"
                                                                 and cfg.get("use_sliding_window")):
        kinds = ["sliding_attention" if window else "full_attention"] * num_layers
    elif arch == "Qwen2MoeForCausalLM" and cfg.get("use_sliding_window"):     # HF's rule: every other layer
        first = int(cfg.get("max_window_layers", num_layers))
        kinds = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(num_layers)]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers", num_layers))
        kinds = cfg.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    else:
        window, kinds = None, ["full_attention"] * num_layers
    return (int(window) if window else None), tuple(kinds)


def _moe(path: Path, arch: str, cfg: dict) -> MoEConfig | None:
    try:
        return MoEConfig.from_hf(arch, cfg)
    except MoEConfigError as exc:
        raise ModelConfigError(f"{path}/{exc}") from None
    except KeyError as exc:
        raise ModelConfigError(f"{path}/config.json: {arch} needs {exc.args[0]!r}") from None


def _eos_ids(gen: dict, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        for tok in source if isinstance(source, list) else [source]:
            if tok is not None and int(tok) not in ids:
                ids.append(int(tok))
    return tuple(ids)


def _parse_rope(path: Path, cfg: dict) -> RopeConfig:
    """transformers 5.x: ``rope_parameters`` holds type + theta + scaling; 4.x: top-level
    ``rope_theta`` and an optional ``rope_scaling`` (key ``type`` or ``rope_type``)."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"{path}/config.json: rope type {rope_type!r} is not supported; "
                               f"supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelConfigError(f"{path}/config.json: partial_rotary_factor {partial} is not supported (only 1.0)")
    original = None
    if rope_type in ("llama3", "yarn"):
        original = int(cfg.get("original_max_position_embeddings")
                       or params.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    rope = RopeConfig(
        rope_type=rope_type, theta=float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
        factor=_opt_float(params.get("factor")), original_max_position_embeddings=original,
        low_freq_factor=_opt_float(params.get("low_freq_factor")),
        high_freq_factor=_opt_float(params.get("high_freq_factor")),
        attention_factor=_opt_float(params.get("attention_factor")),
        beta_fast=_opt_float(params.get("beta_fast")), beta_slow=_opt_float(params.get("beta_slow")),
        mscale=_opt_float(params.get("mscale")), mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)))
    _check_rope(path, rope)
    return rope


def _check_rope(path: Path, rope: RopeConfig) -> None:
    needed = {"linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(rope.rope_type, ())
    missing = [name for name in needed if getattr(rope, name) is None]
    if missing:
        raise ModelConfigError(f"{path}/config.json: rope type {rope.rope_type!r} needs "
                               f"{', '.join(missing)} in rope_parameters/rope_scaling")


def _opt_float(value) -> float | None:
    return None if value is None else float(value)
