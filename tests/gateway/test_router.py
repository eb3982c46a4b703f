"""Consistent hashing with bounded load (pure, no processes), and the gateway routing by it."""

import collections
import math
import random

import pytest

from asyncrl.config import GatewayConfig
from gateway.core import Gateway

from gateway.router import HashRing, pick_bounded

ENGINES = [f"http://e{i}" for i in range(4)]
KEYS = [f"session-{i}" for i in range(4000)]


def homes(ring: HashRing) -> dict[str, str]:
    return {key: next(ring.walk(key)) for key in KEYS}


def test_walk_visits_every_node_once_and_spreads_keys():
    ring = HashRing(ENGINES)
    assert sorted(ring.walk("x")) == ENGINES
    counts = collections.Counter(homes(ring).values())
    assert set(counts) == set(ENGINES) and min(counts.values()) > 0.15 * len(KEYS)


def test_removing_a_node_moves_only_its_keys():
    before = homes(HashRing(ENGINES))
    after = homes(HashRing(ENGINES[:-1]))
    moved = [key for key in KEYS if before[key] != after[key]]
    assert moved and all(before[key] == ENGINES[-1] for key in moved)
    # ... and each moved key goes to its next node clockwise (its fallback when the node is unhealthy)
    ring = HashRing(ENGINES)
    assert all(after[key] == list(ring.walk(key))[1] for key in moved)


def test_bounded_load_skips_an_overloaded_home_and_unhealthy_nodes():
    ring = HashRing(ENGINES)
    key = KEYS[0]
    order = list(ring.walk(key))
    load = collections.Counter()
    assert pick_bounded(ring, key, load.__getitem__, lambda n: True, 1.25) == order[0]
    load[order[0]] = 10  # the home engine is far above the mean
    assert pick_bounded(ring, key, load.__getitem__, lambda n: True, 1.25) == order[1]
    assert pick_bounded(ring, key, load.__getitem__, lambda n: n != order[1], 1.25) == order[2]
    assert pick_bounded(ring, key, load.__getitem__, lambda n: n != order[1], 1.25, frozenset(order[2:])) == order[0]
    assert pick_bounded(ring, key, load.__getitem__, lambda n: False, 1.25) is None


def test_bounded_load_keeps_every_node_within_the_bound():
    ring = HashRing(ENGINES)
    load = collections.Counter()
    for key in KEYS[:1000]:  # requests that all stay in flight
        load[pick_bounded(ring, key, load.__getitem__, lambda n: True, 1.25)] += 1
    assert max(load.values()) <= 1.25 * 1000 / len(ENGINES) + 1


@pytest.mark.parametrize("slack", [0, 2])
def test_bounded_pick_is_the_first_node_of_the_whole_walk_within_the_bound(slack):
    """The pick walks the ring only until a node within the bound: it must equal the rule's definition over
    every node of the walk, at 64 engines with uneven load, unhealthy and excluded engines."""
    engines = [f"http://e{i}" for i in range(64)]
    ring = HashRing(engines)
    rng = random.Random(0)
    for key in KEYS[:500]:
        load = {engine: rng.choice((0, 0, 1, 1, 2, 5)) for engine in engines}
        down = set(rng.sample(engines, rng.randrange(4)))
        exclude = frozenset(rng.sample(engines, rng.randrange(3)))
        usable = lambda n: n not in down  # noqa: E731
        walk = [n for n in ring.walk(key) if n not in exclude and usable(n)]
        bound = max(math.ceil(1.25 * (sum(load[n] for n in walk) + 1) / len(walk)), min(load[n] for n in walk) + slack)
        expected = next(n for n in walk if load[n] + 1 <= bound)
        assert pick_bounded(ring, key, load.__getitem__, usable, 1.25, exclude, slack) == expected


def test_a_session_keeps_its_engine_until_it_carries_slack_more_than_the_least_loaded():
    """At ~1 request in flight per engine the mean bound alone moves a session off an engine with 2 (its
    prefix cache lost); with a slack of 4 it stays until its engine has 4 more than the least loaded one."""
    engines = [f"http://e{i}" for i in range(64)]
    ring = HashRing(engines)
    key = KEYS[0]
    home, second = list(ring.walk(key))[:2]
    load = collections.Counter({engine: 1 for engine in engines})
    load[home] = 2
    assert pick_bounded(ring, key, load.__getitem__, lambda n: True, 1.25) == second
    assert pick_bounded(ring, key, load.__getitem__, lambda n: True, 1.25, slack=4) == home
    load[home] = 4  # 3 more than the least loaded: it stays
    assert pick_bounded(ring, key, load.__getitem__, lambda n: True, 1.25, slack=4) == home
    load[home] = 5  # 4 more: it has its share
    assert pick_bounded(ring, key, load.__getitem__, lambda n: True, 1.25, slack=4) == second


def test_a_load_factor_below_one_and_a_negative_slack_are_refused():
    with pytest.raises(ValueError, match="load_factor must be >= 1"):
        GatewayConfig(load_factor=0.9)
    with pytest.raises(ValueError, match="balance_abs_threshold must be >= 0"):
        GatewayConfig(balance_abs_threshold=-1)


async def test_the_gateway_routes_with_its_configured_slack(template):
    """gateway.balance_abs_threshold reaches the engine pool's picks (tests/test_config_propagation.py shows it
    reaches the process)."""
    engines = [f"http://e{i}" for i in range(8)]
    gateway = Gateway(GatewayConfig(engine_urls=engines, balance_abs_threshold=4), template, None)
    try:
        home, second = list(gateway.pool.ring.walk(KEYS[0]))[:2]
        for url, engine in gateway.pool.engines.items():
            engine.in_flight = 4 if url == home else 1
        assert gateway.pool.pick(KEYS[0]).url == home
        gateway.pool.engines[home].in_flight = 5
        assert gateway.pool.pick(KEYS[0]).url == second
    finally:
        await gateway.pool.close()
