"""`asyncrl watch`: a live terminal dashboard of a run, read from the run's Redis.

    asyncrl watch --run-dir runs/tiny_demo          # finds the run's Redis through <run_dir>/redis.url
    asyncrl watch --redis-url redis://host:6379/0 --run tiny_demo [--once]

Shows training progress, rollout and training throughput, reward, staleness, weight version and the
health of every environment service. Everything comes from the `metrics` stream
and the `services` hash (docs/store.md); the dashboard holds no state of its own.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

from asyncrl.store import Store


@dataclass
class RunView:
    """The latest state of a run, folded from its metrics stream."""

    total_steps: int = 0
    mode: str = "?"
    trainer: dict[str, float] = field(default_factory=dict)
    orchestrator: dict[str, float] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    after: str = "0-0"

    def fold(self, records: list[tuple[str, str, dict[str, float]]]) -> None:
        for stream_id, source, values in records:
            self.after = stream_id
            if source == "trainer":
                self.trainer = values
                self.rewards.append(values.get("reward_mean", 0.0))
            elif source == "orchestrator":
                self.orchestrator = values


async def refresh(store: Store, view: RunView) -> RunView:
    services = {k.decode(): v.decode() for k, v in (await store.redis.hgetall(store.key("services"))).items()}
    view.total_steps = int(services.get("total_steps", view.total_steps or 0))
    view.mode = services.get("mode", view.mode)
    view.fold(await store.read_metrics(after=view.after, count=100_000))
    return view


def render(view: RunView, run: str) -> Group:
    step = int(view.trainer.get("step", 0))
    total = max(view.total_steps, 1)
    head = Table.grid(expand=True)
    head.add_row(f"[bold]{run}[/] ({view.mode} mode)  step {step}/{view.total_steps}")
    head.add_row(ProgressBar(total=total, completed=min(step, total)))
    figures = Table(title="run", show_header=False, expand=True)
    t, o = view.trainer, view.orchestrator
    recent = view.rewards[-10:]
    rows = [
        ("reward (last step / mean of last 10)", f"{t.get('reward_mean', 0):.3f} / {sum(recent) / max(len(recent), 1):.3f}"),
        ("reward at first step", f"{view.rewards[0]:.3f}" if view.rewards else "-"),
        ("rollout throughput", f"{o.get('episodes_per_s', 0):.1f} episodes/s, {o.get('in_flight', 0):.0f} in flight"),
        ("training throughput", f"{t.get('tokens_per_s', 0):.0f} tokens/s"),
        ("weight version / staleness", f"{t.get('weight_version', 0):.0f} / {t.get('staleness_mean', 0):.2f}"),
        ("loss / masked fraction", f"{t.get('loss', 0):.4f} / {t.get('masked_fraction', 0):.3f}"),
        ("episodes completed / failed / retried", f"{o.get('completed', 0):.0f} / {o.get('failed', 0):.0f} / "
                                                    f"{o.get('retried', 0):.0f}"),
    ]
    for name, value in rows:
        figures.add_row(name, value)
    health = Table(title="environment services", expand=True)
    health.add_column("env")
    health.add_column("healthy services")
    health.add_column("in flight")
    envs = sorted({k.split("/")[1] for k in o if k.startswith("env/")})
    for env in envs:
        healthy = o.get(f"env/{env}/healthy_services", 0)
        health.add_row(env, f"[{'green' if healthy else 'red'}]{healthy:.0f}[/]", f"{o.get(f'env/{env}/in_flight', 0):.0f}")
    return Group(Panel(head), figures, health)


async def watch(redis_url: str, run: str, interval_s: float, once: bool, console: Optional[Console] = None) -> None:
    store = Store.connect(redis_url, run)
    view = RunView()
    console = console or Console()
    try:
        if once:
            console.print(render(await refresh(store, view), run))
            return
        with Live(render(view, run), console=console, refresh_per_second=4) as live:
            while True:
                live.update(render(await refresh(store, view), run))
                await asyncio.sleep(interval_s)
    finally:
        await store.close()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="asyncrl watch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", help="the run directory (its redis.url names the run's Redis)")
    p.add_argument("--redis-url")
    p.add_argument("--run", help="run name (default: the run directory's name)")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    args = p.parse_args(argv)
    if not args.redis_url and not args.run_dir:
        p.error("give --run-dir or --redis-url")
    redis_url = args.redis_url or (Path(args.run_dir) / "redis.url").read_text().strip()
    run = args.run or Path(args.run_dir).name
    try:
        asyncio.run(watch(redis_url, run, args.interval, args.once))
    except KeyboardInterrupt:
        pass
    except RedisConnectionError:
        raise SystemExit(f"asyncrl watch: cannot reach the run's Redis at {redis_url} (has the run ended?)")
    except RedisError as err:  # e.g. a stalled server: no answer within the Store's command timeout
        raise SystemExit(f"asyncrl watch: the run's Redis at {redis_url} failed: {err}")


if __name__ == "__main__":
    main()
