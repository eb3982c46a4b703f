"""mini-swe-agent's Environment over the episode's asyncrl Sandbox: every bash action runs there (in the
episode's repository, under the sandbox's isolation and limits), never in mini-swe-agent's local or
docker runner. A command whose output starts with COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT and that exits
0 is the agent's submission, as in mini-swe-agent's own environments (raises Submitted).
"""

from __future__ import annotations

import platform
import shlex
from typing import Any, Optional

from minisweagent.exceptions import Submitted
from pydantic import BaseModel

from envs.mini_swe.bridge import LoopBridge
from envs.sdk import ExecResult, Sandbox

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SandboxEnvironmentConfig(BaseModel):
    """The `environment:` section of a mini-swe-agent config; keys for its own runners (cwd, docker
    image, environment_class, ...) are ignored: the sandbox decides where and how long commands run."""

    env: dict[str, str] = {}
    """Variables set for every command (mini-swe-agent's configs set PAGER=cat and the like)."""


class SandboxEnvironment:
    def __init__(self, sandbox: Sandbox, bridge: LoopBridge, **config: Any):
        self.config = SandboxEnvironmentConfig(**config)
        self.sandbox, self.bridge = sandbox, bridge

    def execute(self, action: dict, cwd: str = "", *, timeout: Optional[int] = None) -> dict[str, Any]:
        command = action.get("command", "")
        if cwd:
            command = f"cd {shlex.quote(cwd)} && {command}"
        argv = ["env", *(f"{k}={v}" for k, v in self.config.env.items()), "bash", "-c", command]
        result = self.bridge.call(self.sandbox.run(argv, timeout_s=timeout))
        output = {"output": result.output, "returncode": result.exit_code, "exception_info": _killed(result)}
        lines = result.output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and result.exit_code == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config and the kernel's uname ({{system}} {{release}} ... in mini-swe-agent's templates): the
        sandbox runs on the service's kernel, so the host's uname is the sandbox's."""
        uname = platform.uname()
        return {**self.config.model_dump(), "system": uname.system, "release": uname.release,
                "version": uname.version, "machine": uname.machine, **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}


def _killed(result: ExecResult) -> str:
    """Why the sandbox killed the command, for mini-swe-agent's `exception_info` ('' when it was not)."""
    if result.timed_out:
        return "the command ran past its time limit and was killed"
    if result.truncated:
        return "the command printed more output than the sandbox keeps and was killed"
    return ""
