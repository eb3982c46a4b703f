"""Learnable tasks for a tiny model on a CPU: arithmetic, copy, sort, and a multi-turn arithmetic chain.

One dialogue loop serves all of them (a visible state machine per turn):

    USER (send prompt k) -> MODEL (one chat completion) -> SCORE (reply k vs answer k) -> next k | END

The reward is the mean turn score (1/0 per turn; sort gives partial credit by position).
No tools, no sandbox: answers are parsed from the assistant's content.

Held-out split: a task id names a problem drawn from a seeded rng, and the problem spaces are small
(single-digit addition has 100 problems, which the 1,000 train ids cover many times over), so held-out
*ids* alone would hold nothing out. Instead a fixed share of the problems themselves (`eval_fraction`,
chosen by a hash of the prompt text) is held out: train tasks and the warm-up's demonstrations are drawn
from the other problems only, and the `eval` split lists distinct held-out problems (`arith-eval-00000`,
...; at most `num_eval_tasks`, fewer when the held-out share of a small space is smaller).
"""

from __future__ import annotations

import hashlib
import random
from abc import abstractmethod
from typing import Callable, ClassVar

from envs.sdk import Environment, EpisodeContext, EpisodeResult, EpisodeStatus
from envs.tasks import problems
from envs.tasks.problems import Problem


MAX_DRAWS = 10_000
"""Draws of a problem stream before giving up on finding one on the wanted side of the split."""
EVAL_PATIENCE = 2_000
"""Draws without a new held-out problem after which the eval split is complete."""


class DialogueTaskEnv(Environment):
    domain = "tasks"
    prefix: ClassVar[str]
    score: ClassVar[Callable[[str, str], float]]

    def __init__(self, num_tasks: int = 1000, seed: int = 0, eval_fraction: float = 0.2, num_eval_tasks: int = 100):
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction}: expected 0 <= eval_fraction < 1")
        self.num_tasks = num_tasks
        self.seed = seed
        self.eval_fraction = eval_fraction
        self.num_eval_tasks = num_eval_tasks
        self.splits = ("train", "eval") if eval_fraction > 0 else ("train",)
        self._eval_problems: list[Problem] | None = None

    @abstractmethod
    def make_problem(self, rng: random.Random) -> Problem:
        """Draw one problem; the rng is seeded by (seed, task index)."""

    def held_out(self, problem: Problem) -> bool:
        """Whether the problem belongs to the held-out share (a hash of its prompts: the same for every
        seed and task id, so no train task and no demonstration is ever a held-out problem)."""
        digest = hashlib.sha256("\x1f".join((self.prefix, *problem.prompts)).encode()).digest()
        return int.from_bytes(digest[:8], "big") < self.eval_fraction * 2**64

    def _draw(self, rng: random.Random, held_out: bool = False) -> Problem:
        """The next problem of the rng's stream that is (or is not) held out."""
        for _ in range(MAX_DRAWS):
            problem = self.make_problem(rng)
            if self.held_out(problem) == held_out:
                return problem
        raise ValueError(f"{type(self).__name__}: no {'held-out' if held_out else 'train'} problem in {MAX_DRAWS} "
                         f"draws (eval_fraction={self.eval_fraction})")

    def eval_problems(self) -> list[Problem]:
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

    def problem(self, task_id: str) -> Problem:
        index = int(task_id.rsplit("-", 1)[1])
        if task_id.startswith(f"{self.prefix}-eval-"):
            return self.eval_problems()[index]
        return self._draw(random.Random(f"{self.prefix}:{self.seed}:{index}"))

    async def list_tasks(self, split: str = "train") -> list[str]:
        if split == "train":
            return [f"{self.prefix}-{i:05d}" for i in range(self.num_tasks)]
        if split == "eval" and "eval" in self.splits:
            return [f"{self.prefix}-eval-{i:05d}" for i in range(len(self.eval_problems()))]
        raise ValueError(f"{type(self).__name__} has no {split!r} split (splits: {', '.join(self.splits)})")

    def demonstrations(self, count: int, seed: int = 0) -> list[list[dict[str, str]]]:
        """`count` solved dialogues (OpenAI messages) for a supervised warm-up, drawn from problems
        outside the task ids (their own seed stream), so the warm-up does not see the RL tasks, and
        never a held-out problem."""
        rng = random.Random(f"{self.prefix}:demo:{self.seed}:{seed}")
        dialogues = []
        for _ in range(count):
            problem = self._draw(rng)
            turns = [[{"role": "user", "content": p}, {"role": "assistant", "content": a}]
                     for p, a in zip(problem.prompts, problem.answers)]
            dialogues.append([m for turn in turns for m in turn])
        return dialogues

    async def run_episode(self, task_id, llm, sandbox, ctx: EpisodeContext) -> EpisodeResult:
        problem, messages, scores, replies = self.problem(task_id), [], [], []
        for prompt, answer in zip(problem.prompts, problem.answers):
            if len(scores) >= ctx.max_turns:
                break
            messages.append({"role": "user", "content": prompt})
            response = await llm.chat.completions.create(messages=messages, **ctx.completion_args())
            reply = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            replies.append(reply)
            scores.append(type(self).score(answer, reply))
        status = EpisodeStatus.completed if len(scores) == len(problem.prompts) else EpisodeStatus.truncated
        return EpisodeResult(reward=sum(scores) / len(problem.prompts), status=status,
                             info={"prompts": list(problem.prompts), "expected": list(problem.answers),
                                   "replies": replies, "turn_scores": scores})


class ArithmeticEnv(DialogueTaskEnv):
    """'3+4=' -> '7'. Reward 1 when the first integer of the reply is right."""

    name, prefix, score = "arithmetic", "arith", staticmethod(problems.score_integer)

    def __init__(self, max_operand: int = 9, ops: str = "+", **kw):
        super().__init__(**kw)
        self.max_operand, self.ops = max_operand, ops

    def make_problem(self, rng):
        return problems.arithmetic(rng, self.max_operand, self.ops)


class ChainArithmeticEnv(DialogueTaskEnv):
    """Multi-turn: '3+4=' -> '7', '+2=' -> '9'. Reward = fraction of turns right."""

    name, prefix, score = "chain", "chain", staticmethod(problems.score_integer)

    def __init__(self, max_operand: int = 9, ops: str = "+", steps: int = 2, **kw):
        super().__init__(**kw)
        self.max_operand, self.ops, self.steps = max_operand, ops, steps

    def make_problem(self, rng):
        return problems.chain(rng, self.max_operand, self.ops, self.steps)


class CopyEnv(DialogueTaskEnv):
    """'copy abca' -> 'abca'. Reward 1 on an exact (whitespace-trimmed) copy."""

    name, prefix, score = "copy", "copy", staticmethod(problems.score_exact)

    def __init__(self, alphabet: str = "abcdefgh", min_len: int = 2, max_len: int = 4, **kw):
        super().__init__(**kw)
        self.alphabet, self.min_len, self.max_len = alphabet, min_len, max_len

    def make_problem(self, rng):
        return problems.copy(rng, self.alphabet, self.min_len, self.max_len)


class SortEnv(DialogueTaskEnv):
    """'sort 3 1 2' -> '1 2 3'. Partial credit: the fraction of positions right."""

    name, prefix, score = "sort", "sort", staticmethod(problems.score_positions)

    def __init__(self, min_len: int = 3, max_len: int = 4, **kw):
        super().__init__(**kw)
        self.min_len, self.max_len = min_len, max_len

    def make_problem(self, rng):
        return problems.sort(rng, self.min_len, self.max_len)
