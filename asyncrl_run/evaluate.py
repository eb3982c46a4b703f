"""`asyncrl eval`: score a checkpoint on an env's held-out tasks, without training.

    asyncrl eval experiment=tiny_demo --model runs/tiny_demo/weights/v00000150 [--env arithmetic]
        [--split eval] [--samples 8] [--k 1,8] [--tasks N] [--temperature 0] [--out result.json]
    asyncrl eval experiment=tiny_demo model.path=PATH [any other Hydra override]

The config is the run's (Hydra, the same groups and validation as `asyncrl_run.train`), and so is every
piece that plays an episode: the launcher starts the engines, the gateway, the orchestrator and the env
service exactly as in training, and the orchestrator runs every episode's lifecycle (session, dispatch,
deadline, retries up to `orchestrator.max_attempts`, finish) with the training run's rules. What makes it an
evaluation is its orchestrator section (`eval_section`): `--samples` episodes per task of the split (a group
per task, `orchestrator.task_split`), one pass over the env's tasks in its own order, every group recorded,
and nothing waiting for a trainer (there is none). The result is read from the groups it recorded.

Nothing reaches a training run: the evaluation runs under a name of its own (`<name>-eval-<stamp>`, its
Redis keys and Ray actor names) with its own embedded Redis under `<run_dir>/eval/<stamp>-<env>/`, where
the gateway records its trajectories (the `samples` stream) and the orchestrator its groups (the
`groups` stream, which no trainer reads), and the services write their logs. The result is JSON (`result.json` there, or `--out`): mean reward,
pass@k for every k asked (the unbiased estimator of Chen et al. 2021, "Evaluating Large Language
Models Trained on Code": 1 - C(n-c, k) / C(n, k) for n samples of which c pass, averaged over tasks),
the number of tasks and every task's rewards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from asyncrl.auth import bearer_headers
from asyncrl.config import CONFIG_DIR, EnvServiceConfig, OrchestratorConfig, RunConfig, register_configs, to_dataclass

log = logging.getLogger("asyncrl.eval")


# pass@k ------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from n samples of which c passed: 1 - C(n-c, k) / C(n, k), computed
    as a product (no huge binomials). The probability that k samples drawn without replacement from the
    n contain at least one that passed."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def summarize(rewards: dict[str, list[float]], ks: list[int], threshold: float = 1.0,
              failed: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """Mean reward over all scored episodes, and pass@k averaged over the tasks with at least k scored
    samples (a sample passes when its reward >= threshold)."""
    failed = failed or {}
    tasks, per_k = [], {k: [] for k in ks}
    for task_id, values in rewards.items():
        n, c = len(values), sum(r >= threshold for r in values)
        scores = {str(k): pass_at_k(n, c, k) for k in ks if k <= n}
        for k, value in scores.items():
            per_k[int(k)].append(value)
        tasks.append({"task_id": task_id, "n": n, "passed": c, "failed": failed.get(task_id, 0),
                      "mean_reward": sum(values) / n if n else None, "pass_at_k": scores, "rewards": values})
    scored = [r for values in rewards.values() for r in values]
    return {"mean_reward": sum(scored) / len(scored) if scored else None,
            "pass_at_k": {str(k): (sum(v) / len(v) if v else None) for k, v in per_k.items()},
            "pass_at_k_tasks": {str(k): len(v) for k, v in per_k.items()},
            "episodes": len(scored), "failed_episodes": sum(failed.values()), "tasks": tasks}


# The evaluation ----------------------------------------------------------------------------------
@dataclass
class EvalSpec:
    env: EnvServiceConfig
    split: str = "eval"
    samples: int = 8
    ks: list[int] = field(default_factory=lambda: [1, 8])
    num_tasks: Optional[int] = None
    """The first N tasks of the split (its stable order); None = all."""
    pass_threshold: float = 1.0
    out: Optional[Path] = None


class EvalError(RuntimeError):
    """The evaluation cannot be run as asked (no such split, no tasks, ...): exit 2 with the message."""


# Running it ---------------------------------------------------------------------------------------
def model_dir(path: str) -> str:
    """An HF checkpoint directory (config.json); a trainer checkpoint's directory (model/) is taken too."""
    p = Path(path).expanduser().resolve()
    if (p / "config.json").exists():
        return str(p)
    if (p / "model" / "config.json").exists():
        return str(p / "model")
    raise EvalError(f"--model {path}: no HF checkpoint there (config.json + safetensors; a run writes them "
                    f"to <run_dir>/warmup, <run_dir>/weights/v*, <run_dir>/checkpoints/step-*/model)")


def run_eval(cfg: RunConfig, spec: EvalSpec, signals: Any = None) -> tuple[dict[str, Any], Path]:
    """Start engines, gateway and env service(s) as the launcher does, play the split, write the JSON.
    `signals`: the launcher's StopSignals (installed again after ray.init, as the launcher does)."""
    if not cfg.model.path:
        raise EvalError("no model: pass --model PATH or model.path=PATH (an HF checkpoint directory, e.g. "
                        f"{cfg.run_dir}/final or {cfg.run_dir}/warmup)")
    model = model_dir(cfg.model.path)
    ecfg = _eval_config(cfg, spec, model)
    eval_dir = Path(ecfg.run_dir)
    _log_to(eval_dir / "eval.log")
    out = (spec.out or eval_dir / "result.json").resolve()
    started = time.monotonic()
    played = _play_on_services(ecfg, spec, model, signals)
    result = _result(cfg, ecfg, spec, model, played, time.monotonic() - started)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    return result, out


def _eval_config(cfg: RunConfig, spec: EvalSpec, model: str) -> RunConfig:
    """The evaluation's own run: its name prefixes Redis keys, Ray actor names and the engines registry
    the gateway follows, so nothing here touches a training run, even on a shared Redis or Ray cluster.
    redis.data_dir is the training run's: the evaluation's embedded server keeps its own AOF in its
    directory (run_dir: <run_dir>/eval/<stamp>-<env>, created here)."""
    from asyncrl_run.launcher import resolve_run_dir

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2)
    eval_dir = resolve_run_dir(cfg.run_dir) / "eval" / f"{stamp}-{spec.env.name}"
    eval_dir.mkdir(parents=True, exist_ok=True)
    return replace(cfg, name=f"{cfg.name}-eval-{stamp}", run_dir=str(eval_dir), model=replace(cfg.model, path=model),
                   envs=replace(cfg.envs, services={spec.env.name: spec.env}), redis=replace(cfg.redis, data_dir=None))


def eval_section(section: OrchestratorConfig, spec: EvalSpec) -> OrchestratorConfig:
    """The orchestrator of an evaluation: the training run's section, so every rule of an episode's lifecycle
    (sessions, dispatch, limits, retries, finish) is the one training uses, with what makes it an evaluation:
    `spec.samples` episodes per task of `spec.split`, one pass in the env's order (its first `spec.num_tasks`
    tasks), every group recorded (no dynamic sampling), no trainer to wait for (no staleness or
    unconsumed-groups backpressure), and every deadline the run's episode_timeout_s (a few hundred episodes
    are too few to size one from)."""
    return replace(section, group_size=spec.samples, max_groups=spec.num_tasks, task_split=spec.split,
                   task_order="listed", staleness_limit=None, max_unconsumed_groups=0,
                   dynamic_sampling=replace(section.dynamic_sampling, enabled=False),
                   episode_deadline=replace(section.episode_deadline, factor=0.0))


@dataclass
class Played:
    """A played split: what the result JSON reports."""

    rewards: dict[str, list[float]]
    """Task -> the rewards of its scored samples, in member order (given-up members left out)."""
    failed: dict[str, int]
    """Task -> members given up."""
    reasons: dict[str, int]
    """How the episodes ended (completed, max_turns, env_error, ...), each counted once."""
    agent: dict[str, float]
    """The played samples' turns and tool use, per sample (asyncrl.types.agent_health: as the trainer logs it)."""
    n_available: int
    """Tasks the split has (n_tasks can be fewer: --tasks)."""
    max_turns: Optional[int]
    deadline_s: Optional[float]


def _play_on_services(ecfg: RunConfig, spec: EvalSpec, model: str, signals: Any) -> Played:
    """Redis, Ray, engines, gateway, orchestrator and env service(s) up, the split played, all down."""
    from asyncrl_run.launcher import ComponentFailed, Job, _redis_for, _start_ray, orchestrator_section

    eval_dir = Path(ecfg.run_dir)
    with ExitStack() as stack:
        job: Optional[Job] = None
        interrupted = True
        try:
            redis_url, embedded = _redis_for(ecfg, eval_dir, stack)
            try:
                _start_ray(ecfg, stack)
            except Exception as err:  # e.g. a local GCS that does not come up in time on an overloaded machine
                raise ComponentFailed("ray", f"{type(err).__name__}: {str(err).strip()[:500]}") from err
            if signals is not None:
                signals.install()
            job = Job(ecfg, eval_dir, redis_url, embedded)
            job._guard("engines", lambda: job._start_engines(model))
            gateway = job._guard("gateway", job._start_gateway)
            section = eval_section(orchestrator_section(ecfg, redis_url, gateway), spec)
            orchestrator = job._guard("orchestrator", lambda: job._start_orchestrator(gateway, section))
            urls = [job._guard(f"env service {spec.env.name}", lambda r=r: job._start_env(spec.env, r, orchestrator))
                    for r in range(spec.env.num_replicas)]
            log.info("eval %s: model %s, env %s (%d service(s)), gateway %s, orchestrator %s; logs under %s",
                     ecfg.name, model, spec.env.name, len(urls), gateway, orchestrator, eval_dir)
            task_ids = asyncio.run(_list_tasks(ecfg, spec, urls[0]))
            tasks = task_ids[:spec.num_tasks] if spec.num_tasks else task_ids
            log.info("eval: %d %s tasks of %s x %d samples", len(tasks), spec.split, spec.env.name, spec.samples)
            _await_groups(job, len(tasks))
            played = asyncio.run(_read_played(redis_url, ecfg.name, tasks))
            played.n_available = len(task_ids)
            played.max_turns, played.deadline_s = _limits(ecfg, orchestrator, spec.env.name)
            interrupted = False
        finally:
            if signals is not None:
                signals.ignore()
            if job is not None:
                job.shutdown(interrupted)
    return played


async def _list_tasks(cfg: RunConfig, spec: EvalSpec, env_url: str) -> list[str]:
    """The split's task ids, as the orchestrator lists them (orchestrator.envclient)."""
    from orchestrator.envclient import EnvClient
    from orchestrator.http import HTTPFailure, client_session

    async with client_session() as http:
        try:
            task_ids = await EnvClient(http, cfg.envs.auth_token).tasks(env_url, spec.split)
        except (ValueError, HTTPFailure) as err:  # an unknown split (404), a service without splits
            raise EvalError(f"env {spec.env.name!r}: {err}") from err
    if not task_ids:
        raise EvalError(f"env {spec.env.name!r} lists no {spec.split!r} tasks")
    if spec.num_tasks is not None and spec.num_tasks > len(task_ids):
        log.warning("--tasks %d: the %s split of %s has only %d tasks; evaluating all of them", spec.num_tasks,
                    spec.split, spec.env.name, len(task_ids))
    return task_ids


def _await_groups(job: Any, expected: int) -> None:
    """Until the orchestrator has recorded a group for every task; a component that cannot be brought back
    fails the evaluation, as it fails a run."""
    from asyncrl.store import store_call
    from asyncrl_run.launcher import SERVICE_CHECK_EVERY_S

    started = last_check = time.monotonic()
    reported = 0
    while True:
        done = store_call(job.redis_url, job.cfg.name, lambda s: s.redis.xlen(s.key("groups")))
        if done >= expected or done >= reported + max(1, expected // 10):
            log.info("eval: %d/%d tasks played (%.0f s)", done, expected, time.monotonic() - started)
            reported = done
        if done >= expected:
            return
        job._revive_redis()
        if time.monotonic() - last_check > SERVICE_CHECK_EVERY_S:
            last_check = time.monotonic()
            job._check_services()
        time.sleep(1.0)


async def _read_played(redis_url: str, name: str, tasks: list[str]) -> Played:
    """Each task's rewards, failures and end reasons, from the groups the orchestrator recorded and their
    samples (a member is its session's samples; a member given up has a `failed` one, or none when no
    session could be opened for it)."""
    from asyncrl.store import Store
    from asyncrl.types import GroupRecord, agent_health

    store = Store.connect(redis_url, name)
    try:
        records = [GroupRecord.decode(f) for _, f in await store.redis.xrange(store.key("groups"))]
        rewards, failed, reasons, played = {t: [] for t in tasks}, dict.fromkeys(tasks, 0), Counter(), []
        for record in records:
            members = {}  # session id -> the member's first segment (its segments share reward and status)
            for sample in await store.get_samples(record.sample_refs):
                members.setdefault(sample.session_id, sample)
                if sample.status != "failed":
                    played.append(sample)
            for member in members.values():
                reasons[member.outcome_reason or "unknown"] += 1
                if member.status == "failed":
                    failed[record.task_id] += 1
                else:
                    rewards[record.task_id].append(member.reward)
            unrecorded = record.group_size - len(members)
            failed[record.task_id] += unrecorded
            reasons["no_session"] += unrecorded
        return Played(rewards, failed, {r: n for r, n in sorted(reasons.items()) if n},
                      {k: round(v, 4) for k, v in agent_health(played).items()}, len(tasks), None, None)
    finally:
        await store.close()


def _limits(cfg: RunConfig, orchestrator: str, env: str) -> tuple[Optional[int], Optional[float]]:
    """(max_turns, deadline_s) the orchestrator gave the env's episodes (its /v1/status)."""
    import httpx

    reply = httpx.get(f"{orchestrator}/v1/status", headers=bearer_headers(cfg.orchestrator.auth_token), timeout=30)
    reply.raise_for_status()
    stats = reply.json()["by_env"].get(env, {})
    return stats.get("max_turns"), stats.get("deadline_s")


def _result(cfg: RunConfig, ecfg: RunConfig, spec: EvalSpec, model: str, played: Played, wall_s: float
            ) -> dict[str, Any]:
    """The result JSON of a played split (`cfg`: the run's config as given, `ecfg`: the evaluation's)."""
    summary = summarize(played.rewards, spec.ks, spec.pass_threshold, played.failed)
    return {
        "model": model, "env": spec.env.name, "env_target": spec.env.target, "split": spec.split,
        "n_tasks": len(played.rewards), "n_tasks_available": played.n_available, "samples_per_task": spec.samples,
        "k": spec.ks, "mean_reward": summary["mean_reward"], "pass_at_k": summary["pass_at_k"],
        "pass_at_k_tasks": summary["pass_at_k_tasks"], "pass_threshold": spec.pass_threshold,
        "episodes": summary["episodes"], "failed_episodes": summary["failed_episodes"], "reasons": played.reasons,
        "agent": played.agent,
        "sampling": asdict(cfg.rollout.sampling), "max_turns": played.max_turns,
        "episode_timeout_s": played.deadline_s, "seed": cfg.seed, "experiment": cfg.name, "eval_name": ecfg.name,
        "eval_dir": ecfg.run_dir, "wall_s": round(wall_s, 1),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "tasks": summary["tasks"],
    }


def _log_to(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)


# Command line -------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog="asyncrl eval", description="Score a checkpoint on an env's held-out tasks (no training): mean reward "
        "and pass@k. Positional KEY=VALUE arguments are Hydra overrides of the run config, e.g. experiment=tiny_demo.")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides (experiment=..., model.path=...)")
    p.add_argument("--model", help="HF checkpoint directory (same as model.path=PATH)")
    p.add_argument("--env", help="an env service of the config by name (a key of envs.services), or an env class by "
                   "dotted path; default: the config's only service")
    p.add_argument("--split", default="eval", help="task split (default eval: the held-out tasks; train is allowed)")
    p.add_argument("--samples", "-n", type=int, help="samples per task, n of pass@k (default orchestrator.group_size; "
                   "1 when greedy)")
    p.add_argument("--k", help="comma-separated k of pass@k, each <= n (default 1,n)")
    p.add_argument("--tasks", type=int, help="evaluate the first N tasks of the split (default all)")
    p.add_argument("--temperature", type=float, help="sampling temperature (rollout.sampling.temperature); 0 = greedy")
    p.add_argument("--pass-threshold", type=float, default=1.0, help="a sample passes when reward >= this (default 1)")
    p.add_argument("--out", type=Path, help="where the JSON result goes (default <run_dir>/eval/<stamp>-<env>/result.json)")
    args = p.parse_intermixed_args(argv)  # overrides before, between or after the flags
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"expected KEY=VALUE Hydra overrides, got {bad}")
    return args, list(args.overrides)


def compose(overrides: list[str]) -> RunConfig:
    """The run config exactly as `asyncrl_run.train` composes it (configs/, validated against RunConfig)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return to_dataclass(hydra_compose(config_name="config", overrides=overrides))


def spec_from_args(cfg: RunConfig, args: argparse.Namespace) -> EvalSpec:
    services = dict(cfg.envs.services)
    if args.env is None:
        if len(services) != 1:
            raise EvalError(f"--env: the config has {len(services)} env services ({', '.join(services) or 'none'}); "
                            f"name one")
        env = next(iter(services.values()))
    elif args.env in services:
        env = services[args.env]
    elif "." in args.env:
        env = EnvServiceConfig(name=args.env.rpartition(".")[2].lower(), target=args.env)
    else:
        raise EvalError(f"--env {args.env}: not an env service of the config ({', '.join(services) or 'none'}) "
                        f"nor a dotted class path")
    greedy = cfg.rollout.sampling.temperature == 0  # every sample of a task would be the same one
    samples = args.samples or (1 if greedy else cfg.orchestrator.group_size)
    ks = sorted({int(k) for k in args.k.split(",")}) if args.k else sorted({1, samples})
    if samples < 1 or not ks or min(ks) < 1 or max(ks) > samples:
        raise EvalError(f"--k {','.join(map(str, ks))} with --samples {samples}: every k must be in 1..n")
    if args.tasks is not None and args.tasks < 1:
        raise EvalError("--tasks must be at least 1")
    return EvalSpec(env=env, split=args.split, samples=samples, ks=ks, num_tasks=args.tasks,
                    pass_threshold=args.pass_threshold, out=args.out)


def main(argv: Optional[list[str]] = None) -> int:
    code = _main(list(sys.argv[1:] if argv is None else argv))
    if argv is None:  # the command: everything it started is stopped and flushed by now. Skip the
        logging.shutdown()  # interpreter's finalization, as asyncrl_run.train does: Ray's C++ core worker holds
        sys.stdout.flush()  # the exit ~10 s in its destructors
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.temperature is not None:
        overrides.append(f"rollout.sampling.temperature={args.temperature}")
    try:
        cfg = compose(overrides)
        spec = spec_from_args(cfg, args)
    except EvalError as err:
        print(f"asyncrl eval: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # Hydra composition or validation: name the key, no traceback
        print(f"asyncrl eval: invalid config: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not any(o.split("=", 1)[0].lstrip("+") == "experiment" for o in overrides):
        log.warning("no experiment= override: configs/config.yaml's defaults apply (e.g. gateway.thinking %s, "
                    "max_new_tokens %d); pass the experiment the weights were trained with for its settings",
                    cfg.gateway.thinking, cfg.rollout.sampling.max_new_tokens)
    from asyncrl_run.launcher import ComponentFailed, StopSignals

    signals = StopSignals()
    signals.install()
    try:
        result, out = run_eval(cfg, spec, signals)
    except EvalError as err:
        print(f"asyncrl eval: {err}", file=sys.stderr)
        return 2
    except ComponentFailed as err:
        print(f"asyncrl eval: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("asyncrl eval: interrupted", file=sys.stderr)
        return signals.exit_code
    print(report(result), flush=True)
    print(f"result: {out}", flush=True)
    return 0


def report(result: dict[str, Any]) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    passes = ", ".join(f"pass@{k} {fmt(v)}" for k, v in result["pass_at_k"].items())
    temperature = result["sampling"]["temperature"]
    return (f"asyncrl eval: {result['env']} ({result['split']} split, {result['n_tasks']} tasks x "
            f"{result['samples_per_task']} samples, temperature {temperature:g}): mean reward "
            f"{fmt(result['mean_reward'])}, {passes}; {result['failed_episodes']} failed episodes "
            f"({result['wall_s']:.0f} s)" + _agent_report(result["agent"]))


def _agent_report(agent: dict[str, float]) -> str:
    if not agent.get("tool_calls_mean") and not agent.get("tool_call_parse_failures_mean"):
        return ""
    return (f"; per sample: turns {agent['turns_mean']:.2f}, tool calls {agent['tool_calls_mean']:.2f}, "
            f"tool-call parse failures {agent['tool_call_parse_failures_mean']:.2f}, "
            f"tool errors {agent['tool_errors_mean']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
