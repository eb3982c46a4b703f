"""mini-swe-agent's own agent loop on the SWE env's tasks: its model is the episode's gateway session,
its bash actions run in the episode's sandbox, the SWE env grades (docs/envs.md "Running an existing
agent harness")."""

import os

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # before minisweagent is imported: no banner on stdout

from envs.mini_swe.env import MiniSweAgentEnv  # noqa: E402

__all__ = ["MiniSweAgentEnv"]
