"""Prometheus metrics of one env service, on a registry of its own (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from asyncrl.protocols.env_service import EpisodeStatus


class ServiceMetrics:
    def __init__(self, env_name: str, sandbox_type: str):
        self.registry = CollectorRegistry()
        labels = {"env": env_name}
        self.episodes = Counter("asyncrl_env_episodes_total", "Finished episodes by status", ["env", "status"],
                                registry=self.registry)
        self.rejected = Counter("asyncrl_env_rejected_total", "Episodes refused with 429 (at capacity)", ["env"],
                                registry=self.registry).labels(**labels)
        self.in_flight = Gauge("asyncrl_env_in_flight", "Episodes running now", ["env"],
                               registry=self.registry).labels(**labels)
        self.duration = Histogram("asyncrl_env_episode_seconds", "Wall clock of finished episodes", ["env"],
                                  buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
                                  registry=self.registry).labels(**labels)
        self.reward = Histogram("asyncrl_env_reward", "Rewards of completed and truncated episodes", ["env"],
                                buckets=(0.0, 0.25, 0.5, 0.75, 1.0), registry=self.registry).labels(**labels)
        self.turns = Histogram("asyncrl_env_turns", "Model calls per episode", ["env"],
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry).labels(**labels)
        Gauge("asyncrl_env_sandbox_info", "Sandbox backend in use (1 = this type)", ["env", "type"],
              registry=self.registry).labels(env=env_name, type=sandbox_type).set(1)
        self._env = env_name
        for status in EpisodeStatus:  # so every series exists from the start
            self.episodes.labels(env=env_name, status=status.value)

    def finished(self, status: EpisodeStatus, reward: float, turns: int, seconds: float) -> None:
        self.episodes.labels(env=self._env, status=status.value).inc()
        self.duration.observe(seconds)
        self.turns.observe(turns)
        if status in (EpisodeStatus.completed, EpisodeStatus.truncated):
            self.reward.observe(reward)

    def render(self) -> bytes:
        return generate_latest(self.registry)
