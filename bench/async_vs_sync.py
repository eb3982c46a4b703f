"""Async versus sync RL on the same experiment and sample count: long-tailed response lengths
(experiment=async_vs_sync, the default) or the main job's multi-turn tool use (--experiment file_lookup).

    python bench/async_vs_sync.py [--experiment async_vs_sync] [--steps 12] [--rounds 3]
                                  [--out bench/results/async_vs_sync] [OVERRIDE ...]

Runs `python -m asyncrl_run.train experiment=<experiment> mode={sync,async}` (the full system: engines,
gateway, orchestrator, env service, trainer under local Ray) and times each run from "all components
serving" to the record of the last step (the shutdown after it is the same in both), the same number of
samples trained in both, in alternating rounds; then one sampled run of each mode for the busy/idle
timeline of engines, orchestrator and trainer (bench/timeline.py: <out>_{sync,async}.png). Sync: generate a batch, train,
push, repeat (the long tail of each batch stalls everything). Async: rollout never waits for training,
bounded by the staleness limit. Anchor: AReaL reports 2.77x.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.timeline import TimelineSampler, read_trainer_records, trainer_phases  # noqa: E402
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def stamp(line: str) -> float:
    return datetime.strptime(STAMP.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


EXPERIMENTS = {
    "async_vs_sync": "response lengths log-normal (median ~24, capped at 512 tokens)",
    "file_lookup": "the main job's episodes: 3 model turns and 2 `bash` calls in the namespace sandbox each, "
                   "the warm-up's weights as the start of both (model.path, warmup.steps=0)",
}
"""What the report says of each experiment's workload."""


def run(mode: str, steps: int, workdir: Path, overrides: list[str], timeline_png: Optional[Path] = None,
        experiment: str = "async_vs_sync") -> dict:
    """One run; with `timeline_png`, sampled by a TimelineSampler (which slows it: see bench/timeline.py)."""
    name = f"avs_{mode}"
    log = workdir / f"{name}.log"
    run_dir = workdir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    sampler = TimelineSampler(run_dir, name).start() if timeline_png else None
    with open(log, "w") as out_file:
        code = subprocess.call([sys.executable, "-m", "asyncrl_run.train", f"experiment={experiment}", f"mode={mode}",
                                f"name={name}", f"total_steps={steps}", f"run_dir={run_dir}", *overrides],
                               cwd=ROOT, stdout=out_file, stderr=subprocess.STDOUT)
    timeline = sampler.stop() if sampler else None
    if code != 0:
        raise SystemExit(f"{mode} run failed ({code}); see {log}")
    ready = next(stamp(l) for l in log.read_text().splitlines() if "asyncrl_run.launcher" in l and " mode, gateway " in l)
    records = read_trainer_records(run_dir, name)
    done = records[-1]["ts"]  # the last step's record, not the shutdown after it
    orchestrator = json.loads((run_dir / "config" / "orchestrator.json").read_text())
    result = {"train_wall_s": done - ready, "log": str(log), "stale_dropped": sum(r["filter_stale"] for r in records),
              "staleness_mean": statistics.mean(r["staleness_mean"] for r in records),
              "samples_per_step": orchestrator["groups_per_step"] * orchestrator["group_size"]}
    if timeline is not None:
        timeline.trainer = trainer_phases(records)
        timeline.plot(timeline_png, ready, done, f"{mode}: {done - ready:.1f} s from serving to step {steps} (sampled)")
        result["timeline"] = timeline.summary(ready, done)
    return result


FRACTIONS = [("engine_busy", "engines generating"), ("mean_in_flight", "episodes in flight (mean)"),
             ("trainer_wait", "trainer waiting for groups"), ("trainer_train", "trainer training"),
             ("trainer_push", "trainer pushing weights")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experiment", default="async_vs_sync", choices=sorted(EXPERIMENTS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3, help="sync/async pairs, run alternately (the machine's speed drifts)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "async_vs_sync"))
    p.add_argument("--workdir", default="/tmp/asyncrl-async-vs-sync")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for both runs, e.g. trainer.staleness_tau=1")
    args = p.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    rounds = [{mode: run(mode, args.steps, workdir, args.overrides, experiment=args.experiment)
               for mode in ("sync", "async")} for _ in range(args.rounds)]
    sampled = {mode: run(mode, args.steps, workdir, args.overrides, Path(f"{args.out}_{mode}.png"), args.experiment)
               for mode in ("sync", "async")}
    ratios = [r["sync"]["train_wall_s"] / r["async"]["train_wall_s"] for r in rounds]
    speedup = statistics.median(ratios)
    report = {"command": " ".join(["python", *sys.argv]), "experiment": args.experiment, "steps": args.steps,
              "samples_per_run": args.steps * rounds[0]["async"]["samples_per_step"],
              "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "rounds": rounds, "ratios": ratios,
              "speedup_median": speedup, "sampled": sampled}
    Path(args.out + ".json").write_text(json.dumps(report, indent=2))
    name = Path(args.out).name
    md = ["# Async versus sync", "", f"Command: `{report['command']}`  ",
          f"Same experiment (configs/experiment/{args.experiment}.yaml{' + ' + ' '.join(args.overrides) if args.overrides else ''}), "
          f"{report['samples_per_run']} samples trained per run, {EXPERIMENTS[args.experiment]}, 2 CPU cores, "
          f"load average {load_start[0]:.2f} at start; {args.rounds} rounds of sync then "
          "async. Wall time from all components serving to the last step's record.", "",
          "| round | sync | async | ratio | async: mean staleness, samples dropped as stale |", "|---|---|---|---|---|",
          *[f"| {i + 1} | {r['sync']['train_wall_s']:.1f} s | {r['async']['train_wall_s']:.1f} s | {x:.2f}x | "
            f"{r['async']['staleness_mean']:.2f}, {r['async']['stale_dropped']:.0f} |"
            for i, (r, x) in enumerate(zip(rounds, ratios))], "",
          f"Speedup of async over sync, median of the rounds: **{speedup:.2f}x** (AReaL's anchor: 2.77x on GPUs).", "",
          "Where the time goes: one more run of each mode, sampled by bench/timeline.py (20 Hz: the orchestrator's "
          "/v1/status, the engine's /metrics; the trainer's step records). The probes cost the engine CPU, so "
          f"these runs are slower (sync {sampled['sync']['train_wall_s']:.1f} s, async "
          f"{sampled['async']['train_wall_s']:.1f} s) and are not in the ratio above.", "",
          "| share of the window | sync | async |", "|---|---|---|",
          *[f"| {label} | {sampled['sync']['timeline'][key]:.2f} | {sampled['async']['timeline'][key]:.2f} |"
            for key, label in FRACTIONS], "",
          f"![sync]({name}_sync.png)", "", f"![async]({name}_async.png)", ""]
    Path(args.out + ".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
