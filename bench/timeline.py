"""Per-component busy/idle timeline of a running asyncrl job, for finding the bubbles of a schedule.

    sampler = TimelineSampler(run_dir, run_name).start()   # while `python -m asyncrl_run.train ...` runs
    ...
    timeline = sampler.stop()                               # -> Timeline (the probes)
    timeline.trainer = trainer_phases(read_trainer_records(run_dir, run_name))
    timeline.summary(t0, t1), timeline.plot(path, t0, t1, title)

Sources, all of them the job's own interfaces: every `period_s` the orchestrator's /v1/status (episodes
in flight, pause reasons) and each engine's /metrics (`sglang_num_running_reqs`); after the run the
trainer's step records (read_trainer_records, trainer_phases). The probes cost the engine process CPU:
at 20 Hz they slowed sync runs by a quarter or more, so time runs without a sampler and sample others.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import redis


@dataclass
class Probe:
    t: float
    in_flight: int
    pause_reasons: list[str]
    engine_running: int


@dataclass
class Timeline:
    probes: list[Probe] = field(default_factory=list)
    trainer: list[tuple[str, float, float]] = field(default_factory=list)
    """(phase, start, end) with phase in wait / train / push, wall-clock seconds."""

    def summary(self, t0: float, t1: float) -> dict[str, float]:
        """Fractions of [t0, t1]: engines generating / idle, orchestrator paused (by reason), trainer
        waiting for groups / training / pushing."""
        window = [p for p in self.probes if t0 <= p.t <= t1]
        n = max(len(window), 1)
        out = {"window_s": t1 - t0, "probes": len(window),
               "engine_busy": sum(p.engine_running > 0 for p in window) / n,
               "orchestrator_paused": sum(bool(p.pause_reasons) for p in window) / n,
               "mean_in_flight": sum(p.in_flight for p in window) / n}
        for reason in sorted({r for p in window for r in p.pause_reasons}):
            out[f"paused_{reason}"] = sum(reason in p.pause_reasons for p in window) / n
        for phase in ("wait", "train", "push"):
            spent = sum(max(0.0, min(e, t1) - max(s, t0)) for ph, s, e in self.trainer if ph == phase)
            out[f"trainer_{phase}"] = spent / max(t1 - t0, 1e-9)
        return out

    def plot(self, path: Path, t0: float, t1: float, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(3, 1, figsize=(11, 5), sharex=True, gridspec_kw={"height_ratios": [2, 2, 1]})
        ts = [p.t - t0 for p in self.probes]
        axes[0].plot(ts, [p.engine_running for p in self.probes], lw=0.8, label="engine running requests")
        axes[0].plot(ts, [p.in_flight for p in self.probes], lw=0.8, label="orchestrator episodes in flight")
        axes[0].legend(loc="upper right", fontsize=7)
        colours = {"wait": "#bbbbbb", "train": "#1f77b4", "push": "#d62728"}
        for phase, s, e in self.trainer:
            axes[1].axvspan(s - t0, e - t0, color=colours[phase], lw=0)
        axes[1].set_yticks([])
        axes[1].set_ylabel("trainer")
        axes[1].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()],
                       labels=list(colours), loc="upper right", fontsize=7, ncol=3)
        paused = [1 if p.pause_reasons else 0 for p in self.probes]
        axes[2].fill_between(ts, paused, step="post", color="#ff7f0e", lw=0)
        axes[2].set_yticks([])
        axes[2].set_ylabel("orch.\npaused", fontsize=8)
        axes[2].set_xlim(0, t1 - t0)
        axes[2].set_xlabel("seconds since all components serve")
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


class TimelineSampler:
    def __init__(self, run_dir: Path, run: str, period_s: float = 0.05) -> None:
        self.run_dir, self.run, self.period_s = Path(run_dir), run, period_s
        self.timeline = Timeline()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._redis: Optional[redis.Redis] = None

    def start(self) -> "TimelineSampler":
        self._thread.start()
        return self

    def stop(self) -> Timeline:
        self._stop.set()
        self._thread.join()
        return self.timeline

    def _key(self, name: str) -> str:
        return f"asyncrl:{self.run}:{name}"

    def _sample(self) -> None:
        http = httpx.Client(timeout=2.0)
        orchestrator, engines = None, []
        while not self._stop.is_set():
            started = time.time()
            try:
                if self._redis is None and (self.run_dir / "redis.url").exists():
                    self._redis = redis.Redis.from_url((self.run_dir / "redis.url").read_text().strip())
                if self._redis is not None and orchestrator is None:
                    orchestrator = (self._redis.hget(self._key("services"), "orchestrator") or b"").decode() or None
                if self._redis is not None:
                    engines = [u.decode() for u in self._redis.hgetall(self._key("engines")).values()]
                if orchestrator:
                    status = http.get(f"{orchestrator}/v1/status").json()
                    running = sum(_running(http, url) for url in engines)
                    self.timeline.probes.append(Probe(started, status["in_flight"], status["pause_reasons"], running))
            except (httpx.HTTPError, redis.RedisError, OSError, KeyError, ValueError):
                pass  # starting up or shutting down
            self._stop.wait(max(0.0, self.period_s - (time.time() - started)))
        http.close()


def read_trainer_records(run_dir: Path, run: str) -> list[dict[str, float]]:
    """The finished run's trainer step records (each with its `ts`), from a copy of its Redis AOF."""
    import shutil
    import tempfile

    import msgpack

    from asyncrl_run.redis_server import EmbeddedRedis

    with tempfile.TemporaryDirectory() as copy:  # never touch the run's own files
        shutil.copytree(Path(run_dir) / "redis", copy, dirs_exist_ok=True)
        with EmbeddedRedis(copy) as server:
            client = redis.Redis.from_url(server.url)
            entries = client.xrange(f"asyncrl:{run}:metrics")
            client.close()
    return [{**msgpack.unpackb(f[b"data"], raw=False), "ts": float(f[b"ts"])} for _, f in entries
            if f[b"source"] == b"trainer"]


def trainer_phases(records: list[dict[str, float]]) -> list[tuple[str, float, float]]:
    """(phase, start, end) of each step: a record's ts is the step's end; wait_s, train_s and push_s lay
    out the step before it."""
    phases = []
    for values in records:
        start = values["ts"] - values["step_s"]
        wait_end = start + values["wait_s"]
        train_end = wait_end + values["train_s"]
        phases += [("wait", start, wait_end), ("train", wait_end, train_end)]
        if values.get("push_s"):
            phases.append(("push", train_end, train_end + values["push_s"]))
    return phases


def _running(http: httpx.Client, engine_url: str) -> int:
    for line in http.get(f"{engine_url}/metrics").text.splitlines():
        if line.startswith("sglang_num_running_reqs"):
            return int(float(line.split()[-1]))
    return 0
