"""Failures the orchestrator must survive without losing or duplicating anything: an env service
SIGKILLed mid-episode, a frozen service (missed heartbeats), a broken service (retries, give-up),
the orchestrator itself SIGKILLed and restarted on the same Redis."""

import re
import signal
import time
from collections import defaultdict

from tests.orchestrator.conftest import TIMED_ENV, group_records, journal, running_at, start_envs, starts_by_episode


def member_of(episode_id: str) -> tuple[str, str, tuple[int, int]]:
    """'g0000003-timed-m1-a2' -> ('g0000003-timed', 'm1', (1, 2)): (orchestrator start, attempt), which
    orders dispatches; a restarted orchestrator's 'g0000003-timed-m1-a1-r2' -> (..., (2, 1))."""
    group, member, attempt, start = re.fullmatch(r"(.+)-(m\d+)-a(\d+)(?:-r(\d+))?", episode_id).groups()
    return group, member, (int(start or 1), int(attempt))


def assert_every_group_once(records, count: int, env: str = "timed", group_size: int = 4) -> None:
    ids = [r.group_id for r in records]
    assert sorted(ids) == [f"g{i:07d}-{env}" for i in range(1, count + 1)], ids  # each exactly once
    assert all(r.group_size == group_size for r in records)


def completed_attempts(entries: list[dict]) -> dict[tuple[str, str], list[tuple[int, int]]]:
    done = defaultdict(list)
    for e in entries:
        if e["event"] == "end" and e["outcome"] == "completed":
            group, member, attempt = member_of(e["episode_id"])
            done[(group, member)].append(attempt)
    return done


async def test_env_killed_mid_episode_its_episodes_rerun_elsewhere(orchestrators, tmp_path, redis_server, run_name):
    orch = orchestrators("--group-size", "4", "--max-groups", "10")
    args = ("--capacity", "8", "--option", "sleep_s=1.0", "--option", f"journal={tmp_path}",
            "--orchestrator", orch.url, "--log-level", "WARNING")
    victim, survivor = start_envs(tmp_path, 2, *args)
    orch.wait(lambda s: len(orch.envs()) == 2 and s["in_flight"] >= 12 and running_at(tmp_path, victim.proc.pid),
              what="both services busy, the victim running episodes")
    victim_pid = victim.proc.pid
    victim.proc.kill()  # SIGKILL: no drain, no deregistration
    victim.proc.wait()
    status = orch.wait_done(10)
    survivor.stop()

    assert_every_group_once(await group_records(redis_server.url, run_name), 10)
    entries = journal(tmp_path, run_name)
    killed = [e for e in starts_by_episode(entries).values() if e["pid"] == victim_pid
              and not any(x["event"] == "end" and x["episode_id"] == e["episode_id"] for x in entries)]
    assert killed, "the kill hit no running episode"
    done = completed_attempts(entries)
    for e in killed:  # each episode cut off by the kill ran again, on the survivor, as a later attempt
        group, member, attempt = member_of(e["episode_id"])
        assert len(done[(group, member)]) == 1 and done[(group, member)][0] > attempt
    assert all(len(attempts) == 1 for attempts in done.values()) and len(done) == 40
    assert status["completed"] == 40 and status["failed"] == 0 and status["retried"] >= len(killed)
    health = {r["url"]: r["healthy"] for r in orch.envs()}
    assert health[victim.url] is False


async def test_frozen_service_misses_heartbeats_and_its_episodes_move(orchestrators, tmp_path, redis_server,
                                                                      run_name):
    orch = orchestrators("--group-size", "4", "--max-groups", "8")
    args = ("--capacity", "8", "--option", "sleep_s=1.0", "--option", f"journal={tmp_path}",
            "--orchestrator", orch.url, "--log-level", "WARNING")
    frozen, other = start_envs(tmp_path, 2, *args)
    orch.wait(lambda s: len(orch.envs()) == 2 and s["in_flight"] >= 12 and running_at(tmp_path, frozen.proc.pid),
              what="both services busy, the frozen one running episodes")
    frozen.proc.send_signal(signal.SIGSTOP)  # alive, connections open, silent
    try:
        orch.wait(lambda s: any(not r["healthy"] for r in orch.envs()), timeout_s=30, what="missed heartbeats")
        status = orch.wait_done(8)
        assert status["completed"] == 32 and status["failed"] == 0 and status["retried"] >= 1
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    orch.wait(lambda s: all(r["healthy"] for r in orch.envs()), timeout_s=30, what="heartbeats again")
    frozen.stop()
    other.stop()
    assert_every_group_once(await group_records(redis_server.url, run_name), 8)
    done = completed_attempts(journal(tmp_path, run_name))
    # the frozen service may finish its episodes after it thaws; only the current attempt counts
    assert len(done) == 32


async def test_broken_service_episodes_retry_on_a_healthy_one(orchestrators, tmp_path, redis_server, run_name):
    broken, healthy = start_envs(tmp_path, 1, "--option", "sleep_s=0.2", "--option", "broken=true", "--option",
                                 f"journal={tmp_path}") + start_envs(tmp_path, 1, "--option", "sleep_s=0.2",
                                                                     "--option", f"journal={tmp_path}")
    orch = orchestrators("--group-size", "4", "--max-groups", "6", "--max-attempts", "3")
    orch.register(broken.url)
    orch.register(healthy.url)
    status = orch.wait_done(6)
    assert status["completed"] == 24 and status["failed"] == 0 and status["retried"] >= 1
    assert_every_group_once(await group_records(redis_server.url, run_name), 6)
    entries = journal(tmp_path, run_name)
    failed_on_broken = [e for e in entries if e["event"] == "end" and e["outcome"] == "broken"]
    assert failed_on_broken and all(e["pid"] == broken.proc.pid for e in failed_on_broken)
    done = completed_attempts(entries)
    for e in failed_on_broken:  # retried (not on the service that just failed it) and completed once
        group, member, attempt = member_of(e["episode_id"])
        assert len(done[(group, member)]) == 1 and done[(group, member)][0] > attempt
    broken.stop()
    healthy.stop()


async def test_an_episode_that_keeps_failing_is_given_up_after_max_attempts(orchestrators, tmp_path, redis_server,
                                                                           run_name):
    (broken,) = start_envs(tmp_path, 1, "--option", "sleep_s=0.05", "--option", "broken=true", "--option",
                           f"journal={tmp_path}")
    orch = orchestrators("--group-size", "2", "--max-groups", "2", "--max-attempts", "3")
    orch.register(broken.url)
    status = orch.wait_done(2)
    assert (status["completed"], status["failed"], status["retried"]) == (0, 4, 8)
    assert_every_group_once(await group_records(redis_server.url, run_name), 2, group_size=2)
    attempts = defaultdict(list)
    for e in journal(tmp_path, run_name):
        if e["event"] == "start":
            group, member, (_, attempt) = member_of(e["episode_id"])
            attempts[(group, member)].append(attempt)
    assert sorted(attempts.values()) == [[1, 2, 3]] * 4
    assert 'asyncrl_orchestrator_episodes_total{env="timed",status="given_up"} 4.0' in orch.http.get("/metrics").text
    broken.stop()


async def test_orchestrator_killed_mid_run_resumes_on_restart(orchestrators, tmp_path, redis_server, run_name):
    first = orchestrators("--group-size", "4", "--max-groups", "12")
    args = ("--capacity", "8", "--option", "sleep_s=1.0", "--option", f"journal={tmp_path}",
            "--orchestrator", first.url, "--log-level", "WARNING")
    services = start_envs(tmp_path, 2, *args)
    before = first.wait(lambda s: s["groups_completed"] >= 2 and s["in_flight"] >= 8, what="a run in progress")
    first.kill()  # SIGKILL: no flush, the lease stays until it expires
    killed_at = time.time()
    second = orchestrators("--group-size", "4", "--max-groups", "12", port=first.port)
    assert "restored 2 services" in second.proc.log()
    status = second.wait_done(12)
    for service in services:
        service.stop()

    assert_every_group_once(await group_records(redis_server.url, run_name), 12)
    assert status["completed"] == 48 and status["failed"] == 0 and status["groups_completed"] == 12
    assert status["completed"] >= before["completed"] and status["retried"] >= 1
    entries = journal(tmp_path, run_name)
    starts = [e["episode_id"] for e in entries if e["event"] == "start"]
    assert len(set(starts)) == len(starts)  # every dispatch has an id of its own, across the restart too
    done = completed_attempts(entries)
    assert len(done) == 48
    # an attempt may still complete at its service after the orchestrator died (before the service
    # noticed the dropped request); nobody counted it and the member ran again. Only those run twice.
    ends = {e["episode_id"]: e["at"] for e in entries if e["event"] == "end"}
    for (group, member), attempts in done.items():
        for start, attempt in attempts[:-1]:
            assert start == 1 and killed_at - 0.5 < ends[f"{group}-{member}-a{attempt}"] < killed_at + 5
    running_at_kill = [e for e in starts_by_episode(entries).values()
                       if e["at"] < killed_at and ends.get(e["episode_id"], killed_at) >= killed_at]
    assert running_at_kill
    for e in running_at_kill:  # the dead orchestrator's episodes ran again, as later attempts
        group, member, attempt = member_of(e["episode_id"])
        assert done[(group, member)][-1] > attempt
