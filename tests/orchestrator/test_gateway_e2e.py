"""End to end through the real TITO gateway and the built-in CPU engine (tiny model): every episode
talks to the model through its own gateway session; an env service is SIGKILLed mid-run. The
trainer-facing result in Redis: each group once, each member's trajectory once, nothing from the
aborted attempts."""

from collections import defaultdict

from asyncrl.store import Store
from tests.orchestrator.conftest import group_records, journal, running_at, start_envs, starts_by_episode


async def test_groups_through_the_gateway_survive_a_killed_env(gateway, orchestrators, tmp_path, redis_server,
                                                              run_name):
    orch = orchestrators("--gateway", gateway.url, "--group-size", "4", "--max-groups", "6",
                         "--sampling", '{"max_new_tokens": 8}', "--seed", "3")
    victim, survivor = start_envs(tmp_path, 2, "--capacity", "8", "--option", "sleep_s=1.5", "--option", "llm_turns=1",
                                  "--option", f"journal={tmp_path}", "--orchestrator", orch.url)
    # in_flight counts dispatches; wait until the victim has really begun episodes (its journal says so),
    # or a kill right after dispatch leaves it nothing to lose
    orch.wait(lambda s: len(orch.envs()) == 2 and s["in_flight"] >= 12 and running_at(tmp_path, victim.proc.pid),
              timeout_s=120, what="both services busy, the victim running episodes")
    victim.proc.kill()
    victim.proc.wait()
    status = orch.wait_done(6, timeout_s=180)
    survivor.stop()
    assert status["completed"] == 24 and status["failed"] == 0 and status["retried"] >= 1

    records = await group_records(redis_server.url, run_name)
    assert sorted(r.group_id for r in records) == [f"g{i:07d}-timed" for i in range(1, 7)]
    store = Store.connect(redis_server.url, run_name)
    try:
        all_refs = [entry_id.decode() for entry_id, _ in await store.redis.xrange(store.key("samples"))]
        refs = [ref for r in records for ref in r.sample_refs]
        # one trajectory per member, and nothing else: the killed attempts' sessions were aborted
        assert len(refs) == 24 and sorted(refs) == sorted(all_refs)
        for record in records:
            samples = await store.get_samples(record.sample_refs)
            assert {(s.group_id, s.task_id, s.env, s.status) for s in samples} == {
                (record.group_id, record.task_id, "timed", "completed")}
            assert len({s.metadata["seed"] for s in samples}) == 4
            assert all(s.loss_mask.sum() >= 1 and s.num_turns == 1 for s in samples)
    finally:
        await store.close()

    starts = starts_by_episode(journal(tmp_path))
    killed = [e for e in starts.values() if e["pid"] == victim.proc.pid]
    attempts = defaultdict(list)
    for episode_id in starts:
        group, member, attempt = episode_id.rsplit("-", 2)
        attempts[(group, member)].append(int(attempt[1:]))
    assert killed and all(max(attempts[tuple(e["episode_id"].rsplit("-", 2)[:2])]) > 1 for e in killed)
