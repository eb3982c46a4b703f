"""Prometheus metrics of one env service, on a registry of its own (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from asyncrl.protocols.env_service import OUTCOMES, EpisodeReason, OutcomeClass
from envs.sdk.base import ToolLog
from envs.sdk.context import ContextLog


class ServiceMetrics:
    def __init__(self, env_name: str, sandbox_type: str):
        self.registry = CollectorRegistry()
        labels = {"env": env_name}
        self.episodes = Counter("asyncrl_env_episodes_total", "Finished episodes by status", ["env", "status"],
                                registry=self.registry)
        self.outcomes = Counter("asyncrl_env_outcomes_total", "Finished episodes by outcome class (model: trained; "
                                "environment, infrastructure: excluded; cancelled) and reason",
                                ["env", "outcome", "reason"], registry=self.registry)
        self.rejected = Counter("asyncrl_env_rejected_total", "Episodes refused with 429 (at capacity)", ["env"],
                                registry=self.registry).labels(**labels)
        self.in_flight = Gauge("asyncrl_env_in_flight", "Episodes running now", ["env"],
                               registry=self.registry).labels(**labels)
        self.duration = Histogram("asyncrl_env_episode_seconds", "Wall clock of finished episodes", ["env"],
                                  buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
                                  registry=self.registry).labels(**labels)
        self.reward = Histogram("asyncrl_env_reward", "Rewards of model outcomes (completed, truncated)", ["env"],
                                buckets=(0.0, 0.25, 0.5, 0.75, 1.0), registry=self.registry).labels(**labels)
        self.turns = Histogram("asyncrl_env_turns", "Model calls per episode", ["env"],
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry).labels(**labels)
        self.context_tokens = Histogram(
            "asyncrl_env_context_tokens", "Prompt tokens of each model call (the context it saw)", ["env"],
            buckets=(256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144),
            registry=self.registry).labels(**labels)
        self.context_folds = Counter("asyncrl_env_context_folds_total", "Tool observations folded (keep-recent-k)",
                                     ["env"], registry=self.registry).labels(**labels)
        self.context_discards = Counter("asyncrl_env_context_discards_total", "Fresh contexts started (discard-all)",
                                        ["env"], registry=self.registry).labels(**labels)
        self.context_edits = Counter("asyncrl_env_context_edits_total", "Model calls sent an edited context "
                                     "(each opens a gateway segment)", ["env"], registry=self.registry).labels(**labels)
        self.tool_calls = Counter("asyncrl_env_tool_calls_total", "Tool calls the agents made (executed or refused)",
                                  ["env"], registry=self.registry).labels(**labels)
        self.tool_errors = Counter("asyncrl_env_tool_errors_total", "Tool calls that failed: refused (unknown tool, "
                                   "bad arguments) or reported failed by the tool", ["env"],
                                   registry=self.registry).labels(**labels)
        Gauge("asyncrl_env_sandbox_info", "Sandbox backend in use (1 = this type)", ["env", "type"],
              registry=self.registry).labels(env=env_name, type=sandbox_type).set(1)
        self._env = env_name
        for reason in EpisodeReason:  # so every series exists from the start
            self._series(reason)

    def finished(self, reason: EpisodeReason, reward: float, turns: int, seconds: float) -> None:
        for counter in self._series(reason):
            counter.inc()
        self.duration.observe(seconds)
        self.turns.observe(turns)
        if OUTCOMES[reason][0] is OutcomeClass.model:
            self.reward.observe(reward)

    def context(self, log: ContextLog) -> None:
        for tokens in log.prompt_tokens:
            self.context_tokens.observe(tokens)
        self.context_folds.inc(log.folds)
        self.context_discards.inc(log.discards)
        self.context_edits.inc(log.edits)

    def tools(self, log: ToolLog) -> None:
        self.tool_calls.inc(log.calls)
        self.tool_errors.inc(log.errors)

    def _series(self, reason: EpisodeReason) -> tuple[Counter, Counter]:
        outcome, status = OUTCOMES[reason]
        return (self.episodes.labels(env=self._env, status=status.value),
                self.outcomes.labels(env=self._env, outcome=outcome.value, reason=reason.value))

    def render(self) -> bytes:
        return generate_latest(self.registry)
