"""Env-service SDK: implement `Environment.list_tasks` and `Environment.run_episode`; the SDK serves it.

    from envs.sdk import (AgentLoop, Environment, EpisodeContext, EpisodeReason, EpisodeResult, EpisodeStatus,
                          ExecResult, LoopOutcome, Sandbox, SandboxError, Tool, ToolLog, ToolResult, param, schema)

    class MyEnv(Environment):
        name, domain = "my-env", "demo"
        async def list_tasks(self): return ["t-1", "t-2"]
        async def run_episode(self, task_id, llm, sandbox, ctx):
            reply = await llm.chat.completions.create(messages=[...], **ctx.completion_args())
            return EpisodeResult(reward=1.0 if ... else 0.0)

    python -m envs.serve --env my_pkg.MyEnv --port 0 --orchestrator http://orchestrator:8000
    python -m envs.serve --env path/to/my_env.py:MyEnv ...

Everything an environment author uses is importable from here (`__all__`, the list docs/envs.md
shows); the submodules are the SDK's own plumbing. See docs/envs.md.
"""

from asyncrl.protocols.env_service import EpisodeReason, EpisodeStatus
from envs.sdk import param
from envs.sdk.agent import AgentLoop, LoopOutcome, Tool, ToolResult
from envs.sdk.base import Environment, EpisodeContext, EpisodeResult, ToolLog
from envs.sdk.param import Param, check_arguments, schema
from envs.sdk.sandbox import ExecResult, Sandbox, SandboxConfig, SandboxError

__all__ = ["AgentLoop", "Environment", "EpisodeContext", "EpisodeReason", "EpisodeResult", "EpisodeStatus",
           "ExecResult", "LoopOutcome", "Param", "Sandbox", "SandboxConfig", "SandboxError", "Tool", "ToolLog",
           "ToolResult", "check_arguments", "param", "schema"]
