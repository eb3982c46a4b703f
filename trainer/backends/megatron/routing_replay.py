"""Routing replay (R3) on megatron-core, through its own hook: with `moe_enable_routing_replay` every
TopKRouter asks a RouterReplay for its top-k; in REPLAY_FORWARD that returns given indices (probabilities
gathered from the live scores, as asyncrl's Router does), and in REPLAY_BACKWARD it hands the same
indices to activation recomputation.

Megatron replays whole tensors; asyncrl's rows of -1 (no recorded routing) mean "the router decides, in
the replayed context". `PartialReplay` adds exactly that: it computes the router's own top-k and keeps
it on the rows without a target, so one forward does what asyncrl's Router does.

The targets of a micro-batch are its samples' routing rows at the input positions ([T, layers x top_k],
MicroBatch.routed_experts), one [tokens, top_k] slice per MoE layer. The router sees this rank's tokens:
the THD sequence plus the padding sequence (which routes itself: its rows are dropped), and under
sequence parallelism only this TP rank's contiguous share.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

from asyncrl.model.config import ModelConfig
from trainer.packing import MicroBatch


class PartialReplay(RouterReplay):
    """RouterReplay whose targets may hold rows of -1: those rows take the router's own top-k."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            target = self.target_topk_idx
        elif self.router_replay_action == RouterReplayAction.REPLAY_BACKWARD:
            target = self.replay_backward_list.pop(0)
        else:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        target = target.to(scores.device)
        known = (target >= 0).all(-1, keepdim=True)
        if not bool(known.all()):
            _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = torch.where(known, target, own)
        return scores.gather(1, target), target


class RoutingReplay:
    """The routers of one megatron model, switched to PartialReplay, and the micro-batch -> targets mapping."""

    def __init__(self, model: torch.nn.Module, arch: ModelConfig, tp_rank: int, tp_size: int) -> None:
        self.routers: list[PartialReplay] = []
        for module in model.modules():
            stock = getattr(module, "router_replay", None)
            if stock is None:
                continue
            module.router_replay = PartialReplay()
            module.router_replay.layer_number = stock.layer_number
            for replay in (stock, module.router_replay):  # only this object drives them, not the global list
                RouterReplay.global_router_replay_instances.remove(replay)
            self.routers.append(module.router_replay)
        self.moe_layers = [i for i, kind in enumerate(arch.layer_mlp_types) if kind == "sparse"]
        if len(self.routers) != len(self.moe_layers):
            raise RuntimeError(f"{len(self.routers)} megatron routers with replay hooks for {len(self.moe_layers)} "
                               "MoE layers (is moe_enable_routing_replay set?)")
        self.arch, self.tp_rank, self.tp_size = arch, tp_rank, tp_size

    def local_targets(self, mb: MicroBatch, padded_tokens: int) -> Optional[list[Tensor]]:
        """Per MoE layer, the [this rank's tokens, top_k] experts to replay (-1: unknown); None without routing."""
        if mb.routed_experts is None:
            return None
        k = self.arch.num_experts_per_tok
        rows = mb.routed_experts.long().view(mb.num_tokens, self.arch.num_hidden_layers, k)
        rows = torch.cat([rows, rows.new_full((padded_tokens - mb.num_tokens, *rows.shape[1:]), -1)])
        share = padded_tokens // self.tp_size
        rows = rows[self.tp_rank * share:(self.tp_rank + 1) * share]
        return [rows[:, layer].contiguous() for layer in self.moe_layers]

    @contextmanager
    def replaying(self, targets: Optional[list[Tensor]]) -> Iterator["RoutingReplay"]:
        """Within: forwards replay `targets` (nothing changes when None); call `backward_phase()` before a
        backward that recomputes activations."""
        if targets is None:
            yield self
            return
        try:
            for router, target in zip(self.routers, targets):
                router.set_target_indices(target)
                router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            yield self
        finally:
            for router in self.routers:
                router.clear_indices()
                router.clear_router_replay_action()

    def backward_phase(self) -> None:
        for router in self.routers:
            if router.router_replay_action is not None:
                router.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
