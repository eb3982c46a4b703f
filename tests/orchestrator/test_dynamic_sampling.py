"""Dynamic sampling (DAPO): complete groups whose rewards are all equal never reach the trainer.

Unit level (no processes but redis-server): the verdicts, the guard for rewards that never vary, the
ledger's discard (no record, samples deleted, the next record counts it), and the staleness budget
counting only usable groups. Process level: real orchestrators and TimedEnv services whose rewards
follow `reward_rule=mixed` (task t-i: i % 3 == 2 varies within a group, the rest are all 0 or all 1),
over real HTTP and Redis; the off switch (every group appended, as before), the on switch, sync mode
(staleness limit 0: every weight version gets exactly groups_per_step informative groups), the guard;
and the whole path through the real gateway and CPU engine to the trainer's GroupLoader, with no
sample left behind in Redis.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import numpy as np
import pytest

from asyncrl.config import DynamicSamplingConfig, OrchestratorConfig, TrainerConfig
from asyncrl.store import Store
from asyncrl.types import GroupRecord
from orchestrator.core import Orchestrator as Core
from orchestrator.counters import Counters
from orchestrator.dynamic_sampling import DynamicSampler, Verdict, judge, reward_std
from orchestrator.groups import Group, MemberState, TaskOrder
from orchestrator.ledger import Ledger
from orchestrator.runtime import METRICS_INTERVAL_S
from tests.orchestrator.conftest import TIMED_ENV, EnvProcess, group_records, start_envs
from tests.orchestrator.timed_env import informative
from trainer.data import GroupLoader

NUM_TASKS = 50  # TimedEnv's default task list: t-0000 .. t-0049


def finished(ordinal: int, rewards: list, given_up: int = 0, env: str = "timed") -> Group:
    """A complete group: members done with `rewards`, then `given_up` members given up."""
    group = Group.new(env, f"t-{ordinal:04d}", ordinal, group_size=len(rewards) + given_up, seed=0)
    for member, reward in zip(group.members, rewards):
        member.state, member.reward, member.sample_refs = MemberState.done, reward, [f"{ordinal}-{member.index}"]
    for member in group.members[len(rewards):]:
        member.state, member.sample_refs = MemberState.given_up, [f"{ordinal}-{member.index}"]
    return group


def metric(text: str, name: str, **labels: str) -> float:
    selector = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    found = re.search(rf"^{re.escape(name + selector)} (\S+)$", text, re.M)
    assert found, f"{name}{selector} not in metrics"
    return float(found.group(1))


# Unit level --------------------------------------------------------------------------------------
def test_verdicts_follow_the_trainer_group_rule():
    assert reward_std([0.1] * 3) == 0.0 and np.std([0.1] * 3) > 0  # float noise is not variance
    assert judge(finished(1, [1.0, 1.0, 1.0, 1.0])) is Verdict.uninformative
    assert judge(finished(1, [0.0, 1.0, 0.0, 0.0])) is Verdict.informative
    assert judge(finished(1, [0.5, 0.5, 0.5], given_up=1)) is Verdict.uninformative  # padding repeats equal rewards
    assert judge(finished(1, [0.0, 1.0, 1.0], given_up=1)) is Verdict.informative
    assert judge(finished(1, [0.0, 1.0], given_up=2)) is Verdict.unusable  # half done: the trainer drops it
    assert judge(finished(1, [0.5, 0.50001]), std_tol=1e-3) is Verdict.uninformative
    unknown = finished(1, [1.0, 1.0, 1.0])
    unknown.members[0].reward = None  # recovered after a restart from the gateway's finish reply
    assert judge(unknown) is Verdict.unknown


def test_the_guard_passes_uninformative_groups_after_max_filtered_batches_then_filters_again():
    sampler = DynamicSampler(DynamicSamplingConfig(enabled=True, max_filtered_batches=2), groups_per_step=2)
    streak, decisions = 0, []
    for ordinal in range(6):  # 4 = 2 batches of 2 filtered in a row, then uninformative groups pass
        _, filtered, streak = sampler.decide(finished(ordinal, [0.0, 0.0]), streak)
        decisions.append(filtered)
    assert decisions == [True] * 4 + [False] * 2 and streak == 4
    assert sampler.decide(finished(6, [0.0, 1.0]), streak) == (Verdict.informative, False, 0)  # resets the streak
    assert sampler.decide(finished(7, [0.0, 0.0]), 0)[1:] == (True, 1)  # and filtering starts again
    assert sampler.filtered_fraction == 5 / 8

    never = DynamicSampler(DynamicSamplingConfig(enabled=True, max_filtered_batches=0), groups_per_step=2)
    assert all(never.decide(finished(i, [1.0, 1.0]), i)[1] for i in range(100))
    off = DynamicSampler(DynamicSamplingConfig(enabled=False), groups_per_step=2)
    assert off.decide(finished(1, [1.0, 1.0]), 0) == (Verdict.uninformative, False, 0)


def test_filter_counters_survive_a_restart():
    counters = Counters(filter_streak=7)
    counters.by_env["timed"].update(groups=3, filtered=5, passed=1, unusable=2)
    restored = Counters.from_meta({k: str(v) for k, v in {**counters.to_meta(), "filtered_unreported": 4}.items()})
    assert restored.filter_streak == 7 and restored.by_env["timed"] == counters.by_env["timed"]
    assert restored.not_usable() == 7


async def test_a_restarted_orchestrator_restores_the_filter_counts_streak_and_outcomes(redis_server, run_name):
    """Through recovery.restore, not only Counters' meta round trip (restore used to drop the outcome counts)."""
    from orchestrator.ledger import Snapshot
    from orchestrator.recovery import restore

    before = Counters(ordinal=9, filter_streak=3)
    before.by_env["timed"].update(groups=4, filtered=5)
    before.outcomes["timed"]["completed"] = 8
    meta = {k: str(v) for k, v in {**before.to_meta(), "filtered_unreported": 2}.items()}
    cfg = OrchestratorConfig(sessions="endpoint", llm_url="http://127.0.0.1:9/v1", group_size=2,
                             dynamic_sampling=DynamicSamplingConfig(enabled=True))
    store = Store.connect(redis_server.url, run_name)
    orch = Core(cfg, store)
    try:
        await restore(orch, Snapshot(meta=meta))
        status = orch.status()
        assert (status.groups_completed, status.groups_filtered, status.filter_streak) == (4, 5, 3)
        assert status.outcomes == {"model": {"completed": 8}} and orch.ledger.filtered_unreported == 2
    finally:
        await orch.close()
        await store.close()


async def test_a_discarded_group_leaves_no_record_and_no_samples(redis_server, run_name):
    store = Store.connect(redis_server.url, run_name)
    ledger = Ledger(store, lambda: {"ordinal": 3})
    writer = asyncio.create_task(ledger.write_forever())
    try:
        groups = [finished(1, [1.0, 1.0]), finished(2, [0.0, 0.0]), finished(3, [0.0, 1.0])]
        for group in groups:  # their samples, as the gateway appends them
            group_refs = [await store.redis.xadd(store.key("samples"), {"data": b"x"}) for _ in group.members]
            for member, ref in zip(group.members, group_refs):
                member.sample_refs = [ref.decode()]
            ledger.touch(group)
        await ledger.sync()
        ledger.discard(groups[0])
        await ledger.sync()
        assert ledger.filtered_unreported == 1
        ledger.discard(groups[1])
        ledger.complete(groups[2])
        await ledger.sync()
        records = [GroupRecord.decode(f) for _, f in await store.redis.xrange(store.key("groups"))]
        assert [(r.group_id, r.filtered_before) for r in records] == [(groups[2].group_id, 2)]
        left = [i.decode() for i, _ in await store.redis.xrange(store.key("samples"))]
        assert left == records[0].sample_refs  # the filtered groups' samples are gone
        snapshot = await ledger.load()
        assert snapshot.groups == [] and snapshot.meta["filtered_unreported"] == "0"
    finally:
        writer.cancel()
        await store.close()


@pytest.mark.parametrize("enabled", [True, False])
async def test_the_staleness_budget_counts_only_groups_that_reach_the_trainer_usable(enabled, redis_server, run_name):
    """Sync mode (limit 0, 2 groups per version): a filtered or an unusable group frees its place at once;
    without dynamic sampling every started group counts, as before."""
    cfg = OrchestratorConfig(sessions="endpoint", llm_url="http://127.0.0.1:9/v1", group_size=2, staleness_limit=0,
                             groups_per_step=2, max_unconsumed_groups=0,
                             dynamic_sampling=DynamicSamplingConfig(enabled=enabled))
    store = Store.connect(redis_server.url, run_name)
    orch = Core(cfg, store)
    try:
        orch.backpressure.served_version = 0

        def start(rewards: list, given_up: int = 0) -> Group:
            orch.counters.ordinal += 1
            group = finished(orch.counters.ordinal, rewards, given_up)
            orch.add_group(group)
            return group

        first, second = start([0.0, 1.0]), start([1.0, 1.0])
        assert orch.backpressure.reasons() == ["staleness"]  # (0 + 0 + 1) x 2 started
        orch.complete_group(first)
        orch.complete_group(second)  # equal rewards
        assert orch.backpressure.reasons() == ([] if enabled else ["staleness"])
        assert orch.status().groups_filtered == int(enabled) and orch.status().groups_completed == 2 - enabled
        if enabled:
            third = start([], given_up=2)  # every member given up: the trainer's group rule will drop it
            assert orch.backpressure.reasons() == ["staleness"]
            orch.complete_group(third)
            assert orch.backpressure.reasons() == [] and orch.status().groups_unusable == 1
            orch.complete_group(start([1.0, 0.0]))
            assert orch.backpressure.reasons() == ["staleness"]  # two usable groups: the version's batch
            assert orch.counters.ordinal == 4 and orch._budgeted_groups() == 2
    finally:
        await orch.close()
        await store.close()


async def test_the_command_line_sets_it_and_groups_of_one_are_refused():
    from orchestrator.server import parse_args

    cfg, _ = parse_args(["--redis-url", "redis://127.0.0.1:1", "--llm-url", "http://127.0.0.1:2/v1",
                         "--dynamic-sampling", "--dynamic-sampling-max-filtered-batches", "3",
                         "--dynamic-sampling-std-tol", "0.01"])
    assert cfg.dynamic_sampling == DynamicSamplingConfig(enabled=True, std_tol=0.01, max_filtered_batches=3)
    assert parse_args(["--redis-url", "redis://127.0.0.1:1", "--llm-url", "http://127.0.0.1:2/v1"])[0] \
        .dynamic_sampling == DynamicSamplingConfig()
    with pytest.raises(ValueError, match="group_size >= 2"):  # a group of one always has equal rewards
        Core(OrchestratorConfig(sessions="endpoint", llm_url="http://x/v1", group_size=1,
                                dynamic_sampling=DynamicSamplingConfig(enabled=True)), Store.connect("redis://x", "x"))


def test_the_launcher_passes_dynamic_sampling_to_the_orchestrator(tmp_path):
    from hydra import compose, initialize_config_dir

    from asyncrl.config import register_configs, to_dataclass
    from asyncrl_run.launcher import orchestrator_section, write_config
    from orchestrator.server import parse_args
    from tests.services import ROOT

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        off = to_dataclass(compose("config", overrides=["experiment=tiny_demo"]))
        run = to_dataclass(compose("config", overrides=["experiment=tiny_demo", "mode=sync",
                                                        "orchestrator.dynamic_sampling.enabled=true",
                                                        "orchestrator.dynamic_sampling.std_tol=0.05",
                                                        "orchestrator.dynamic_sampling.max_filtered_batches=4"]))
    assert orchestrator_section(off, "redis://127.0.0.1:1", "http://127.0.0.1:2").dynamic_sampling \
        == DynamicSamplingConfig()  # off: as before
    cfg, _ = parse_args(write_config(tmp_path, "orchestrator",
                                     orchestrator_section(run, "redis://127.0.0.1:1", "http://127.0.0.1:2")))
    assert cfg.dynamic_sampling == DynamicSamplingConfig(enabled=True, std_tol=0.05, max_filtered_batches=4)
    assert (cfg.staleness_limit, cfg.groups_per_step) == (0, run.trainer.groups_per_step)  # sync: one batch a version


# Process level -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_envs(tmp_path_factory):
    """TimedEnv services scoring by `reward_rule`: mixed (a third of the tasks vary) and zero (never vary)."""
    workdir = tmp_path_factory.mktemp("dynamic-sampling")
    mixed, zero = [EnvProcess(TIMED_ENV, workdir, "--capacity", "8", "--option", "sleep_s=0.05", "--option",
                              f"reward_rule={rule}", "--log-level", "WARNING").spawn() for rule in ("mixed", "zero")]
    services = {"mixed": mixed.wait_ready(), "zero": zero.wait_ready()}
    yield services
    for service in services.values():
        service.stop()


def first_tasks(count: int, seed: int = 0) -> list[str]:
    """The tasks of the first `count` groups of the one env (its seeded task order)."""
    order = TaskOrder("timed", [f"t-{i:04d}" for i in range(NUM_TASKS)], seed)
    return [order[i] for i in range(count)]


async def test_off_every_group_is_appended_as_before(orchestrators, reward_envs, redis_server, run_name):
    orch = orchestrators("--group-size", "2", "--max-groups", "12")
    orch.register(reward_envs["mixed"].url)
    status = orch.wait_done(12)
    records = await group_records(redis_server.url, run_name)
    assert sorted(r.task_id for r in records) == sorted(first_tasks(12))
    assert not all(informative(r.task_id) for r in records)  # groups with equal rewards reach the trainer
    assert (status["failed"], status["groups_filtered"], status["groups_passed"], status["filter_streak"]) == \
        (0, 0, 0, 0)
    assert {r.filtered_before for r in records} == {0}


async def test_on_only_groups_with_reward_variance_are_appended_and_counted(orchestrators, reward_envs, redis_server,
                                                                          run_name):
    orch = orchestrators("--group-size", "2", "--max-groups", "12", "--dynamic-sampling")
    orch.register(reward_envs["mixed"].url)
    tasks = first_tasks(12)
    expected_filtered = sum(not informative(t) for t in tasks)
    status = orch.wait(lambda s: s["groups_recorded"] + s["groups_filtered"] == 12 and s["groups_open"] == 0
                       and s["in_flight"] == 0, what="12 groups recorded or filtered")
    records = await group_records(redis_server.url, run_name)
    assert sorted(r.task_id for r in records) == sorted(t for t in tasks if informative(t))
    assert status["groups_filtered"] == status["by_env"]["timed"]["groups_filtered"] == expected_filtered > 0
    assert status["groups_completed"] == 12 - expected_filtered and status["groups_passed"] == 0 == status["failed"]
    metrics = orch.http.get("/metrics").text
    assert metric(metrics, "asyncrl_orchestrator_groups_filtered_total", env="timed") == expected_filtered
    assert metric(metrics, "asyncrl_orchestrator_filtered_fraction") == pytest.approx(expected_filtered / 12)
    store = Store.connect(redis_server.url, run_name)
    try:  # the records carry the filtered groups before them; the rest waits in orch:meta for the next one
        async def reported() -> int:  # the ledger writes in batches: the last one may land after the status
            records = await group_records(redis_server.url, run_name)
            unreported = int(await store.redis.hget(store.key("orch:meta"), "filtered_unreported") or 0)
            return sum(r.filtered_before for r in records) + unreported

        deadline = time.monotonic() + 10
        while await reported() < expected_filtered and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await reported() == expected_filtered
        # the orchestrator's metrics record (every METRICS_INTERVAL_S) says it too, for watch and TensorBoard;
        # records written while the groups were still running show fewer, so wait for one written after
        record, deadline = None, time.monotonic() + 3 * METRICS_INTERVAL_S + 5
        while time.monotonic() < deadline:
            records = [v for _, source, v in await store.read_metrics() if source == "orchestrator"]
            record = records[-1] if records else None
            if record is not None and record["groups_filtered"] == expected_filtered:
                break
            await asyncio.sleep(0.1)
        assert record is not None and record["groups_filtered"] == expected_filtered, record
        assert record["filtered_fraction"] == pytest.approx(expected_filtered / 12)
    finally:
        await store.close()


async def test_sync_mode_fills_every_version_with_exactly_its_informative_groups(orchestrators, reward_envs,
                                                                              redis_server, run_name):
    """Staleness limit 0, 2 groups per version: the orchestrator replaces every filtered group, holds at
    exactly 2 informative groups per version, and starts the next batch only after the push. If filtered
    groups used up the budget, the first hold would have fewer than 2 groups and the trainer would wait
    forever."""
    orch = orchestrators("--group-size", "2", "--staleness-limit", "0", "--groups-per-step", "2", "--dynamic-sampling")
    orch.register(reward_envs["mixed"].url)
    store = Store.connect(redis_server.url, run_name)
    try:
        for version in range(4):
            held = orch.wait(lambda s: s["weight_version"] == version and "staleness" in s["pause_reasons"]
                             and s["groups_open"] == 0 and s["in_flight"] == 0
                             and s["groups_recorded"] == s["groups_completed"], what=f"the batch of version {version}")
            assert held["groups_completed"] == 2 * (version + 1)  # never more: the step is exactly on-policy
            batch = await store.read_groups("trainer-0", count=10)
            assert len(batch) == 2 and all(informative(g.record.task_id) for g in batch)
            await store.ack_groups(batch)
            await store.record_served_version(version + 1, "disk")  # the trainer's push
        assert held["groups_filtered"] > 0
    finally:
        await store.close()


@pytest.mark.parametrize("batches", [1, 0])
def test_rewards_that_never_vary_warn_and_pass_after_the_guard(batches, orchestrators, reward_envs):
    orch = orchestrators("--group-size", "2", "--groups-per-step", "2", "--max-groups", "8", "--dynamic-sampling",
                         "--dynamic-sampling-max-filtered-batches", str(batches))
    orch.register(reward_envs["zero"].url)
    status = orch.wait(lambda s: s["groups_recorded"] + s["groups_filtered"] == 8 and s["groups_open"] == 0,
                       what="8 groups recorded or filtered")
    log = orch.proc.log()
    if batches:  # 2 filtered (one batch), then every uninformative group passes: the trainer still steps
        assert (status["groups_filtered"], status["groups_passed"], status["groups_recorded"]) == (2, 6, 6)
        assert status["filter_streak"] == 2 and "delivering uninformative groups" in log
    else:  # never passes: nothing reaches the trainer, and the log says why
        assert (status["groups_filtered"], status["groups_recorded"]) == (8, 0)
        assert status["filtered_fraction"] == 1.0 and "they never pass" in log


# Through the gateway to the trainer ----------------------------------------------------------------
async def test_the_trainer_reads_only_groups_with_reward_variance_and_no_sample_leaks(gateway, orchestrators, tmp_path,
                                                                                      redis_server, run_name):
    """Real gateway and CPU engine record every member's trajectory; the orchestrator (staleness limit 1,
    2 groups per version, unconsumed-groups limit 6) filters the equal-reward groups; a trainer reads
    4 steps through GroupLoader and pushes after each. Then the orchestrator comes to rest at its
    staleness hold: every sample left in Redis belongs to an appended group."""
    group_size, per_step, steps = 4, 2, 4
    orch = orchestrators("--gateway", gateway.url, "--group-size", str(group_size), "--staleness-limit", "1",
                         "--groups-per-step", str(per_step), "--max-unconsumed-groups", "6", "--dynamic-sampling",
                         "--sampling", '{"max_new_tokens": 4}')
    (env,) = start_envs(tmp_path, 1, "--capacity", "8", "--option", "llm_turns=1", "--option", "sleep_s=0.05",
                        "--option", "reward_rule=mixed", "--log-level", "WARNING")
    orch.register(env.url)
    store = Store.connect(redis_server.url, run_name)
    loader = GroupLoader(store, "trainer-0", TrainerConfig(groups_per_step=per_step))
    filtered_in_steps = 0
    try:
        for step in range(steps):
            batch = await asyncio.wait_for(loader.next_step(step), timeout=120)
            assert (batch.stats.groups_kept, batch.stats.groups_dropped, len(batch.groups)) == (per_step, 0, per_step)
            for group in batch.groups:
                rewards = [s.reward for s in group.samples]
                assert len(rewards) == group_size and np.std(rewards) > 0 and informative(group.record.task_id)
            filtered_in_steps += int(batch.stats.metrics()["filter_groups_filtered"])
            await loader.commit(batch)
            status = orch.status()  # the budget: usable groups delivered or open <= (v + 1 + 1) x 2
            assert status["groups_completed"] - status["groups_unusable"] + status["groups_open"] \
                <= (step + 2) * per_step
            await store.record_served_version(step + 1, "disk")
        rest = orch.wait(lambda s: "staleness" in s["pause_reasons"] and s["groups_open"] == 0 and s["in_flight"] == 0
                         and s["settling"] == 0 and s["groups_recorded"] == s["groups_completed"], timeout_s=120,
                         what="the staleness hold after the last push")
        for _ in range(50):  # the last discards are flushed with the ledger's next batch
            if not await store.redis.hlen(store.key("orch:groups")):
                break
            await asyncio.sleep(0.1)
        assert rest["groups_completed"] == (steps + 2) * per_step and rest["groups_filtered"] > 0
        records = await group_records(redis_server.url, run_name)
        kept = {ref for r in records for ref in r.sample_refs}
        left = {i.decode() for i, _ in await store.redis.xrange(store.key("samples"))}
        assert left == kept and len(kept) == group_size * rest["groups_completed"]
        written = metric(httpx.get(f"{gateway.url}/metrics").text, "asyncrl_gateway_samples_written_total")
        assert written == group_size * (rest["groups_completed"] + rest["groups_filtered"])  # and deleted since
        unreported = int(await store.redis.hget(store.key("orch:meta"), "filtered_unreported") or 0)
        assert sum(r.filtered_before for r in records) + unreported == rest["groups_filtered"]
        assert 0 < filtered_in_steps <= rest["groups_filtered"]
        assert metric(orch.http.get("/metrics").text, "asyncrl_orchestrator_groups_filtered_total", env="timed") \
            == rest["groups_filtered"]
    finally:
        await store.close()
        env.stop()
