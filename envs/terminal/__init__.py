"""Terminal env: shell tasks checked by verifier scripts, tool `bash`, one fresh sandbox per episode; and its
learnable tier for the tiny model, file lookup (envs/terminal/lookup.py)."""

from envs.terminal.env import TerminalEnv
from envs.terminal.lookup import FileLookupEnv

__all__ = ["FileLookupEnv", "TerminalEnv"]
