"""SWE env: fix a planted bug in a small Python repository; reward = the held-out tests pass.

    setup (repository into the sandbox) -> AgentLoop with read_file / write_file / run_tests /
    submit, until submit (or a reply without a tool call, or out of turns) -> grading

Grading happens in a fresh directory of the sandbox that the agent never saw: the agent's version
of the repository's source files, the original visible tests and the held-out tests. Files the agent
added and edits to the tests are ignored, so rewriting a test cannot buy a reward.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path, PurePosixPath
from typing import Optional

from envs.sdk import AgentLoop, Environment, EpisodeContext, EpisodeResult, Sandbox, Tool, ToolResult
from envs.sdk import SandboxError, schema
from envs.sdk.sandbox import ExecResult

DATA = Path(__file__).with_name("data") / "tasks.jsonl"
SYSTEM_PROMPT = ("You are fixing a bug in a small Python repository. Tools: read_file(path), write_file(path, "
                 "content) (replaces the whole file), run_tests() (runs the repository's tests), submit() (ends the "
                 "episode; hidden tests then decide). Fix the code, not the tests; only existing files under the "
                 "package directory count.")
MISSING_INTERPRETER = (126, 127)


class SweEnv(Environment):
    name = "swe"
    domain = "swe"
    requires_sandbox = True

    def __init__(self, tasks_file: Optional[str] = None, python: str = "python3", max_file_bytes: int = 100_000):
        rows = [json.loads(line) for line in Path(tasks_file or DATA).read_text().splitlines() if line.strip()]
        self.tasks = {row["task_id"]: row for row in rows}
        self.python = python
        self.max_file_bytes = max_file_bytes

    async def list_tasks(self) -> list[str]:
        return list(self.tasks)

    async def run_episode(self, task_id: str, llm, sandbox: Sandbox, ctx: EpisodeContext) -> EpisodeResult:
        task = self.tasks[task_id]
        await sandbox.write_files(task["repo"])
        repo = _RepoTools(self, sandbox)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.brief(task)}]
        outcome = await AgentLoop(llm, ctx, repo.tools()).run(messages)
        reward, info = await self.score(sandbox, task)
        return EpisodeResult(reward=reward, status=outcome.status, reason=outcome.reason,
                             info={**info, "submitted": repo.submitted})

    def brief(self, task: dict) -> str:
        files = "\n".join(f"  {path}" for path in task["repo"])
        return (f"Repository files:\n{files}\n\nThe tests in {task['visible_test']} fail. Find the bug in "
                f"{task['module']} and fix it.")

    async def score(self, sandbox: Sandbox, task: dict) -> tuple[float, dict]:
        """The reward of the repository as the agent left it (1: the graded tests pass) and what grading saw;
        shared by every harness that plays these tasks (envs/mini_swe)."""
        graded = await self.grade(sandbox, task)
        passed, total = _counts(graded)
        return (1.0 if graded.ok else 0.0,
                {"tests_passed": passed, "tests_run": total, "grader_output": graded.output[-2000:]})

    async def grade(self, sandbox: Sandbox, task: dict) -> ExecResult:
        """Agent's source files + pristine visible and held-out tests, in a directory the agent never saw."""
        grading = f".grading-{uuid.uuid4().hex}"
        sources = [p for p in task["repo"] if p.endswith(".py") and not p.startswith("tests/")]
        files = {f"{grading}/{p}": content for p, content in task["repo"].items() if p.startswith("tests/")}
        files.update({f"{grading}/{p}": content for p, content in task["hidden_tests"].items()})
        for path in sources:
            current = await sandbox.read_file(path, self.max_file_bytes)
            files[f"{grading}/{path}"] = current if current is not None else b""
        await sandbox.write_files(files)
        return await self.unittest(sandbox, grading)

    async def unittest(self, sandbox: Sandbox, directory: str) -> ExecResult:
        result = await sandbox.run(["sh", "-c", f'cd "$1" && exec {self.python} -m unittest 2>&1', "sh", directory])
        if result.exit_code in MISSING_INTERPRETER:
            raise SandboxError(f"cannot run {self.python!r} in the sandbox: {result.output[-500:]}")
        return result


class _RepoTools:
    """The agent's tools over one episode's repository (all file access goes through the sandbox)."""

    def __init__(self, env: SweEnv, sandbox: Sandbox):
        self.env, self.sandbox = env, sandbox
        self.submitted = False

    def tools(self) -> list[Tool]:
        return [Tool("read_file", "Read a file of the repository.", schema({"path": "relative path"}), self.read_file),
                Tool("write_file", "Replace a file's content.",
                     schema({"path": "relative path", "content": "the new content"}), self.write_file),
                Tool("run_tests", "Run the repository's tests (python -m unittest).", schema({}), self.run_tests),
                Tool("submit", "Submit the fix and end the episode.", schema({}), self.submit)]

    async def read_file(self, path: str) -> str:
        if (problem := _bad_path(path)) is not None:
            return problem
        data = await self.sandbox.read_file(path, self.env.max_file_bytes)
        return data.decode(errors="replace") if data is not None else f"error: cannot read {path!r}"

    async def write_file(self, path: str, content: str) -> str:
        if (problem := _bad_path(path)) is not None:
            return problem
        if len(content.encode()) > self.env.max_file_bytes:
            return f"error: content larger than {self.env.max_file_bytes} bytes"
        await self.sandbox.write_files({path: content})
        return f"wrote {len(content.encode())} bytes to {path}"

    async def run_tests(self) -> str:
        result = await self.env.unittest(self.sandbox, ".")
        return f"exit code {result.exit_code}\n{result.output[-6000:]}"

    async def submit(self) -> ToolResult:
        self.submitted = True
        return ToolResult("submitted", done=True)


def _bad_path(path: str) -> Optional[str]:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or not path.strip():
        return f"error: {path!r} is not a relative path inside the repository"
    return None


def _counts(result: ExecResult) -> tuple[int, int]:
    """(passed, run) from unittest's summary ('Ran 5 tests', 'FAILED (failures=2, errors=1)')."""
    ran = re.search(r"Ran (\d+) tests?", result.output)
    total = int(ran.group(1)) if ran else 0
    bad = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", result.output))
    return total - bad, total
