"""Top-k expert routing of every MoE family: ``weights, ids = route(logits, cfg, bias)``.

Called by ``moe.MoE.forward`` once per MoE layer and step, on the router's logits ``[T, E]``. The ops and their
order are HF transformers' (5.x) for each family, so that the chosen experts and their weights are the same bits
in fp32 (``tests/test_moe_layer.py`` runs HF's routers beside this):

    scores      softmax(logits) or sigmoid(logits), float32
    choice      greedy: topk(scores)
                group_limited_greedy (DeepSeek V2): keep the ``topk_groups`` groups with the best single score,
                    zero the others, topk(scores)
                noaux_tc (DeepSeek V3): choice scores = scores + e_score_correction_bias; keep the groups whose
                    two best choice scores sum highest, -inf the others, topk(choice scores); the weights are
                    the unbiased scores of the chosen experts
    normalise   weights / (sum of the k weights + 1e-20) where ``norm_topk_prob`` (the 1e-20 is DeepSeek's; at
                fp32 it changes no sum of positive scores)
    scale       weights * routed_scaling_factor, after normalising (a no-op multiply is skipped: x * 1.0 == x)

The weights stay float32 (the experts' outputs are scaled in float32 and cast back, as HF's DeepSeek and
Mixtral do). Ties in topk are broken by torch.topk, as in HF; DeepSeek's calls pass ``sorted=False`` like HF's.
"""

from __future__ import annotations

import torch

from pdserve.engine.models.moe_config import MoEConfig


def route(logits: torch.Tensor, cfg: MoEConfig,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    scores = logits.softmax(dim=-1, dtype=torch.float32) if cfg.scoring == "softmax" else logits.float().sigmoid()
    if cfg.topk_method == "noaux_tc":
        weights, ids = _noaux_tc(scores, cfg, bias)
    elif cfg.topk_method == "group_limited_greedy":
        weights, ids = torch.topk(_keep_groups(scores, cfg, scores_of_group(scores, cfg, 1), 0.0),
                                  cfg.top_k, dim=-1, sorted=False)
    else:
        weights, ids = torch.topk(scores, cfg.top_k, dim=-1, sorted=cfg.sorted_topk)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def scores_of_group(scores: torch.Tensor, cfg: MoEConfig, best: int) -> torch.Tensor:
    """[T, E] -> [T, n_group]: each group's best score (``best`` 1, V2) or the sum of its two best (2, V3)."""
    grouped = scores.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
    if best == 1:
        return grouped.max(dim=-1).values
    return grouped.topk(best, dim=-1)[0].sum(dim=-1)


def _noaux_tc(scores: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None):
    if bias is None:
        raise ValueError("topk_method noaux_tc needs the gate's e_score_correction_bias (missing from the checkpoint?)")
    choice = scores + bias
    choice = _keep_groups(choice, cfg, scores_of_group(choice, cfg, 2), float("-inf"))
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


def _keep_groups(scores: torch.Tensor, cfg: MoEConfig, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
    """``scores`` [T, E] with every expert outside the ``topk_groups`` best groups set to ``fill``."""
    group_idx = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    per_group = cfg.num_experts // cfg.num_groups
    keep = group_mask.unsqueeze(-1).expand(-1, cfg.num_groups, per_group).reshape(-1, cfg.num_experts)
    return scores.masked_fill(~keep.bool(), fill)

