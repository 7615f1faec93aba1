"""Tiny random MoE checkpoints: ``pdserve make-tiny-model DIR --arch qwen3_moe|mixtral|qwen2_moe``.

Reached through ``tiny_model.make_tiny_model`` (its ``EXTRA_ARCHS``). Each is its dense sibling's checkpoint
(``tiny_model``: Qwen3's attention with q/k norm for qwen3_moe, Mistral's for mixtral, Qwen2's with q/k/v bias for
qwen2_moe; the same tokenizer files)
with MoE blocks in place of the MLPs, stored one expert at a time as transformers' ``save_pretrained`` writes them:

    qwen3_moe  8 experts, top 2, renormalised, moe_intermediate_size = intermediate_size / 4;
               layer 1 dense (``mlp_only_layers``, width intermediate_size) when there are 2+ layers
               model.layers.{i}.mlp.gate.weight [E, H], mlp.experts.{e}.gate_proj|up_proj|down_proj.weight
    mixtral    8 experts, top 2, every layer MoE, each expert intermediate_size / 2 wide
               model.layers.{i}.block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1|w3|w2.weight
    qwen2_moe  as qwen3_moe (not renormalised), plus a shared expert intermediate_size / 2 wide behind a sigmoid gate:
               mlp.shared_expert.gate_proj|up_proj|down_proj.weight, mlp.shared_expert_gate.weight [1, H]

Deterministic like ``tiny_model``: the same arguments give byte-identical files.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.checkpoints.tiny_model import (FLAVOURS, TinySpec, _write_json, hf_config, param_shapes,
                                                   random_weights, save_weights, write_tokenizer_files)

NUM_EXPERTS, TOP_K = 8, 2
_BASE = {"qwen3_moe": "qwen3", "mixtral": "mistral", "qwen2_moe": "qwen2"}     # the dense sibling: its attention
_NAMES = {"qwen3_moe": ("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
          "mixtral": ("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
          "qwen2_moe": ("Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"))}


def make_tiny_model(out_dir: str | Path, arch: str, seed: int = 0, *, num_layers: int = 2, hidden_size: int = 64,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128, shards: int = 1,
                    tie_word_embeddings: bool | None = None, rope_scaling: dict | None = None,
                    max_position_embeddings: int = 2048, head_dim: int | None = None, tokenizer: str = "bpe",
                    vocab_size: int | None = None) -> Path:
    """Write a random ``arch`` MoE checkpoint into ``out_dir`` (``tiny_model.make_tiny_model``'s arguments)."""
    if arch not in _NAMES:
        raise ValueError(f"arch={arch!r} is not one of {sorted(_NAMES)}")
    if tokenizer not in FLAVOURS:
        raise ValueError(f"tokenizer={tokenizer!r} is not one of {sorted(FLAVOURS)}")
    flavour, base = FLAVOURS[tokenizer], _BASE[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = flavour.build(tokenizer)
    if vocab_size is not None and vocab_size < tok.get_vocab_size():
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {tok.get_vocab_size()} tokens")
    spec = TinySpec(
        arch=base, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads * (2 if base == "qwen3" else 1),
        intermediate_size=intermediate_size, vocab_size=vocab_size or -(-tok.get_vocab_size() // 64) * 64,
        tie_word_embeddings=base == "qwen3" if tie_word_embeddings is None else tie_word_embeddings)
    config = {**hf_config(spec, rope_scaling, max_position_embeddings, flavour), **moe_keys(arch, spec)}
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": flavour.bos_id, "eos_token_id": list(flavour.eos_ids), "pad_token_id": flavour.pad_id})
    save_weights(out, random_weights(spec, seed, moe_shapes(arch, spec, config)), shards)
    write_tokenizer_files(out, tok, chat_template=flavour.chat_template, eos_token=flavour.eos_token,
                          bos_token=flavour.bos_token, pad_token=flavour.pad_token, unk_token=flavour.unk_token,
                          model_max_length=max_position_embeddings)
    return out


def moe_keys(arch: str, spec: TinySpec) -> dict:
    """config.json keys that make ``spec``'s dense config the MoE one."""
    keys = {"architectures": [_NAMES[arch][0]], "model_type": arch, "num_experts_per_tok": TOP_K,
            "output_router_logits": False, "router_aux_loss_coef": 0.001}
    if arch == "mixtral":
        return {**keys, "num_local_experts": NUM_EXPERTS, "intermediate_size": spec.intermediate_size // 2,
                "router_jitter_noise": 0.0}
    keys = {**keys, "num_experts": NUM_EXPERTS, "moe_intermediate_size": spec.intermediate_size // 4,
            "norm_topk_prob": arch == "qwen3_moe", "decoder_sparse_step": 1,
            "mlp_only_layers": [1] if spec.num_layers > 1 else []}
    return keys if arch == "qwen3_moe" else {**keys, "shared_expert_intermediate_size": spec.intermediate_size // 2,
                                             "qkv_bias": True}


def moe_shapes(arch: str, spec: TinySpec, config: dict) -> dict[str, tuple[int, ...]]:
    """``param_shapes(spec)`` with each MoE layer's MLP replaced by its router and experts (same order otherwise)."""
    _, block, (gate, up, down) = _NAMES[arch]
    dense = set(config.get("mlp_only_layers", []))
    width = config.get("moe_intermediate_size", config["intermediate_size"])
    d, shapes = spec.hidden_size, {}
    for name, shape in param_shapes(spec).items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is None or ".mlp." not in name or layer in dense:
            shapes[name] = shape
        elif name.endswith("mlp.gate_proj.weight"):                  # the first of the layer's MLP tensors
            p = f"model.layers.{layer}.{block}"
            shapes[f"{p}.gate.weight"] = (NUM_EXPERTS, d)
            for e in range(NUM_EXPERTS):
                shapes.update({f"{p}.experts.{e}.{gate}.weight": (width, d), f"{p}.experts.{e}.{up}.weight": (width, d),
                               f"{p}.experts.{e}.{down}.weight": (d, width)})
            shared = config.get("shared_expert_intermediate_size")
            if shared:
                shapes.update({f"{p}.shared_expert.gate_proj.weight": (shared, d),
                               f"{p}.shared_expert.up_proj.weight": (shared, d),
                               f"{p}.shared_expert.down_proj.weight": (d, shared),
                               f"{p}.shared_expert_gate.weight": (1, d)})
    return shapes
