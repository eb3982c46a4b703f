"""`asyncrl eval` plays its split through the orchestrator (asyncrl_run/evaluate.py eval_section): a real
orchestrator with the evaluation's section, a real TITO gateway and engine, and TimedEnv services with a
held-out split. Every task of the split is played once, in the env's order, by the training lifecycle (its
deadlines, its retries); eval reads its figures from the groups that run recorded."""

import asyncio

from asyncrl.config import EnvServiceConfig
from asyncrl_run.evaluate import EvalSpec, _read_played, compose, eval_section
from asyncrl_run.launcher import orchestrator_section
from tests.orchestrator.conftest import journal, start_envs

EVAL_FIELDS = {"group_size", "max_groups", "task_split", "task_order", "staleness_limit", "max_unconsumed_groups",
               "dynamic_sampling", "episode_deadline"}
"""What eval_section changes of the training run's orchestrator section; every other field is the same."""


def test_the_eval_orchestrator_is_the_training_one_but_for_what_makes_it_an_evaluation():
    cfg = compose(["experiment=tiny_demo", "orchestrator.max_attempts=5", "orchestrator.request_grace_s=7",
                   "orchestrator.dynamic_sampling.enabled=true"])
    training = orchestrator_section(cfg, "redis://127.0.0.1:1/0", "http://gateway")
    spec = EvalSpec(env=EnvServiceConfig(name="arithmetic", target="envs.tasks.ArithmeticEnv"), split="eval",
                    samples=3, num_tasks=5)
    evaluation = eval_section(training, spec)
    changed = {name for name in vars(training) if getattr(training, name) != getattr(evaluation, name)}
    assert changed == EVAL_FIELDS
    assert (evaluation.max_attempts, evaluation.request_grace_s) == (5, 7.0)  # a retry rule reaches both
    assert (evaluation.group_size, evaluation.max_groups, evaluation.task_split, evaluation.task_order) == \
        (3, 5, "eval", "listed")
    assert not evaluation.dynamic_sampling.enabled and evaluation.episode_deadline.factor == 0


async def test_every_held_out_task_is_played_once_with_the_training_retries(gateway, orchestrators, tmp_path,
                                                                          redis_server, run_name):
    # member 0 of every group overruns its 2 s deadline: retried once (max_attempts 2), then given up
    orch = orchestrators("--gateway", gateway.url, "--group-size", "3", "--task-split", "eval", "--task-order",
                         "listed", "--max-attempts", "2", "--episode-timeout-s", "2",
                         "--episode-deadline", '{"factor": 0}', "--sampling", '{"max_new_tokens": 4}')
    services = start_envs(tmp_path, 1, "--capacity", "16", "--option", "sleep_s=0.1", "--option", "llm_turns=1",
                          "--option", "eval_tasks=4", "--option", "stalled_members=1", "--option", "group_size=3",
                          "--option", "stall_s=30", "--option", f"journal={tmp_path}", "--orchestrator", orch.url)
    try:
        status = orch.wait_done(4, timeout_s=120)
        await asyncio.sleep(1.0)  # a listed order ends: no fifth group starts
        assert orch.status()["groups_completed"] == 4 and status["failed"] == 4
    finally:
        for service in services:
            service.stop()
    played = await _read_played(redis_server.url, run_name, [f"e-{i:04d}" for i in range(4)])
    assert played.failed == {f"e-{i:04d}": 1 for i in range(4)}
    assert all(len(rewards) == 2 for rewards in played.rewards.values())  # members 1 and 2, in member order
    assert played.reasons == {"completed": 8, "deadline_exceeded": 4}
    assert played.agent["turns_mean"] == 1.0 and played.agent["tool_calls_mean"] == 0.0  # the scored members' turns
    starts = [e for e in journal(tmp_path) if e["event"] == "start"]
    assert {e["task_id"] for e in starts} == {f"e-{i:04d}" for i in range(4)}  # held-out tasks only
    assert sum(e["episode_id"].endswith("-m0-a2") for e in starts) == 4  # the stalled member: two attempts each
    assert not any(e["episode_id"].endswith("-a3") for e in starts)
