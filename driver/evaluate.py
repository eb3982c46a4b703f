"""`asyncrl eval`: score a checkpoint on an env's held-out tasks, without training.

    asyncrl eval experiment=tiny_demo --model runs/tiny_demo/weights/v00000150 [--env arithmetic]
        [--split eval] [--samples 8] [--k 1,8] [--tasks N] [--temperature 0] [--out result.json]
    asyncrl eval experiment=tiny_demo model.path=PATH [any other Hydra override]

The config is the run's (Hydra, the same groups and validation as `driver.train`), so the engines,
the gateway and the env service start exactly as in training (the launcher's own pieces: embedded
Redis, Ray, `components.engine_group`, the gateway, `components.env_service`) and every episode samples
at `rollout.sampling` (temperature, top_p, max_new_tokens: the same endpoint and session sampling the
orchestrator sends, asyncrl/sampling.py). No orchestrator and no trainer run: this driver opens one
gateway session per episode and posts it to the env service (the env-service protocol), `--samples`
episodes per task of the split (GET /tasks?split=eval). Failures are retried up to
`orchestrator.max_attempts` like the orchestrator does, and counted when they persist.

Nothing reaches a training run: the evaluation runs under a name of its own (`<name>-eval-<stamp>`, its
Redis keys and Ray actor names) with its own embedded Redis under `<run_dir>/eval/<stamp>-<env>/`, where
the gateway records its trajectories (the `samples` stream; no groups stream is written at all) and
the services write their logs. The result is JSON (`result.json` there, or `--out`): mean reward,
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
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from asyncrl.auth import bearer_headers
from asyncrl.config import CONFIG_DIR, EnvServiceConfig, RunConfig, register_configs, to_dataclass

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


# The driver --------------------------------------------------------------------------------------
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


@dataclass
class _Episode:
    reward: float
    status: str
    reason: str


class Driver:
    """Plays every (task, sample) once through a gateway session and an env service, at most
    `concurrency` at a time, retrying failures like the orchestrator (max_attempts; refusals free)."""

    def __init__(self, cfg: RunConfig, spec: EvalSpec, gateway: str, env_urls: Callable[[], Awaitable[list[str]]],
                 concurrency: int, transport: Any = None) -> None:
        import httpx

        self.cfg, self.spec, self.gateway, self.env_urls = cfg, spec, gateway.rstrip("/"), env_urls
        self.concurrency = max(1, concurrency)
        timeout_s = max([cfg.orchestrator.episode_timeout_s, *cfg.orchestrator.episode_timeout_s_by_env.values(),
                         spec.env.episode_timeout_s or 0.0]) + cfg.orchestrator.request_grace_s
        env_token = cfg.envs.auth_token  # every call to the env services carries it; the gateway's add their own
        self.http = httpx.AsyncClient(timeout=timeout_s, headers=bearer_headers(env_token),
                                      limits=httpx.Limits(max_connections=2 * self.concurrency + 8), transport=transport)
        self.gateway_headers = bearer_headers(cfg.gateway.auth_token)
        self.urls: list[str] = []
        self.load: dict[str, int] = {}
        self.max_turns, self.deadline_s = episode_limits(cfg, spec.env, spec.env.domain)
        self.done = 0

    async def tasks(self) -> list[str]:
        """The split's task ids (and the env's domain, for its episode limits)."""
        from asyncrl.protocols.env_service import InfoResponse, TasksResponse

        self.urls = list(await self.env_urls())
        url, split, ids = self.urls[0], self.spec.split, []
        info = await self.http.get(f"{url}/info")
        info.raise_for_status()
        domain = InfoResponse.model_validate(info.json()).domain
        self.max_turns, self.deadline_s = episode_limits(self.cfg, self.spec.env, domain)
        while True:
            reply = await self.http.get(f"{url}/tasks", params={"split": split, "offset": len(ids), "limit": 10_000})
            if reply.status_code == 404 and ids == []:
                raise EvalError(f"env {self.spec.env.name!r}: {reply.json().get('error', reply.text)}")
            reply.raise_for_status()
            page = TasksResponse.model_validate(reply.json())
            if page.split != split:  # a service built before splits ignores the parameter and lists train
                raise EvalError(f"env service {self.spec.env.name!r} at {url} serves no splits (it answered "
                                f"{split!r} with its {page.split!r} tasks); update it, or pass --split train")
            ids += page.task_ids
            if not page.task_ids or len(ids) >= page.total:
                return ids

    async def run(self, task_ids: list[str]) -> tuple[dict[str, list[float]], dict[str, int], dict[str, int]]:
        """-> (rewards of each task's scored samples in member order, failed samples per task, final reasons)."""
        gate = asyncio.Semaphore(self.concurrency)
        played: dict[str, list[Optional[_Episode]]] = {t: [None] * self.spec.samples for t in task_ids}
        total, started = len(task_ids) * self.spec.samples, time.monotonic()

        async def one(index: int, task_id: str, member: int) -> None:
            async with gate:
                played[task_id][member] = await self.play(index, task_id, member)
            self.done += 1
            if self.done % max(1, total // 10) == 0 or self.done == total:
                log.info("eval: %d/%d episodes (%.0f s)", self.done, total, time.monotonic() - started)

        await asyncio.gather(*(one(i, t, m) for i, t in enumerate(task_ids) for m in range(self.spec.samples)))
        episodes = [e for members in played.values() for e in members if e is not None]
        reasons = {r: sum(e.reason == r for e in episodes) for r in sorted({e.reason for e in episodes})}
        rewards = {t: [e.reward for e in members if e is not None and e.status != "failed"]
                   for t, members in played.items()}
        failed = {t: sum(e is not None and e.status == "failed" for e in members) for t, members in played.items()}
        return rewards, failed, reasons

    async def play(self, index: int, task_id: str, member: int) -> _Episode:
        from asyncrl.protocols.env_service import EpisodeRequest, EpisodeResponse, LLMEndpoint, OutcomeClass
        from asyncrl.protocols.gateway import CreateSessionRequest, FinishSessionRequest
        from asyncrl.sampling import endpoint_sampling, session_sampling

        cfg, o = self.cfg, self.cfg.orchestrator
        seed = (cfg.seed * 1_000_003 + index) * self.spec.samples + member  # as the orchestrator seeds members
        failures, attempt, error, response = 0, 0, "", None
        while failures < o.max_attempts:
            attempt += 1
            episode_id = f"eval-{index:05d}-m{member}-a{attempt}"
            session = CreateSessionRequest(group_id=f"eval-{index:05d}", task_id=task_id, env=self.spec.env.name,
                                           metadata={"episode_id": episode_id, "member": member, "seed": seed,
                                                     "eval": True, "split": self.spec.split},
                                           sampling=session_sampling(cfg.rollout.sampling, seed))
            opened = await self._gateway("POST", "/sessions", session.model_dump(), expect=201)
            url = self._pick()
            request = EpisodeRequest(episode_id=episode_id, task_id=task_id, seed=seed, max_turns=self.max_turns,
                                     deadline_s=self.deadline_s,
                                     llm=LLMEndpoint(base_url=opened["base_url"], model=o.model_name,
                                                     api_key=opened.get("api_key"),
                                                     sampling=endpoint_sampling(cfg.rollout.sampling)))
            response, refused = None, False
            self.load[url] = self.load.get(url, 0) + 1
            try:
                reply = await self.http.post(f"{url}/episodes", json=request.model_dump(mode="json"))
                if reply.status_code in (429, 503):
                    refused, error = True, f"{reply.status_code} {reply.text[:200]}"
                elif reply.status_code != 200:
                    error = f"{reply.status_code} {reply.text[:500]}"
                else:
                    response = EpisodeResponse.model_validate(reply.json())
            except Exception as err:  # noqa: BLE001 - unreachable, timed out, malformed: a failed attempt
                error = f"{type(err).__name__}: {err}"
                await self._refresh_urls()  # a restarted service binds a new port
            finally:
                self.load[url] -= 1
            sid = opened["session_id"]
            if response is not None and response.outcome is OutcomeClass.model:
                finish = FinishSessionRequest(reward=response.reward, status=response.status.value,
                                              info={"num_turns": response.num_turns, **response.info})
                if await self._gateway("POST", f"/sessions/{sid}/finish", finish.model_dump(), expect=200) is None:
                    log.warning("eval episode %s: the gateway lost its session; playing it again", episode_id)
                    continue  # as the orchestrator does (session_lost): not a failure of the episode
                return _Episode(response.reward, response.status.value, response.reason.value)
            if response is not None:
                error = f"{response.reason.value}: {response.info.get('error', '')}"
            last = not refused and failures + 1 >= o.max_attempts
            status = "failed" if last else "aborted"
            await self._gateway("POST", f"/sessions/{sid}/finish",
                                FinishSessionRequest(status=status, info={"error": error[:2000]}).model_dump(),
                                expect=200)
            if refused:
                await asyncio.sleep(0.25)
                continue
            failures += 1
            log.warning("eval episode %s (%s) failed (%d/%d): %s", episode_id, task_id, failures, o.max_attempts,
                        error[:300])
        reason = response.reason.value if response is not None else "service_error"
        return _Episode(0.0, "failed", reason)

    async def _refresh_urls(self) -> None:
        try:
            self.urls = list(await self.env_urls())
        except Exception as err:  # noqa: BLE001 - not bound yet (restarting): keep the old ones for now
            log.warning("eval: env service URLs not readable (%s); retrying with the old ones", err)

    def _pick(self) -> str:
        """The least loaded replica."""
        return min(self.urls, key=lambda u: self.load.get(u, 0))

    async def _gateway(self, method: str, path: str, body: dict, expect: int) -> Optional[dict]:
        """The reply; None for a finish of a session the gateway no longer knows (404: it restarted)."""
        delay = 0.2
        for _ in range(20):  # a restarting gateway: wait for it, as the orchestrator does
            try:
                reply = await self.http.request(method, self.gateway + path, json=body, headers=self.gateway_headers)
                if reply.status_code == expect:
                    return reply.json()
                if reply.status_code == 404 and path.endswith("/finish"):
                    return None
                if reply.status_code < 500 and reply.status_code != 429:
                    raise EvalError(f"gateway refused {method} {path}: {reply.status_code} {reply.text[:500]}")
                problem = f"{reply.status_code} {reply.text[:200]}"
            except EvalError:
                raise
            except Exception as err:  # noqa: BLE001 - transport errors are retried
                problem = f"{type(err).__name__}: {err}"
            log.warning("gateway %s %s failed (%s); retrying in %.1fs", method, path, problem, delay)
            await asyncio.sleep(delay)
            delay = min(5.0, delay * 2)
        raise EvalError(f"gateway {method} {path} kept failing: {problem}")

    async def close(self) -> None:
        await self.http.aclose()


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
    from driver.launcher import resolve_run_dir

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2)
    eval_dir = resolve_run_dir(cfg.run_dir) / "eval" / f"{stamp}-{spec.env.name}"
    eval_dir.mkdir(parents=True, exist_ok=True)
    return replace(cfg, name=f"{cfg.name}-eval-{stamp}", run_dir=str(eval_dir), model=replace(cfg.model, path=model),
                   envs=replace(cfg.envs, services={spec.env.name: spec.env}), redis=replace(cfg.redis, data_dir=None))


def _play_on_services(ecfg: RunConfig, spec: EvalSpec, model: str, signals: Any) -> tuple:
    """Redis, Ray, engines, gateway and env service(s) up, the split played (_play's answer), all down."""
    from driver.launcher import ComponentFailed, Job, _redis_for, _start_ray

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
            urls = [job._guard(f"env service {spec.env.name}", lambda r=r: job._start_env(spec.env, r, None))
                    for r in range(spec.env.num_replicas)]
            log.info("eval %s: model %s, env %s (%d service(s)), gateway %s; logs under %s", ecfg.name, model,
                     spec.env.name, len(urls), gateway, eval_dir)
            handles = [job.services[f"env-{spec.env.name}-{r}"] for r in range(spec.env.num_replicas)]

            async def env_urls() -> list[str]:
                return [await h.url.remote() for h in handles]

            concurrency = min(ecfg.orchestrator.max_in_flight, spec.env.capacity * spec.env.num_replicas)
            played = asyncio.run(_play(ecfg, spec, gateway, env_urls, concurrency))
            interrupted = False
        finally:
            if signals is not None:
                signals.ignore()
            if job is not None:
                job.shutdown(interrupted)
    return played


def _result(cfg: RunConfig, ecfg: RunConfig, spec: EvalSpec, model: str, played: tuple, wall_s: float
            ) -> dict[str, Any]:
    """The result JSON of a played split (`cfg`: the run's config as given, `ecfg`: the evaluation's)."""
    rewards, failed, reasons, n_available, (max_turns, deadline_s) = played
    summary = summarize(rewards, spec.ks, spec.pass_threshold, failed)
    return {
        "model": model, "env": spec.env.name, "env_target": spec.env.target, "split": spec.split,
        "n_tasks": len(rewards), "n_tasks_available": n_available, "samples_per_task": spec.samples, "k": spec.ks,
        "mean_reward": summary["mean_reward"], "pass_at_k": summary["pass_at_k"],
        "pass_at_k_tasks": summary["pass_at_k_tasks"], "pass_threshold": spec.pass_threshold,
        "episodes": summary["episodes"], "failed_episodes": summary["failed_episodes"], "reasons": reasons,
        "sampling": asdict(cfg.rollout.sampling), "max_turns": max_turns, "episode_timeout_s": deadline_s,
        "seed": cfg.seed, "experiment": cfg.name, "eval_name": ecfg.name, "eval_dir": ecfg.run_dir,
        "wall_s": round(wall_s, 1), "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tasks": summary["tasks"],
    }


def _log_to(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)


def episode_limits(cfg: RunConfig, env: EnvServiceConfig, domain: str) -> tuple[int, float]:
    """(max_turns, deadline_s) of the env's episodes, as the orchestrator sends them in training: the env
    service's own setting, else orchestrator.*_by_env by env name then by domain, else the run's."""
    o = cfg.orchestrator

    def pick(own, by_env: dict, default):
        return own if own is not None else by_env.get(env.name, by_env.get(domain, default))

    return (pick(env.max_turns, o.max_turns_by_env, o.max_turns),
            pick(env.episode_timeout_s, o.episode_timeout_s_by_env, o.episode_timeout_s))


async def _play(cfg: RunConfig, spec: EvalSpec, gateway: str, env_urls, concurrency: int):
    driver = Driver(cfg, spec, gateway, env_urls, concurrency)
    try:
        task_ids = await driver.tasks()
        if not task_ids:
            raise EvalError(f"env {spec.env.name!r} lists no {spec.split!r} tasks")
        n_available = len(task_ids)
        if spec.num_tasks is not None:
            if spec.num_tasks > n_available:
                log.warning("--tasks %d: the %s split of %s has only %d tasks; evaluating all of them", spec.num_tasks,
                            spec.split, spec.env.name, n_available)
            task_ids = task_ids[:spec.num_tasks]
        log.info("eval: %d %s tasks of %s x %d samples, at most %d episodes at once", len(task_ids), spec.split,
                 spec.env.name, spec.samples, concurrency)
        rewards, failed, reasons = await driver.run(task_ids)
        return rewards, failed, reasons, n_available, (driver.max_turns, driver.deadline_s)
    finally:
        await driver.close()


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
    """The run config exactly as `driver.train` composes it (configs/, validated against RunConfig)."""
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
        logging.shutdown()  # interpreter's finalization, as driver.train does: Ray's C++ core worker holds
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
    from driver.launcher import ComponentFailed, StopSignals

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
            f"({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
