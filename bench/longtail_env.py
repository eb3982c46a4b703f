"""A benchmark environment with long-tailed response lengths (written against the env SDK only).

Task i asks for a completion whose `max_tokens` follows a log-normal law fixed by i (median ~24 tokens,
p99 ~300): on an untrained model, which almost never emits a stop token, the response length is that
budget. The reward is a deterministic function of the task, so learning is irrelevant here: the
benchmark measures how rollout and training overlap (async) or wait for each other (sync).
"""

from __future__ import annotations

import math
import random

from envs.sdk import Environment, EpisodeContext, EpisodeResult


class LongTailEnv(Environment):
    name = "longtail"
    domain = "bench"

    def __init__(self, num_tasks: int = 512, median_tokens: int = 24, sigma: float = 1.1, cap: int = 512):
        self.num_tasks, self.median, self.sigma, self.cap = num_tasks, median_tokens, sigma, cap

    def budget(self, task_id: str) -> int:
        rng = random.Random(task_id)
        return max(2, min(self.cap, int(self.median * math.exp(rng.gauss(0.0, self.sigma)))))

    async def list_tasks(self) -> list[str]:
        return [f"tail-{i:05d}" for i in range(self.num_tasks)]

    async def run_episode(self, task_id, llm, sandbox, ctx: EpisodeContext) -> EpisodeResult:
        args = {**ctx.completion_args(), "max_tokens": self.budget(task_id)}
        reply = await llm.chat.completions.create(messages=[{"role": "user", "content": f"write {task_id}"}], **args)
        tokens = reply.usage.completion_tokens if reply.usage else 0
        return EpisodeResult(reward=float(int(task_id[-1]) % 2), info={"completion_tokens": tokens})
