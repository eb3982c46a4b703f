"""Environment services: the SDK (envs.sdk), the built-in environments (tasks, terminal, swe, search) and
mini-swe-agent on the SWE tasks (mini_swe).

Serve one with `python -m envs.serve --env envs.tasks.ArithmeticEnv --port 0`; see docs/envs.md.
Depends only on asyncrl-level packages, never on the other components (rollout, gateway, ...).
The SDK and envs.serve also install alone, without the built-in environments, torch or Ray
(distributions/env-sdk; docs/envs.md "the light SDK").
"""
