"""Train and held-out splits of a generated problem space, shared by the learnable task envs.

A task id names a problem drawn from a seeded rng, and problem spaces can be small (single-digit addition
has 100 problems, which 1,000 train ids cover many times over), so held-out *ids* alone would hold
nothing out. Instead a fixed share of the problems themselves (`eval_fraction`, chosen by a hash of the
problem's key text) is held out: train tasks and the warm-up's demonstrations are drawn from the other
problems only, and the `eval` split lists distinct held-out problems (`<prefix>-eval-00000`, ...; at most
`num_eval_tasks`, fewer when the held-out share of a small space is smaller).
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable, Generic, Hashable, TypeVar

MAX_DRAWS = 10_000
"""Draws of a problem stream before giving up on finding one on the wanted side of the split."""
EVAL_PATIENCE = 2_000
"""Draws without a new held-out problem after which the eval split is complete."""

P = TypeVar("P", bound=Hashable)


class HeldOutSplit(Generic[P]):
    """Task ids <-> problems for the `train` and `eval` splits of one env."""

    def __init__(self, prefix: str, make_problem: Callable[[random.Random], P], key: Callable[[P], str],
                 seed: int = 0, eval_fraction: float = 0.2, num_eval_tasks: int = 100):
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction}: expected 0 <= eval_fraction < 1")
        self.prefix, self.make_problem, self.key = prefix, make_problem, key
        self.seed, self.eval_fraction, self.num_eval_tasks = seed, eval_fraction, num_eval_tasks
        self.splits = ("train", "eval") if eval_fraction > 0 else ("train",)
        self._eval_problems: list[P] | None = None

    def held_out(self, problem: P) -> bool:
        """Whether the problem belongs to the held-out share (a hash of its key: the same for every seed
        and task id, so no train task and no demonstration is ever a held-out problem)."""
        digest = hashlib.sha256(f"{self.prefix}\x1f{self.key(problem)}".encode()).digest()
        return int.from_bytes(digest[:8], "big") < self.eval_fraction * 2**64

    def draw(self, rng: random.Random, held_out: bool = False) -> P:
        """The next problem of the rng's stream that is (or is not) held out."""
        for _ in range(MAX_DRAWS):
            problem = self.make_problem(rng)
            if self.held_out(problem) == held_out:
                return problem
        raise ValueError(f"{self.prefix}: no {'held-out' if held_out else 'train'} problem in {MAX_DRAWS} "
                         f"draws (eval_fraction={self.eval_fraction})")

    def eval_problems(self) -> list[P]:
        """Distinct held-out problems in a seeded order: up to num_eval_tasks, fewer when the stream finds
        no new one in EVAL_PATIENCE draws (the held-out share of a small problem space is exhausted)."""
        if self._eval_problems is None:
            rng, found, seen, misses = random.Random(f"{self.prefix}:eval:{self.seed}"), [], set(), 0
            while self.eval_fraction > 0 and len(found) < self.num_eval_tasks and misses < EVAL_PATIENCE:
                problem = self.make_problem(rng)
                if self.held_out(problem) and problem not in seen:
                    seen.add(problem)
                    found.append(problem)
                    misses = 0
                else:
                    misses += 1
            self._eval_problems = found
        return self._eval_problems

    def problem(self, task_id: str) -> P:
        index = int(task_id.rsplit("-", 1)[1])
        if task_id.startswith(f"{self.prefix}-eval-"):
            return self.eval_problems()[index]
        return self.draw(random.Random(f"{self.prefix}:{self.seed}:{index}"))

    def task_ids(self, split: str, num_tasks: int, owner: str) -> list[str]:
        if split == "train":
            return [f"{self.prefix}-{i:05d}" for i in range(num_tasks)]
        if split == "eval" and "eval" in self.splits:
            return [f"{self.prefix}-eval-{i:05d}" for i in range(len(self.eval_problems()))]
        raise ValueError(f"{owner} has no {split!r} split (splits: {', '.join(self.splits)})")

    def demonstration_problems(self, count: int, seed: int) -> list[P]:
        """`count` train-side problems from a stream of their own (not the task ids' streams), so the
        warm-up does not see the RL tasks, and never a held-out problem."""
        rng = random.Random(f"{self.prefix}:demo:{self.seed}:{seed}")
        return [self.draw(rng) for _ in range(count)]
