"""An orchestrator process dispatching GRPO groups to real env services (the shared TimedEnv pool):
group dispatch, capacities, rate limits, weights, pause/resume, backpressure. Every group ends up in
the run's `groups` stream exactly once."""

import time
from collections import Counter, defaultdict

import pytest

from asyncrl.store import Store
from tests.orchestrator.conftest import group_records, journal, max_concurrency, start_envs, starts_by_episode


def by_group(entries: list[dict]) -> dict[str, list[dict]]:
    groups = defaultdict(list)
    for e in starts_by_episode(entries).values():
        groups[e["episode_id"].split("-m")[0]].append(e)
    return groups


async def test_groups_are_dispatched_together_and_recorded_once(orchestrators, env_pool, journal_dir, redis_server,
                                                                run_name):
    orch = orchestrators("--group-size", "4", "--max-groups", "6", "--seed", "7")
    for service in env_pool[:2]:
        orch.register(service.url, capacity=8)
    status = orch.wait_done(6)
    assert (status["completed"], status["failed"], status["by_env"]["timed"]["groups_completed"]) == (24, 0, 6)

    records = await group_records(redis_server.url, run_name)
    assert sorted(r.group_id for r in records) == [f"g{i:07d}-timed" for i in range(1, 7)]
    assert all(r.group_size == 4 and r.env == "timed" and r.sample_refs == [] for r in records)
    groups = by_group(journal(journal_dir, run_name))
    assert set(groups) == {r.group_id for r in records}
    for record in records:
        members = groups[record.group_id]
        assert len(members) == 4 and {m["task_id"] for m in members} == {record.task_id}
        assert len({m["seed"] for m in members}) == 4  # one task, four different episode seeds
    assert len({e["pid"] for e in starts_by_episode(journal(journal_dir, run_name)).values()}) == 2
    metrics = orch.http.get("/metrics").text
    assert 'asyncrl_orchestrator_episodes_total{env="timed",status="completed"} 24.0' in metrics
    assert 'asyncrl_orchestrator_groups_completed_total{env="timed"} 6.0' in metrics
    # stopping writes a last metrics record with the final totals: this run is shorter than the records'
    # interval, so without it the stream would end with the record from start, before any env came
    assert orch.stop() == 0, orch.proc.log()
    store = Store.connect(redis_server.url, run_name)
    try:
        last = [values for _, source, values in await store.read_metrics() if source == "orchestrator"][-1]
    finally:
        await store.close()
    assert (last["completed"], last["env/timed/completed"], last["env/timed/groups_completed"]) == (24, 24, 6)


async def test_task_order_follows_the_seed(orchestrators, env_pool, redis_server, run_name):
    orch = orchestrators("--group-size", "2", "--max-groups", "8", "--seed", "7", "--max-in-flight", "2")
    orch.register(env_pool[0].url)
    orch.wait_done(8)
    from orchestrator.groups import TaskOrder

    order = TaskOrder("timed", [f"t-{i:04d}" for i in range(50)], seed=7)
    records = sorted(await group_records(redis_server.url, run_name), key=lambda r: r.group_id)
    assert [r.task_id for r in records] == [order[i] for i in range(8)]


def test_registered_capacity_bounds_episodes_per_service(orchestrators, env_pool, journal_dir, run_name):
    orch = orchestrators("--group-size", "2", "--max-groups", "8")
    orch.register(env_pool[0].url, capacity=4)
    orch.wait_done(8)
    entries = journal(journal_dir, run_name)
    assert max_concurrency(entries) == 4  # reached, never exceeded (the service itself would take 8)


def test_rate_limit_spaces_episodes(orchestrators, env_pool, journal_dir, run_name):
    orch = orchestrators("--group-size", "2", "--max-groups", "8", "--rate-limits", "timed=8")
    orch.register(env_pool[0].url)
    orch.register(env_pool[1].url)
    orch.wait_done(8)
    starts = [e["at"] for e in journal(journal_dir, run_name) if e["event"] == "start"]
    assert len(starts) == 16
    # a burst of 8 tokens, then 8 more episodes at 8/s: at least ~1 s; without the limit it is ~0 s
    assert starts[-1] - starts[0] >= 0.85
    for first in starts:
        assert sum(first <= t < first + 0.5 for t in starts) <= 8 + 4 + 1


async def test_weights_set_the_ratio_between_envs(orchestrators, env_pool, redis_server, run_name):
    orch = orchestrators("--group-size", "2", "--max-in-flight", "6", "--max-groups", "40",
                         "--weights", "swe=2,terminal=1,search=1")
    for service, (name, domain) in zip(env_pool[:3], [("swe-like", "swe"), ("terminal-like", "terminal"),
                                                       ("search-like", "search")]):
        orch.register(service.url, name=name, domain=domain)
    orch.wait_done(40)
    started = Counter(r.env for r in await group_records(redis_server.url, run_name))
    assert sum(started.values()) == 40
    # 20:10:10 expected; the first groups can go out before every env's task list is loaded
    assert started["swe-like"] == pytest.approx(20, abs=3)
    assert started["terminal-like"] == pytest.approx(10, abs=3) and started["search-like"] == pytest.approx(10, abs=3)


def test_pause_stops_dispatch_and_resume_restarts_it(orchestrators, env_pool):
    orch = orchestrators("--group-size", "2", "--max-in-flight", "4")
    orch.register(env_pool[0].url)
    orch.wait(lambda s: s["completed"] >= 4, what="first episodes")
    assert orch.http.post("/v1/pause").json() == {"paused": True, "pause_reasons": ["operator"]}
    paused = orch.wait(lambda s: s["in_flight"] == 0 and s["settling"] == 0, what="running episodes to finish")
    assert paused["paused"] and orch.status()["completed"] == paused["completed"]
    import time

    time.sleep(1.0)
    assert orch.status()["completed"] == paused["completed"]
    assert orch.http.post("/v1/resume").json() == {"paused": False, "pause_reasons": []}
    orch.wait(lambda s: s["completed"] >= paused["completed"] + 4, what="dispatch after resume")


async def test_unconsumed_groups_hold_new_groups_until_the_trainer_reads(orchestrators, env_pool, redis_server,
                                                                       run_name):
    orch = orchestrators("--group-size", "2", "--max-unconsumed-groups", "3")
    orch.register(env_pool[0].url)
    held = orch.wait(lambda s: "unconsumed_groups" in s["pause_reasons"] and s["groups_open"] == 0
                     and s["groups_recorded"] == s["groups_completed"], what="backpressure")
    assert held["groups_completed"] == 3  # open groups count towards the limit: no overshoot
    store = Store.connect(redis_server.url, run_name)
    try:
        taken = await store.read_groups("trainer-0", count=held["groups_completed"])
        await store.ack_groups(taken)
        orch.wait(lambda s: s["groups_completed"] > held["groups_completed"], what="dispatch after consumption")
    finally:
        await store.close()


async def test_an_env_whose_episodes_hang_holds_up_only_its_own_new_groups(orchestrators, env_pool, redis_server,
                                                                          run_name, tmp_path):
    """The hung env's open groups count against the healthy env only up to its share of the limit (2 of 4
    here), so the healthy env's groups keep flowing while the trainer reads them (it stopped every env)."""
    (hang,) = start_envs(tmp_path, 1, "--capacity", "64", "--option", "sleep_s=1000", "--log-level", "WARNING")
    orch = orchestrators("--group-size", "2", "--max-unconsumed-groups", "4", "--max-in-flight", "16")
    store = Store.connect(redis_server.url, run_name)
    try:
        orch.register(hang.url, name="hang", capacity=64)
        # alone, the hung env's open groups reach the whole limit: under the old run-wide count every env
        # was then held for good
        stuck = orch.wait(lambda s: s["by_env"]["hang"]["groups_open"] == 4 and s["pause_reasons"], what="hung groups")
        assert stuck["pause_reasons"] == ["unconsumed_groups"]
        orch.register(env_pool[0].url, capacity=8)
        trained = 0
        while trained < 16:  # the trainer reads and acknowledges what completes: the healthy env's groups
            taken = await store.read_groups("trainer-0", count=4, block_ms=30_000)
            assert taken, orch.status()
            assert all(g.record.env == "timed" for g in taken)
            await store.ack_groups(taken)
            trained += len(taken)
        status = orch.status()  # the healthy env may be at its own share now and then: held too, for a moment
        assert status["by_env"]["hang"]["completed"] == 0 and status["by_env"]["hang"]["held"] == ["unconsumed_groups"]
    finally:
        await store.close()
        hang.terminate()
        hang.stop()


async def test_a_restarted_orchestrator_counts_only_unread_groups_against_the_limit(orchestrators, env_pool,
                                                                                    redis_server, run_name):
    """A re-run (or a crash restart) restores the run's group total from the ledger; the limit must
    still count only groups the trainer has not read, or a resumed run holds new groups for good."""
    first = orchestrators("--group-size", "2", "--max-unconsumed-groups", "3")
    first.register(env_pool[0].url)
    held = first.wait(lambda s: "unconsumed_groups" in s["pause_reasons"] and s["groups_open"] == 0
                      and s["groups_recorded"] == s["groups_completed"], what="backpressure")
    store = Store.connect(redis_server.url, run_name)
    try:
        await store.ack_groups(await store.read_groups("trainer-0", count=held["groups_completed"]))
        first.kill()
        second = orchestrators("--group-size", "2", "--max-unconsumed-groups", "3", port=first.port)
        second.wait(lambda s: s["groups_completed"] >= held["groups_completed"] + 3, what="dispatch after restart")
    finally:
        await store.close()


async def test_staleness_limit_ties_groups_to_the_weight_version(orchestrators, env_pool, redis_server, run_name):
    orch = orchestrators("--group-size", "2", "--staleness-limit", "0", "--groups-per-step", "2")
    orch.register(env_pool[0].url)
    held = orch.wait(lambda s: "staleness" in s["pause_reasons"] and s["groups_open"] == 0, what="staleness hold")
    assert held["groups_completed"] == 2  # (version 0 + limit 0 + 1) * 2 groups per step
    store = Store.connect(redis_server.url, run_name)
    try:
        await store.record_served_version(1, "tensor")  # a tensor push writes no snapshot: the served version moves
        done = orch.wait(lambda s: s["weight_version"] == 1 and s["groups_completed"] == 4 and s["groups_open"] == 0
                         and "staleness" in s["pause_reasons"], what="two more groups at version 1")
        assert done["groups_completed"] == 4
    finally:
        await store.close()


async def test_backpressure_reacts_to_the_trainer_at_once_not_at_the_next_poll(orchestrators, env_pool, redis_server,
                                                                             run_name):
    """With a 60 s poll interval, a group read and a weight push still release new groups within seconds:
    the orchestrator blocks on the trainer's `progress` stream."""
    import time

    orch = orchestrators("--group-size", "2", "--max-unconsumed-groups", "2", "--staleness-limit", "1",
                         "--groups-per-step", "1", "--backpressure-interval-s", "60")
    orch.register(env_pool[0].url)
    held = orch.wait(lambda s: "unconsumed_groups" in s["pause_reasons"] and s["groups_open"] == 0
                     and s["groups_recorded"] == s["groups_completed"], what="unconsumed hold")
    assert held["groups_completed"] == 2
    store = Store.connect(redis_server.url, run_name)
    try:
        started = time.monotonic()
        await store.ack_groups(await store.read_groups("trainer-0", count=2))
        stale = orch.wait(lambda s: s["pause_reasons"] == ["staleness"] and s["groups_open"] == 0, timeout_s=20,
                          what="the staleness hold after the read")
        assert stale["groups_completed"] == 2 and time.monotonic() - started < 10  # (0 + 1 + 1) x 1 groups
        started = time.monotonic()
        await store.record_served_version(1, "disk")
        orch.wait(lambda s: s["weight_version"] == 1 and s["groups_completed"] > 2, timeout_s=20,
                  what="new groups after the push")
        assert time.monotonic() - started < 10
    finally:
        await store.close()


async def test_new_groups_wait_for_the_runs_envs_so_the_first_groups_hold_every_env(orchestrators, env_pool,
                                                                                     redis_server, run_name):
    """wait_for_envs (the launcher names the run's envs): an env that comes up late still gets its share of the
    first groups, instead of the first steps holding only the envs that came up first."""
    import time

    orch = orchestrators("--group-size", "2", "--max-groups", "8", "--wait-for-envs", "early",
                         "--wait-for-envs", "late")
    orch.register(env_pool[0].url, name="early")
    time.sleep(2.0)
    waiting = orch.status()
    assert waiting["pause_reasons"] == ["waiting_for_envs"] and waiting["in_flight"] == 0, waiting
    orch.register(env_pool[1].url, name="late")
    orch.wait_done(8)
    first = [r.env for r in sorted(await group_records(redis_server.url, run_name), key=lambda r: r.group_id)][:2]
    assert sorted(first) == ["early", "late"]


def test_an_env_that_never_comes_holds_new_groups_only_for_wait_for_envs_s(orchestrators, env_pool):
    orch = orchestrators("--group-size", "2", "--max-groups", "2", "--wait-for-envs", "timed",
                         "--wait-for-envs", "absent", "--wait-for-envs-s", "3")
    orch.register(env_pool[0].url)
    assert orch.status()["pause_reasons"] == ["waiting_for_envs"]
    status = orch.wait_done(2, timeout_s=30)
    assert status["pause_reasons"] == [] and status["groups_recorded"] == 2
    assert "new groups start without env(s) ['absent']" in orch.proc.log()
