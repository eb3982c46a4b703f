"""From complete groups to scored samples: filtering (failed, stale), the group padding rule, and
group-relative advantages. docs/trainer.md has the rules with their reasons; in short:

* A group *member* is one episode, i.e. one gateway session; its segments are the group's samples
  with that session_id (usually exactly one). A member is invalid when any segment failed (the
  environment or the infrastructure broke: env error, sandbox, LLM endpoint, deadline), when it is
  stale (w_now - first weight version > tau, measured on its oldest generated token), or when it is
  missing from the record. Stale members count as invalid for the group rule, like failed ones.
* A group with more than half of `group_size` valid members is padded back to `group_size` by
  repeating valid members in order (deterministic); otherwise the whole group is dropped.
* Advantages are computed over the padded group, exactly as for a complete group, and every segment
  of a member carries the member's advantage on its loss tokens.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, fields
from itertools import cycle, islice
from typing import Callable, Sequence

import numpy as np

from asyncrl.protocols.env_service import OutcomeClass
from asyncrl.types import Sample, TrainingGroup

log = logging.getLogger(__name__)

_STD_EPS = 1e-6
"""group_norm divides by std + eps: a group with equal rewards gets zero advantages, not NaN."""


def group_mean(rewards: np.ndarray) -> np.ndarray:
    """Agentic RL (GLM-5 §4.1): A_i = r_i - mean(r)."""
    return rewards - rewards.mean()


def group_norm(rewards: np.ndarray) -> np.ndarray:
    """Reasoning RL (GRPO): A_i = (r_i - mean(r)) / (std(r) + eps), population std (ddof 0)."""
    return (rewards - rewards.mean()) / (rewards.std() + _STD_EPS)


ADVANTAGES: dict[str, Callable[[np.ndarray], np.ndarray]] = {"group_mean": group_mean, "group_norm": group_norm}


@dataclass(frozen=True)
class ScoredSample:
    """A sample to train on, with its member's advantage."""

    sample: Sample
    advantage: float
    padding_copy: bool = False
    """True for the repeats that group padding added (the original is in the batch too)."""

    def token_advantages(self) -> np.ndarray:
        """Per-token advantages aligned with `sample.tokens`: the advantage on loss tokens, 0 elsewhere."""
        return np.where(self.sample.loss_mask.astype(bool), self.advantage, 0.0).astype(np.float32)


@dataclass
class FilterStats:
    """What filtering did, counted in members (episodes) and groups; add them across groups."""

    groups_kept: int = 0
    groups_padded: int = 0
    groups_dropped: int = 0
    failed: int = 0
    failed_environment: int = 0
    """Failed members whose environment broke (a tool, the grader); `failed` counts every failed one."""
    failed_infrastructure: int = 0
    """Failed members whose infrastructure broke (deadline, sandbox, LLM endpoint, env service)."""
    stale: int = 0
    missing: int = 0
    """Members the record's group_size promised but no sample carries."""
    aborted: int = 0
    """Aborted samples must never reach the trainer; counted (and logged) if they do."""
    padding_copies: int = 0
    redelivered: int = 0
    """Groups acknowledged before that Redis delivered again (it lost the acknowledgement in a restart
    from its AOF): acknowledged again, not trained (trainer/data.py)."""
    groups_filtered: int = 0
    """Groups the orchestrator's dynamic sampling filtered before these ones (equal rewards, never
    appended: GroupRecord.filtered_before), i.e. the uninformative groups it took to fill the step."""
    failed_by_reason: Counter = field(default_factory=Counter)
    """(env, reason) -> failed members; reason "unknown" for samples recorded without one."""

    def __add__(self, other: "FilterStats") -> "FilterStats":
        return FilterStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def count_failure(self, env: str, sample: Sample) -> None:
        self.failed_environment += sample.outcome_class == OutcomeClass.environment.value
        self.failed_infrastructure += sample.outcome_class == OutcomeClass.infrastructure.value
        self.failed_by_reason[env, sample.outcome_reason or "unknown"] += 1

    def metrics(self) -> dict[str, float]:
        """The `filter_*` entries of a step's metrics: every count, and failed members per env and reason
        (`filter_failed/<env>/<reason>`)."""
        flat = {f"filter_{f.name}": float(getattr(self, f.name)) for f in fields(self) if f.name != "failed_by_reason"}
        flat.update({f"filter_failed/{env}/{reason}": float(n) for (env, reason), n in self.failed_by_reason.items()})
        return flat


@dataclass
class ScoredGroup:
    group: TrainingGroup
    samples: list[ScoredSample]
    """Empty when the group was dropped."""
    stats: FilterStats


def members(group: TrainingGroup) -> list[list[Sample]]:
    """The group's samples gathered per episode (session_id), in record order."""
    by_session: dict[str, list[Sample]] = {}
    for sample in group.samples:
        by_session.setdefault(sample.session_id, []).append(sample)
    return list(by_session.values())


def as_recorded(version: int) -> int:
    """The lineage of a trainer that never restarted: recorded versions already count its pushes."""
    return version


def is_stale(member: Sequence[Sample], weight_version: int, staleness_tau: int,
             lineage: Callable[[int], int] = as_recorded) -> bool:
    """w_now - w_first > tau, w_first the oldest version of any generated token (none: not stale), in the
    numbering of w_now's line of weights (`lineage`: TrainerState.lineage_version, after restarts)."""
    versions = [lineage(s.first_weight_version) for s in member if s.first_weight_version >= 0]
    return bool(versions) and weight_version - min(versions) > staleness_tau


def _classify(member: Sequence[Sample], weight_version: int, staleness_tau: int,
              lineage: Callable[[int], int]) -> str:
    statuses = {s.status for s in member}
    if "aborted" in statuses:
        log.warning("aborted sample %s reached the trainer (dropped)", member[0].sample_id)
        return "aborted"
    if "failed" in statuses:
        return "failed"
    return "stale" if is_stale(member, weight_version, staleness_tau, lineage) else "valid"


def score_group(group: TrainingGroup, weight_version: int, staleness_tau: int, advantage: str,
                lineage: Callable[[int], int] = as_recorded) -> ScoredGroup:
    """Apply the validity and padding rules to one group and compute its advantages."""
    if advantage not in ADVANTAGES:
        raise ValueError(f"trainer.advantage {advantage!r} not in {sorted(ADVANTAGES)}")
    size = group.record.group_size
    found = members(group)
    kinds = [_classify(m, weight_version, staleness_tau, lineage) for m in found]
    valid = [m for m, kind in zip(found, kinds) if kind == "valid"]
    stats = FilterStats(failed=kinds.count("failed"), stale=kinds.count("stale"), aborted=kinds.count("aborted"),
                        missing=max(size - len(found), 0), groups_filtered=group.record.filtered_before)
    for member, kind in zip(found, kinds):
        if kind == "failed":
            stats.count_failure(group.record.env, next(s for s in member if s.status == "failed"))
    if stats.stale:
        versions = sorted({s.first_weight_version for m, kind in zip(found, kinds) if kind == "stale" for s in m})
        log.info("group %s: %d stale members (generated at versions %s, %s in this line of weights; now %d, "
                 "tau %d)", group.stream_id, stats.stale, versions, [lineage(v) for v in versions],
                 weight_version, staleness_tau)
    if 2 * len(valid) <= size:
        stats.groups_dropped = 1
        return ScoredGroup(group, [], stats)
    padded = valid + list(islice(cycle(valid), max(size - len(valid), 0)))
    stats.groups_kept, stats.padding_copies = 1, len(padded) - len(valid)
    stats.groups_padded = int(stats.padding_copies > 0)
    rewards = np.array([m[0].reward for m in padded], dtype=np.float64)  # segments share the episode reward
    scores = ADVANTAGES[advantage](rewards)
    samples = [ScoredSample(s, float(a), padding_copy=i >= len(valid))
               for i, (m, a) in enumerate(zip(padded, scores)) for s in m]
    return ScoredGroup(group, samples, stats)
