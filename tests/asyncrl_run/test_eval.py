"""`asyncrl eval`'s arithmetic and command line (no services): the unbiased pass@k estimator, the
summary, and how flags and Hydra overrides become the run config and the evaluation."""

import itertools
import json
from math import comb

import pytest

from asyncrl_run.evaluate import EvalError, compose, model_dir, parse_args, pass_at_k, spec_from_args, summarize


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The definition: the share of k-subsets of the n samples that contain a pass."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in (1, 2, 5, 8) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    expected = 1 - comb(n - c, k) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k([True] * c + [False] * (n - c), k), abs=1e-12)


def test_pass_at_k_edges_and_large_n():
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the pass rate
    assert pass_at_k(10, 6, 5) == 1.0                  # fewer failures than k: every k-subset passes
    assert pass_at_k(1000, 1, 1000) == 1.0 and pass_at_k(1000, 1, 10) == pytest.approx(0.01)  # no overflow
    assert [pass_at_k(8, 2, k) for k in range(1, 9)] == sorted(pass_at_k(8, 2, k) for k in range(1, 9))
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_summary_means_over_tasks_and_thresholds():
    rewards = {"a": [1.0, 0.0, 1.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0], "c": [0.5, 1.0]}
    s = summarize(rewards, [1, 4], threshold=1.0, failed={"c": 2})
    assert s["mean_reward"] == pytest.approx(4.5 / 10)
    assert s["pass_at_k"]["1"] == pytest.approx((3 / 4 + 0 + 1 / 2) / 3)
    assert s["pass_at_k"]["4"] == pytest.approx((1.0 + 0.0) / 2)  # c has 2 scored samples: not in pass@4
    assert s["pass_at_k_tasks"] == {"1": 3, "4": 2} and s["failed_episodes"] == 2 and s["episodes"] == 10
    assert [t["passed"] for t in s["tasks"]] == [3, 0, 1]
    partial = summarize({"a": [0.5, 0.5]}, [1], threshold=0.5)  # partial credit counts from the threshold up
    assert partial["pass_at_k"]["1"] == 1.0
    json.dumps(s)  # what is written


def test_flags_and_overrides_compose_the_run_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args, overrides = parse_args(["experiment=tiny_demo", "--model", str(tmp_path), "--samples", "4", "seed=3",
                                  "--tasks", "5", "--temperature", "0"])
    assert overrides == ["experiment=tiny_demo", "seed=3"]
    cfg = compose(overrides + [f"model.path={args.model}", "rollout.sampling.temperature=0"])
    assert (cfg.name, cfg.seed, cfg.rollout.sampling.max_new_tokens, cfg.gateway.thinking) == ("tiny_demo", 3, 8, False)
    assert cfg.rollout.sampling.temperature == 0.0
    spec = spec_from_args(cfg, args)
    assert (spec.env.name, spec.split, spec.samples, spec.ks, spec.num_tasks) == ("arithmetic", "eval", 4, [1, 4], 5)
    assert model_dir(str(tmp_path)) == str(tmp_path.resolve())
    greedy, _ = parse_args(["--temperature", "0"])  # identical samples: one per task unless asked
    assert spec_from_args(cfg, greedy).samples == 1


def test_bad_arguments_are_named():
    cfg = compose(["experiment=tiny_demo"])
    args, _ = parse_args(["--env", "nope"])
    with pytest.raises(EvalError, match="nope"):
        spec_from_args(cfg, args)
    args, _ = parse_args(["--samples", "4", "--k", "1,8"])
    with pytest.raises(EvalError, match="1..n"):
        spec_from_args(cfg, args)
    with pytest.raises(EvalError, match="no HF checkpoint"):
        model_dir("/nonexistent/checkpoint")
    args, _ = parse_args(["--env", "envs.tasks.CopyEnv", "--k", "2"])
    spec = spec_from_args(cfg, args)
    assert (spec.env.target, spec.samples, spec.ks) == ("envs.tasks.CopyEnv", 8, [2])
