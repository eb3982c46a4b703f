"""Mixture of experts: sigmoid router with expert bias and group-limited top-k, batched experts, shared expert.

    s = sigmoid(x W_gate^T) (fp32);  choice = s + e_score_correction_bias
    groups ranked by the sum of their top-2 choice values; keep topk_group groups; top-k experts by choice
    weights = s[top-k] / sum(s[top-k]) * routed_scaling_factor           (the unbiased scores)
    y = sum_k weights_k * expert_k(x) + shared_expert(x)

Routed experts live in two stacked tensors and run as two batched matmuls over tokens grouped by
expert (no Python loop over tokens or experts). Their state-dict entries are nevertheless the HF
per-expert names (mlp.experts.{e}.{gate,up,down}_proj.weight), translated by state-dict hooks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model.config import ModelConfig


class MLP(nn.Module):
    """SwiGLU MLP: the dense layers' MLP and the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Picks num_experts_per_tok experts per token and their weights (computed in fp32)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, replay: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (expert ids [N, k] int64, weights [N, k] fp32).

        replay [N, k]: routing replay (R3) uses these experts (rows of -1 route themselves); the weights
        still come from this router's scores, so the router keeps its gradient."""
        scores, choice = self.scores(x)
        experts = choice.topk(self.top_k, dim=-1).indices
        if replay is not None:
            replay = replay.to(experts.device, torch.int64)
            experts = torch.where((replay >= 0).all(-1, keepdim=True), replay, experts)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> fp32 sigmoid scores [N, E] (the weights) and the choice values [N, E] the top-k
        ranks: scores + expert bias, -inf outside the kept groups."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        return scores, self._keep_best_groups(choice) if self.n_group > 1 else choice

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask (-inf) the experts outside the topk_group groups with the best top-2 sums."""
        grouped = choice.view(choice.shape[0], self.n_group, -1)  # [N, groups, experts per group]
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class Experts(nn.Module):
    """The routed experts as stacked SwiGLU weights, input-major so bmm reads them contiguously:
    w_gate_up [E, H, 2I] (gate_proj.weight^T then up_proj.weight^T), w_down [E, I, H] (down_proj.weight^T)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n, hidden, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.intermediate = n, inter
        self.w_gate_up = nn.Parameter(torch.empty(n, hidden, 2 * inter))
        self.w_down = nn.Parameter(torch.empty(n, inter, hidden))
        self.register_state_dict_post_hook(_experts_to_hf_names)
        self.register_load_state_dict_pre_hook(_experts_from_hf_names)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], experts/weights [N, k] -> sum_k weights_k expert_k(x) [N, H].

        Assignments are grouped by expert into a zero-padded [E, capacity, H] batch (capacity = the
        busiest expert's load), so each projection is one bmm.
        """
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)  # [N * k] expert of each (token, choice)
        one_hot = F.one_hot(flat, self.num_experts)  # [N * k, E]
        rank = one_hot.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1  # arrival order within its expert
        capacity = int(rank.max()) + 1
        row = flat * capacity + rank  # [N * k] row in the flattened [E * capacity] batch
        grouped = x.new_zeros(self.num_experts * capacity, x.shape[-1])
        grouped.index_copy_(0, row, x.repeat_interleave(top_k, dim=0))
        grouped = grouped.view(self.num_experts, capacity, -1)  # [E, capacity, H]
        gate, up = torch.bmm(grouped, self.w_gate_up).chunk(2, dim=-1)  # [E, capacity, I] each
        out = torch.bmm(F.silu(gate) * up, self.w_down)  # [E, capacity, H]
        per_choice = out.view(-1, x.shape[-1]).index_select(0, row).view(num_tokens, top_k, -1)  # [N, k, H]
        return (per_choice * weights[..., None]).sum(1).to(x.dtype)


def _experts_to_hf_names(module: Experts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """{prefix}w_gate_up / w_down -> {prefix}{e}.gate_proj.weight, .up_proj.weight, .down_proj.weight
    (transposed views; .contiguous() them before serialising)."""
    gate_up, down = state_dict.pop(prefix + "w_gate_up"), state_dict.pop(prefix + "w_down")
    for e in range(module.num_experts):
        state_dict[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :, : module.intermediate].T
        state_dict[f"{prefix}{e}.up_proj.weight"] = gate_up[e, :, module.intermediate :].T
        state_dict[f"{prefix}{e}.down_proj.weight"] = down[e].T


def _experts_from_hf_names(module: Experts, state_dict: dict, prefix: str, *args) -> None:
    """Stack per-expert HF tensors back into w_gate_up / w_down (when all experts are present)."""
    names = [f"{prefix}{e}.{p}_proj.weight" for e in range(module.num_experts) for p in ("gate", "up", "down")]
    if not all(name in state_dict for name in names):
        return  # load_state_dict reports the missing keys
    pops = [state_dict.pop(name) for name in names]
    state_dict[prefix + "w_gate_up"] = torch.stack([torch.cat(pops[i : i + 2]).T for i in range(0, len(pops), 3)])
    state_dict[prefix + "w_down"] = torch.stack([down.T for down in pops[2::3]])


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared) if shared > 0 else None

    def forward(self, x: torch.Tensor, replay: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> [N, hidden] and the routed expert ids [N, k] (what routing replay records).
        replay [N, k]: experts to use instead of the router's choice (Router.forward)."""
        experts, weights = self.gate(x, replay)
        out = self.experts(x, experts, weights)
        return (out + self.shared_experts(x) if self.shared_experts is not None else out), experts
