"""asyncrl.gc_policy in this process: what survives a collection is frozen (no later collection walks it),
a cycle that dies frozen waits for the sweep and the sweep frees it, and a negative gc_sweep_s is refused by
name. The same policy on the real gateway and orchestrator: tests/gateway/test_gc_pauses.py."""

from __future__ import annotations

import gc
import weakref

import pytest

from asyncrl.config import GatewayConfig, OrchestratorConfig
from asyncrl.gc_policy import SurvivorFreezer


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic GC frees it


def in_a_generation(obj: object) -> bool:
    return any(any(o is obj for o in gc.get_objects(generation)) for generation in range(3))


@pytest.fixture
def freezer():
    freezer = SurvivorFreezer(sweep_s=3600)
    freezer.install()
    yield freezer
    freezer.uninstall()
    gc.unfreeze()  # this pytest process collects as before


def test_survivors_are_frozen_and_a_cycle_that_dies_frozen_waits_for_the_sweep(freezer):
    survivor = Node()
    gc.collect(0)
    assert not in_a_generation(survivor) and gc.get_freeze_count() > 0  # no collection walks it now
    dead = weakref.ref(survivor)
    del survivor
    gc.collect()
    assert dead() is not None  # frozen cyclic garbage: what the policy gives up between sweeps
    assert freezer.sweep() >= 1
    assert dead() is None and freezer.sweeps == 1


def test_a_cycle_that_dies_before_the_next_collection_is_freed_by_it(freezer):
    dead = weakref.ref(Node())
    gc.collect(0)
    assert dead() is None


def test_without_the_freezer_a_young_cycle_stays_collectable():
    """The control: the frozen cycle above outlives gc.collect() because of the freezer, not by accident."""
    survivor = Node()
    gc.collect(0)
    assert in_a_generation(survivor)
    dead = weakref.ref(survivor)
    del survivor
    gc.collect()
    assert dead() is None


@pytest.mark.parametrize("section", [GatewayConfig, OrchestratorConfig])
@pytest.mark.parametrize("seconds", [-1.0, float("nan")])
def test_a_negative_sweep_interval_is_refused_by_name(section, seconds):
    with pytest.raises(ValueError, match="gc_sweep_s must be >= 0"):
        section(gc_sweep_s=seconds)
