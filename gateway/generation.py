"""Runs a planned turn on the engines: routing, failover, continuation, progress for streaming.

The gateway holds every token, so an engine failure loses nothing:
  * a call that fails before any output (connection refused, 5xx, timeout) is re-run on the next
    engine of the session's ring walk;
  * when no engine is left (the only one died and is being restarted), the turn waits up to
    `engine_wait_s` for one to be healthy again, its client's request held open, and continues there;
  * a call that ends early (engine abort, e.g. a weight update with pause mode `abort`, or a stream
    cut mid-way) keeps the tokens it produced, with their log-probs and versions, and the next call
    continues from them with the remaining token budget.
Each call becomes one TurnRecord, so the record shows which engine produced which tokens.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

import httpx
import numpy as np

from asyncrl.engine_client import EngineError
from asyncrl.engine_response import routed_experts
from asyncrl.protocols.engine import GenerateResponse, MetaInfo
from gateway.engines import EnginePool, EngineState
from gateway.errors import EngineCredentialError, NoEngineError
from gateway.metrics import GatewayMetrics
from gateway.session_ledger import EngineCall, Session, Turn

log = logging.getLogger("gateway.generation")

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default, used when neither the request nor the session gives one."""


class EngineRequestError(ValueError):
    """The engine refused the request itself (4xx, e.g. a prompt longer than its context): a 400."""


def engine_call(engine: str, response: GenerateResponse, prompt_len: int, wall_s: float) -> EngineCall:
    """Per-token facts of an engine response to a prompt of `prompt_len` tokens: ids, log-probs, integer
    weight versions, and the routed experts if the engine returned them; `wall_s`: the call so far."""
    meta = response.meta_info
    n = len(response.output_ids)
    logprobs = [float(entry[0]) for entry in (meta.output_token_logprobs or [])][:n]
    if len(logprobs) != n:
        raise EngineRequestError(f"engine {engine} returned {len(logprobs)} log-probs for {n} tokens")
    versions = [_version(meta.weight_version)] * n
    for span in meta.weight_versions:
        versions[span.start:span.end] = [_version(span.version)] * (min(span.end, n) - span.start)
    finish = meta.finish_reason or {"type": "abort"}
    routing = _routing_rows(engine, meta, prompt_len + n - 1) if finish["type"] != "abort" else None
    top = [[(float(entry[0]), int(entry[1])) for entry in row or []] for row in (meta.output_top_logprobs or [])][:n]
    if top and len(top) != n:
        raise EngineRequestError(f"engine {engine} returned top log-probs for {len(top)} of {n} tokens")
    return EngineCall(engine, list(response.output_ids), logprobs, versions, finish["type"], finish.get("matched"),
                      meta.e2e_latency, routing, top, cached_tokens=meta.cached_tokens, wall_s=wall_s)


def _routing_rows(engine: str, meta: MetaInfo, rows: int) -> Optional[np.ndarray]:
    """meta_info.routed_experts -> [rows, layers x top_k]; None if the call has none. Aborted calls are
    skipped by the caller: their rows stop where the abort caught the prefill, and the call that
    continues them brings the routing of every token."""
    if meta.routed_experts is None or rows <= 0:
        return None
    try:
        return routed_experts(meta, rows)
    except ValueError as err:
        raise EngineRequestError(f"engine {engine}: {err}") from None


def _call_params(sampling: dict[str, Any], budget: int, turn: Turn) -> dict[str, Any]:
    """The next engine call's sampling: the budget left, and a stop where the turn's forced tokens go."""
    params = {**sampling, "max_new_tokens": budget - len(turn.generated_ids)}
    if turn.forced_pending:
        params["stop_token_ids"] = [*params.get("stop_token_ids", []), turn.forced_after]
    return params


def _version(value: str) -> int:
    """Engines report versions as strings ("7"); a non-integer one (SGLang's "default") is -1."""
    try:
        return int(value)
    except ValueError:
        return -1


class TurnRunner:
    def __init__(self, pool: EnginePool, metrics: GatewayMetrics, max_interruptions: int = 8,
                 interruption_backoff_s: float = 0.2, engine_wait_s: float = 120.0, routing_replay: bool = False) -> None:
        self.pool = pool
        self.routing_replay = routing_replay
        """Ask every engine call for its routed experts (engines need --enable-return-routed-experts)."""
        self.metrics = metrics
        self.max_interruptions = max_interruptions
        self.interruption_backoff_s = interruption_backoff_s
        self.engine_wait_s = engine_wait_s
        """How long a turn with no engine left to try waits for a healthy one before its 503 (GatewayConfig)."""

    async def run(self, session: Session, turn: Turn, sampling: dict[str, Any]) -> None:
        async for _ in self.stream(session, turn, sampling, stream=False):
            pass

    async def stream(self, session: Session, turn: Turn, sampling: dict[str, Any],
                     stream: bool = True) -> AsyncIterator[list[int]]:
        """Generate until the turn ends by stop or length; yields the turn's cumulative output ids
        (after every engine update when `stream`, else once per call). A turn with forced tokens gets them
        at its start, or, with `forced_after`, when a call stops on that token: the next call continues
        after them (tool_choice; the budget counts generated tokens only)."""
        budget = sampling.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
        turn.sampling = sampling
        if turn.forced_pending and turn.forced_after is None:
            turn.force()
        failed: frozenset[str] = frozenset()
        interruptions = 0
        outage: Optional[float] = None
        """When the turn last found no engine to try, until a call brings tokens again."""
        while True:
            session.ensure_open()
            engine = self.pool.pick(session.id, exclude=failed)
            if engine is None:
                if outage is None:
                    outage = time.monotonic()
                    log.warning("session %s...: no engine left to run its turn (failed: %s); waiting up to %g s for "
                                "a healthy one", session.id[:8], sorted(failed) or "none", self.engine_wait_s)
                if await self._wait_for_engine(outage, failed):
                    failed = frozenset()  # an engine is healthy again (or new): try them all
                continue
            params = _call_params(sampling, budget, turn)
            rid = secrets.token_hex(12)  # not derived from the session id: that is a secret
            call = None
            try:
                async with aclosing(self._call(engine, session, turn, params, rid, stream)) as calls:
                    async for call, done in calls:
                        if done or stream:
                            yield turn.output_ids + call.output_ids
            except (httpx.TransportError, EngineError) as err:
                self._call_failed(engine, turn, call, err)
                failed |= {engine.url}
                continue
            if call.output_ids or call.finish_reason != "abort":
                turn.calls.append(call)
                outage = None
            if call.finish_reason != "abort":
                if (turn.forced_pending and call.finish_reason == "stop" and call.output_ids[-1:] == [turn.forced_after]
                        and len(turn.generated_ids) < budget):
                    turn.force()
                    if stream:
                        yield turn.output_ids
                    continue
                return
            interruptions += 1
            self.metrics.engine_interruptions.inc()
            if interruptions > self.max_interruptions:
                raise NoEngineError(f"session {session.id}: engine calls aborted {interruptions} times in a row")
            await asyncio.sleep(self.interruption_backoff_s)

    def _call_failed(self, engine: EngineState, turn: Turn, call: Optional[EngineCall],
                     err: httpx.TransportError | EngineError) -> None:
        """After a failed engine call: the engine's refusal of the request or of the gateway's credential
        ends the turn (raised); else the engine is marked failed and what a cut stream brought is kept."""
        if isinstance(err, EngineError) and err.status in (401, 403):
            raise EngineCredentialError(f"engine {engine.url} refused the gateway's API key (HTTP {err.status}):"
                                        " check rollout.api_key (the gateway's --engine-api-key)") from None
        if isinstance(err, EngineError) and err.status < 500:
            raise EngineRequestError(f"engine {engine.url}: {err.message}") from None
        self.pool.mark_failed(engine, f"{type(err).__name__}: {err}")
        self.metrics.engine_errors.labels(engine.url).inc()
        if call is not None and call.output_ids:  # a stream cut mid-way: keep what arrived
            turn.calls.append(EngineCall(engine.url, call.output_ids, call.logprobs, call.versions, "abort",
                                         top_logprobs=call.top_logprobs))

    async def _wait_for_engine(self, outage: float, failed: frozenset[str]) -> bool:
        """Wait for a healthy engine, a second at most (the loop then sees a session closed meanwhile); True once
        there is one. NoEngineError (503) once the turn has had no engine since `outage` for engine_wait_s."""
        left = outage + self.engine_wait_s - time.monotonic()
        if left <= 0:
            raise NoEngineError(f"no healthy engine within {self.engine_wait_s:g} s (gateway.engine_wait_s), the "
                                f"longest a turn waits for one (failed: {sorted(failed) or 'none'}; engines: "
                                f"{sorted(self.pool.engines) or 'none'})")
        return await self.pool.wait_healthy(min(left, 1.0))

    async def _call(self, engine: EngineState, session: Session, turn: Turn, params: dict[str, Any],
                    rid: str, stream: bool) -> AsyncIterator[tuple[EngineCall, bool]]:
        """One engine /generate of the turn's prompt so far; yields (call so far, finished)."""
        prompt = turn.prompt
        session.in_flight[rid] = engine.url
        engine.in_flight += 1
        engine.requests += 1
        started = time.perf_counter()
        try:
            routing, top = self.routing_replay, turn.top_logprobs
            if not stream:
                response = await engine.client.generate(prompt, params, rid=rid, return_routed_experts=routing,
                                                        top_logprobs_num=top)
                call = engine_call(engine.url, response, len(prompt), time.perf_counter() - started)
                self.pool.mark_answered(engine)
                self.metrics.engine_hop.observe(max(call.wall_s - call.engine_latency_s, 0.0))
                yield call, True
                return
            async with aclosing(engine.client.generate_stream(prompt, params, rid=rid, return_routed_experts=routing,
                                                              top_logprobs_num=top)) as snapshots:
                async for snapshot in snapshots:
                    self.pool.mark_answered(engine)
                    yield (engine_call(engine.url, snapshot, len(prompt), time.perf_counter() - started),
                           snapshot.meta_info.finish_reason is not None)
        finally:
            engine.in_flight -= 1
            session.in_flight.pop(rid, None)
            self.metrics.engine_latency.observe(time.perf_counter() - started)

    async def abort(self, in_flight: dict[str, str]) -> None:
        """Abort engine calls (rid -> engine URL): client gone, session deleted, shutdown."""
        for rid, url in in_flight.items():
            engine = self.pool.engines.get(url)
            if engine is None:
                continue
            try:
                await engine.client.abort(rid)
            except (httpx.TransportError, EngineError) as err:
                log.warning("abort of %s on %s failed: %s", rid, url, err)
