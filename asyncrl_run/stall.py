"""Why a run makes no training step: the component that holds it up, read from the orchestrator's status.

The launcher's progress line (and its stall_limit_s), `asyncrl watch` and the dashboard say the same thing.
The trainer waits for complete groups, so a stall is seen from the rollout side: the orchestrator does not
answer; it holds new groups with nothing in flight (the trainer consumes none); an env's episodes are in
flight and never finish (its services or the engines); or nothing is dispatched (no healthy env service).
"""

from __future__ import annotations

from typing import Optional

from orchestrator.run_record import envs_of
from asyncrl_run.run_summary import format_duration

STALL_AFTER_S = 120.0
"""No step for this long (or 5 median steps, whichever is longer) is reported as a stall, with its reason."""
STATUS_STALE_S = 60.0
"""An orchestrator status older than this: its figures are stale, and the orchestrator is what stalls."""


def stall_after_s(step_intervals: list[float]) -> float:
    if not step_intervals:
        return STALL_AFTER_S
    return max(STALL_AFTER_S, 5 * sorted(step_intervals)[len(step_intervals) // 2])


def idle_s(now: float, training_started_at: float, step_times: list[float]) -> tuple[float, float]:
    """(seconds without a training step, how many of them make a stall), counted from when this launch started
    training: the warm-up and start-up before it, and a resumed run's steps of earlier launches, are not idle."""
    times = [training_started_at, *(t for t in step_times if t > training_started_at)]
    return now - times[-1], stall_after_s([b - a for a, b in zip(times, times[1:])])


def stall_cause(status: Optional[dict], status_age_s: float = 0.0) -> tuple[str, str]:
    """(component, why) nothing trains, from the orchestrator's side (the trainer waits for complete groups).
    `status_age_s`: how old the orchestrator's last /v1/status answer is."""
    if status is None or status_age_s > STATUS_STALE_S:
        since = f" for {format_duration(status_age_s)}" if status is not None else ""
        return "orchestrator", f"its /v1/status does not answer{since}"
    by_env = status.get("by_env") or {}
    running = {env: s["in_flight"] for env, s in by_env.items() if s.get("in_flight")}
    paused = f"the orchestrator holds new groups ({', '.join(status['pause_reasons'])})" \
        if status.get("pause_reasons") else ""
    if running:
        envs = ", ".join(sorted(running))
        return (f"env {envs}", f"{', '.join(f'{int(n)} episodes in flight at {env}' for env, n in sorted(running.items()))}"
                f"{', ' + paused if paused else ''}, none completing a group: its services or the engines "
                f"do not finish them")
    if paused:
        return "trainer", f"{paused} with 0 episodes in flight: the trainer consumes no groups"
    healthy = {env: s.get("healthy_services", 0) for env, s in by_env.items()}
    if status["queued"]:
        return "env services", (f"{int(status['queued'])} episodes queued, none dispatched (healthy env services: "
                                f"{healthy or 'none registered'})")
    return "env services", f"no episode in flight (healthy env services: {healthy or 'none registered'})"


def status_of_record(record: dict[str, float]) -> dict:
    """An `orchestrator` record of the metrics stream (flat: `pause/<reason>`, `env/<env>/<field>`) as the
    /v1/status shape stall_cause reads."""
    return {"in_flight": record.get("in_flight", 0), "queued": record.get("queued", 0), "by_env": envs_of(record),
            "pause_reasons": pause_reasons_of(record)}


def pause_reasons_of(record: dict[str, float]) -> list[str]:
    """The pause reasons an `orchestrator` record holds (`pause/<reason>`: 1 while it holds)."""
    return sorted(k.split("/", 1)[1] for k, v in record.items() if k.startswith("pause/") and v)
