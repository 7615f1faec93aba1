"""The mixture-of-experts block of every MoE family (Qwen3-MoE, Mixtral, DeepSeek V2/V3, Qwen2-MoE's shared expert).

``make_mlp(config, layer, shard)`` is the decoder layer's MLP factory (``llama.DecoderLayer``; DeepSeek's layers
call it too): an ``MoE`` where ``config.moe.is_moe_layer(layer)``, else the dense ``GatedMLP``. Per step:

    logits  [T, E]  = x gate^T                 (float32 weights and matmul for DeepSeek, as HF)
    weights, ids    = moe_routing.route(logits, cfg, e_score_correction_bias)       # [T, k] each
    y       [T, H]  = dispatch.fused_moe(x, w13, w2, weights, ids)   # grouped matmul by expert: torch / Triton
    y              += shared expert(x)  (times sigmoid(x g^T) for Qwen2-MoE)
    y               = all_reduce(y)     (tensor parallel only)

Experts are stacked at load: ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I], read from the
checkpoint one expert at a time as transformers' ``save_pretrained`` writes them
(``{block}.experts.{e}.gate_proj|up_proj|down_proj``; Mixtral ``block_sparse_moe.experts.{e}.w1|w3|w2``), or from
transformers 5's fused layout (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).

Tensor parallelism: each expert's intermediate dim is split over the ``tp`` ranks (rank r holds rows
[r*I/tp, (r+1)*I/tp) of every gate and up, the same columns of every down; likewise the shared expert), the router
is replicated. Every rank routes every token the same way and computes a partial sum of each expert's output, so
the routed part plus the shared part need ONE all-reduce per MoE layer -- the dense MLP's count (``tp.attach``
wires it here and takes the shared expert's own away). Expert parallelism (whole experts per rank) would also need
one all-reduce with replicated tokens, but leaves ranks idle when routing is skewed and makes the split depend on
E dividing by tp; splitting each expert keeps every rank's work equal for any routing. The cost: each rank's
expert GEMMs are tp times narrower (DeepSeek-V3 at tp 8: I = 256 per rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models.layers import GatedMLP, _copy
from pdserve.engine.models.model_config import ModelConfig
from pdserve.engine.models.moe_config import MoEConfig
from pdserve.engine.models.moe_routing import route
from pdserve.kernels.dispatch import fused_moe


def make_mlp(config: ModelConfig, layer: int, shard) -> nn.Module:
    """The MLP of global layer ``layer`` on a rank holding ``shard`` (``llama.ShardSizes``)."""
    moe = config.moe
    if moe is not None and moe.is_moe_layer(layer):
        return MoE(config.hidden_size, moe, shard.tp_size, config.dtype, shared_bias=config.mlp_bias)
    return GatedMLP(config.hidden_size, shard.intermediate_size, config.mlp_bias, config.dtype)


class MoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: MoEConfig, tp_size: int, dtype: torch.dtype,
                 shared_bias: bool = False):
        super().__init__()
        for what, n in (("moe_intermediate_size", cfg.intermediate_size),
                        ("shared expert width", cfg.shared_intermediate_size)):
            if n % tp_size:
                raise ValueError(f"the model has {n} {what}, not divisible by --tensor-parallel-size {tp_size}")
        self.cfg, self.tp_size = cfg, tp_size
        E, H, inter = cfg.num_experts, hidden_size, cfg.intermediate_size // tp_size
        self.intermediate_size = inter                                   # this rank's share of one expert
        self.gate = _param(E, H, dtype=torch.float32 if cfg.router_fp32 else dtype)
        self.e_score_correction_bias = _param(E, dtype=torch.float32) if cfg.topk_method == "noaux_tc" else None
        self.w13 = _param(E, 2 * inter, H, dtype=dtype)
        self.w2 = _param(E, H, inter, dtype=dtype)
        shared = cfg.shared_intermediate_size // tp_size
        # the shared experts are the family's dense MLP: biased where it is (DeepSeek V2's mlp_bias, as HF builds)
        self.shared = GatedMLP(H, shared, shared_bias, dtype) if shared else None
        self.shared_gate = _param(1, H, dtype=dtype) if cfg.shared_expert_gate else None
        self.collective = None            # tensor parallel: the all-reduce of routed + shared partial sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.route(x)                                       # [T, k] each
        y = fused_moe(x, self.w13, self.w2, weights, ids)
        if self.shared is not None:
            s = self.shared(x)
            y = y + (s if self.shared_gate is None else torch.sigmoid(F.linear(x, self.shared_gate)) * s)
        return y if self.collective is None else self.collective(y)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> (weights [T, k] float32, ids [T, k] int64)
        logits = F.linear(x.float() if self.cfg.router_fp32 else x, self.gate)          # [T, E]
        return route(logits, self.cfg, self.e_score_correction_bias)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + forward(x) (the decoder layer's call, as ``GatedMLP.plus``)."""
        return residual + self(x)

    def rows_independent(self) -> bool:
        """False: grouped matmuls give a row other bits as its expert's segment grows (``DecoderLayer``)."""
        return False

    def attach_collective(self, all_reduce) -> None:
        """Tensor parallel (``parallel.tp.attach``): one all-reduce for the whole block, none in the shared expert."""
        self.collective = all_reduce
        if self.shared is not None:
            self.shared.down.collective = None

    def load(self, src, prefix: str, tp_rank: int = 0) -> None:
        """Fill from the checkpoint's ``prefix`` (``model.layers.{i}.mlp``; Mixtral's block name replaces ``mlp``)."""
        fused = f"{prefix}.experts.gate_up_proj"           # transformers 5's layout keeps every block at ``mlp``
        if fused not in src:
            prefix = prefix.rsplit(".", 1)[0] + "." + self.cfg.block_name
        _copy(self.gate, src.get(f"{prefix}.gate.weight"), f"{prefix}.gate.weight")
        if self.e_score_correction_bias is not None:
            name = f"{prefix}.gate.e_score_correction_bias"
            _copy(self.e_score_correction_bias, src.get(name), name)
        if fused in src:
            self._load_fused(src, fused.rsplit(".", 1)[0], tp_rank)
        else:
            for e in range(self.cfg.num_experts):
                self._load_expert(src, f"{prefix}.experts.{e}", e, tp_rank)
        if self.shared is not None:
            self.shared.load(src, f"{prefix}.shared_expert{'' if self.shared_gate is not None else 's'}", tp_rank)
            if tp_rank and self.shared.down.bias is not None:    # the block's one all-reduce sums every rank's
                self.shared.down.bias.zero_()                     # partial: rank 0 alone adds down's bias
        if self.shared_gate is not None:
            _copy(self.shared_gate, src.get(f"{prefix}.shared_expert_gate.weight"), f"{prefix}.shared_expert_gate")

    def _load_expert(self, src, prefix: str, e: int, tp_rank: int) -> None:
        gate, up, down = (f"{prefix}.{n}.weight" for n in self.cfg.expert_names)
        inter, lo = self.intermediate_size, tp_rank * self.intermediate_size
        _copy(self.w13[e, :inter], src.get_slice(gate, 0, lo, lo + inter), gate)
        _copy(self.w13[e, inter:], src.get_slice(up, 0, lo, lo + inter), up)
        _copy(self.w2[e], src.get_slice(down, 1, lo, lo + inter), down)

    def _load_fused(self, src, prefix: str, tp_rank: int) -> None:
        """transformers 5's stacked experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
        name, inter = f"{prefix}.gate_up_proj", self.intermediate_size
        lo, full = tp_rank * inter, self.cfg.intermediate_size
        _copy(self.w13[:, :inter], src.get_slice(name, 1, lo, lo + inter), name)
        _copy(self.w13[:, inter:], src.get_slice(name, 1, full + lo, full + lo + inter), name)
        _copy(self.w2, src.get_slice(f"{prefix}.down_proj", 2, lo, lo + inter), f"{prefix}.down_proj")


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
