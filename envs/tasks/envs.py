"""Learnable tasks for a tiny model on a CPU: arithmetic, copy, sort, and a multi-turn arithmetic chain.

One dialogue loop serves all of them (a visible state machine per turn):

    USER (send prompt k) -> MODEL (one chat completion) -> SCORE (reply k vs answer k) -> next k | END

The reward is the mean turn score (1/0 per turn; sort gives partial credit by position).
No tools, no sandbox: answers are parsed from the assistant's content. Train and held-out splits:
envs/tasks/splits.py (a share of the problems themselves is held out, chosen by a hash of the prompts).
"""

from __future__ import annotations

import random
from abc import abstractmethod
from typing import Callable, ClassVar

from envs.sdk import Environment, EpisodeContext, EpisodeResult, EpisodeStatus
from envs.tasks import problems
from envs.tasks.problems import Problem
from envs.tasks.splits import HeldOutSplit


class DialogueTaskEnv(Environment):
    domain = "tasks"
    prefix: ClassVar[str]
    score: ClassVar[Callable[[str, str], float]]

    def __init__(self, num_tasks: int = 1000, seed: int = 0, eval_fraction: float = 0.2, num_eval_tasks: int = 100):
        self.num_tasks = num_tasks
        self.split = HeldOutSplit(self.prefix, self.make_problem, lambda p: "\x1f".join(p.prompts), seed,
                                  eval_fraction, num_eval_tasks)
        self.splits = self.split.splits

    @abstractmethod
    def make_problem(self, rng: random.Random) -> Problem:
        """Draw one problem; the rng is seeded by (seed, task index)."""

    def held_out(self, problem: Problem) -> bool:
        return self.split.held_out(problem)

    def problem(self, task_id: str) -> Problem:
        return self.split.problem(task_id)

    async def list_tasks(self, split: str = "train") -> list[str]:
        return self.split.task_ids(split, self.num_tasks, type(self).__name__)

    def demonstrations(self, count: int, seed: int = 0) -> list[list[dict[str, str]]]:
        """`count` solved dialogues (OpenAI messages) for a supervised warm-up, from train-side problems
        outside the task ids (HeldOutSplit.demonstration_problems)."""
        dialogues = []
        for problem in self.split.demonstration_problems(count, seed):
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
