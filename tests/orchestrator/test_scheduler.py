"""The scheduler's decisions without I/O: weight ratios, capacities, rate limits, group admission."""

from collections import Counter

import pytest

from asyncrl.types import GroupRecord
from orchestrator.groups import Group, MemberState, TaskOrder
from orchestrator.registry import Service
from orchestrator.scheduler import Scheduler, TokenBucket


ANY_ENV = lambda env: True  # noqa: E731 - backpressure lets every env start groups
NO_ENV = lambda env: False  # noqa: E731


def service(name: str, capacity: int = 10**6, domain: str = "", weight: float = 1.0, n: int = 0) -> Service:
    return Service(env_id=f"{name}-{n}", name=name, domain=domain, url=f"http://{name}-{n}", capacity=capacity,
                   weight=weight, heartbeat="push")


def make(group_size: int = 4, max_in_flight: int = 10_000, weights=None, rates=None, services=()) -> Scheduler:
    s = Scheduler(group_size, max_in_flight, weights or {}, rates or {})
    for svc in services:
        s.add_service(svc)
        s.queue(svc.name).tasks = TaskOrder(svc.name, ["t0", "t1", "t2"], seed=0)
    return s


def dispatch_groups(s: Scheduler, n: int, now: float = 0.0) -> Counter:
    """Start n groups (every member on the scheduler's chosen service, never finished)."""
    started = Counter()
    for _ in range(n):
        decision = s.next(now, new_groups=ANY_ENV)
        assert decision is not None and decision.member is None
        for _ in range(s.group_size):
            svc = decision.queue.pick_service(now)
            svc.in_flight += 1
            decision.queue.in_flight += 1
            s.charge(decision.queue, 1, now)
        started[decision.queue.name] += 1
    return started


def test_domain_weights_give_the_configured_ratio():
    s = make(weights={"swe": 2, "terminal": 1, "search": 1},
             services=[service("swe-env", domain="swe"), service("term-env", domain="terminal"),
                       service("search-env", domain="search")])
    started = dispatch_groups(s, 400)
    assert started == {"swe-env": 200, "term-env": 100, "search-env": 100}


def test_a_domain_weight_is_shared_by_its_envs_and_names_win_over_domains():
    s = make(weights={"swe": 2, "special": 3},
             services=[service("swe-a", domain="swe"), service("swe-b", domain="swe", weight=3.0),
                       service("special", domain="swe"), service("other", domain="misc", weight=1.0)])
    assert {q.name: q.weight for q in s.queues.values()} == {"swe-a": 0.5, "swe-b": 1.5, "special": 3, "other": 1.0}
    started = dispatch_groups(s, 600)
    assert started == {"swe-a": 50, "swe-b": 150, "special": 300, "other": 100}


def test_capacity_is_never_exceeded_and_a_group_waits_for_room():
    s = make(group_size=4, services=[service("a", capacity=6, n=0), service("a", capacity=5, n=1)])
    dispatch_groups(s, 2)  # 8 of 11 slots
    assert s.next(0.0, new_groups=ANY_ENV) is None  # 3 free slots < group_size
    assert all(svc.in_flight <= svc.capacity for svc in s.queue("a").services.values())
    s.queue("a").services["a-0"].in_flight -= 1
    assert s.next(0.0, new_groups=ANY_ENV) is not None


def test_an_env_smaller_than_a_group_still_starts_groups_when_empty():
    s = make(group_size=8, services=[service("small", capacity=3)])
    decision = s.next(0.0, new_groups=ANY_ENV)
    assert decision is not None and decision.queue.free_slots(0.0) == 3


def test_max_in_flight_bounds_all_envs_and_pending_members_go_first():
    s = make(group_size=4, max_in_flight=8, services=[service("a"), service("b")])
    dispatch_groups(s, 2)
    assert s.next(0.0, new_groups=ANY_ENV) is None
    group = Group.new("b", "t0", 99, 4, seed=0)
    s.queue("b").pending.append((group, group.members[0]))
    s.queue("a").in_flight -= 1
    decision = s.next(0.0, new_groups=ANY_ENV)
    assert decision.queue.name == "b" and decision.member == (group, group.members[0])
    assert s.next(0.0, new_groups=NO_ENV) is not None  # backpressure holds groups, not accepted members


def test_an_env_beyond_its_share_of_max_in_flight_leaves_the_others_their_share():
    """Episodes that hang at one env (never settled) do not take the room of the others."""
    s = make(group_size=4, max_in_flight=16, services=[service("hang"), service("ok")])
    s.queue("hang").in_flight = 14  # e.g. after "ok" had no tasks yet: beyond its share of 8
    assert s.next(0.0, new_groups=lambda env: env == "hang") is None  # 2 left: no room for a group
    decision = s.next(0.0, new_groups=ANY_ENV)
    assert decision.queue.name == "ok"  # 16 - 0 - min(14, 8)
    s.queue("ok").in_flight = 4
    assert s.next(0.0, new_groups=ANY_ENV).queue.name == "ok"  # 16 - 4 - 8
    s.queue("ok").in_flight = 5
    assert s.next(0.0, new_groups=ANY_ENV) is None  # 3 left for ok, none for hang


def test_unhealthy_removed_and_backing_off_services_get_nothing():
    a0, a1, a2 = service("a", n=0), service("a", n=1), service("a", n=2)
    s = make(services=[a0, a1, a2])
    a0.healthy, a1.removed, a2.backoff_until = False, True, 5.0
    assert s.next(0.0, new_groups=ANY_ENV) is None
    assert s.wake_in(0.0) == pytest.approx(5.0)
    assert s.queue("a").pick_service(6.0) is a2


def test_rate_limit_spaces_groups():
    s = make(group_size=2, rates={"a": 4.0}, services=[service("a")])
    times = []
    now = 0.0
    while len(times) < 10:
        decision = s.next(now, new_groups=ANY_ENV)
        if decision is None:
            now += s.wake_in(now)
            continue
        times.append(now)
        s.charge(decision.queue, 2, now)
    # burst of max(group_size, rate) = 4 tokens (2 groups at t=0), then one group of 2 every 0.5 s
    assert times[:2] == [0.0, 0.0]
    assert times[2:] == pytest.approx([0.5 * k for k in range(1, 9)])


def test_token_bucket_refills_up_to_its_burst():
    bucket = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    bucket.take(3, 0.0)
    assert bucket.wait_s(1, 0.0) == pytest.approx(0.5)
    assert bucket.wait_s(3, 100.0) == 0.0 and bucket.tokens == 3.0


def test_an_env_back_from_a_stall_catches_up_one_group_at_most():
    a, b = service("a"), service("b")
    s = make(group_size=4, services=[a, b])
    b.healthy = False
    dispatch_groups(s, 50)  # only a runs meanwhile
    b.healthy = True
    started = dispatch_groups(s, 20)
    assert started["b"] <= 11  # fair share (10) plus at most one group of catch-up, not 50


def test_task_order_is_seeded_complete_per_epoch_and_stable():
    order = TaskOrder("env", [f"t{i}" for i in range(10)], seed=3)
    first, second = [order[i] for i in range(10)], [order[i] for i in range(10, 20)]
    assert sorted(first) == sorted(second) == sorted(f"t{i}" for i in range(10)) and first != second
    again = TaskOrder("env", [f"t{i}" for i in range(10)], seed=3)
    assert [again[i] for i in range(25)] == [order[i] for i in range(25)]
    assert [TaskOrder("env", [f"t{i}" for i in range(10)], seed=4)[i] for i in range(10)] != first


def test_group_state_round_trips_and_records_member_refs_in_order():
    group = Group.new("swe", "t7", ordinal=12, group_size=3, seed=5)
    assert group.group_id == "g0000012-swe" and len({m.seed for m in group.members}) == 3
    group.members[0].state, group.members[0].sample_refs = MemberState.done, ["1-0"]
    group.members[1].state, group.members[1].attempt, group.members[1].session_id = MemberState.running, 2, "sid"
    back = Group.decode(group.encode())
    assert back.members[1].state is MemberState.running and back.members[1].session_id == "sid"
    assert back.episode_id(back.members[1]) == "g0000012-swe-m1-a2" and not back.complete
    back.members[1].state, back.members[1].sample_refs = MemberState.done, ["2-0", "2-1"]
    back.members[2].state = MemberState.given_up
    assert back.complete and back.record() == GroupRecord("g0000012-swe", "t7", "swe", ["1-0", "2-0", "2-1"], 3)
