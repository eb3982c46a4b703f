"""Dynamic sampling (DAPO): which complete groups reach the trainer, and the guard for rewards that never vary.

A complete group is judged on its *done* members (model outcomes: what the trainer trains; given-up
members reach it as failed samples it drops):

- `unusable`: half or fewer of group_size members done. The trainer's group rule drops the group
  (trainer/advantages.py), so it carries no signal either; it is still appended (the trainer counts
  its failures by reason), but with dynamic sampling it does not count towards the staleness budget.
- `unknown`: a done member whose reward this process does not know (recovered after a restart from the
  gateway's idempotent finish, which returns the sample refs but not the reward): delivered, and the
  streak below is left as it was.
- `uninformative`: every done member's reward equal (population std <= std_tol). Padding repeats done
  members, so the padded group's rewards are equal too and every advantage is 0 (group_mean and
  group_norm alike). With dynamic sampling: filtered (not appended, its samples deleted), unless the
  guard is passing uninformative groups through.
- `informative`: the rest.

The guard: `streak` counts groups filtered since the last informative group was delivered. Once it
reaches max_filtered_batches x groups_per_step, uninformative groups are delivered ("passed") until an
informative one comes, which resets the streak. Without it, a run whose rewards never vary would
generate forever and never step (verl raises after max_num_gen_batches; here the run goes on, loudly).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from enum import Enum
from typing import Optional

import numpy as np

from asyncrl.config import DynamicSamplingConfig
from orchestrator.groups import Group, MemberState

log = logging.getLogger("orchestrator.dynamic_sampling")

WARN_EVERY_S = 30.0


class Verdict(str, Enum):
    informative = "informative"
    uninformative = "uninformative"
    unusable = "unusable"
    unknown = "unknown"


def reward_std(rewards: list[float]) -> float:
    """Population std; exactly 0 when all are equal (np.std([0.1] * 3) is 1.4e-17, not 0)."""
    return 0.0 if max(rewards) == min(rewards) else float(np.std(rewards))


def judge(group: Group, std_tol: float = 0.0) -> Verdict:
    done = [m for m in group.members if m.state is MemberState.done]
    if 2 * len(done) <= len(group.members):
        return Verdict.unusable
    rewards = [m.reward for m in done]
    if any(r is None for r in rewards):
        return Verdict.unknown
    return Verdict.uninformative if reward_std(rewards) <= std_tol else Verdict.informative  # type: ignore[arg-type]


class DynamicSampler:
    """Decides filter or deliver for each complete group; keeps the filtered fraction of the recent ones
    and warns while groups keep being filtered. The streak lives in the orchestrator's counters (it
    survives restarts with them); this object holds only the recent window."""

    def __init__(self, cfg: DynamicSamplingConfig, groups_per_step: int) -> None:
        self.cfg = cfg
        self.enabled = cfg.enabled
        self.groups_per_step = max(1, groups_per_step)
        self.pass_after = cfg.max_filtered_batches * self.groups_per_step
        """Filtered groups in a row after which uninformative ones are delivered (0: never)."""
        self.recent: deque[bool] = deque(maxlen=max(64, 4 * self.groups_per_step))
        """Filtered or not, for the latest complete groups (the filtered fraction)."""
        self._warned_at = -WARN_EVERY_S

    @property
    def filtered_fraction(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    def passing(self, streak: int) -> bool:
        return self.pass_after > 0 and streak >= self.pass_after

    def decide(self, group: Group, streak: int) -> tuple[Verdict, bool, int]:
        """(verdict, filter it, the new streak)."""
        verdict = judge(group, self.cfg.std_tol)
        if not self.enabled:
            return verdict, False, streak
        filtered = verdict is Verdict.uninformative and not self.passing(streak)
        self.recent.append(filtered)
        if filtered:
            streak += 1
            self._report(streak)
        elif verdict is Verdict.informative:
            if self.passing(streak):
                log.info("dynamic sampling: %s has reward variance again after %d uninformative groups in a row; "
                         "filtering again", group.group_id, streak)
            streak = 0
        return verdict, filtered, streak

    def _report(self, streak: int, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        if streak == self.pass_after:
            log.warning("dynamic sampling: %d groups in a row had equal rewards (%.0f%% of the last %d groups "
                        "filtered); delivering uninformative groups (zero advantages) until one with reward "
                        "variance comes (max_filtered_batches=%d)", streak, 100 * self.filtered_fraction,
                        len(self.recent), self.cfg.max_filtered_batches)
            self._warned_at = now
        elif streak % self.groups_per_step == 0 and now - self._warned_at >= WARN_EVERY_S:
            log.warning("dynamic sampling: the last %d complete groups all had equal rewards and were filtered "
                        "(%.0f%% of the last %d groups); the trainer waits for groups with reward variance%s",
                        streak, 100 * self.filtered_fraction, len(self.recent),
                        f" (they pass after {self.pass_after} in a row)" if self.pass_after else
                        " (max_filtered_batches=0: they never pass)")
            self._warned_at = now
