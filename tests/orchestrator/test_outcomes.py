"""Infrastructure failures are not trained as model failures, end to end: env services whose episodes
overrun their deadline for some members of every group, the orchestrator (retry, give up), the real
gateway and CPU engine recording trajectories into Redis, and the trainer's group rule reading them.
Plus the orchestrator's per-env, per-reason outcome counters on their own."""

import re
from collections import Counter, defaultdict

from asyncrl.config import TrainerConfig
from orchestrator.run_record import orchestrator_record
from asyncrl.store import Store
from orchestrator.counters import Counters
from orchestrator.outcomes import SERVICE_ERROR, by_class
from tests.orchestrator.conftest import TIMED_ENV, EnvProcess, journal
from trainer.advantages import FilterStats, score_group

GROUP_SIZE = 4
DEADLINE_S = 5.0
"""The orchestrator's episode_timeout_s: far above a one-turn episode of the tiny engine, far below stall_s."""


def test_counters_keep_outcomes_per_env_and_reason_across_a_restart():
    counters = Counters()
    counters.outcomes["swe"]["completed"] += 3
    counters.outcomes["swe"]["deadline_exceeded"] += 2
    counters.outcomes["team:search"][SERVICE_ERROR] += 1  # env names may hold a colon
    counters.outcomes["team:search"]["env_error"] += 1
    restored = Counters.from_meta({k: str(v) for k, v in counters.to_meta().items()})
    assert restored.outcomes == counters.outcomes
    assert by_class(restored.outcomes["swe"]) == {"model": {"completed": 3}, "infrastructure": {"deadline_exceeded": 2}}
    assert by_class(restored.outcomes["team:search"]) == {"environment": {"env_error": 1},
                                                          "infrastructure": {SERVICE_ERROR: 1}}
    assert restored.total_outcomes() == {"completed": 3, "deadline_exceeded": 2, SERVICE_ERROR: 1, "env_error": 1}


def metric(text: str, name: str, **labels: str) -> float:
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{re.escape(name)}{{{re.escape(selector)}}} (\S+)$", text, re.M)
    assert found, f"{name}{{{selector}}} not in metrics"
    return float(found.group(1))


async def test_deadline_cut_members_are_excluded_and_the_group_rule_pads_or_drops(gateway, orchestrators, tmp_path,
                                                                                 redis_server, run_name):
    orch = orchestrators("--gateway", gateway.url, "--group-size", str(GROUP_SIZE), "--max-groups", "2",
                         "--max-attempts", "2", "--episode-timeout-s", str(DEADLINE_S), "--request-grace-s", "10",
                         "--sampling", '{"max_new_tokens": 8}')
    stalled = {"slow-1": 1, "slow-3": 3}  # members per group that sleep past the deadline
    services = {name: EnvProcess(TIMED_ENV, tmp_path, "--name", name, "--option", "llm_turns=1", "--option",
                                 "sleep_s=0.2", "--option", f"stalled_members={count}", "--option",
                                 f"group_size={GROUP_SIZE}", "--option", f"journal={tmp_path}").spawn()
                for name, count in stalled.items()}
    for name, service in services.items():  # both before the first group: capacity one group each, a group
        service.wait_ready()                # takes two deadlines, so each env gets one of the two groups
    for name, service in services.items():
        orch.register(service.url, name=name, capacity=GROUP_SIZE)
    status = orch.wait_done(2, timeout_s=180)
    env_metrics = {name: service.get("/metrics").text for name, service in services.items()}
    orch_metrics = orch.http.get("/metrics").text
    for service in services.values():
        service.stop()

    # the orchestrator: every cut attempt is a failure (retried once, then given up), never a result
    assert (status["completed"], status["failed"], status["retried"]) == (4, 4, 4)
    for name, count in stalled.items():
        expected = {"model": {"completed": GROUP_SIZE - count}, "infrastructure": {"deadline_exceeded": 2 * count}}
        assert status["by_env"][name]["outcomes"] == expected
        assert metric(orch_metrics, "asyncrl_orchestrator_outcomes_total", env=name, outcome="infrastructure",
                      reason="deadline_exceeded") == 2 * count
        assert metric(env_metrics[name], "asyncrl_env_outcomes_total", env=name, outcome="infrastructure",
                      reason="deadline_exceeded") == 2 * count
        assert metric(env_metrics[name], "asyncrl_env_episodes_total", env=name, status="truncated") == 0
        assert orchestrator_record(status)[f"env/{name}/outcome_infrastructure"] == 2 * count
    assert status["outcomes"] == {"model": {"completed": 4}, "infrastructure": {"deadline_exceeded": 8}}
    attempts = defaultdict(list)
    for entry in journal(tmp_path):
        if entry["event"] == "start":
            member, attempt = entry["episode_id"].rsplit("-", 1)
            attempts[member].append(int(attempt[1:]))
    assert sorted(map(sorted, attempts.values())) == [[1]] * 4 + [[1, 2]] * 4  # the cut members ran twice

    # Redis: each cut member's final session is recorded as failed with its class and reason, none as truncated
    store = Store.connect(redis_server.url, run_name)
    try:
        groups = await store.read_groups("trainer-0", 10)
    finally:
        await store.close()
    assert sorted(g.record.env for g in groups) == ["slow-1", "slow-3"]
    for group in groups:
        samples = group.samples
        assert len(samples) == GROUP_SIZE and all(s.loss_mask.sum() >= 1 for s in samples)  # every member generated
        failed = [s for s in samples if s.status == "failed"]
        assert len(failed) == stalled[group.record.env]
        assert {(s.outcome_class, s.outcome_reason, s.reward, s.metadata["info"]["attempts"]) for s in failed} == {
            ("infrastructure", "deadline_exceeded", 0.0, 2)}
        assert {(s.status, s.outcome_class, s.outcome_reason) for s in samples if s.status != "failed"} == {
            ("completed", "model", "completed")}

    # the trainer: the cut members are not trained; 1 of 4 cut -> padded to 4, 3 of 4 cut -> dropped
    config = TrainerConfig()
    scored = {g.record.env: score_group(g, 0, config.staleness_tau, config.advantage) for g in groups}
    padded, dropped = scored["slow-1"], scored["slow-3"]
    assert len(padded.samples) == GROUP_SIZE and {s.sample.status for s in padded.samples} == {"completed"}
    assert sum(s.padding_copy for s in padded.samples) == 1
    assert dropped.samples == []
    stats = sum((s.stats for s in scored.values()), FilterStats())
    assert (stats.groups_kept, stats.groups_padded, stats.groups_dropped) == (1, 1, 1)
    assert (stats.failed, stats.failed_infrastructure, stats.failed_environment) == (4, 4, 0)
    assert stats.failed_by_reason == Counter({("slow-1", "deadline_exceeded"): 1, ("slow-3", "deadline_exceeded"): 3})
    metrics = stats.metrics()
    assert metrics["filter_failed/slow-3/deadline_exceeded"] == 3 and metrics["filter_failed_infrastructure"] == 4
