"""An environment written only against the SDK, outside envs/, for the orchestrator's tests and
benchmark: an episode makes `llm_turns` model calls, then sleeps `sleep_s` (its "tool time"), and
scores 1.0 when the first reply contains the task's answer.

    python -m envs.serve --env tests.orchestrator.timed_env.TimedEnv --option sleep_s=0.5 ...
"""

from __future__ import annotations

import asyncio
import os

from envs.sdk import Environment, EpisodeResult


class TimedEnv(Environment):
    name = "timed"
    domain = "test"

    def __init__(self, sleep_s: float = 0.2, llm_turns: int = 0, num_tasks: int = 50):
        self.sleep_s, self.llm_turns, self.num_tasks = sleep_s, llm_turns, num_tasks

    async def list_tasks(self) -> list[str]:
        return [f"t-{i:04d}" for i in range(self.num_tasks)]

    async def run_episode(self, task_id, llm, sandbox, ctx) -> EpisodeResult:
        replies = []
        messages = [{"role": "user", "content": f"Say {task_id}."}]
        for _ in range(min(self.llm_turns, ctx.max_turns)):
            response = await llm.chat.completions.create(messages=messages, **ctx.completion_args())
            replies.append(response.choices[0].message.content or "")
            messages += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": "Again."}]
        await asyncio.sleep(self.sleep_s)
        reward = 1.0 if replies and task_id in replies[0] else 0.0
        return EpisodeResult(reward=reward, info={"pid": os.getpid(), "seed": ctx.seed})
