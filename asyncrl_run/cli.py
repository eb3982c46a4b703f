"""The `asyncrl` command. Each subcommand lives in the module that implements it (the run layer's or a
component's) and is imported by dotted path only when invoked, so `asyncrl --help` is instant and a command
loads only what it runs."""

from __future__ import annotations

import sys

from asyncrl.plugins import load_object

# command words -> (module:function reading sys.argv, one-line help). Added as components land.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("asyncrl_run.train:main", "run an RL job (Hydra overrides, e.g. experiment=tiny_demo)"),
    "eval": ("asyncrl_run.evaluate:main", "score a checkpoint on an env's held-out tasks: mean reward, pass@k "
             "(experiment=tiny_demo --model PATH)"),
    "engine serve": ("rollout.server:main", "serve the built-in CPU engine (SGLang native API)"),
    "gateway serve": ("gateway.server:main", "serve the TITO gateway (sessions, OpenAI chat, token-native)"),
    "watch": ("asyncrl_run.watch:main", "live terminal dashboard of a run (--run-dir runs/NAME)"),
    "dashboard": ("asyncrl_run.dashboard.server:main", "web dashboard of a run: curves, services, trajectory browser "
                  "(--run-dir runs/NAME)"),
    "orchestrator serve": ("orchestrator.server:main", "serve the orchestrator (env registry, scheduler, retries)"),
    "env register": ("orchestrator.cli:register", "register an env service with the orchestrator (it probes /health)"),
    "env list": ("orchestrator.cli:list_envs", "list the env services an orchestrator knows"),
    "env remove": ("orchestrator.cli:remove", "deregister an env service (its running episodes finish)"),
    "trainer": ("trainer.run:main", "run the trainer alone against a run's Redis (Hydra overrides; torchrun for DP)"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in sorted(COMMANDS.items())]
    return "usage: asyncrl <command> [args...]\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = next((n for n in sorted(COMMANDS, key=len, reverse=True) if argv[:len(n.split())] == n.split()), None)
    if name is None:
        print(f"asyncrl: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    sys.argv = [f"asyncrl {name}", *argv[len(name.split()):]]
    result = load_object(target)()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
