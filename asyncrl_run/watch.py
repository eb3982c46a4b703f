"""`asyncrl watch`: a live terminal dashboard of a run, and the summary of a finished one.

    asyncrl watch --run-dir runs/tiny_demo          # finds the run's Redis through <run_dir>/redis.url
    asyncrl watch --redis-url redis://host:6379/0 [--run tiny_demo] [--once]

While the run trains: progress with elapsed time and ETA, rollout and training throughput, reward,
staleness, weight version, whether the orchestrator holds new groups back and why (operator,
unconsumed_groups, staleness), and each environment's services, episodes in flight and outcomes.
Everything comes from the run's `metrics` stream and `services` hash (docs/store.md); the dashboard
holds no state of its own.

Once the run has finished (its last step trained, or its Redis gone after the run): a summary of
steps, wall time, reward of the first vs the last 10 steps, per-env outcome counts and the final
weights, from <run_dir>/summary.json (written by the launcher at the end of a run) and the metrics
stream; when the run's embedded Redis has stopped, from a replay of the Redis data the run dir keeps.

Exit codes: 0 after a frame, a summary or Ctrl-C; 1 when the run's Redis cannot be read; 2 when the
arguments do not name a run (a wrong --run-dir, no such run in that Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from redis.exceptions import ConnectionError as RedisConnectionError, RedisError
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

from asyncrl.store import Store
from asyncrl_run.redis_server import has_redis_data, replay_copy
from asyncrl_run.run_summary import REWARD_WINDOW, SUMMARY_FILE, format_duration
from asyncrl_run.stall import idle_s, pause_reasons_of, stall_cause, status_of_record
from orchestrator.run_record import envs_of
OUTCOME_CLASSES = ("model", "environment", "infrastructure", "cancelled")
COMMAND_TIMEOUT_S = 10.0


class WatchError(Exception):
    """The arguments name no run: one line for the user, exit 2."""


def stream_time(stream_id: str) -> float:
    """Unix time of a Redis stream entry (its id is milliseconds-sequence)."""
    return int(stream_id.split("-", 1)[0]) / 1000.0


@dataclass
class RunView:
    """The latest state of a run, folded from its metrics stream and `services` hash."""

    total_steps: int = 0
    mode: str = "?"
    services: dict[str, str] = field(default_factory=dict)
    trainer: dict[str, float] = field(default_factory=dict)
    trainer_times: list[float] = field(default_factory=list)
    """Stream time of every trainer record (one per step)."""
    rewards: list[float] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)
    """Every trainer record, in stream order, each with its stream time as `at` (the dashboard's curves)."""
    rollout_rate: list[tuple[float, float]] = field(default_factory=list)
    """(stream time, episodes_per_s) of every orchestrator record."""
    orchestrator: dict[str, float] = field(default_factory=dict)
    orchestrator_at: float = 0.0
    first_record_at: Optional[float] = None
    now: float = 0.0
    """Redis server time at the last refresh (the clock stream ids are written in)."""
    weights: Optional[str] = None
    after: str = "0-0"

    def fold(self, records: list[tuple[str, str, dict[str, float]]]) -> None:
        for stream_id, source, values in records:
            self.after = stream_id
            at = stream_time(stream_id)
            if self.first_record_at is None:
                self.first_record_at = at
            if source == "trainer":
                self.trainer = values
                self.trainer_times.append(at)
                self.rewards.append(values.get("reward_mean", 0.0))
                self.history.append({**values, "at": at})
            elif source == "orchestrator":
                # One shape per source: each record is the whole status. (Runs before issue 16 wrote two
                # shapes under this source, one without the env table: those are merged, not replaced.)
                has_envs = any(k.startswith("env/") for k in values)
                self.orchestrator = values if has_envs else {**self.orchestrator, **values}
                self.orchestrator_at = at
                if "episodes_per_s" in values:
                    self.rollout_rate.append((at, values["episodes_per_s"]))

    @property
    def step(self) -> int:
        return int(self.trainer.get("step", 0))

    @property
    def finished(self) -> bool:
        return self.total_steps > 0 and self.step >= self.total_steps

    @property
    def started_at(self) -> Optional[float]:
        started = self.services.get("started_at")
        return float(started) if started else self.first_record_at

    def elapsed_s(self) -> Optional[float]:
        end = self.trainer_times[-1] if self.finished and self.trainer_times else self.now
        return None if self.started_at is None or not end else max(0.0, end - self.started_at)

    def eta_s(self) -> Optional[float]:
        """Remaining steps at the pace of the last REWARD_WINDOW steps."""
        recent = self.trainer_times[-(REWARD_WINDOW + 1):]
        if len(recent) < 2 or not self.total_steps:
            return None
        per_step = (recent[-1] - recent[0]) / (len(recent) - 1)
        return max(0, self.total_steps - self.step) * per_step

    def pause_reasons(self) -> list[str]:
        return pause_reasons_of(self.orchestrator)

    def stall(self) -> Optional[dict[str, Any]]:
        """{idle_s, component, why} while a started, unfinished run has made no step for longer than the
        launcher's stall line waits (asyncrl_run/stall.py), else None. The orchestrator's record older than
        STATUS_STALE_S names the orchestrator: its figures here are that old."""
        since = self.services.get("training_started_at")
        since = float(since) if since else self.started_at  # a run launched before the field: its launch
        if self.finished or since is None or not self.now or not self.services:
            return None
        idle, stall_after = idle_s(self.now, since, self.trainer_times)
        if idle <= stall_after:
            return None
        status = status_of_record(self.orchestrator) if self.orchestrator else None
        component, why = stall_cause(status, self.now - self.orchestrator_at if self.orchestrator else 0.0)
        return {"idle_s": idle, "component": component, "why": why}


async def refresh(store: Store, view: RunView) -> RunView:
    view.services = {k.decode(): v.decode() for k, v in (await store.redis.hgetall(store.key("services"))).items()}
    view.total_steps = int(view.services.get("total_steps", view.total_steps or 0))
    view.mode = view.services.get("mode", view.mode)
    seconds, micros = await store.redis.time()
    view.now = seconds + micros / 1e6
    while True:  # in pages: a long run's stream holds up to ~100k records
        page = await store.read_metrics(after=view.after, count=10_000)
        view.fold(page)
        if len(page) < 10_000:
            break
    weights = await store.weights()
    if weights.served_version:
        at = f": {weights.snapshot}" if weights.snapshot and weights.snapshot_version == weights.served_version else ""
        view.weights = f"v{weights.served_version}{at}"
    return view


# Rendering --------------------------------------------------------------------------------------------
def duration(seconds: Optional[float]) -> str:
    return "-" if seconds is None else format_duration(seconds)


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _num(value: Optional[float], spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def render(view: RunView, run: str) -> Group:
    step, t, o = view.step, view.trainer, view.orchestrator
    total = max(view.total_steps, 1)
    head = Table.grid(expand=True)
    head.add_row(f"[bold]{run}[/] ({view.mode} mode)  step {step}/{view.total_steps or '?'}  "
                 f"elapsed {duration(view.elapsed_s())}  ETA {duration(view.eta_s())}")
    head.add_row(ProgressBar(total=total, completed=min(step, total)))
    reasons = view.pause_reasons()
    if not view.services:
        head.add_row("[dim]starting: the launcher records the run once its services serve[/]")
    elif not o:
        head.add_row("[dim]rollout: no orchestrator record yet[/]")
    elif reasons:
        head.add_row(f"[bold red]rollout paused[/]: new groups held back by {', '.join(reasons)}")
    else:
        head.add_row("[green]rollout dispatching[/]")
    stall = view.stall()
    if stall:
        head.add_row(f"[bold red]STALLED[/]: no step for {duration(stall['idle_s'])}: {stall['component']}: "
                     f"{stall['why']}")
    figures = Table(title="run", show_header=False, expand=True)
    recent = view.rewards[-REWARD_WINDOW:]
    rows = [
        ("reward (last step / mean of last 10)", f"{t.get('reward_mean', 0):.3f} / {_num(_mean(recent))}"),
        ("reward at first step", _num(view.rewards[0]) if view.rewards else "-"),
        ("rollout", f"{o.get('episodes_per_s', 0):.1f} episodes/s, {o.get('in_flight', 0):.0f} in flight, "
                    f"{o.get('settling', 0):.0f} settling, {o.get('queued', 0):.0f} queued"),
        ("training throughput", f"{t.get('tokens_per_s', 0):.0f} tokens/s"),
        ("weight version / staleness", f"{t.get('weight_version', 0):.0f} / {t.get('staleness_mean', 0):.2f}"),
        ("loss / masked fraction", f"{t.get('loss', 0):.4f} / {t.get('masked_fraction', 0):.3f}"),
        ("off-policy: mismatch KL / max |log ratio| / ESS fraction",  # docs/run.md "Off-policy health"
         f"{t.get('off_policy/mismatch_kl', 0):.2g} / {t.get('off_policy/max_abs_log_ratio', 0):.2f} / "
         f"{t.get('off_policy/ess_fraction', 0):.3f}"),
        ("step time: wait / train / push", f"{t.get('wait_s', 0):.2f} / {t.get('train_s', 0):.2f} / "
                                           f"{t.get('push_s', 0):.2f} s"),
        ("episodes completed / failed / retried", f"{o.get('completed', 0):.0f} / {o.get('failed', 0):.0f} / "
                                                    f"{o.get('retried', 0):.0f}"),
    ]
    for name, value in rows:
        figures.add_row(name, value)
    parts: list[Any] = [Panel(head), figures, env_table(envs_of(o))]
    urls = [f"{name} {view.services[key]}" for name, key in
            (("orchestrator", "orchestrator"), ("gateway", "gateway"), ("trainer /metrics", "trainer_metrics"))
            if view.services.get(key)]
    if urls:
        parts.append(f"[dim]{'  '.join(urls)}[/]")
    return Group(*parts)


def env_table(envs: dict[str, dict[str, float]]) -> Table:
    table = Table(title="environment services", expand=True)
    for column in ("env", "healthy services", "in flight", "queued", "completed", "failed",
                   "outcomes (model / environment / infrastructure)"):
        table.add_column(column)
    for env in sorted(envs):
        e = envs[env]
        healthy = e.get("healthy_services", 0)
        outcomes = " / ".join(f"{e.get(f'outcome_{cls}', 0):.0f}" for cls in OUTCOME_CLASSES[:3])
        table.add_row(env, f"[{'green' if healthy else 'red'}]{healthy:.0f}[/]", f"{e.get('in_flight', 0):.0f}",
                      f"{e.get('queued', 0):.0f}", f"{e.get('completed', 0):.0f}", f"{e.get('failed', 0):.0f}",
                      outcomes)
    return table


# The summary of a finished run --------------------------------------------------------------------------
@dataclass
class Summary:
    name: str
    steps: Optional[int] = None
    total_steps: Optional[int] = None
    wall_s: Optional[float] = None
    reward_first: Optional[float] = None
    reward_last: Optional[float] = None
    outcomes: dict[str, dict[str, float]] = field(default_factory=dict)
    final_weights: Optional[str] = None
    eval_command: Optional[str] = None
    reward_window: Optional[int] = None
    """Steps in each reward window (the launcher's summary uses fewer than REWARD_WINDOW in a short run)."""
    source: str = ""

    @classmethod
    def of_view(cls, view: RunView, run: str, source: str, run_dir: Optional[Path] = None) -> "Summary":
        """The summary of what the stream holds, by the launcher's rules (asyncrl_run/run_summary.py): reward
        windows of REWARD_WINDOW steps, fewer when the run has under two; the final weights are the HF
        export at <run_dir>/final once the trainer wrote it, else the last pushed snapshot."""
        outcomes = {}
        for env, values in envs_of(view.orchestrator).items():
            counts = {k[len("outcome_"):]: v for k, v in values.items() if k.startswith("outcome_") and "/" not in k}
            outcomes[env] = counts
        window = max(1, min(REWARD_WINDOW, len(view.rewards) // 2))
        final = run_dir / "final" if run_dir is not None else None
        weights = str(final) if final is not None and (final / "config.json").exists() else view.weights
        return cls(name=run, steps=view.step if view.trainer else None, total_steps=view.total_steps or None,
                   wall_s=view.elapsed_s() if view.trainer_times else None,
                   reward_first=_mean(view.rewards[:window]), reward_last=_mean(view.rewards[-window:]),
                   outcomes=outcomes, final_weights=weights, reward_window=window if view.rewards else None,
                   source=source)

    @classmethod
    def of_file(cls, data: dict[str, Any], run: str, source: str) -> "Summary":
        fields = {k: data.get(k) for k in ("steps", "total_steps", "wall_s", "reward_first", "reward_last",
                                           "final_weights", "eval_command", "reward_window")}
        outcomes = data.get("outcomes") if isinstance(data.get("outcomes"), dict) else {}
        return cls(name=str(data.get("name") or run), outcomes=outcomes, source=source, **fields)

    def merged(self, other: Optional["Summary"]) -> "Summary":
        """This summary with the fields it lacks taken from `other`."""
        if other is None:
            return self
        values = {k: getattr(self, k) if getattr(self, k) not in (None, {}, "") else getattr(other, k)
                  for k in self.__dataclass_fields__}
        values["source"] = " + ".join(filter(None, (self.source, other.source)))
        return Summary(**values)


def render_summary(s: Summary) -> Group:
    done = s.steps is not None and s.total_steps is not None and s.steps >= s.total_steps
    state = "finished" if done else "stopped"
    head = Table.grid(expand=True)
    head.add_row(f"[bold]{s.name}[/] {state}: {s.steps if s.steps is not None else '-'}/"
                 f"{s.total_steps if s.total_steps is not None else '-'} steps in {duration(s.wall_s)}")
    figures = Table(title="summary", show_header=False, expand=True)
    delta = (f" ({s.reward_last - s.reward_first:+.3f})" if s.reward_first is not None and s.reward_last is not None
             else "")
    figures.add_row(f"reward, first / last {s.reward_window or REWARD_WINDOW} steps",
                    f"{_num(s.reward_first)} -> {_num(s.reward_last)}{delta}")
    figures.add_row("final weights", s.final_weights or "-")
    if s.eval_command:
        figures.add_row("evaluate with", s.eval_command)
    outcomes = Table(title="episode outcomes by env", expand=True)
    names = sorted({o for counts in s.outcomes.values() for o in counts},
                   key=lambda o: (OUTCOME_CLASSES.index(o) if o in OUTCOME_CLASSES else len(OUTCOME_CLASSES), o))
    outcomes.add_column("env")
    for name in names:
        outcomes.add_column(name)
    for env in sorted(s.outcomes):
        outcomes.add_row(env, *(f"{float(s.outcomes[env].get(n, 0)):.0f}" for n in names))
    return Group(Panel(head), figures, outcomes, f"[dim]from {s.source}[/]")


# Finding the run --------------------------------------------------------------------------------------
@dataclass
class Target:
    redis_url: Optional[str]
    run: Optional[str]
    run_dir: Optional[Path]

    def summary_file(self, current_only: bool = False) -> Optional[dict[str, Any]]:
        """<run_dir>/summary.json; with `current_only`, None when a launch began after it was written (the
        launcher rewrites redis.url first thing at every start: a resumed run is running again)."""
        path = self.run_dir / SUMMARY_FILE if self.run_dir else None
        if path is None or not path.is_file():
            return None
        url_file = self.run_dir / "redis.url"
        if current_only and url_file.is_file() and url_file.stat().st_mtime > path.stat().st_mtime:
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise WatchError(f"{path} is not readable JSON ({err})") from None
        if not isinstance(data, dict):
            raise WatchError(f"{path} does not hold a summary object")
        return data


def resolve(args: argparse.Namespace) -> Target:
    """The run the arguments name; WatchError (one line) when they name none."""
    if not args.run_dir:
        return Target(args.redis_url, args.run, None)
    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        raise WatchError(f"no run directory at {run_dir}{_runs_near(run_dir)}")
    if not run_dir.is_dir():
        raise WatchError(f"{run_dir} is not a directory (give the run directory, e.g. runs/<name>)")
    url_file = run_dir / "redis.url"
    if not url_file.is_file() and not (run_dir / SUMMARY_FILE).is_file():
        raise WatchError(f"{run_dir} is not a run directory: it has no redis.url (a run writes it when it starts) "
                         f"nor {SUMMARY_FILE}{_runs_near(run_dir)}")
    redis_url = args.redis_url
    if redis_url is None and url_file.is_file():
        redis_url = url_file.read_text().strip()
        if not redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise WatchError(f"{url_file} does not hold a Redis URL ({redis_url[:60]!r})")
    return Target(redis_url, args.run, run_dir.resolve())


def _runs_near(run_dir: Path) -> str:
    parent = run_dir.parent if run_dir.parent.is_dir() else None
    runs = sorted(p.name for p in parent.iterdir() if (p / "redis.url").is_file()) if parent else []
    return f" (run directories in {parent}: {', '.join(runs[:10])})" if runs else ""


class NotStarted(Exception):
    """The Redis holds no run yet: a run starting up (the first keys come as its components start)."""


async def find_run(store: Store, wanted: Optional[str], run_dir: Optional[Path]) -> str:
    """The run's name: --run, else the run dir's name when that run is in this Redis, else the one run there."""
    runs = sorted({key.decode().split(":")[1] async for key in store.redis.scan_iter(match="asyncrl:*:*")})
    if not runs:
        raise NotStarted()
    if wanted:
        if wanted not in runs:
            raise WatchError(f"no run named {wanted!r} in the Redis at {_url(store)} (runs there: "
                             f"{', '.join(runs)})")
        return wanted
    if run_dir is not None and run_dir.name in runs:
        return run_dir.name
    if len(runs) == 1:
        return runs[0]
    raise WatchError(f"several runs in the Redis at {_url(store)}: {', '.join(runs)}; name one with --run")


def _url(store: Store) -> str:
    kw = store.redis.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


# The command ------------------------------------------------------------------------------------------
async def watch(target: Target, interval_s: float, once: bool, console: Optional[Console] = None) -> int:
    console = console or Console()
    if target.redis_url is None:  # a run dir with a summary only
        path = str(target.run_dir / SUMMARY_FILE)
        console.print(render_summary(Summary.of_file(target.summary_file(), target.run_dir.name, path)))
        return 0
    store = Store.connect(target.redis_url, target.run or "", command_timeout_s=COMMAND_TIMEOUT_S)
    try:
        try:
            await store.redis.ping()
        except RedisConnectionError:
            return await finished_without_redis(target, console)
        store.run = run = await wait_for_run(store, target, interval_s, once, console)
        if run is None:
            return 0
        view = await refresh(store, RunView())
        summary_file = target.summary_file(current_only=True)
        file_summary = (Summary.of_file(summary_file, run, str(target.run_dir / SUMMARY_FILE))
                        if summary_file is not None else None)
        if view.finished or (file_summary is not None and (file_summary.steps or 0) >= view.step):
            console.print(render_summary(merge(file_summary, Summary.of_view(view, run, "the run's metrics stream",
                                                                                target.run_dir))))
            return 0
        if once:
            console.print(render(view, run))
            return 0
        try:
            with Live(render(view, run), console=console, refresh_per_second=4) as live:
                while not view.finished:
                    await asyncio.sleep(interval_s)
                    live.update(render(await refresh(store, view), run))
        except RedisConnectionError:  # the run ended and its embedded Redis with it, maybe before its last read
            summary_file = await _await_summary(target)
            fallback = Summary.of_view(view, run, "the run's metrics stream as last read", target.run_dir)
            data_dir = target.run_dir / "redis" if target.run_dir is not None else None
            if summary_file is None and has_redis_data(data_dir):
                fallback = await replay(data_dir, run, target.run_dir) or fallback
        else:
            summary_file = target.summary_file(current_only=True)
            fallback = Summary.of_view(view, run, "the run's metrics stream", target.run_dir)
        console.print(render_summary(merge(
            Summary.of_file(summary_file, run, str(target.run_dir / SUMMARY_FILE)) if summary_file else None,
            fallback)))
        return 0
    finally:
        await store.close()


async def wait_for_run(store: Store, target: Target, interval_s: float, once: bool, console: Console) -> Optional[str]:
    """The run's name once its first component has written to Redis (None: --once, and none has yet)."""
    waiting = f"[dim]waiting for the run to start: nothing of it in the Redis at {target.redis_url} yet[/]"
    try:
        return await find_run(store, target.run, target.run_dir)
    except NotStarted:
        if once:
            console.print(waiting)
            return None
    with Live(waiting, console=console, refresh_per_second=4, transient=True):
        while True:
            await asyncio.sleep(interval_s)
            try:
                return await find_run(store, target.run, target.run_dir)
            except NotStarted:
                pass


def merge(primary: Optional[Summary], fallback: Summary) -> Summary:
    return primary.merged(fallback) if primary is not None else fallback


async def _await_summary(target: Target, timeout_s: float = 10.0) -> Optional[dict[str, Any]]:
    """The launcher writes summary.json as the run ends, about when its Redis stops: give it a moment."""
    deadline = time.monotonic() + timeout_s
    while target.run_dir is not None and time.monotonic() < deadline:
        data = target.summary_file(current_only=True)
        if data is not None:
            return data
        await asyncio.sleep(0.5)
    return None


async def finished_without_redis(target: Target, console: Console) -> int:
    """The run's Redis is gone: the summary from what the run dir keeps: its summary.json, else a replay of
    its Redis data, else a summary.json from before the last launch (a resumed run that stopped early)."""
    name = target.run or (target.run_dir.name if target.run_dir else "?")
    path = str(target.run_dir / SUMMARY_FILE) if target.run_dir else ""
    current = target.summary_file(current_only=True)
    summary = Summary.of_file(current, name, path) if current is not None else None
    data_dir = target.run_dir / "redis" if target.run_dir else None
    if summary is None and has_redis_data(data_dir):
        summary = await replay(data_dir, target.run, target.run_dir)
    older = target.summary_file() if summary is None else None
    if older is not None:
        summary = Summary.of_file(older, name, f"{path}, written before the last launch of the run")
    if summary is None:
        hint = f" and {target.run_dir} keeps no {SUMMARY_FILE} nor Redis data" if target.run_dir else ""
        print(f"asyncrl watch: cannot reach the run's Redis at {target.redis_url} (has the run ended?){hint}",
              file=sys.stderr)
        return 1
    console.print(render_summary(summary))
    return 0


async def replay(data_dir: Path, wanted: Optional[str], run_dir: Path) -> Optional[Summary]:
    """Start a private redis-server on a copy of the run's Redis data (AOF) and read the run's summary from it."""
    with ExitStack() as stack:
        server = await asyncio.to_thread(stack.enter_context, replay_copy(data_dir))
        store = Store.connect(server.url, "", command_timeout_s=60)
        try:
            try:
                store.run = run = await find_run(store, wanted, run_dir)
            except NotStarted:
                return None
            view = await refresh(store, RunView())
            return Summary.of_view(view, run, f"the run's Redis data in {data_dir} (replayed)", run_dir)
        finally:
            await store.close()
            await asyncio.to_thread(stack.close)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="asyncrl watch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", help="the run directory (its redis.url names the run's Redis)")
    p.add_argument("--redis-url")
    p.add_argument("--run", help="run name (default: the run directory's name, else the one run in that Redis)")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    args = p.parse_args(argv)
    if not args.redis_url and not args.run_dir:
        p.error("give --run-dir or --redis-url")
    try:
        target = resolve(args)
        code = asyncio.run(watch(target, args.interval, args.once))
    except KeyboardInterrupt:
        code = 0
    except WatchError as err:
        print(f"asyncrl watch: {err}", file=sys.stderr)
        code = 2
    except RedisConnectionError:
        print(f"asyncrl watch: cannot reach the run's Redis at {args.redis_url or target.redis_url} "
              "(has the run ended?)", file=sys.stderr)
        code = 1
    except RedisError as err:  # e.g. a stalled server: no answer within the command timeout
        print(f"asyncrl watch: the run's Redis failed: {err}", file=sys.stderr)
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    main()
