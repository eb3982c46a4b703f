"""A multi-turn SDK env for control-plane benchmarks: `turns` model calls with a tool-time sleep between
them, the conversation growing each turn by the model's reply and a tool observation, so a router that
keeps a session on one engine finds the prefix in that engine's cache.

    python -m envs.serve --env bench.tool_loop_env.ToolLoopEnv --option turns=3 --option tool_s=20 ...

The first `ramp_episodes` episodes of a service first sleep U(0, `ramp_s`): with ramp_s one episode length,
the first wave's completions, and so every later wave's dispatches, are spread evenly instead of arriving
as one wave per episode length (a lull between waves). With
`stats_dir`, each turn's client-side figures are appended to <stats_dir>/<pid>.tsv (every 2 s):
finish unix time, wall seconds of the chat call as the client saw it, and the engines' own seconds
(the gateway's x-engine-latency-s header), so overhead outside the engines can be read off.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

from envs.sdk import Environment, EpisodeResult

WORDS = ("read", "file", "test", "error", "line", "patch", "module", "return", "value", "build", "passed", "failed")
FLUSH_S = 2.0


class ToolLoopEnv(Environment):
    name = "tool_loop"
    domain = "bench"

    def __init__(self, turns: int = 3, tool_s: float = 5.0, jitter: float = 0.5, ramp_s: float = 0.0,
                 ramp_episodes: int = 0, observation_words: int = 60, num_tasks: int = 1000, stats_dir: str = "") -> None:
        self.turns, self.tool_s, self.jitter = int(turns), float(tool_s), float(jitter)
        self.ramp_s, self.ramp_left = float(ramp_s), int(ramp_episodes)
        self.observation_words, self.num_tasks = int(observation_words), int(num_tasks)
        self.stats = Path(stats_dir) / f"{os.getpid()}.tsv" if stats_dir else None
        self.pending: list[str] = []
        self.flushed = time.monotonic()

    async def list_tasks(self) -> list[str]:
        return [f"t-{i:04d}" for i in range(self.num_tasks)]

    async def run_episode(self, task_id, llm, sandbox, ctx) -> EpisodeResult:
        rng = random.Random(ctx.seed)
        if self.ramp_left > 0:
            self.ramp_left -= 1
            await asyncio.sleep(rng.random() * self.ramp_s)
        messages = [{"role": "user", "content": f"Episode {ctx.episode_id}, task {task_id}: fix the failing test."}]
        for turn in range(min(self.turns, ctx.max_turns)):
            started = time.perf_counter()
            raw = await llm.chat.completions.with_raw_response.create(messages=messages, **ctx.completion_args())
            self.note(time.perf_counter() - started, float(raw.headers.get("x-engine-latency-s", "nan")))
            messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content or ""})
            if turn < self.turns - 1:
                await asyncio.sleep(self.tool_s * (1 + self.jitter * (2 * rng.random() - 1)))
                observation = " ".join(rng.choice(WORDS) for _ in range(self.observation_words))
                messages.append({"role": "user", "content": f"Observation: {observation}"})
        return EpisodeResult(reward=float(ctx.seed % 2), info={"turns": self.turns})

    def note(self, wall_s: float, engine_s: float) -> None:
        if self.stats is None:
            return
        self.pending.append(f"{time.time():.3f}\t{wall_s:.6f}\t{engine_s:.6f}\n")
        if time.monotonic() - self.flushed > FLUSH_S:
            with self.stats.open("a") as f:
                f.writelines(self.pending)
            self.pending, self.flushed = [], time.monotonic()
