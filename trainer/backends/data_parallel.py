"""Data parallelism for the torch backend: full model replicas in N processes (torchrun), one
optimizer step per RL step, identical weights on every rank.

* The leader (rank 0) runs the RL loop and announces to the followers the calls that change state
  everywhere (trainer/backends/leader.py).
* A step's micro-batches are split across ranks by tokens (`shard_by_tokens`); a rank may get none.
* After the local backward passes, gradients are summed over ranks by one bucketed all-reduce. The
  loss uses the step-wide normalizer, so the summed gradient is exactly the single-process one (up to
  float summation order): no rescaling by the world size.

gloo on CPU, NCCL on GPU. One reduction per step, after all micro-batches, is what DDP's `no_sync`
accumulation gives too; doing it by hand lets ranks hold different numbers of micro-batches
(including zero) without dummy forward passes.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from trainer.packing import MicroBatch

GRAD_BUCKET_BYTES = 64 * 1024 * 1024
"""Gradients are all-reduced in flat buckets of about this size (fewer, larger messages)."""


def shard_by_tokens(micro_batches: Sequence[MicroBatch], world_size: int) -> list[list[MicroBatch]]:
    """Micro-batches per rank, balancing tokens: largest first onto the least loaded rank (ties: lowest
    rank). Deterministic; each rank keeps the micro-batches' original order."""
    order = sorted(range(len(micro_batches)), key=lambda i: (-micro_batches[i].num_tokens, i))
    load = [0] * world_size
    owner = {}
    for i in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += micro_batches[i].num_tokens
    return [[mb for i, mb in enumerate(micro_batches) if owner[i] == rank] for rank in range(world_size)]


class DataParallel:
    """This process's place among the replicas; a no-op when there is one process."""

    def __init__(self, device: torch.device) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # env:// from torchrun
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.device = device

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def scatter(self, micro_batches: Optional[Sequence[MicroBatch]]) -> list[MicroBatch]:
        """Leader passes the step's micro-batches; every rank gets its token-balanced share."""
        if self.world_size == 1:
            return list(micro_batches or [])
        shards = shard_by_tokens(micro_batches, self.world_size) if self.is_leader else None
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, shards, src=0)
        return mine[0]

    # Reductions --------------------------------------------------------------------------------
    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks (a rank without data contributes zeros)."""
        if self.world_size == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in params], GRAD_BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            for g, reduced in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(reduced.view_as(g))

    def merge_on_leader(self, parts: dict) -> dict:
        """Every rank's dict merged on the leader (other ranks get theirs back): per-sample outputs of a step."""
        if self.world_size == 1:
            return parts
        gathered: list[Any] = [None] * self.world_size if self.is_leader else None
        dist.gather_object(parts, gathered, dst=0)
        return {k: v for part in gathered for k, v in part.items()} if self.is_leader else parts

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Start every replica from the leader's weights."""
        if self.world_size > 1:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def close(self) -> None:
        """Every rank calls this. The barrier keeps a rank from tearing down its connections while a
        peer still reads from them (the leader's last broadcast): gloo then aborts the peer (SIGABRT)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _buckets(tensors: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of about max_bytes each."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > max_bytes or buckets[-1][0].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets
