"""The engine's control calls besides weight updates: pause/continue, abort, flush, the version label,
memory release/resume and weight reads (engine.md). Each runs on the engine thread, between steps."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from asyncrl.protocols.engine import (AbortRequest, AbortResponse, GenerationStatusResponse, GetWeightsByNameRequest,
                                      MemoryOccupationRequest, PauseGenerationRequest, SuccessResponse,
                                      UpdateWeightVersionRequest, UpdateWeightVersionResponse)
from rollout.engine import MEMORY_TAGS, Engine
from rollout.errors import Refused


class EngineControl:
    """What the control routes ask of the engine; a malformed call raises ValueError (a 400 error body),
    one the engine cannot carry out raises Refused."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def _on_engine(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    async def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests are running or waiting."""
        scheduler = self.engine.scheduler

        def flush() -> bool:
            if scheduler.running or scheduler.waiting:
                return False
            scheduler.flush_cache()
            return True
        return await self._on_engine(flush)

    async def abort(self, body: AbortRequest) -> AbortResponse:
        if not body.abort_all and not body.rid:
            raise ValueError("give 'rid' or set 'abort_all'")
        rid = None if body.abort_all else body.rid
        count = await self._on_engine(lambda: self.engine.scheduler.abort(rid, prefix=True))
        return AbortResponse(success=True, num_aborted=count)

    async def pause(self, body: PauseGenerationRequest) -> GenerationStatusResponse:
        """Stop scheduling; running requests are aborted, retracted to the queue, or kept (`mode`)."""
        scheduler = self.engine.scheduler

        def pause() -> None:
            if body.mode == "abort":
                scheduler.abort(None, "aborted by pause_generation")
            elif body.mode == "retract":
                scheduler.retract_all()
            scheduler.paused = True
        await self._on_engine(pause)
        return GenerationStatusResponse(message="Generation paused successfully.")

    async def resume(self) -> GenerationStatusResponse:
        def resume() -> None:
            self.engine.scheduler.paused = False
        await self._on_engine(resume)
        return GenerationStatusResponse(message="Generation continued successfully.")

    async def update_weight_version(self, body: UpdateWeightVersionRequest) -> UpdateWeightVersionResponse:
        scheduler = self.engine.scheduler

        def relabel() -> None:
            if body.abort_all_requests:
                scheduler.abort(None, "aborted by update_weight_version")
            scheduler.weight_version = body.new_version
        await self._on_engine(relabel)
        return UpdateWeightVersionResponse(success=True, message=f"Weight version updated to {body.new_version}.",
                                           new_version=body.new_version)

    async def weights_by_name(self, body: GetWeightsByNameRequest) -> list:
        return await self._on_engine(lambda: self.engine.weights_by_name(body.name, body.truncate_size))

    async def release_memory(self, body: Optional[MemoryOccupationRequest]) -> SuccessResponse:
        return await self._change_memory(body, self.engine.release_memory)

    async def resume_memory(self, body: Optional[MemoryOccupationRequest]) -> SuccessResponse:
        return await self._change_memory(body, self.engine.resume_memory)

    async def _change_memory(self, body: Optional[MemoryOccupationRequest],
                             change: Callable[[frozenset[str]], str]) -> SuccessResponse:
        tags = frozenset((body.tags if body else None) or MEMORY_TAGS)
        if not tags <= MEMORY_TAGS:
            raise ValueError(f"tags: unknown {sorted(tags - MEMORY_TAGS)} (known: {sorted(MEMORY_TAGS)})")
        try:
            message = await self._on_engine(lambda: change(tags))
        except ValueError as err:
            raise Refused(str(err)) from None
        return SuccessResponse(success=True, message=message)
