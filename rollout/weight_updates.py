"""The three weight-update paths of engine.md (disk, tensor, distributed) and the one weights update group
an engine may be in; the receivers themselves are in rollout/weights.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError

from asyncrl.model.io import read_tensors
from asyncrl.protocols.engine import (DestroyWeightsUpdateGroupRequest, InitWeightsUpdateGroupRequest, SuccessResponse,
                                      UpdateWeightsFromDiskRequest, UpdateWeightsFromDistributedRequest,
                                      UpdateWeightsFromTensorRequest, WeightsUpdateResponse)
from rollout.engine import Engine
from rollout.errors import Refused
from rollout.weights import WeightsUpdateGroup, decode_tensors

PAYLOAD_ERRORS = (ValueError, RuntimeError, OSError, KeyError, SafetensorError)
"""What a bad payload or checkpoint raises while it is read and loaded: a refusal, not a server error."""


class WeightUpdates:
    """Loads new weights into the engine; a failed update is a Refused naming the error."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.group: Optional[WeightsUpdateGroup] = None
        self._joining = asyncio.Lock()
        """Held while a rendezvous for a weights update group is under way (one at a time)."""

    async def from_disk(self, body: UpdateWeightsFromDiskRequest) -> WeightsUpdateResponse:
        return await self._load(lambda: read_tensors(body.model_path), True, body.weight_version, body.flush_cache,
                                body.abort_all_requests)

    async def from_tensor(self, body: UpdateWeightsFromTensorRequest) -> WeightsUpdateResponse:
        try:  # a whole model: decoded off the loop
            tensors = await asyncio.to_thread(decode_tensors, body.serialized_named_tensors, body.load_format)
        except ValueError as err:
            raise Refused(str(err)) from None
        return await self._load(lambda: tensors, False, body.weight_version, body.flush_cache)

    async def from_distributed(self, body: UpdateWeightsFromDistributedRequest) -> WeightsUpdateResponse:
        group = self._group_named(body.group_name)
        return await self._load(lambda: group.receive(body.names, body.dtypes, body.shapes), False,
                                body.weight_version, body.flush_cache)

    async def join_group(self, body: InitWeightsUpdateGroupRequest) -> SuccessResponse:
        """Join the trainer's group: the rendezvous waits for rank 0, in a thread of its own, never the
        engine's, so that generation goes on while a trainer (or a wrong address) keeps it waiting."""
        try:
            await asyncio.to_thread(socket.getaddrinfo, body.master_address, body.master_port)
        except (socket.gaierror, UnicodeError) as err:
            raise Refused(f"master_address {body.master_address!r} does not resolve ({err})") from None
        if self._joining.locked():
            raise Refused("a weights update group is being joined already", status=409)
        async with self._joining:
            try:
                self.group = await _in_daemon_thread(
                    WeightsUpdateGroup, body.master_address, body.master_port, body.rank_offset, body.world_size,
                    body.backend, body.group_name)
            except (RuntimeError, ValueError) as err:
                raise Refused(str(err)) from None
        return SuccessResponse(success=True, message=f"joined {body.group_name} as rank {body.rank_offset}")

    async def destroy_group(self, body: DestroyWeightsUpdateGroupRequest) -> SuccessResponse:
        group = self._group_named(body.group_name)
        await asyncio.wrap_future(self.engine.call(group.destroy))
        self.group = None
        return SuccessResponse(success=True, message=f"destroyed {body.group_name}")

    def _group_named(self, name: str) -> WeightsUpdateGroup:
        """The group the engine has joined, if it is called `name`; else Refused."""
        if self.group is None or self.group.group_name != name:
            raise Refused(f"no weights update group {name!r}")
        return self.group

    async def _load(self, receive: Callable[[], dict[str, torch.Tensor]], strict: bool, version: Optional[str],
                    flush: bool, abort_all: bool = False) -> WeightsUpdateResponse:
        try:
            message = await asyncio.wrap_future(self.engine.update_weights(receive, strict, version, flush, abort_all))
        except PAYLOAD_ERRORS as err:
            raise Refused(f"{type(err).__name__}: {err}") from None
        if version is not None:
            message += f" Weight version updated to {version}."
        return WeightsUpdateResponse(success=True, message=message, num_paused_requests=0)


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """`fn(*args)` in a daemon thread: a rendezvous that never completes must hold neither the event
    loop nor the process's exit (the default executor's threads are joined at exit)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as err:
            done.set_exception(err)

    threading.Thread(target=run, name=f"rollout-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return asyncio.wrap_future(done)
