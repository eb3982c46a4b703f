"""The run's summary (asyncrl_run/run_summary.py): the agent metrics of the first and the last reward window."""

from pathlib import Path

from asyncrl_run.run_summary import RunSummary, read_summary, summarize


def records(n: int) -> list[dict]:
    return [{"step": s, "reward_mean": s / n, "rollout/turns_mean": 3.0, "rollout/tool_calls_mean": 2.0,
             "rollout/tool_call_parse_failures_mean": 1.0 - s / n, "rollout/tool_errors_mean": 0.0,
             "rollout/episode_len_mean": 360.0} for s in range(1, n + 1)]


def test_the_summary_reports_the_agent_metrics_of_the_first_and_the_last_window(tmp_path: Path):
    summary = summarize("run", tmp_path, 40, 60.0, records(40), None, "file_lookup")
    failures = summary.agent["rollout/tool_call_parse_failures_mean"]
    assert failures == {"first": round(1 - 5.5 / 40, 4), "last": round(1 - 35.5 / 40, 4)}  # steps 1-10, 31-40
    assert summary.agent["rollout/tool_calls_mean"] == {"first": 2.0, "last": 2.0}
    line = next(line for line in summary.lines() if "per sample" in line)
    assert "tool calls 2.00 -> 2.00" in line and "tool-call parse failures 0.86 -> 0.11" in line
    summary.write(tmp_path)
    assert read_summary(tmp_path) == summary


def test_a_run_without_tool_calls_prints_no_agent_line(tmp_path: Path):
    plain = [{"step": s, "reward_mean": 0.5} for s in range(1, 5)]
    summary = summarize("run", tmp_path, 4, 6.0, plain, None, "tiny_demo")
    assert summary.agent == {} and not any("per sample" in line for line in summary.lines())
    assert isinstance(summary, RunSummary)


def test_what_redis_lost_in_a_restart_is_said_and_nothing_when_it_lost_nothing(tmp_path: Path):
    trainer = [{"step": 1, "reward_mean": 0.5, "filter_redelivered": 0.0},
               {"step": 2, "reward_mean": 0.5, "filter_redelivered": 3.0}]
    summary = summarize("run", tmp_path, 2, 6.0, trainer, {"groups_lost_to_redis": 5}, None)
    assert summary.lost_to_redis == {"group_records": 5, "acknowledgements": 3}
    assert "  LOST in Redis restarts (acknowledged writes its AOF did not hold): 5 group records, 3 acknowledgements" \
        in summary.lines()
    clean = summarize("run", tmp_path, 2, 6.0, trainer[:1], {"groups_lost_to_redis": 0}, None)
    assert clean.lost_to_redis == {} and not any("LOST" in line for line in clean.lines())
