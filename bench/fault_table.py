"""Issue 41's fault table, measured: the tiny demo with one component SIGKILLed mid-run, per fault: did the
run finish, how long until training moved past the step it was at, what was lost or trained twice, and
how many episodes were dispatched again (bench/results/fault_table.md).

    python bench/fault_table.py [--faults none,env,engine,trainer,gateway,orchestrator,redis] [--kill-at 5]
                                [--steps 12] [--out bench/results/fault_table]

"Groups lost" counts groups the trainer acknowledged but did not train (the staleness filter's drops
included: consumed, not trained) and groups acknowledged twice; "re-dispatched" is the orchestrator's
`retried` counter (episodes dispatched again after a failed attempt or a lost session).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from asyncrl_run.redis_server import EmbeddedRedis  # noqa: E402

OVERRIDES = ["warmup.steps=20", "trainer.groups_per_step=8", "trainer.checkpoint_every=4",
             "orchestrator.heartbeat_timeout_s=4", "orchestrator.heartbeat_interval_s=1",
             "rollout.health_check_interval_s=1"]
PID_FILES = {"env": "services/env-arithmetic-0.pid", "engine": "engines/engine-0.pid", "trainer": "trainer.pid",
             "gateway": "services/gateway.pid", "orchestrator": "services/orchestrator.pid"}
WHAT = {"none": "nothing killed", "env": "env service", "engine": "engine", "trainer": "trainer (between checkpoints)",
        "gateway": "gateway", "orchestrator": "orchestrator", "redis": "embedded redis-server"}


def read_run(run_dir: Path) -> dict:
    """The trainer's records, the acknowledged groups and the orchestrator's counters, from a copy of the AOF."""
    with tempfile.TemporaryDirectory() as copy:
        shutil.copytree(run_dir / "redis", copy, dirs_exist_ok=True)
        with EmbeddedRedis(copy) as server:
            r = redis.Redis.from_url(server.url)
            prefix = f"asyncrl:{run_dir.name}:"
            records = [{**msgpack.unpackb(f[b"data"], raw=False), "ts": float(f[b"ts"])}
                       for _, f in r.xrange(prefix + "metrics") if f[b"source"] == b"trainer"]
            acked = [msgpack.unpackb(e, raw=False)[0] for e in r.lrange(prefix + "consumed", 0, -1)]
            appended = [int(entry.split(b"-")[0]) / 1000 for entry, _ in r.xrange(prefix + "groups")]
            meta = {k.decode(): int(v) for k, v in r.hgetall(prefix + "orch:meta").items()
                    if v.decode().lstrip("-").isdigit()}
            r.close()
    return {"records": records, "acked": acked, "meta": meta, "appended": appended}


def live_step(run_dir: Path) -> int:
    try:
        r = redis.Redis.from_url((run_dir / "redis.url").read_text(), socket_timeout=5)
        entries = r.xrevrange(f"asyncrl:{run_dir.name}:metrics", count=50)
        r.close()
    except (OSError, redis.RedisError):
        return 0
    steps = [msgpack.unpackb(f[b"data"], raw=False)["step"] for _, f in entries if f[b"source"] == b"trainer"]
    return int(max(steps, default=0))


def kill(run_dir: Path, fault: str) -> None:
    if fault == "redis":
        r = redis.Redis.from_url((run_dir / "redis.url").read_text())
        pid = r.info("server")["process_id"]
        r.close()
    else:
        pid = int((run_dir / PID_FILES[fault]).read_text())
    os.kill(pid, signal.SIGKILL)


def one(fault: str, steps: int, kill_at: int, workdir: Path) -> dict:
    run_dir = workdir / f"fault_{fault}"
    log = open(workdir / f"fault_{fault}.log", "wb")
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl_run.train", "experiment=tiny_demo", f"name={run_dir.name}",
                             f"run_dir={run_dir}", f"total_steps={steps}", *OVERRIDES], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    killed_at = None
    try:
        while fault != "none" and killed_at is None and proc.poll() is None:
            if live_step(run_dir) >= kill_at:
                kill(run_dir, fault)
                killed_at = time.time()
            time.sleep(0.2)
        code = proc.wait(900)
    finally:
        if proc.poll() is None:
            proc.kill()
    wall_s = time.time() - started
    run = read_run(run_dir)
    records = run["records"]
    steps_seen = [int(r["step"]) for r in records]
    before = [r["ts"] for r in records if killed_at is None or r["ts"] < killed_at]
    interval = statistics.median(b - a for a, b in zip(before, before[1:])) if len(before) > 2 else None
    if fault == "none":  # the same measures from the moment a kill would have come: the no-fault baseline
        killed_at = next((r["ts"] for r in records if int(r["step"]) >= kill_at), None)
    rollout_gap_s = None  # the rollout's stall: the longest wait for a complete group from the kill on
    if killed_at is not None:
        after = [t for t in run["appended"] if t > killed_at]
        rollout_gap_s = round(max([b - a for a, b in zip([killed_at, *after], after)], default=0.0), 1)
    heal_s = None
    if killed_at is not None:
        at = max((int(r["step"]) for r in records if r["ts"] < killed_at), default=0)
        later = [r["ts"] for r in records if r["ts"] > killed_at and int(r["step"]) > at]
        heal_s = round(later[0] - killed_at, 1) if later else None
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    infrastructure = sum(n for env in summary.get("outcomes", {}).values() for cls, n in env.items()
                         if cls == "infrastructure")
    acked = run["acked"]
    return {"fault": fault, "what": WHAT[fault], "exit_code": code, "wall_s": round(wall_s, 1),
            "steps_done": len(set(steps_seen)), "steps_total": steps, "steps_redone": len(steps_seen) - len(set(steps_seen)),
            "heal_s": heal_s, "step_interval_s": round(interval, 2) if interval else None,
            "rollout_gap_s": rollout_gap_s,
            "groups_acked": len(acked), "groups_acked_twice": len(acked) - len(set(acked)),
            "groups_dropped_stale_or_failed": int(sum(r.get("filter_groups_dropped", 0) for r in records)),
            "episodes_redispatched": run["meta"].get("retried", 0), "episodes_failed_infrastructure": infrastructure}


def markdown(rows: list[dict], command: str, load: str) -> str:
    lines = ["# Faults: one component SIGKILLed mid-run, the run heals", "",
             f"Command: `{command}`  ", f"Machine: {os.uname().machine}, {os.cpu_count()} cores, load average at "
             f"start {load}. tiny_demo, {rows[0]['steps_total']} steps of 8 groups x 8, checkpoint every 4 steps; "
             "the kill comes when step 5 is recorded.", "",
             "Next step: seconds from the kill until a step past the one the run was at is recorded (a step "
             "takes the step interval when nothing fails; groups read ahead carry the trainer over a rollout "
             "stall). Rollout gap: the longest wait for a complete group from the kill on. The no-fault row "
             "measures both from the moment step 5 is recorded (no kill): the baseline. Dropped: groups acknowledged without training (stale or failed "
             "members; consumed by design, counted here). Twice: groups acknowledged twice (must be 0). "
             "Re-dispatched: the orchestrator's `retried` counter, which also counts the attempts its own shutdown "
             "cut at the run's end (the no-fault row).", "",
             "| fault | exit | steps | next step s (step interval) | rollout gap s | groups acked | twice | "
             "dropped | re-dispatched | infrastructure failures | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['exit_code']} | {r['steps_done']}/{r['steps_total']}"
                     f"{' (' + str(r['steps_redone']) + ' redone)' if r['steps_redone'] else ''} | "
                     f"{'-' if r['heal_s'] is None else r['heal_s']} ({r['step_interval_s']}) | "
                     f"{'-' if r['rollout_gap_s'] is None else r['rollout_gap_s']} | "
                     f"{r['groups_acked']} | {r['groups_acked_twice']} | "
                     f"{r['groups_dropped_stale_or_failed']} | {r['episodes_redispatched']} | "
                     f"{r['episodes_failed_infrastructure']} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="none,env,engine,trainer,gateway,orchestrator,redis")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench/results/fault_table"))
    args = p.parse_args()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    command = "python bench/fault_table.py " + " ".join(sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory(prefix="faults-") as workdir:
        for fault in args.faults.split(","):
            rows.append(one(fault, args.steps, args.kill_at, Path(workdir)))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out + ".json").write_text(json.dumps({"command": command, "load_at_start": load, "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(markdown(rows, command, load))
    print(markdown(rows, command, load))


if __name__ == "__main__":
    main()
