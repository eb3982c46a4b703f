"""File lookup: the terminal env's learnable tier, small enough for the tiny model on a CPU.

Each task writes two files with numbers drawn for that task into a fresh namespace sandbox and asks for
both numbers; the prompt names the files, never the numbers, so the answer exists only in what the
agent's tool calls print:

    USER "Reply with the numbers in files k and p."
    MODEL bash(cat k) -> OBSERVATION "exit code 0\\n47"
    MODEL bash(cat p) -> OBSERVATION "exit code 0\\n13"
    MODEL "47 13"            reward 1 when the reply's integers are exactly [47, 13], else 0

The files are `num_files` names drawn per task from `names`, or, when `names` has exactly `num_files`
letters, those files in that order: the main job (configs/experiment/file_lookup.yaml) asks for `a` and
`b` every time, so the numbers are all that differs between tasks (in its warm-up budget the tiny model
learns to copy numbers out of observations, not yet names out of the prompt: docs/envs.md "File lookup").
The scripted expert (`demonstrations`) plays exactly this for the supervised warm-up, with the
observations the sandbox really prints; in a share `lazy_expert` of its demonstrations it replies before it
has read every file (the main job: half), which RL then unlearns. Train and held-out splits:
envs/tasks/splits.py (a hash of the file names and numbers holds a share of the problems out).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any

from envs.sdk import AgentLoop, Environment, EpisodeContext, EpisodeResult, ExecResult, Sandbox
from envs.tasks.problems import INTEGER
from envs.tasks.splits import HeldOutSplit
from envs.terminal.env import bash_tool, format_exec

PROMPT = "Reply with the numbers in files {names}."


@dataclass(frozen=True)
class LookupProblem:
    files: tuple[tuple[str, int], ...]
    """(file name, the number it holds), in the order the prompt asks for them."""

    @property
    def prompt(self) -> str:
        names = [name for name, _ in self.files]
        return PROMPT.format(names=", ".join(names[:-1]) + f" and {names[-1]}")

    @property
    def answer(self) -> list[int]:
        return [value for _, value in self.files]

    def key(self) -> str:
        return ",".join(f"{name}={value}" for name, value in self.files)


class FileLookupEnv(Environment):
    name = "file-lookup"
    domain = "terminal"
    requires_sandbox = True

    def __init__(self, num_tasks: int = 1000, seed: int = 0, eval_fraction: float = 0.2, num_eval_tasks: int = 100,
                 num_files: int = 2, names: str = string.ascii_lowercase, low: int = 10, high: int = 99,
                 lazy_expert: float = 0.0):
        if not 1 <= num_files <= len(names):
            raise ValueError(f"num_files={num_files}: expected 1..{len(names)} (one name each)")
        if not 0.0 <= lazy_expert <= 1.0 or (lazy_expert > 0 and num_files < 2):
            raise ValueError(f"lazy_expert={lazy_expert}: expected a share in [0, 1], and num_files >= 2 "
                             "for a demonstration to stop before the last file")
        self.lazy_expert = lazy_expert
        self.num_tasks, self.num_files, self.names, self.low, self.high = num_tasks, num_files, names, low, high
        self.split = HeldOutSplit("look", self.make_problem, LookupProblem.key, seed, eval_fraction, num_eval_tasks)
        self.splits = self.split.splits

    def make_problem(self, rng: random.Random) -> LookupProblem:
        names = list(self.names) if len(self.names) == self.num_files else rng.sample(self.names, self.num_files)
        return LookupProblem(tuple((name, rng.randint(self.low, self.high)) for name in names))

    async def list_tasks(self, split: str = "train") -> list[str]:
        return self.split.task_ids(split, self.num_tasks, type(self).__name__)

    async def run_episode(self, task_id: str, llm, sandbox: Sandbox, ctx: EpisodeContext) -> EpisodeResult:
        problem = self.split.problem(task_id)
        await sandbox.write_files({name: f"{value}\n" for name, value in problem.files})
        messages = [{"role": "user", "content": problem.prompt}]
        outcome = await AgentLoop(llm, ctx, [bash_tool(sandbox)]).run(messages)
        reply = outcome.final_text or ""
        found = [int(n) for n in INTEGER.findall(reply)]
        return EpisodeResult(reward=float(found == problem.answer), status=outcome.status, reason=outcome.reason,
                             info={"expected": problem.answer, "reply": reply[:200]})

    def demonstration_tools(self) -> list[dict[str, Any]]:
        """The tool specs every demonstration is rendered with (those the episode's agent sends)."""
        return [bash_tool(None).schema()]

    def demonstrations(self, count: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """The scripted expert: `cat` each file in the prompt's order, then reply with the numbers. In a share
        `lazy_expert` of them it stops after 1..num_files-1 files and replies with the numbers it has read
        (an agent's classic failure: answering before it has looked at everything; reward 0), so the warm-up
        leaves a policy that RL can teach to read every file (docs/envs.md "File lookup"). Every number in a
        reply is copied from an observation: the laziness is in the decision to stop, not in the copying."""
        rng = random.Random(f"lazy-expert-{seed}")
        return [self._solve(problem, self._files_read(rng))
                for problem in self.split.demonstration_problems(count, seed)]

    def _files_read(self, rng: random.Random) -> int:
        return rng.randint(1, self.num_files - 1) if rng.random() < self.lazy_expert else self.num_files

    def _solve(self, problem: LookupProblem, files_read: int) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": problem.prompt}]
        for i, (name, value) in enumerate(problem.files[:files_read]):
            call = {"id": f"call_{i}", "type": "function",
                    "function": {"name": "bash", "arguments": f'{{"command": "cat {name}"}}'}}
            printed = ExecResult(0, f"{value}\n".encode(), truncated=False, timed_out=False, duration_s=0.0)
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": format_exec(printed)}]
        messages.append({"role": "assistant", "content": " ".join(map(str, problem.answer[:files_read]))})
        return messages
