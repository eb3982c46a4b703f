"""What a run did, in one record: printed when it ends and kept as <run_dir>/summary.json.

    steps, wall time, mean reward of the first and the last window of steps, the agent metrics over the
    same windows, per-env outcome counts, the final HF-format weights, and the command that evaluates them.

Built from the run's metrics stream (the trainer's per-step records) and the orchestrator's last
/v1/status; `asyncrl watch` shows the same file for a finished run.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

REWARD_WINDOW = 10
"""Steps averaged for the first and the last reward (fewer when the run has under 2 windows)."""
SUMMARY_FILE = "summary.json"
AGENT_METRICS = {"rollout/turns_mean": "turns", "rollout/tool_calls_mean": "tool calls",
                 "rollout/tool_call_parse_failures_mean": "tool-call parse failures",
                 "rollout/tool_errors_mean": "tool errors", "rollout/episode_len_mean": "tokens"}
"""Trainer record keys (per sample means, trainer/off_policy.py agent_health) the summary reports first vs last."""


@dataclass
class RunSummary:
    name: str
    steps: int
    total_steps: int
    wall_s: float
    """This invocation's wall time, start-up included (a resumed run counts from its own start)."""
    reward_first: Optional[float]
    reward_last: Optional[float]
    reward_window: int
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    """env -> outcome class (model, environment, infrastructure, ...) -> attempts."""
    agent: dict[str, dict[str, float]] = field(default_factory=dict)
    """AGENT_METRICS key -> {"first", "last"}: its mean over the first and the last reward window, per sample."""
    lost_to_redis: dict[str, int] = field(default_factory=dict)
    """What Redis acknowledged and then lost in restarts from its AOF (appendfsync everysec, a host crash):
    `group_records` (the orchestrator's count: never trained), `acknowledgements` (the trainer's: those
    groups came back and were acknowledged again, not trained twice). Empty when nothing was lost."""
    final_weights: Optional[str] = None
    eval_command: Optional[str] = None
    run_dir: str = ""

    def write(self, run_dir: Path) -> Path:
        path = run_dir / SUMMARY_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    def lines(self) -> list[str]:
        reward = "no step trained"
        if self.reward_first is not None and self.reward_last is not None:
            reward = (f"mean reward {self.reward_first:.3f} (first {self.reward_window} steps) -> "
                      f"{self.reward_last:.3f} (last {self.reward_window})")
        out = [f"run {self.name}: {self.steps}/{self.total_steps} steps in {format_duration(self.wall_s)}, {reward}"]
        if self.agent.get("rollout/tool_calls_mean", {}).get("last"):  # an agent that called tools
            out.append("  per sample, first -> last: " + ", ".join(
                f"{AGENT_METRICS.get(key, key)} {v['first']:.2f} -> {v['last']:.2f}" for key, v in self.agent.items()))
        for env, classes in sorted(self.outcomes.items()):
            counts = ", ".join(f"{cls} {n}" for cls, n in sorted(classes.items()))
            out.append(f"  env {env}: episodes by outcome: {counts or 'none'}")
        if self.lost_to_redis:
            out.append("  LOST in Redis restarts (acknowledged writes its AOF did not hold): " + ", ".join(
                f"{n} {what.replace('_', ' ')}" for what, n in self.lost_to_redis.items()))
        if self.final_weights:
            out.append(f"  final weights (HF format): {self.final_weights}")
        if self.eval_command:
            out.append(f"  evaluate them: {self.eval_command}")
        out.append(f"  run dir: {self.run_dir}")
        return out


def summarize(name: str, run_dir: Path, total_steps: int, wall_s: float, trainer_records: list[dict[str, float]],
              status: Optional[dict[str, Any]], experiment: Optional[str]) -> RunSummary:
    rewards = [r["reward_mean"] for r in trainer_records if "reward_mean" in r]
    window = max(1, min(REWARD_WINDOW, len(rewards) // 2)) if rewards else REWARD_WINDOW
    final = run_dir / "final"
    final_weights = str(final) if (final / "config.json").exists() else None
    return RunSummary(
        name=name, steps=int(trainer_records[-1]["step"]) if trainer_records else 0, total_steps=total_steps,
        wall_s=round(wall_s, 1), reward_first=_mean(rewards[:window]), reward_last=_mean(rewards[-window:]),
        reward_window=window, outcomes=_outcomes(status), agent=_agent(trainer_records, window),
        lost_to_redis=_lost_to_redis(trainer_records, status),
        final_weights=final_weights,
        eval_command=eval_command(final_weights, experiment), run_dir=str(run_dir))


def eval_command(weights: Optional[str], experiment: Optional[str]) -> Optional[str]:
    if weights is None:
        return None
    target = f"experiment={experiment}" if experiment else ""
    return " ".join(filter(None, ["asyncrl eval", target, f"model.path={shlex.quote(weights)}"]))


def read_summary(run_dir: Path) -> Optional[RunSummary]:
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        return None
    return RunSummary(**json.loads(path.read_text()))


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _mean(values: list[float]) -> Optional[float]:
    return round(sum(values) / len(values), 4) if values else None


def _agent(trainer_records: list[dict[str, float]], window: int) -> dict[str, dict[str, float]]:
    out = {}
    for key in AGENT_METRICS:
        values = [r[key] for r in trainer_records if key in r]
        if values:
            out[key] = {"first": _mean(values[:window]), "last": _mean(values[-window:])}
    return out


def _lost_to_redis(trainer_records: list[dict[str, float]], status: Optional[dict[str, Any]]) -> dict[str, int]:
    lost = {"group_records": int((status or {}).get("groups_lost_to_redis", 0)),
            "acknowledgements": int(sum(r.get("filter_redelivered", 0) for r in trainer_records))}
    return {what: n for what, n in lost.items() if n}


def _outcomes(status: Optional[dict[str, Any]]) -> dict[str, dict[str, int]]:
    by_env = (status or {}).get("by_env") or {}
    return {env: {cls: int(sum(reasons.values())) for cls, reasons in (stats.get("outcomes") or {}).items()}
            for env, stats in by_env.items()}
