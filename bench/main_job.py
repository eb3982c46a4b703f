"""The main job's learning figures: `make run`'s experiment, then `asyncrl eval` of its warm-up and of its final
weights on the held-out tasks, and the agent metrics of every step (bench/results/main_job.md).

    python bench/main_job.py [--experiment file_lookup] [--samples 8] [--out bench/results/main_job]
                             [--run-dir DIR] [--reuse] [OVERRIDE ...]

--reuse reports on a run dir whose run finished (its summary.json) instead of training again.
The claim the figures back is the README's: RL, not the warm-up, raises held-out pass@1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.timeline import read_trainer_records  # noqa: E402

AGENT = ["reward_mean", "rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_call_parse_failures_mean",
         "rollout/tool_errors_mean", "rollout/episode_len_mean"]


def train(experiment: str, run_dir: Path, overrides: list[str]) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "asyncrl_run.train", f"experiment={experiment}", f"run_dir={run_dir}",
                    *overrides], cwd=ROOT, check=True)
    return time.monotonic() - started


def evaluate(experiment: str, weights: Path, samples: int, out: Path, overrides: list[str]) -> dict:
    """`asyncrl eval` of `weights` with the run's own overrides: the held-out tasks of the env it trained on."""
    subprocess.run([sys.executable, "-m", "asyncrl_run.cli", "eval", f"experiment={experiment}", *overrides,
                    "--model", str(weights), "--samples", str(samples), "--k", f"1,4,{samples}", "--out", str(out)],
                   cwd=ROOT, check=True)
    return json.loads(out.read_text())


def window_means(records: list[dict], size: int = 10) -> list[dict]:
    """The agent metrics averaged over consecutive windows of `size` steps."""
    out = []
    for start in range(0, len(records), size):
        window = records[start:start + size]
        out.append({"steps": f"{int(window[0]['step'])}-{int(window[-1]['step'])}",
                    **{k: sum(r.get(k, 0.0) for r in window) / len(window) for k in AGENT}})
    return out


def cpu_model() -> str:
    """The host's CPU (the warm-up's outcome has differed by CPU: docs/envs.md "File lookup")."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    return "unknown"


def report(args, run_dir: Path, wall_s, results: dict, windows: list[dict], load: tuple) -> list[str]:
    base, final = results["warmup"], results["final"]
    ks = list(base["pass_at_k"])
    rows = [f"| {name} | {r['mean_reward']:.3f} | " + " | ".join(f"{r['pass_at_k'][k]:.3f}" for k in ks)
            + f" | {r['agent']['tool_calls_mean']:.2f} | {r['agent']['tool_call_parse_failures_mean']:.2f} |"
            for name, r in (("base (warm-up)", base), ("trained (final)", final))]
    return ["# The main job: held-out pass@1 before and after RL", "",
            f"Command: `{' '.join(['python', *sys.argv])}` (load average {load[0]:.2f} at start; host: {cpu_model()}).  ",
            f"Run: `python -m asyncrl_run.train experiment={args.experiment}` (what `make run` runs)"
            + (f", {wall_s:.0f} s wall, start-up and warm-up included" if wall_s else "") + f"; run dir {run_dir}.  ",
            f"Eval: `asyncrl eval experiment={args.experiment}{''.join(' ' + o for o in args.overrides)} --model <run_dir>/<weights> --samples {args.samples}`, "
            f"{base['n_tasks']} held-out tasks x {args.samples} samples at temperature "
            f"{base['sampling']['temperature']:g}, {base['failed_episodes'] + final['failed_episodes']} failed episodes.",
            "", "| weights | mean reward | " + " | ".join(f"pass@{k}" for k in ks)
            + " | tool calls | parse failures |", "|---|---|" + "---|" * (len(ks) + 2), *rows, "",
            "(tool calls and tool-call parse failures per held-out sample: the eval result's `agent`.)", "",
            f"RL raised held-out pass@1 by **{final['pass_at_k']['1'] - base['pass_at_k']['1']:+.3f}**.", "",
            "Agent metrics per sample, means over windows of 10 steps (the trainer's step records):", "",
            "| steps | reward | turns | tool calls | parse failures | tool errors | tokens |", "|---|---|---|---|---|---|---|",
            *[f"| {w['steps']} | " + " | ".join(f"{w[k]:.3f}" for k in AGENT) + " |" for w in windows], ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default="file_lookup")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "main_job"))
    p.add_argument("--run-dir", default="/tmp/asyncrl-main-job")
    p.add_argument("--reuse", action="store_true", help="report on the finished run in --run-dir")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    run_dir, load = Path(args.run_dir), os.getloadavg()
    wall_s = None if args.reuse else train(args.experiment, run_dir, args.overrides)
    summary = json.loads((run_dir / "summary.json").read_text())
    results = {w: evaluate(args.experiment, run_dir / w, args.samples, Path(f"{args.out}_{w}.json"), args.overrides)
               for w in ("warmup", "final")}
    windows = window_means([r for r in read_trainer_records(run_dir, summary["name"]) if "step" in r])
    Path(args.out + "_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = report(args, run_dir, wall_s or summary["wall_s"], results, windows, load)
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
