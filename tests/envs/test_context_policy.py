"""Context policies on their own (envs/sdk/context.py) and as an env's config makes them: through the SDK's
runner, and from the run config to the service's command line. The token bounds, segments and prefix
cache through a real gateway are tests/gateway/test_context_management.py."""

from __future__ import annotations

import itertools

import pytest

from asyncrl.protocols.env_service import EpisodeRequest, LLMEndpoint
from envs.sdk import AgentLoop, Environment, EpisodeResult, Tool, schema
from envs.sdk.context import ContextConfig, ContextView, ContextLog, DiscardAll, KeepRecent, for_model, rounds
from envs.sdk.metrics import ServiceMetrics
from envs.sdk.runner import EpisodeRunner
from envs.serve import context_config, parse_args as parse_service_args
from tests.envs.scripted_llm import call
from tests.test_env_config import env_service_args, load

IDS = itertools.count()
TASK = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]


def conversation(n: int) -> list[dict]:
    messages = list(TASK)
    for i in range(n):
        messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function",
                      "function": {"name": "bash", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": f"output {i} " * 20}]
    return messages


def view(last_tokens=None, at=0) -> ContextView:
    return ContextView(last_context_tokens=last_tokens, messages_at_last_call=at, log=ContextLog())


def test_keep_recent_k_folds_observations_older_than_the_last_k_rounds_in_batches():
    messages = conversation(6)
    v = view()
    assert KeepRecent(k=3, fold_every=4).edit(messages, v) is None  # 3 old rounds: not yet a batch of 4
    folded = KeepRecent(k=3, fold_every=3).edit(messages, v)
    contents = [folded[end - 1]["content"] for _, end in rounds(folded)]
    assert contents == ["[tool output folded: 180 characters]"] * 3 + [f"output {i} " * 20 for i in range(3, 6)]
    assert v.log.folds == 3 and messages == conversation(6)  # the input is not mutated
    assert KeepRecent(k=3, fold_every=3).edit(folded, v) is None  # already folded: nothing to do
    assert "_asyncrl_context" not in str(for_model(folded))  # the marks never reach the model


def test_discard_all_keeps_the_task_a_note_and_the_latest_round_within_the_budget():
    messages = conversation(8)
    policy = DiscardAll(max_tokens=1200, keep_rounds=1)
    assert policy.edit(messages, view(last_tokens=100, at=len(messages))) is None  # exact size known, under T
    fresh = policy.edit(messages, view(last_tokens=1190, at=len(messages) - 1))  # + the last observation > T
    assert fresh[:2] == TASK and "the 7 earlier rounds" in fresh[2]["content"] and fresh[3:] == messages[-2:]
    again = policy.edit(fresh + conversation(3)[2:], view())  # a second discard: one note, not two
    assert again[:2] == TASK and sum("earlier rounds" in str(m) for m in again) == 1
    tight = DiscardAll(max_tokens=50, keep_rounds=1).edit(messages, view())  # the latest round does not fit
    assert [m["role"] for m in tight] == ["system", "user", "user"]


def test_wrong_context_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="keep_recent_k must be >= 0"):
        ContextConfig(keep_recent_k=-1)
    with pytest.raises(ValueError, match="fold_every must be >= 1"):
        ContextConfig(keep_recent_k=2, fold_every=0)
    with pytest.raises(SystemExit):
        parse_service_args(["--env", "envs.tasks.ArithmeticEnv", "--context-option", "keep_recnt_k=3"])


def test_context_options_reach_the_services_context_config(tmp_path):
    env = load("experiment=tiny_demo", "+envs.services.sh={target: envs.terminal.TerminalEnv, "
               "context: {keep_recent_k: 5, discard_at_tokens: 32768, fold_every: 2}}").envs.services["sh"]
    context = context_config(parse_service_args(env_service_args(tmp_path, env, None)).section)
    assert (context.keep_recent_k, context.discard_at_tokens, context.fold_every) == (5, 32768, 2)


class KeepLastToolMessage:
    """A user's policy (ContextConfig.policy): only the task and the latest `keep` messages survive."""

    def __init__(self, keep: int):
        self.keep = keep

    def edit(self, messages, view):
        if len(messages) <= len(TASK) + self.keep:
            return None
        return messages[:len(TASK)] + messages[-self.keep:]


class LongEnv(Environment):
    """An env whose agent makes tool calls until the model stops (here: the turn limit)."""

    name, domain = "long", "test"

    async def list_tasks(self):
        return ["t"]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        async def bash(command: str) -> str:
            return f"ran {command}"

        tool = Tool("bash", "Run a command.", schema({"command": "the command line"}), bash)
        outcome = await AgentLoop(llm, ctx, [tool]).run([dict(m) for m in TASK])
        return EpisodeResult(0.0, status=outcome.status, reason=outcome.reason)


async def test_a_users_policy_runs_in_the_agent_loop_and_its_edits_are_reported(scripted_llm):
    turns = 42
    metrics = ServiceMetrics("long", "none")
    config = ContextConfig(policy=f"{__name__}:KeepLastToolMessage", policy_options={"keep": 4})
    runner = EpisodeRunner(LongEnv(), capacity=1, sandboxes=None, metrics=metrics, context=config)
    await runner.load_tasks()
    url, script = scripted_llm.script(*[call("bash", command=f"ls {i}") for i in range(turns)])
    response = await runner.run(EpisodeRequest(episode_id=f"e-{next(IDS)}", task_id="t", max_turns=turns,
                                               llm=LLMEndpoint(base_url=url, model="scripted")))
    assert (response.status.value, response.reason.value, response.num_turns) == ("truncated", "max_turns", turns)
    assert [len(r["messages"]) for r in script.requests] == [2, 4] + [6] * (turns - 2)
    assert script.requests[-1]["messages"][-1]["content"] == f"ran ls {turns - 2}"
    assert response.info["context"] == {"calls": turns, "folds": 0, "discards": 0, "edits": turns - 3,
                                        "max_prompt_tokens": 1, "mean_prompt_tokens": 1.0, "cached_tokens": 0}
    text = metrics.render().decode()
    assert 'asyncrl_env_context_edits_total{env="long"} 39.0' in text
    assert 'asyncrl_env_context_tokens_count{env="long"} 42.0' in text
