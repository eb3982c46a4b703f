"""Terminal env: shell tasks checked by verifier scripts, tool `bash`, one fresh sandbox per episode."""

from envs.terminal.env import TerminalEnv

__all__ = ["TerminalEnv"]
