"""Mixture of experts as DeepSeek-V2/V3 use it: routed experts plus always-on shared ones.

    gate:            ExpertRouter, scores [T, E] from fp32 logits, picks k experts per token
    experts.N:       GatedMLP of moe_intermediate_size, HF names (experts.N.gate_proj ...)
    shared_experts:  one GatedMLP of n_shared * moe_intermediate_size, applied to all tokens

Each expert is a separate GatedMLP of nn.Linear modules, as the checkpoints store them, so a
quantization pass swaps every expert's linears for FP8 like any other. Routing rules follow
transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter (the oracle in tests); they are a
registry keyed by the config's `topk_method`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .mlp import GatedMLP

# scores [T, E] fp32, router -> (weights [T, k] fp32, expert ids [T, k] int64)
Routing = Callable[[torch.Tensor, "ExpertRouter"], tuple[torch.Tensor, torch.Tensor]]
ROUTINGS: dict[str, Routing] = {}


def routing(name: str) -> Callable[[Routing], Routing]:
    def register(fn: Routing) -> Routing:
        ROUTINGS[name] = fn
        return fn
    return register


def _within_groups(choice: torch.Tensor, group_scores: torch.Tensor, router: "ExpertRouter",
                   fill: float) -> torch.Tensor:
    """choice [T, E] with the experts outside each token's best `topk_groups` groups set to
    `fill`. group_scores: [T, num_groups]."""
    t, e = choice.shape
    best = torch.topk(group_scores, k=router.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()  # [T, G]
    keep = keep.unsqueeze(-1).expand(t, router.num_groups, e // router.num_groups).reshape(t, e)
    return choice.masked_fill(~keep, fill)


@routing("greedy")  # DeepSeek-V2: softmax, the k best experts
def _greedy(logits, router):
    scores = logits.softmax(dim=-1)
    return torch.topk(scores, k=router.top_k, dim=-1, sorted=False)


@routing("group_limited_greedy")  # DeepSeek-V2: k best within the groups of best max score
def _group_limited(logits, router):
    scores = logits.softmax(dim=-1)
    t = scores.shape[0]
    groups = scores.view(t, router.num_groups, -1).max(dim=-1).values  # [T, G]
    return torch.topk(_within_groups(scores, groups, router, 0.0), k=router.top_k, dim=-1,
                      sorted=False)


@routing("noaux_tc")  # DeepSeek-V3: sigmoid scores, choice biased by a learned correction
def _noaux_tc(logits, router):
    scores = logits.sigmoid()
    choice = scores + router.e_score_correction_bias.float()
    t = scores.shape[0]
    groups = choice.view(t, router.num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    ids = torch.topk(_within_groups(choice, groups, router, float("-inf")), k=router.top_k,
                     dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


class ExpertRouter(nn.Module):
    """`weight` [E, hidden] (kept fp32, as the checkpoints and transformers keep it)."""

    def __init__(self, hidden: int, moe) -> None:
        super().__init__()
        self.top_k, self.method = moe.experts_per_token, moe.topk_method
        self.num_groups, self.topk_groups = moe.num_groups, moe.topk_groups
        self.norm_topk_prob = moe.norm_topk_prob
        self.scaling = moe.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden))
        if moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [T, hidden] -> weights [T, k] fp32, expert ids [T, k] int64
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # [T, E] fp32
        weights, ids = ROUTINGS[self.method](logits, self)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, hidden: int, moe, act: str) -> None:
        super().__init__()
        self.gate = ExpertRouter(hidden, moe)
        self.experts = nn.ModuleList(
            [GatedMLP(hidden, moe.intermediate_size, act) for _ in range(moe.num_experts)])
        self.shared_experts = (
            GatedMLP(hidden, moe.intermediate_size * moe.num_shared_experts, act)
            if moe.num_shared_experts else None)
        # Set by calibration: every expert also runs on every token, so experts the
        # calibration text rarely or never routes to still get input statistics; the
        # output is the routed one all the same.
        self.calibrating = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = self.gate(x)  # [T, k] fp32, [T, k]
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // ids.shape[1]  # [T * k]: the token of each sorted choice
        w_sorted = weights.reshape(-1)[order]
        if self.calibrating:
            for expert in self.experts:
                expert(x)
        start = 0
        for expert, n in enumerate(counts):  # only the experts some token chose
            if n:
                rows = token_of[start:start + n]
                y = self.experts[expert](x[rows]) * w_sorted[start:start + n, None]
                out.index_add_(0, rows, y.to(out.dtype))
                start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
