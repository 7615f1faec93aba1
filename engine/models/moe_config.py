"""What an HF config.json says about a model's mixture-of-experts layers: ``MoEConfig.from_hf(arch, cfg)``.

Called by ``ModelConfig.from_dir`` (``model_config.py``), which keeps the result as ``ModelConfig.moe`` (None for a
dense model); read by ``moe.py`` (the layer: routing, expert sizes, checkpoint names) and by ``llama.py``'s MLP
factory (``is_moe_layer``). Families and the keys they use:

    Qwen3-MoE  num_experts (transformers 5 writes num_local_experts), num_experts_per_tok, moe_intermediate_size,
               norm_topk_prob, softmax;
               dense layers: ``mlp_only_layers`` + ``decoder_sparse_step`` (MoE where (i + 1) % step == 0)
    Qwen2-MoE  as Qwen3-MoE, plus one shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate
    Mixtral    num_local_experts, num_experts_per_tok, ``intermediate_size`` per expert, softmax, always
               renormalised; every layer MoE; checkpoint names ``block_sparse_moe.experts.{e}.w1|w3|w2``
    DeepSeek   n_routed_experts, num_experts_per_tok, moe_intermediate_size, ``n_shared_experts`` shared experts of
               moe_intermediate_size each (one MLP of n x that width), scoring_func softmax | sigmoid, topk_method
               greedy | group_limited_greedy (V2: the ``topk_group`` groups with the best expert) | noaux_tc (V3:
               groups by the sum of their two best biased scores, ``e_score_correction_bias``), routed_scaling_factor;
               dense layers: i < ``first_k_dense_replace``

``moe_layer_freq`` is read nowhere, as in transformers: its DeepSeek V2/V3 models put an MoE block on every layer
from ``first_k_dense_replace`` on and ``save_pretrained`` writes those experts, whatever the key says (DeepSeek's
own code would make layers off the frequency dense; every published checkpoint has 1, where the two agree).
HF's DeepSeek-V2 port ignores ``norm_topk_prob`` (DeepSeek's own code and vLLM honour it); every published V2
checkpoint sets it false, where the two agree. Here the config is followed.
A key config.json leaves out means what transformers' config class defaults it to (``_DEEPSEEK_DEFAULTS``,
``QWEN2_MOE_SHARED_WIDTH``): HF builds the model, and writes the checkpoint, from those.
"""

from __future__ import annotations

from dataclasses import dataclass

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_QWEN = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class MoEConfigError(ValueError):
    """config.json asks for an MoE layout pdserve does not implement, or its numbers do not fit together."""


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int                  # one routed expert's width
    scoring: str = "softmax"                # one of SCORING
    norm_topk_prob: bool = False            # renormalise the k chosen weights to sum 1
    topk_method: str = "greedy"             # one of TOPK_METHODS
    num_groups: int = 1                     # n_group
    topk_groups: int = 1                    # topk_group
    routed_scaling_factor: float = 1.0      # times the (normalised) routed weights
    sorted_topk: bool = True                # torch.topk's ``sorted`` (HF: False for DeepSeek, True elsewhere)
    router_fp32: bool = False               # DeepSeek: the router's weight and matmul in float32
    shared_intermediate_size: int = 0       # width of the shared expert MLP (0: none)
    shared_expert_gate: bool = False        # Qwen2-MoE: shared output times sigmoid(x . g)
    first_k_dense: int = 0                  # DeepSeek first_k_dense_replace
    sparse_step: int = 1                    # Qwen decoder_sparse_step
    dense_layers: tuple[int, ...] = ()      # Qwen mlp_only_layers
    block_name: str = "mlp"                 # checkpoint module of the layer's MoE block
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def from_hf(cls, arch: str, cfg: dict) -> MoEConfig | None:
        """The MoE layout of an ``arch`` config, None for a dense one."""
        if arch == "MixtralForCausalLM":
            moe = cls(num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                      intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                      block_name="block_sparse_moe", expert_names=("w1", "w3", "w2"))
        elif arch in _QWEN:
            moe = _qwen(arch, cfg)
        elif arch in _DEEPSEEK:
            moe = _deepseek(arch, cfg)
        else:
            return None
        moe.check()
        return moe

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` runs this MoE block (else a dense gated MLP)."""
        if layer in self.dense_layers or (layer + 1) % self.sparse_step:
            return False
        return layer >= self.first_k_dense

    @property
    def grouped(self) -> bool:
        """Whether routing first picks ``topk_groups`` of ``num_groups`` expert groups."""
        return self.topk_method in ("group_limited_greedy", "noaux_tc")

    def check(self) -> None:
        if self.scoring not in SCORING:
            raise MoEConfigError(f"config.json: scoring_func {self.scoring!r} is not one of {', '.join(SCORING)}")
        if self.topk_method not in TOPK_METHODS:
            raise MoEConfigError(f"config.json: topk_method {self.topk_method!r} is not one of "
                                 f"{', '.join(TOPK_METHODS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise MoEConfigError(f"config.json: num_experts_per_tok {self.top_k} must be between 1 and the "
                                 f"{self.num_experts} experts")
        if self.grouped and (self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups):
            raise MoEConfigError(f"config.json: {self.num_experts} experts in n_group {self.num_groups} groups, "
                                 f"topk_group {self.topk_groups}: the experts must divide into the groups and "
                                 f"1 <= topk_group <= n_group")
        if self.topk_method == "noaux_tc" and self.num_experts // self.num_groups < 2:
            raise MoEConfigError(f"config.json: noaux_tc scores a group by its two best experts; n_group "
                                 f"{self.num_groups} leaves {self.num_experts // self.num_groups} per group")


def _num_experts(cfg: dict) -> int:
    """The routed experts, under any family's key (transformers 5 writes ``num_local_experts`` for Qwen3-MoE too)."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key])
    raise KeyError("num_experts")


QWEN2_MOE_SHARED_WIDTH = 5632      # Qwen2MoeConfig's shared_expert_intermediate_size, for a config.json without it


def _qwen(arch: str, cfg: dict) -> MoEConfig:
    shared = 0
    if arch == "Qwen2MoeForCausalLM":     # transformers always builds the shared expert: absent key, its default
        shared = int(cfg.get("shared_expert_intermediate_size", QWEN2_MOE_SHARED_WIDTH) or 0)
    return MoEConfig(num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                     intermediate_size=int(cfg["moe_intermediate_size"]),
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     shared_intermediate_size=shared, shared_expert_gate=shared > 0,
                     sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                     dense_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))


# transformers' DeepseekV2Config / DeepseekV3Config defaults (5.x) for the keys a config.json may leave out: HF
# builds the model with these, so a missing key must mean the same here (V3 without n_shared_experts still has one).
_DEEPSEEK_DEFAULTS = {
    "DeepseekV2ForCausalLM": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
                              "norm_topk_prob": False, "topk_method": "greedy", "scoring_func": "softmax",
                              "n_group": 1, "topk_group": 1},
    "DeepseekV3ForCausalLM": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                              "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                              "n_group": 8, "topk_group": 4},
}


def _deepseek(arch: str, cfg: dict) -> MoEConfig:
    defaults = _DEEPSEEK_DEFAULTS[arch]

    def get(key: str):
        """config.json's value; transformers' default where the key is absent (an explicit null stays null)."""
        return cfg[key] if key in cfg else defaults[key]

    width = int(cfg["moe_intermediate_size"])
    return MoEConfig(num_experts=_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                     intermediate_size=width, scoring=get("scoring_func") or defaults["scoring_func"],
                     norm_topk_prob=bool(get("norm_topk_prob")),
                     topk_method=get("topk_method") or defaults["topk_method"],
                     num_groups=int(get("n_group") or 1), topk_groups=int(get("topk_group") or 1),
                     routed_scaling_factor=float(get("routed_scaling_factor") or 1.0),
                     shared_intermediate_size=width * int(get("n_shared_experts") or 0),
                     first_k_dense=int(get("first_k_dense_replace") or 0), sorted_topk=False,
                     router_fp32=True)
