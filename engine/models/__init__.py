"""Model code: our own plain-torch decoders over HF checkpoints (no transformers modeling code).

Who calls what:

    loader.load_model(dir)          # pdserve.engine.models.loader
      -> ModelConfig.from_dir(dir)  # pdserve.engine.models.model_config (checks registry.model_class)
      -> registry.model_class(arch)(config, first_layer, num_layers, shard)
      -> model.load_weights(WeightSource, tp_rank)
    model(input_ids, positions, kv_caches, attn_meta, pieces=None) -> hidden [T, D]   # ModelRunner, per step
    model.compute_logits(hidden[sample_rows])        -> logits [N, V] float32
    model(..., logit_rows=LogitRows(rows, attn_meta.for_rows(rows))) -> hidden [N, D]  # the CPU runner:
                                                     # the last layer's attention and MLP for ``rows`` only

Files:
    loader.py        load_model(dir, dtype): our model class filled from safetensors (a rank reads only its share)
    model_config.py  ModelConfig.from_dir: what config.json says (architecture quirks become flags), the KV layout
    registry.py      architecture name (config.json ``architectures[0]``) -> model class
    llama.py         Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral / Qwen2-MoE: one decoder, per-architecture flags from
                     ModelConfig, each layer's MLP from moe.make_mlp
    deepseek.py      DeepSeek V2 / V3: Llama's decoder with the MLA layer; MLP or MoE per layer (moe.make_mlp)
    mla.py           multi-head latent attention: the latent KV cache, plain prefill, weight-absorbed decode
    mla_config.py    MLAConfig: config.json's latent-attention dims, rope layout and softmax scale (YaRN mscale)
    moe_config.py    MoEConfig.from_hf: experts, top-k, scoring, groups, shared experts, which layers are MoE
    moe_routing.py   route(logits, cfg): each family's top-k routing, HF's ops in HF's order
    moe.py           the MoE block (router, stacked experts [E, 2I, H] / [E, H, I], shared expert), make_mlp; its
                     tensor-parallel split (each expert's width; one all-reduce per layer)
    layers.py        RMSNorm (+ residual add: add_norm), Linear with explicit shard sizes, fused SiLU-and-mul MLP,
                     embedding, the LM head (logits cut to the vocabulary)
    vocab.py         vocab-parallel padding: padded_vocab(V, tp) rows over the ranks, vocab_rows reads a shard
    rope.py          rotary embeddings (default, linear, dynamic, llama3, yarn), cos/sin computed in float32

Tensor/pipeline parallelism stays out of the model: layer constructors take this rank's sizes
(``ShardSizes``) and the model takes a layer range; with the defaults it is the full model.
"""

from pdserve.engine.models.registry import (UnsupportedArchitectureError, model_class,
                                            supported_architectures)

__all__ = ["UnsupportedArchitectureError", "model_class", "supported_architectures"]
