"""Rank 0 drives the other ranks of a multi-process backend (torchrun): the RL loop runs on the
leader only, and each call that must run on every rank (a train step, an optimizer reset, a
checkpoint load) is announced over `torch.distributed` before the leader runs it itself. The
followers wait in `follow_leader` and run what is announced, so the loop never knows how many
ranks exist. Used by the torch backend's data parallelism and by the megatron backend."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

STOP = "close"
"""The announcement that ends `follow_leader`."""


def announce(method: str, *args: Any) -> None:
    """Leader: make every follower run `method(*args)`. A no-op in a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        assert dist.get_rank() == 0, f"rank {dist.get_rank()} announced {method!r}: only the leader drives the backend"
        dist.broadcast_object_list([(method, args)], src=0)


def follow_leader(run: Callable[[str, tuple], None]) -> None:
    """Followers: run each announced call until the leader announces STOP."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        method, args = message[0]
        if method == STOP:
            return
        run(method, args)
