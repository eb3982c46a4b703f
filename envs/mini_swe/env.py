"""mini-swe-agent on asyncrl: its own agent loop (DefaultAgent with its default tool-calling config,
mini.yaml) plays the SWE env's tasks, its model being the episode's gateway session and its shell the
episode's sandbox; the SWE env grades the repository it leaves (SweEnv.score).

    setup (repository into the sandbox) -> DefaultAgent.run in a worker thread (bridge.py), until it
    submits (echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT), runs out of turns or repeats format errors
    -> grading

Outcomes, as the SDK's AgentLoop reports them: submitted or given up after repeated format errors:
completed; out of turns (step_limit = ctx.max_turns): truncated, max_turns; given up on replies cut at
max_tokens: truncated, max_tokens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir

from envs.mini_swe.bridge import LoopBridge
from envs.mini_swe.environment import SandboxEnvironment
from envs.mini_swe.model import GatewayModel
from envs.sdk import EpisodeContext, EpisodeReason, EpisodeResult, EpisodeStatus, Sandbox
from envs.swe.env import SweEnv

DEFAULT_CONFIG = builtin_config_dir / "mini.yaml"
"""mini-swe-agent's default config of `mini` (tool calling, submission by the echo command)."""


class MiniSweAgentEnv(SweEnv):
    name = "mini-swe-agent"
    domain = "swe"

    def __init__(self, config_file: Optional[str] = None, **swe_options: Any):
        """`config_file`: a mini-swe-agent config (agent / model / environment sections, e.g. a copy of
        mini.yaml with other templates); None = mini-swe-agent's own mini.yaml. `swe_options`: SweEnv's."""
        super().__init__(**swe_options)
        self.config = yaml.safe_load(Path(config_file or DEFAULT_CONFIG).read_text())

    async def run_episode(self, task_id: str, llm, sandbox: Sandbox, ctx: EpisodeContext) -> EpisodeResult:
        task = self.tasks[task_id]
        await sandbox.write_files(task["repo"])
        bridge = LoopBridge(asyncio.get_running_loop())
        model = GatewayModel(llm, ctx, bridge, **self.config.get("model", {}))
        agent = DefaultAgent(model, SandboxEnvironment(sandbox, bridge, **self.config.get("environment", {})),
                             **{**self.config.get("agent", {}), "step_limit": ctx.max_turns, "cost_limit": 0.0,
                                "wall_time_limit_seconds": 0, "output_path": None})
        ended = await bridge.run(agent.run, self.task_text(task))
        status, reason = _outcome(ended["exit_status"], model.last_finish_reason)
        reward, info = await self.score(sandbox, task)
        return EpisodeResult(reward, status=status, reason=reason,
                             info={**info, "exit_status": ended["exit_status"],
                                   "submitted": ended["exit_status"] == "Submitted"})

    def task_text(self, task: dict) -> str:
        """The `{{task}}` of mini-swe-agent's instance template: the SWE env's brief and how grading works."""
        return (f"{self.brief(task)} Run the tests with `{self.python} -m unittest`. Fix the code, not the tests: "
                "grading runs held-out tests against the existing source files of the package only.")


def _outcome(exit_status: str, last_finish_reason: Optional[str]) -> tuple[EpisodeStatus, EpisodeReason]:
    if exit_status == "Submitted":
        return EpisodeStatus.completed, EpisodeReason.completed
    if exit_status == "LimitsExceeded":
        return EpisodeStatus.truncated, EpisodeReason.max_turns
    if exit_status == "RepeatedFormatError":
        if last_finish_reason == "length":
            return EpisodeStatus.truncated, EpisodeReason.max_tokens
        return EpisodeStatus.completed, EpisodeReason.completed
    raise RuntimeError(f"mini-swe-agent ended with exit status {exit_status!r}")
