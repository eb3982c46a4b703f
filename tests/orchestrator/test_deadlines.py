"""Episode deadlines sized from each env's own episodes (orchestrator/deadlines.py): the rule, and what a real
orchestrator sends a real env service."""

import numpy as np
import pytest

from asyncrl.config import EpisodeDeadlineConfig
from orchestrator.deadlines import EpisodeDeadlines
from tests.orchestrator.conftest import journal

SIZING = EpisodeDeadlineConfig(factor=4.0, min_s=1.0, window=50, after_episodes=10)


def test_the_cap_until_enough_episodes_then_factor_times_the_p99():
    deadlines = EpisodeDeadlines(SIZING, cap_s=600.0)
    for _ in range(9):
        deadlines.observe("fast", 2.0)
    assert deadlines.deadline_s("fast") == 600.0
    deadlines.observe("fast", 2.5)
    assert deadlines.deadline_s("fast") == pytest.approx(4.0 * np.percentile([2.0] * 9 + [2.5], 99))
    assert deadlines.deadline_s("other") == 600.0  # each env its own


def test_between_the_floor_and_the_cap():
    deadlines = EpisodeDeadlines(SIZING, cap_s=30.0)
    for _ in range(10):
        deadlines.observe("instant", 0.01)
        deadlines.observe("slow", 20.0)
    assert deadlines.deadline_s("instant") == 1.0 and deadlines.deadline_s("slow") == 30.0


def test_episodes_cut_at_the_deadline_make_it_grow():
    """An env that got slower: its episodes run into the sized deadline; counted at the deadline, they raise
    the p99 to it, and the next deadline is factor times longer (it does not keep cutting them)."""
    deadlines = EpisodeDeadlines(SIZING, cap_s=600.0)
    for _ in range(50):
        deadlines.observe("env", 1.0)
    assert deadlines.deadline_s("env") == pytest.approx(4.0)
    for _ in range(2):  # now every episode needs 10 s: cut at the deadline, counted at what they ran
        deadlines.observe("env", deadlines.deadline_s("env"))
    assert deadlines.deadline_s("env") > 10.0


def test_factor_zero_keeps_the_configured_deadline():
    deadlines = EpisodeDeadlines(EpisodeDeadlineConfig(factor=0.0), cap_s=600.0)
    for _ in range(100):
        deadlines.observe("env", 1.0)
    assert deadlines.deadline_s("env") == 600.0


@pytest.mark.parametrize("bad, named", [({"factor": 0.5}, "factor"), ({"min_s": 0.0}, "min_s"),
                                        ({"window": 5, "after_episodes": 10}, "after_episodes")])
def test_bad_sizing_is_refused_naming_the_field(bad, named):
    with pytest.raises(ValueError, match=named):
        EpisodeDeadlineConfig(**bad)


def test_the_orchestrator_sends_a_deadline_sized_from_the_envs_episodes(orchestrators, env_pool, journal_dir,
                                                                        run_name):
    """The pool's episodes take ~0.4 s: the first 10 get the run's 600 s, later ones about 4 x their p99; an env
    with a deadline of its own keeps it."""
    orch = orchestrators("--group-size", "2", "--max-groups", "24", "--max-in-flight", "4",
                         "--episode-timeout-s-by-env", "fixed=7",
                         "--episode-deadline", '{"factor": 4, "min_s": 0.5, "window": 50, "after_episodes": 10}')
    orch.register(env_pool[0].url, capacity=2)
    orch.register(env_pool[1].url, name="fixed", capacity=2)
    status = orch.wait_done(24)
    starts = [e for e in journal(journal_dir, run_name) if e["event"] == "start"]
    sized = [e["deadline_s"] for e in starts if e["pid"] == env_pool[0].proc.pid]
    assert len(sized) >= 20 and sized[:10] == [600.0] * 10, sized
    assert all(1.6 <= d <= 10.0 for d in sized[14:]), sized  # 4 x (0.4 s asleep + dispatch, slower under load)
    assert status["by_env"]["timed"]["deadline_s"] == pytest.approx(sized[-1], rel=0.5)
    assert {e["deadline_s"] for e in starts if e["pid"] == env_pool[1].proc.pid} == {7.0}
    assert status["by_env"]["fixed"]["deadline_s"] == 7.0
