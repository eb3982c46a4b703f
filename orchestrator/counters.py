"""Run totals that survive restarts: written with every ledger batch, in the same transaction as the
group records they count, so after a crash they still match the `groups` stream exactly."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

PER_ENV = ("completed", "failed", "groups", "filtered", "passed", "unusable")
"""Per env: episodes completed / given up; groups appended (`groups`, including passed and unusable ones);
groups filtered by dynamic sampling (not appended); uninformative groups appended anyway by its guard
(`passed`); appended groups with half or fewer members done, which the trainer's group rule drops."""


@dataclass
class Counters:
    retried: int = 0
    ordinal: int = 0
    """Groups started so far (the last group's ordinal)."""
    filter_streak: int = 0
    """Groups filtered by dynamic sampling since the last informative group was appended."""
    by_env: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(PER_ENV, 0)))
    cursors: dict[str, int] = field(default_factory=dict)
    """Per env: position in its task order of the next group."""
    outcomes: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    """Per env: attempts that ended, by reason (orchestrator/outcomes.py): a model outcome once per
    member, a failure once per failed attempt (retried or given up)."""

    def total(self, name: str) -> int:
        return sum(c[name] for c in self.by_env.values())

    def not_usable(self) -> int:
        """Started groups that never reach the trainer usable: filtered, or dropped by its group rule."""
        return sum(c["filtered"] + c["unusable"] for c in self.by_env.values())

    def total_outcomes(self) -> dict[str, int]:
        """Attempts by reason, over every env."""
        totals: dict[str, int] = defaultdict(int)
        for reasons in self.outcomes.values():
            for reason, n in reasons.items():
                totals[reason] += n
        return totals

    def to_meta(self) -> dict[str, int]:
        meta = {"retried": self.retried, "ordinal": self.ordinal, "filter_streak": self.filter_streak}
        meta.update({f"cursor:{env}": n for env, n in self.cursors.items()})
        meta.update({f"{name}:{env}": c[name] for env, c in self.by_env.items() for name in PER_ENV})
        meta.update({f"outcome:{reason}:{env}": n for env, reasons in self.outcomes.items()
                     for reason, n in reasons.items()})
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> "Counters":
        counters = cls(retried=int(meta.get("retried", 0)), ordinal=int(meta.get("ordinal", 0)),
                       filter_streak=int(meta.get("filter_streak", 0)))
        for key, value in meta.items():
            name, _, env = key.partition(":")
            if name == "cursor":
                counters.cursors[env] = int(value)
            elif name == "outcome":  # outcome:<reason>:<env>; reasons have no colon, env names may
                reason, _, env = env.partition(":")
                counters.outcomes[env][reason] = int(value)
            elif name in PER_ENV:
                counters.by_env[env][name] = int(value)
        return counters
