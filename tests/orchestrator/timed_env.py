"""An environment written only against the SDK, outside envs/, for the orchestrator's tests and
benchmark: an episode makes `llm_turns` model calls, then sleeps `sleep_s` (its "tool time"), and
scores 1.0 when the first reply contains the task's answer (or by `reward_rule`, see `reward`).

    python -m envs.serve --env tests.orchestrator.timed_env.TimedEnv --option sleep_s=0.5 ...
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

from envs.sdk import Environment, EpisodeResult


class TimedEnv(Environment):
    name = "timed"
    domain = "test"

    def __init__(self, sleep_s: float = 0.2, llm_turns: int = 0, num_tasks: int = 50, journal: str = "",
                 broken: bool = False, jitter: float = 0.0, stalled_members: int = 0, group_size: int = 1,
                 stall_s: float = 60.0, reward_rule: str = "reply", eval_tasks: int = 0):
        self.sleep_s, self.llm_turns, self.num_tasks, self.broken = sleep_s, llm_turns, num_tasks, broken
        self.eval_tasks = eval_tasks
        """Held-out tasks (`eval` split, ids e-0000, ...); 0: the env serves the train split only."""
        self.splits = ("train", "eval") if eval_tasks else ("train",)
        """broken: every episode raises after its sleep (the service reports status failed)."""
        self.jitter = jitter
        """Sleep uniformly in sleep_s * (1 +- jitter), drawn from the episode seed (desynchronises load)."""
        self.stalled_members, self.group_size, self.stall_s = stalled_members, group_size, stall_s
        """Members seed % group_size < stalled_members of every group sleep stall_s instead (the orchestrator's
        member seeds are consecutive from a multiple of group_size): episodes that overrun their deadline."""
        self.journal = Path(journal) / f"{os.getpid()}.jsonl" if journal else None
        """When set, every episode appends what it was sent (and when) to <journal>/<pid>.jsonl."""
        if reward_rule not in ("reply", "mixed", "zero"):
            raise ValueError(f"reward_rule {reward_rule!r}: reply, mixed or zero")
        self.reward_rule = reward_rule

    def note(self, event: str, ctx, **extra) -> None:
        if self.journal is not None:
            entry = {"event": event, "at": time.time(), "pid": os.getpid(), "episode_id": ctx.episode_id,
                     "task_id": ctx.task_id, "seed": ctx.seed, **extra}
            with self.journal.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    async def list_tasks(self, split: str = "train") -> list[str]:
        return [f"e-{i:04d}" for i in range(self.eval_tasks)] if split == "eval" else \
            [f"t-{i:04d}" for i in range(self.num_tasks)]

    async def run_episode(self, task_id, llm, sandbox, ctx) -> EpisodeResult:
        base_url = str(llm.base_url)
        self.note("start", ctx, base_url=base_url, max_turns=ctx.max_turns, deadline_s=ctx.deadline_s)
        outcome = "cancelled"
        try:
            replies = await self.talk(task_id, llm, ctx)
            await asyncio.sleep(self.stall_s if ctx.seed % self.group_size < self.stalled_members else
                                self.sleep_s * (1 + self.jitter * (2 * random.Random(ctx.seed).random() - 1)))
            if self.broken:
                outcome = "broken"
                raise RuntimeError("planted failure: this service is broken")
            outcome = "completed"
        finally:
            self.note("end", ctx, base_url=base_url, outcome=outcome)
        return EpisodeResult(reward=self.reward(task_id, ctx.seed, replies),
                             info={"pid": os.getpid(), "seed": ctx.seed})

    def reward(self, task_id: str, seed: int, replies: list[str]) -> float:
        """`reply`: 1.0 when the first reply names the task. `zero`: always 0. `mixed` (dynamic sampling
        tests): task t-i with i % 3 == 0 scores 0 for every member, i % 3 == 1 scores 1 for every member
        (equal rewards: no signal), i % 3 == 2 scores the member seed's parity (the members of a group
        have consecutive seeds: rewards vary). `informative(task_id)` says which."""
        if self.reward_rule == "zero":
            return 0.0
        if self.reward_rule == "mixed":
            kind = int(task_id.rsplit("-", 1)[1]) % 3
            return float(seed % 2) if kind == 2 else float(kind)
        return 1.0 if replies and task_id in replies[0] else 0.0

    async def talk(self, task_id: str, llm, ctx) -> list[str]:
        replies: list[str] = []
        messages = [{"role": "user", "content": f"Say {task_id}."}]
        for _ in range(min(self.llm_turns, ctx.max_turns)):
            response = await llm.chat.completions.create(messages=messages, **ctx.completion_args())
            replies.append(response.choices[0].message.content or "")
            messages += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": "Again."}]
        return replies


def informative(task_id: str) -> bool:
    """Whether a group of `reward_rule=mixed` on this task has rewards that vary."""
    return int(task_id.rsplit("-", 1)[1]) % 3 == 2
