"""Tiny random HF checkpoints for tests: ``pdserve make-tiny-model DIR --arch llama``.

Dense architectures are written here; ``EXTRA_ARCHS`` names the module that writes each other ``--arch`` (the MoE
models: ``tiny_moe.py``, DeepSeek: ``tiny_deepseek.py``) on top of this one's pieces: one line per architecture.

Tests (and the built-in demo model of ``pdserve serve``) call ``make_tiny_model``; it
writes a directory that both HF transformers and ``pdserve.engine``'s loader read:

    config.json                    LlamaForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM | MistralForCausalLM
                                   (DeepseekV2/V3ForCausalLM: ``tiny_deepseek.py``, same files)
    generation_config.json         bos / eos ids
    model.safetensors              fp32, HF parameter names (or model-0000i-of-0000N.safetensors
                                   + model.safetensors.index.json when shards > 1)
    tokenizer.json                 trained offline (``tiny_tokenizer``): byte-level BPE (default, vocab 512) or,
                                   with tokenizer="metaspace", SentencePiece-style (Llama-2 layout, vocab 768)
    tokenizer_config.json          chat_template (ChatML / [INST]), eos <|im_end|> / </s>
    special_tokens_map.json

Everything is a pure function of the arguments: the same seed gives byte-identical files.
Weights are scaled so that greedy decoding wanders (no single-token loops) and logits have
a clear argmax, because parity tests compare greedy token ids with transformers.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.checkpoints.tiny_files import (  # noqa: F401 (re-exported)
    EMBED_STD, LOGIT_STD, NORM_STD, PROJ_GAIN, save_weights, write_tokenizer_files)
from pdserve.engine.checkpoints.tiny_tokenizer import (  # noqa: F401 (re-exported)
    ENDOFTEXT_ID, FLAVOURS, IM_END_ID, IM_START_ID, SPECIAL_TOKENS, TokenizerFlavour)

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
# --arch -> module under pdserve.engine.checkpoints whose ``make_tiny_model(out_dir, arch, seed, **same keywords)``
# writes it
EXTRA_ARCHS = {"qwen3_moe": "tiny_moe", "mixtral": "tiny_moe", "qwen2_moe": "tiny_moe", "deepseek_v2": "tiny_deepseek",
               "deepseek_v3": "tiny_deepseek"}


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model; ``head_dim`` may differ from hidden_size // num_heads (Qwen3)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, *, num_layers: int = 2,
                    hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, shards: int = 1, tie_word_embeddings: bool | None = None,
                    rope_scaling: dict | None = None, max_position_embeddings: int = 2048,
                    head_dim: int | None = None, tokenizer: str = "bpe", vocab_size: int | None = None) -> Path:
    """Write a random ``arch`` checkpoint into ``out_dir`` and return its path.

    ``tie_word_embeddings`` defaults to False for llama/mistral and True for qwen2/qwen3;
    ``head_dim`` defaults to hidden_size // num_heads, except qwen3 which gets twice that
    (like Qwen3-0.6B, where num_heads * head_dim != hidden_size). ``tokenizer``: "bpe" or "metaspace".
    ``vocab_size`` (rows of the embedding / LM head) defaults to the tokenizer's size rounded up to 64; any size
    >= the tokenizer's may be asked for (an odd one: a vocabulary that does not divide by the TP size).
    """
    if arch in EXTRA_ARCHS:
        module = importlib.import_module(f"pdserve.engine.checkpoints.{EXTRA_ARCHS[arch]}")
        return module.make_tiny_model(out_dir, arch, seed, num_layers=num_layers, hidden_size=hidden_size,
                                      num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      intermediate_size=intermediate_size, shards=shards,
                                      tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling,
                                      max_position_embeddings=max_position_embeddings, head_dim=head_dim,
                                      tokenizer=tokenizer, vocab_size=vocab_size)
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {sorted(ARCHS) + sorted(EXTRA_ARCHS)}")
    if tokenizer not in FLAVOURS:
        raise ValueError(f"tokenizer={tokenizer!r} is not one of {sorted(FLAVOURS)}")
    flavour = FLAVOURS[tokenizer]
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size} must divide by num_heads={num_heads}, "
                         f"and num_heads by num_kv_heads={num_kv_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = flavour.build(tokenizer)
    if vocab_size is not None and vocab_size < tok.get_vocab_size():
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {tok.get_vocab_size()} tokens")
    spec = TinySpec(
        arch=arch, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads * (2 if arch == "qwen3" else 1),
        intermediate_size=intermediate_size,
        vocab_size=vocab_size or -(-tok.get_vocab_size() // 64) * 64,
        tie_word_embeddings=arch in ("qwen2", "qwen3") if tie_word_embeddings is None else tie_word_embeddings)
    _write_json(out / "config.json", hf_config(spec, rope_scaling, max_position_embeddings, flavour))
    _write_json(out / "generation_config.json", {
        "bos_token_id": flavour.bos_id, "eos_token_id": list(flavour.eos_ids), "pad_token_id": flavour.pad_id})
    save_weights(out, random_weights(spec, seed), shards)
    write_tokenizer_files(out, tok, chat_template=flavour.chat_template, eos_token=flavour.eos_token,
                          bos_token=flavour.bos_token, pad_token=flavour.pad_token, unk_token=flavour.unk_token,
                          model_max_length=max_position_embeddings)
    return out


def hf_config(spec: TinySpec, rope_scaling: dict | None, max_position_embeddings: int,
              flavour: TokenizerFlavour = FLAVOURS["bpe"]) -> dict:
    """config.json for transformers 4.x (rope_scaling, rope_theta) and 5.x (rope_parameters) alike."""
    rope_theta = 1_000_000.0 if spec.arch.startswith("qwen") else 10_000.0
    scaling = dict(rope_scaling) if rope_scaling else None
    config = {
        "architectures": [ARCHS[spec.arch]], "model_type": spec.arch,
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings, "rope_theta": rope_theta,
        "rope_scaling": scaling, "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": rope_theta},
        "tie_word_embeddings": spec.tie_word_embeddings, "bos_token_id": flavour.bos_id,
        "eos_token_id": flavour.eos_ids[0], "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_cache": True, "dtype": "float32",
    }
    if spec.arch in ("llama", "qwen3"):
        config["attention_bias"] = False
    if spec.arch == "llama":
        config["mlp_bias"] = False
    if spec.arch.startswith("qwen"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers)
    if spec.arch == "mistral":
        config["sliding_window"] = None
    return config


def param_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, in a fixed order (the order weights are drawn in)."""
    d, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, d)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, d)
            if spec.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (spec.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (spec.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, d)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, d)
        shapes[p + "mlp.down_proj.weight"] = (d, spec.intermediate_size)
    shapes["model.norm.weight"] = (d,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, d)
    return shapes


def random_weights(spec: TinySpec, seed: int,
                   shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """fp32 weights drawn from one torch.Generator in ``shapes`` order (default ``param_shapes(spec)``)."""
    gen = torch.Generator().manual_seed(seed)
    final_norm_scale = LOGIT_STD / (EMBED_STD * spec.hidden_size ** 0.5)
    weights = {}
    for name, shape in (param_shapes(spec) if shapes is None else shapes).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name == "model.norm.weight":
            weights[name] = final_norm_scale * (1.0 + NORM_STD * noise)
        elif name.endswith("norm.weight"):
            weights[name] = 1.0 + NORM_STD * noise
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = EMBED_STD * noise
        else:   # projections [out, in] and the qwen2 q/k/v biases [out]
            weights[name] = PROJ_GAIN / spec.hidden_size ** 0.5 * noise if len(shape) == 1 \
                else PROJ_GAIN / shape[1] ** 0.5 * noise
    return weights


def register(subparsers) -> None:
    """Adds ``make-tiny-model`` to the ``pdserve`` CLI (engine/cli.py calls this)."""
    p = subparsers.add_parser("make-tiny-model", help="write a tiny random HF checkpoint (tests, demos)")
    p.add_argument("dir", type=Path, help="output directory")
    p.add_argument("--arch", choices=sorted(ARCHS) + sorted(EXTRA_ARCHS), default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="rows of the embedding / LM head (default: the tokenizer's size rounded up to 64)")
    p.add_argument("--tokenizer", choices=sorted(FLAVOURS), default="bpe",
                   help="bpe: byte-level BPE + ChatML; metaspace: SentencePiece-style (Llama-2 / Mistral-v0.1)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    path = make_tiny_model(args.dir, args.arch, args.seed, num_layers=args.num_layers,
                           hidden_size=args.hidden_size, shards=args.shards, tokenizer=args.tokenizer,
                           vocab_size=args.vocab_size)
    print(path)
    return 0


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
