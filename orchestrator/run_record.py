"""The orchestrator's record in the run's `metrics` stream: its GET /v1/status flattened into scalars, one
record every few seconds (orchestrator/runtime.py). Its shape is defined here, by its writer; the run layer
(watch, the dashboard, the TensorBoard and W&B mirrors: asyncrl_run/) reads it with `envs_of`."""

from __future__ import annotations

from typing import Any

ORCHESTRATOR_TOTALS = ("in_flight", "settling", "queued", "completed", "failed", "retried", "groups_completed",
                       "episodes_per_s", "groups_filtered", "groups_passed", "groups_unusable", "filtered_fraction",
                       "filter_streak", "groups_lost_to_redis")
ENV_FIELDS = ("healthy_services", "in_flight", "queued", "completed", "failed", "groups_completed",
              "groups_filtered", "groups_passed", "groups_unusable")


def orchestrator_record(status: dict[str, Any]) -> dict[str, float]:
    """The `orchestrator` record: GET /v1/status (a StatusResponse as a dict) flattened into scalars.

    Totals (`in_flight`, `settling`, `queued`, `completed`, `failed`, `retried`, `groups_completed`,
    `episodes_per_s`, `weight_version`, `dispatch_overhead_p99_ms`, `outcome_<class>`), `paused` (0/1)
    with `pause/<reason>` = 1 for each reason holding new groups back (operator, unconsumed_groups,
    staleness), and per env `env/<env>/<field>` for ENV_FIELDS plus `env/<env>/outcome_<class>` and
    `env/<env>/outcome_<class>/<reason>` (attempts that ended, by outcome class and reason)."""
    record = {k: float(status[k]) for k in ORCHESTRATOR_TOTALS if isinstance(status.get(k), (int, float))}
    if isinstance(status.get("weight_version"), (int, float)):
        record["weight_version"] = float(status["weight_version"])
    overhead = status.get("dispatch_overhead") or {}
    if isinstance(overhead.get("p99_ms"), (int, float)):
        record["dispatch_overhead_p99_ms"] = float(overhead["p99_ms"])
    reasons = list(status.get("pause_reasons") or [])
    record["paused"] = float(bool(reasons or status.get("paused")))
    record.update({f"pause/{reason}": 1.0 for reason in reasons})
    record.update(_outcomes("", status.get("outcomes") or {}))
    for env, stats in (status.get("by_env") or {}).items():
        record.update({f"env/{env}/{k}": float(stats[k]) for k in ENV_FIELDS if isinstance(stats.get(k), (int, float))})
        record.update(_outcomes(f"env/{env}/", stats.get("outcomes") or {}, by_reason=True))
    return record


def _outcomes(prefix: str, outcomes: dict[str, dict[str, int]], by_reason: bool = False) -> dict[str, float]:
    out = {}
    for cls, reasons in outcomes.items():
        out[f"{prefix}outcome_{cls}"] = float(sum(reasons.values()))
        if by_reason:
            out.update({f"{prefix}outcome_{cls}/{reason}": float(n) for reason, n in reasons.items()})
    return out


def envs_of(record: dict[str, float]) -> dict[str, dict[str, float]]:
    """An `orchestrator` record's per-env values: {env: {field: value}} (fields as after `env/<env>/`)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        if key.startswith("env/"):
            env, _, name = key[4:].partition("/")
            out.setdefault(env, {})[name] = value
    return out
