"""A verifiers (v1) environment that needs no network, for tests/envs/test_verifiers_adapter.py.

Each task asks for one shell command; the reward is 1 when the model's first reply calls the
`bash` tool with exactly that command. tests/gateway/scripted.py's model always calls `bash`
with `ls`, so task `ls` earns 1 and the others 0: a test can tell a wired reward from a constant.

The package ships its own harness (exported next to the taskset, so verifiers picks it as the
taskset's default): one chat completion, in-process, through the rollout's interception endpoint.
The built-in harnesses (`null`, `bash`) would run a program that uv installs from the registry.
"""

from asyncrl_vf_toy.harness import OneCallHarness
from asyncrl_vf_toy.taskset import COMMANDS, CommandTaskset

__all__ = ["COMMANDS", "CommandTaskset", "OneCallHarness"]
