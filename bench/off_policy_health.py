"""What the off-policy health metrics (trainer/off_policy.py) read on a healthy run and on one that breaks.

    python bench/off_policy_health.py [--steps 15] [--out bench/results/off_policy_health]

Two tiny_demo runs from the same warm-up and seed: the experiment's own trainer.lr (1e-4), and 30x that
(3e-3), which moves the policy so far per step that the samples in flight (one or two versions old) no
longer come from anything like it. Per step: reward, mismatch KL, max |log ratio|, the fraction masked below
and above the trust band, the ESS fraction of the IS weights, entropy, staleness and response length, read
back from each run's metrics stream. docs/run.md "Off-policy health" quotes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.demo_report import read_run  # noqa: E402

RUNS = {"healthy (lr 1e-4)": [], "too hot (lr 3e-3)": ["trainer.lr=3e-3"]}
COLUMNS = {"reward_mean": "reward", "off_policy/mismatch_kl": "mismatch KL",
           "off_policy/max_abs_log_ratio": "max abs log ratio", "off_policy/masked_low_fraction": "masked low",
           "off_policy/masked_high_fraction": "masked high", "off_policy/ess_fraction": "ESS fraction",
           "off_policy/entropy": "entropy", "staleness_mean": "staleness", "rollout/response_len_mean": "response len"}


def run(name: str, overrides: list[str], steps: int, workdir: Path) -> list[dict[str, float]]:
    run_dir = workdir / name
    subprocess.run([sys.executable, "-m", "asyncrl_run.train", "experiment=tiny_demo", f"name={name}",
                    f"run_dir={run_dir}", f"total_steps={steps}", *overrides], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return read_run(run_dir, name)


def table(records: list[dict[str, float]]) -> list[str]:
    lines = ["| step | " + " | ".join(COLUMNS.values()) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for r in records:
        lines.append(f"| {int(r['step'])} | " + " | ".join(f"{r.get(k, float('nan')):.3g}" for k in COLUMNS) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default=str(ROOT / "bench/results/off_policy_health"))
    args = parser.parse_args()
    results = {"command": f"python bench/off_policy_health.py --steps {args.steps}", "load_avg_start": os.getloadavg(),
               "runs": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for k, (label, overrides) in enumerate(RUNS.items()):
            results["runs"][label] = run(f"health{k}", overrides, args.steps, Path(workdir))
    results["load_avg_end"] = os.getloadavg()
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = ["# Off-policy health on tiny_demo: a healthy run and one whose policy moves too fast", "",
             f"`{results['command']}`; load average at the start {results['load_avg_start'][0]:.2f}, at the end "
             f"{results['load_avg_end'][0]:.2f} (2 cores). Both runs: the same warm-up, seed and async settings "
             "(staleness_tau 2); only trainer.lr differs. Definitions: docs/run.md \"Off-policy health\".", ""]
    for label, records in results["runs"].items():
        lines += [f"## {label}", "", *table(records), ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
