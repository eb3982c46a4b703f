"""Finished sessions into the run's Redis: one Sample per segment (store.md, asyncrl/types.py)."""

from __future__ import annotations

import time

from asyncrl.protocols.gateway import FinishSessionRequest
from asyncrl.store import Store
from asyncrl.types import Sample
from gateway.session_ledger import Session


def session_samples(session: Session, finish: FinishSessionRequest) -> list[Sample]:
    """The session's segments as Samples (sample_id `{session_id}-{segment index}`)."""
    timings = {"created": session.created, "finished": time.time(), "generate_s": session.generate_s}
    n = len(session.segments)
    return [Sample(sample_id=f"{session.id}-{i}", session_id=session.id, group_id=session.group_id,
                   task_id=session.task_id, env=session.env, status=finish.status, reward=finish.reward,
                   tokens=segment.tokens, loss_mask=segment.loss_mask, rollout_logprobs=segment.logprobs,
                   weight_versions=segment.versions, num_turns=segment.num_turns, engines=segment.engines,
                   timings=timings, metadata={**session.metadata, "info": finish.info, "segment": i, "segments": n,
                             "tool_calls": segment.tool_calls,
                             "tool_call_parse_failures": segment.tool_call_parse_failures},
                   routed_experts=segment.routing_rows(), temperatures=segment.temperatures)
            for i, segment in enumerate(session.segments)]


async def record_session(store: Store, session: Session, finish: FinishSessionRequest) -> list[str]:
    """Append the session's samples; returns their stream ids. Aborted sessions are not recorded. A retry
    after a failed write that Redis had applied gets the ids of that write (`once`), not a second copy."""
    if finish.status == "aborted":
        return []
    return await store.add_samples(session_samples(session, finish), once=session.id)
