"""SWE env: generated Python repositories with a planted bug; tools read_file, write_file, run_tests,
submit; reward = held-out tests pass (run in the sandbox)."""

from envs.swe.env import SweEnv

__all__ = ["SweEnv"]
