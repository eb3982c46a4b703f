"""Each env's episode deadline, sized from the env's own episodes unless the run sets one for it.

A fixed run-wide deadline is either too long for a fast env (its hung episodes hold their groups open,
and its share of the in-flight slots, for 10 minutes) or too short for a slow one. So the deadline of an
env with no `episode_timeout_s` of its own is `factor` x the p99 of its last `window` episode durations,
between `min_s` and the run's `episode_timeout_s`; the run's `episode_timeout_s` until `after_episodes`
have ended (and after an orchestrator restart: the figures live in memory only).

The durations are those of episodes that ended with a model outcome, and of episodes cut at their
deadline, counted at what they ran. Counting the cut ones keeps the rule from locking itself in: once
more than 1% of an env's episodes run into its deadline (the env got slower: longer answers, more
turns), the p99 is the deadline itself and the next one is `factor` times longer. Failures of other
kinds (an env error in the first second) say nothing about how long an episode takes, and do not count.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from asyncrl.config import EpisodeDeadlineConfig


class EpisodeDeadlines:
    def __init__(self, cfg: EpisodeDeadlineConfig, cap_s: float) -> None:
        """`cap_s`: the run's `episode_timeout_s`, the deadline before the figures and never exceeded."""
        self.cfg = cfg
        self.cap_s = cap_s
        self._durations: dict[str, deque[float]] = {}
        self._deadline: dict[str, float] = {}

    def observe(self, env: str, seconds: float) -> None:
        """An episode of `env` that ended with a model outcome or was cut at its deadline, after `seconds`."""
        durations = self._durations.setdefault(env, deque(maxlen=self.cfg.window))
        durations.append(seconds)
        if self.cfg.factor > 0 and len(durations) >= self.cfg.after_episodes:
            p99 = float(np.percentile(durations, 99))
            self._deadline[env] = min(self.cap_s, max(self.cfg.min_s, self.cfg.factor * p99))

    def deadline_s(self, env: str) -> float:
        return self._deadline.get(env, self.cap_s)
