"""Serve an installed verifiers environment (an Environments Hub env) as an asyncrl env service.

    .venv-verifiers/bin/python -m envs.serve --env envs/verifiers_adapter.py:VerifiersEnv \\
        --option env_id=OWNER/NAME --option 'env_args={"agent": {"runtime": {"type": "subprocess"}}}'

It runs in a venv of its own (`make verifiers-venv`, docs/envs.md): verifiers pins an openai of
its own. A verifiers (v1) env is a taskset (its tasks and their `@vf.reward` / `@vf.metric`
scoring), the agent that plays a task (a harness program in a runtime) and an interception server
between that program and the model. Here the tasks are the taskset's rows, an episode is the vf
env's own episode with its model calls sent to the episode's endpoint (the gateway session, which
records the tokens and log-probs), and the reward is its trace's weighted rewards.
"""

from __future__ import annotations

import logging
import os
import uuid
from contextlib import AsyncExitStack, contextmanager
from typing import Any, Iterator, Optional

import httpx
import openai
import verifiers.v1 as vf

from envs.sdk import EpisodeReason, EpisodeResult, EpisodeStatus, SandboxError
from envs.sdk.base import Environment, EpisodeContext

TRUNCATIONS = {"max_turns": EpisodeReason.max_turns, "max_input_tokens": EpisodeReason.max_tokens,
               "max_output_tokens": EpisodeReason.max_tokens, "max_total_tokens": EpisodeReason.max_tokens,
               "compaction_failed": EpisodeReason.max_tokens}
"""verifiers' stop conditions that are the model running out of turns or tokens."""


class VerifiersEnv(Environment):
    """`env_id`: the installed env's id (`owner/name[@version]` or `name`, as `vf-eval` takes it);
    `env_args`: the rest of its env config (`agent`, `taskset` fields, ...), as in vf-eval's `[env]`;
    `eval_taskset_args`: taskset fields that select its held-out rows (e.g. `{"split": "test"}`),
    served as the `eval` split."""

    name, domain = "verifiers", "verifiers"

    def __init__(self, env_id: str, env_args: Optional[dict] = None, eval_taskset_args: Optional[dict] = None):
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # its two INFO lines per rollout: DEBUG's,
            logging.getLogger("verifiers").setLevel(logging.WARNING)  # as the SDK's own episode lines are
        args = dict(env_args or {})
        config = vf.resolve_env_config({**args, "taskset": {**args.get("taskset", {}), "id": env_id}})
        self.vf_env = vf.load_environment(config)
        self.splits = ("train", "eval") if eval_taskset_args is not None else ("train",)
        self._tasks = {"train": _tasks(self.vf_env.taskset, "")}
        if eval_taskset_args is not None:
            held_out = type(config.taskset).model_validate({**config.taskset.model_dump(), **eval_taskset_args})
            self._tasks["eval"] = _tasks(vf.load_taskset(held_out), "eval:")
        self._by_id = {task_id: task for tasks in self._tasks.values() for task_id, task in tasks.items()}
        self._serving: Optional[AsyncExitStack] = None

    async def list_tasks(self, split: str = "train") -> list[str]:
        return list(self._tasks[split])

    async def run_episode(self, task_id: str, llm: openai.AsyncOpenAI, sandbox: None,
                          ctx: EpisodeContext) -> EpisodeResult:
        if self._serving is None and _needs_serving(self.vf_env):
            self._serving = AsyncExitStack()  # held for the service's life
            await self._serving.enter_async_context(self.vf_env.serving())
        sampling = vf.Sampling(**{key: value for key, value in ctx.sampling.items() if value is not None})
        with _endpoint(llm) as client:
            episode = await self.vf_env.run_episode(self._by_id[task_id], vf.ModelContext(ctx.model, client, sampling))
        return episode_result(episode)


def _needs_serving(env: vf.Env) -> bool:
    """Whether the env has shared tool servers or start/stop hooks, which live in `Env.serving()`. Without
    them each episode gets an interception server of its own (verifiers' default outside `serving()`),
    stopped with it: serving()'s shared one keeps an HTTP client per distinct endpoint until it stops,
    and every gateway session is a distinct endpoint."""
    return (bool(env.taskset.toolsets(env.taskset.config)) or type(env).start is not vf.Env.start
            or type(env).stop is not vf.Env.stop)


def _tasks(taskset: vf.Taskset, prefix: str) -> dict[str, vf.Task]:
    """The taskset's tasks by id, in its load order: the row's own id, else its position."""
    if taskset.INFINITE and not taskset.bounded:
        raise ValueError(f"taskset {taskset.config.id!r} is infinite: bound it in env_args (its own size option)")
    return {f"{prefix}{task.data.id if task.data.id is not None else task.data.idx}": task for task in taskset}


@contextmanager
def _endpoint(llm: openai.AsyncOpenAI) -> Iterator[vf.EvalClientConfig]:
    """The episode's endpoint as verifiers' client config. It reads the API key from an environment
    variable only, so the session's credential is put into one of this episode's own meanwhile."""
    variable = f"ASYNCRL_EPISODE_KEY_{uuid.uuid4().hex}"
    os.environ[variable] = llm.api_key
    try:
        yield vf.EvalClientConfig(base_url=str(llm.base_url), api_key_var=variable)
    finally:
        del os.environ[variable]


def episode_result(episode: vf.Episode) -> EpisodeResult:
    """The SDK's outcome of a verifiers episode: its trace's reward when the model played it out,
    else the exception naming what broke (the endpoint, the runtime, the env's own code)."""
    if not episode.ok:
        raise _failure(episode)
    if len(episode.traces) != 1:
        raise ValueError(f"the episode has {len(episode.traces)} traces: multi-agent verifiers envs are not served "
                         "(which agent's reward, and which calls, would be the policy's?)")
    (trace,) = episode.traces
    info: dict[str, Any] = {"rewards": {name: r.score for name, r in trace.rewards.items() if r is not None},
                            "metrics": trace.metrics, "stop_condition": trace.stop_condition}
    if trace.is_truncated:
        reason = TRUNCATIONS.get(trace.stop_condition, EpisodeReason.max_tokens)  # else a reply cut at max_tokens
        return EpisodeResult(trace.reward, EpisodeStatus.truncated, info, reason, num_turns=trace.num_turns)
    return EpisodeResult(trace.reward, info=info, num_turns=trace.num_turns)


def _failure(episode: vf.Episode) -> Exception:
    errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
    error = errors[-1] if errors else None
    message = f"{error.type}: {error.message}" if error else "verifiers episode not ok, and no error recorded"
    kind = error.type if error else ""
    if kind == "ProviderError" or kind == "InterceptionError":
        return openai.APIError(message, httpx.Request("POST", "verifiers-interception"), body=None)
    if kind == "SandboxError":
        return SandboxError(message)
    return RuntimeError(message)
