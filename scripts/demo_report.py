"""Reward curve and numbers of a finished run, from its Redis AOF (the run's own record).

    python scripts/demo_report.py runs/tiny_demo [--out bench/results/tiny_demo] [--wall-s SECONDS]

Starts a private redis-server on <run_dir>/redis (read-only use), reads the `trainer` records of the
metrics stream, and writes <out>.json (per-step figures), <out>.md (summary) and <out>.png (reward
per step with a 10-step moving mean).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.store import Store  # noqa: E402
from asyncrl_run.redis_server import replay_copy  # noqa: E402


async def trainer_records(url: str, run: str) -> list[dict[str, float]]:
    store = Store.connect(url, run)
    try:
        return [values for _, source, values in await store.read_metrics(count=1_000_000) if source == "trainer"]
    finally:
        await store.close()


def read_run(run_dir: Path, run: str | None = None) -> list[dict[str, float]]:
    """The trainer records of a finished run (named `run`, default the run dir's name), from a copy of its Redis data."""
    with replay_copy(run_dir / "redis") as server:  # never touch the run's own files
        return asyncio.run(trainer_records(server.url, run or run_dir.name))


def staleness_histogram(records: list[dict[str, float]]) -> dict[int, float]:
    """versions old -> trained samples, summed over the steps' off_policy/staleness/{k}."""
    counts: dict[int, float] = {}
    for record in records:
        for key, n in record.items():
            if key.startswith("off_policy/staleness/"):
                k = int(key.rsplit("/", 1)[1])
                counts[k] = counts.get(k, 0.0) + n
    return dict(sorted(counts.items()))


def window_mean(values: list[float], lo: int, hi: int) -> float:
    chunk = values[lo:hi]
    return sum(chunk) / len(chunk)


def plot(rewards: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(rewards) + 1))
    smooth = [window_mean(rewards, max(0, i - 9), i + 1) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.35, label="mean reward of the step's samples")
    ax.plot(steps, smooth, linewidth=2, label="10-step moving mean")
    ax.set_xlabel("RL step (16 groups x 8 samples)")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tiny_demo"))
    p.add_argument("--wall-s", type=float, help="wall time of the whole run (from /usr/bin/time or the log)")
    p.add_argument("--command", default="make run")
    args = p.parse_args()
    run_dir = Path(args.run_dir)
    records = read_run(run_dir)
    rewards = [r["reward_mean"] for r in records]
    first, last = window_mean(rewards, 0, 10), window_mean(rewards, len(rewards) - 10, len(rewards))
    summary = {"command": args.command, "steps": len(records), "reward_first_10_steps": first,
               "reward_last_10_steps": last, "gain": last - first, "wall_s": args.wall_s,
               "rl_train_s": sum(r["step_s"] for r in records),
               "mean_staleness": sum(r["staleness_mean"] for r in records) / len(records),
               "mean_masked_fraction": sum(r.get("masked_fraction", 0.0) for r in records) / len(records),
               "staleness_histogram": staleness_histogram(records),
               "stale_samples_dropped": sum(r.get("filter_stale", 0.0) for r in records),
               "per_step": [{k: r[k] for k in ("step", "reward_mean", "loss", "weight_version", "staleness_mean")}
                            for r in records]}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    plot(rewards, out.with_suffix(".png"), f"{run_dir.name}: async GRPO on 2 CPU cores")
    wall = f"{args.wall_s / 60:.1f} min" if args.wall_s else "n/a"
    out.with_suffix(".md").write_text("\n".join([
        f"# {run_dir.name}", "", f"Command: `{args.command}` (2 CPU cores; the whole run, warm-up and start-up included: "
        f"{wall}).", "", f"![reward curve]({out.with_suffix('.png').name})", "",
        "| | mean reward |", "|---|---|", f"| first 10 RL steps | {first:.3f} |", f"| last 10 RL steps | {last:.3f} |",
        "", f"Gain: **{last - first:+.3f}** over {len(records)} steps; mean staleness {summary['mean_staleness']:.2f} "
        f"weight versions; mean masked fraction (double-sided IS) {summary['mean_masked_fraction']:.3f}.", "",
        "Staleness of the trained samples (trainer version minus the version of their oldest token; "
        f"{summary['stale_samples_dropped']:.0f} samples dropped as older than staleness_tau):", "",
        "| versions old | samples | share |", "|---|---|---|",
        *[f"| {k} | {n:.0f} | {n / max(sum(summary['staleness_histogram'].values()), 1):.1%} |"
          for k, n in summary["staleness_histogram"].items()], ""]))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
