"""The tasks (one per command) and their scoring: a `@vf.reward` and a `@vf.metric` per trace."""

import json

import verifiers.v1 as vf

COMMANDS = ("ls", "pwd", "whoami")


class CommandData(vf.TaskData):
    command: str
    """The command the model is asked to run."""


def bash_commands(trace: vf.Trace) -> list[str]:
    """The `command` argument of every `bash` call of the model's first reply."""
    replies = trace.assistant_messages
    calls = (replies[0].tool_calls or []) if replies else []
    return [json.loads(call.arguments or "{}").get("command", "") for call in calls if call.name == "bash"]


class CommandTask(vf.Task[CommandData]):
    @vf.reward(weight=1.0)
    async def ran_the_command(self, trace: vf.Trace) -> float:
        return float(self.data.command in bash_commands(trace))

    @vf.metric
    async def bash_calls(self, trace: vf.Trace) -> float:
        return float(len(bash_commands(trace)))


class CommandTasksetConfig(vf.TasksetConfig):
    commands: list[str] = list(COMMANDS)
    """The commands to ask for, one task each (`env_args: {taskset: {commands: [...]}}`)."""


class CommandTaskset(vf.Taskset[CommandTask, CommandTasksetConfig]):
    def load(self) -> list[CommandTask]:
        return [CommandTask(CommandData(id=command, prompt=f"Run `{command}` with the bash tool.", command=command),
                            self.config.task) for command in self.config.commands]
