"""Env-service SDK: implement `Environment.list_tasks` and `Environment.run_episode`; the SDK serves it.

    class MyEnv(Environment):
        name, domain = "my-env", "demo"
        async def list_tasks(self): return ["t-1", "t-2"]
        async def run_episode(self, task_id, llm, sandbox, ctx):
            reply = await llm.chat.completions.create(messages=[...], **ctx.completion_args())
            return EpisodeResult(reward=1.0 if ... else 0.0)

    python -m envs.serve --env mypkg.MyEnv --port 0 --orchestrator http://orchestrator:8000

See docs/envs.md.
"""

from envs.sdk.agent import AgentLoop, LoopOutcome, Tool, ToolResult, schema
from envs.sdk.base import Environment, EpisodeContext, EpisodeResult
from asyncrl.protocols.env_service import EpisodeReason, EpisodeStatus
from envs.sdk.sandbox import ExecResult, Sandbox, SandboxConfig, SandboxError

__all__ = ["AgentLoop", "Environment", "EpisodeContext", "EpisodeReason", "EpisodeResult", "EpisodeStatus",
           "ExecResult", "LoopOutcome", "Sandbox", "SandboxConfig", "SandboxError", "Tool", "ToolResult", "schema"]
