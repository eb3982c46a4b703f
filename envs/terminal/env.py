"""Terminal env: shell tasks in a fresh sandbox, one `bash` tool, graded by a verifier script.

    setup (task files into the episode directory) -> AgentLoop with `bash` until the model replies
    without a tool call or runs out of turns -> verifier (bash script fed on stdin, run in the same
    directory) -> reward 1 when it exits 0, else 0
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from envs.sdk import AgentLoop, Environment, EpisodeContext, EpisodeResult, ExecResult, Sandbox, Tool, ToolResult
from envs.sdk import schema

DATA = Path(__file__).with_name("data") / "tasks.jsonl"
SYSTEM_PROMPT = ("You are working in a Linux shell. Use the bash tool to run commands; your working directory "
                 "holds the task's files and is the only place you can write. There is no network. When the task "
                 "is done, reply with a short message and no tool call.")


def format_exec(result: ExecResult) -> str:
    """What the agent sees of a command: its status line, then its output."""
    if result.timed_out:
        status = f"killed: time limit ({result.duration_s:.0f}s)"
    elif result.truncated:
        status = f"killed: too much output (first {len(result.output_bytes)} bytes shown, output truncated)"
    else:
        status = f"exit code {result.exit_code}"
    return f"{status}\n{result.output}"


def bash_tool(sandbox: Optional[Sandbox]) -> Tool:
    """The `bash` tool on an episode's sandbox (None: only its schema is wanted). A command that fails
    (non-zero exit, killed by a limit) is a tool error: the agent sees it, the episode's tool log counts it."""

    async def bash(command: str) -> ToolResult:
        result = await sandbox.run(command)
        return ToolResult(format_exec(result), error=not result.ok)

    return Tool("bash", "Run a command in the working directory; returns its exit code and output.",
                schema({"command": "the command line"}), bash)


class TerminalEnv(Environment):
    name = "terminal"
    domain = "terminal"
    requires_sandbox = True

    def __init__(self, tasks_file: Optional[str] = None):
        rows = [json.loads(line) for line in Path(tasks_file or DATA).read_text().splitlines() if line.strip()]
        self.tasks = {row["task_id"]: row for row in rows}

    async def list_tasks(self) -> list[str]:
        return list(self.tasks)

    async def run_episode(self, task_id: str, llm, sandbox: Sandbox, ctx: EpisodeContext) -> EpisodeResult:
        task = self.tasks[task_id]
        if task["files"]:
            await sandbox.write_files(task["files"])
        tool = bash_tool(sandbox)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["instruction"]}]
        outcome = await AgentLoop(llm, ctx, [tool]).run(messages)
        verdict = await sandbox.run(["bash", "-s"], stdin=task["verifier"].encode())
        return EpisodeResult(
            reward=1.0 if verdict.ok else 0.0,
            status=outcome.status, reason=outcome.reason,
            info={"verifier_exit_code": verdict.exit_code, "verifier_output": verdict.output[-2000:],
                  "verifier_timed_out": verdict.timed_out, "final_message": outcome.final_text})
