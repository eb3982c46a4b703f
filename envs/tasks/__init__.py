"""Learnable tasks for the tiny model (the demo run): arithmetic, copy, sort, multi-turn chain."""

from envs.tasks.envs import ArithmeticEnv, ChainArithmeticEnv, CopyEnv, DialogueTaskEnv, SortEnv

__all__ = ["ArithmeticEnv", "ChainArithmeticEnv", "CopyEnv", "DialogueTaskEnv", "SortEnv"]
