"""A user's env in a run: added by a Hydra override beside the built-in one (configs/ composed for real),
started by the launcher's command line with a domain that is never empty, importable from the run's
working directory under the launcher's Ray, and with its own max_turns / episode deadline reaching
its episodes (EpisodeContext) and no other env's, through a real orchestrator."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from asyncrl.config import CONFIG_DIR, RunConfig, register_configs, to_dataclass
from asyncrl.protocols.env_service import SERVICE_TOKEN_ENV
from asyncrl_run.evaluate import EvalSpec, eval_section
from asyncrl_run.launcher import ComponentFailed, Job, env_service_args, orchestrator_section
from envs.serve import parse_args as parse_service_args, sandbox_config
from orchestrator.core import Orchestrator as OrchestratorCore
from orchestrator.deadlines import EpisodeDeadlines
from orchestrator.server import parse_args
from tests.envs.recording_orchestrator import RecordingOrchestrator
from tests.orchestrator.conftest import Orchestrator, journal
from tests.services import ROOT

register_configs()

USER_ENV = '''
from envs.sdk import Environment, EpisodeResult


class UserEnv(Environment):
    name, domain = "user-env", "toy"

    async def list_tasks(self):
        return ["u-1"]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        return EpisodeResult(1.0)


class PlainEnv(Environment):
    """Neither name nor domain of its own."""

    async def list_tasks(self):
        return ["p-1"]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        return EpisodeResult(1.0)
'''


def load(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return to_dataclass(compose(config_name="config", overrides=list(overrides)))


def user_project(root: Path) -> Path:
    """The directory a user starts the run from, with their env module in it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "user_env.py").write_text(USER_ENV)
    (root / "scripts").mkdir(exist_ok=True)
    (root / "scripts" / "loose_env.py").write_text(USER_ENV)
    return root


def spawn_service(args: list[str], cwd: Path, log: Path) -> tuple[subprocess.Popen, Path]:
    """What the launcher's supervisor runs: `python -m envs.serve <args> --port 0 --url-file F`."""
    url_file = log.with_suffix(".url")
    proc = subprocess.Popen([sys.executable, "-m", "envs.serve", *args, "--port", "0", "--url-file", str(url_file)],
                            cwd=cwd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, url_file


def stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    return proc.wait(30)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_an_override_adds_an_env_beside_the_built_in_one_and_its_domain_is_never_empty(tmp_path):
    cfg = load("experiment=tiny_demo", "+envs.services.mine={target: user_env.UserEnv, capacity: 8}",
               "+envs.services.plain={target: user_env.PlainEnv}")
    assert list(cfg.envs.services) == ["arithmetic", "mine", "plain"]
    arithmetic, mine, plain = cfg.envs.services.values()
    assert (arithmetic.name, arithmetic.target, arithmetic.domain, arithmetic.capacity) == (
        "arithmetic", "envs.tasks.ArithmeticEnv", "tasks", 128)  # the experiment's entry, untouched
    assert (mine.name, mine.target, mine.domain, mine.capacity, mine.max_turns) == ("mine", "user_env.UserEnv", None, 8,
                                                                                   None)

    orchestrator = RecordingOrchestrator().start()
    try:
        args = {env.name: env_service_args(tmp_path, env, orchestrator.url) for env in cfg.envs.services.values()}
        arithmetic, mine = (parse_service_args(args[name]).section for name in ("arithmetic", "mine"))
        assert (arithmetic.name, arithmetic.domain) == ("arithmetic", "tasks")
        assert mine.name == "mine" and mine.domain is None
        assert flag(args["mine"], "--orchestrator") == orchestrator.url and mine.capacity == 8
        project = user_project(tmp_path / "project")
        started = [spawn_service(args[name], project, tmp_path / f"{name}.log") for name in args]
        try:
            orchestrator.wait_for(lambda: len(orchestrator.registrations()) == 3, timeout_s=120)
        finally:
            codes = [stop(proc) for proc, _ in started]
    finally:
        orchestrator.stop()
    registered = {c.body["name"]: c.body for c in orchestrator.registrations()}
    assert {name: (body["domain"], body["capacity"]) for name, body in registered.items()} == {
        "arithmetic": ("tasks", 128),  # configured
        "mine": ("toy", 8),             # its class's `domain`
        "plain": ("plain", 64)}         # no domain anywhere: its name
    assert codes == [0, 0, 0]


def test_env_entries_take_field_overrides_removals_and_name_a_misspelt_field():
    cfg = load("envs.services.arithmetic.max_turns=3", "envs.services.arithmetic.episode_timeout_s=9.5",
               "envs.services.other={target: a.B}")
    assert (cfg.envs.services["arithmetic"].max_turns, cfg.envs.services["arithmetic"].episode_timeout_s) == (3, 9.5)
    assert cfg.envs.services["other"].name == "other"  # without `+` it adds too
    assert load("~envs.services.arithmetic").envs.services == {}
    assert list(load("envs=none", "+envs.services.mine={target: a.B}").envs.services) == ["mine"]
    assert list(load("experiment=async_vs_sync").envs.services) == ["longtail"]  # its own only
    with pytest.raises(ValueError, match=r"envs\.services\.mine\.capacitty: Key 'capacitty' not in 'EnvServiceConfig'"):
        load("+envs.services.mine={target: a.B, capacitty: 3}")
    with pytest.raises(ValueError, match=r"envs\.services\.mine\.target: .*missing mandatory value: target"):
        load("+envs.services.mine={capacity: 3}")
    with pytest.raises(ValueError, match=r"envs\.services\.arithmetic\.max_turns: Value 'many'"):
        load("envs.services.arithmetic.max_turns=many")
    with pytest.raises(ValueError, match=r"envs\.services\.arithmetic: max_turns must be >= 1, got 0"):
        load("envs.services.arithmetic.max_turns=0")
    with pytest.raises(ConfigCompositionException):  # the rest of the config stays strict
        load("envs.servics.arithmetic.max_turns=3")


def test_episode_limits_by_env_name_then_domain_then_the_runs():
    cfg = parse_args(["--redis-url", "redis://x", "--llm-url", "http://x", "--max-turns", "7", "--episode-timeout-s",
                      "50", "--max-turns-by-env", "swe=30,search=4", "--episode-timeout-s-by-env", "swe=900"])[0]
    core = SimpleNamespace(cfg=cfg, deadlines=EpisodeDeadlines(cfg.episode_deadline, cfg.episode_timeout_s))
    core.deadline_s = lambda env, domain: OrchestratorCore.deadline_s(core, env, domain)
    core.max_turns = lambda env, domain: OrchestratorCore.max_turns(core, env, domain)
    limits = {(name, domain): OrchestratorCore.episode_limits(core, SimpleNamespace(name=name, domain=domain))
              for name, domain in [("swe", "code"), ("swe-lite", "swe"), ("search", "swe"), ("tasks", "tasks")]}
    assert limits == {("swe", "code"): (30, 900.0), ("swe-lite", "swe"): (30, 900.0), ("search", "swe"): (4, 900.0),
                      ("tasks", "tasks"): (7, 50.0)}
    with pytest.raises(SystemExit):
        parse_args(["--redis-url", "redis://x", "--llm-url", "http://x", "--max-turns-by-env", "swe=2.5"])


def test_an_envs_own_limits_reach_its_episodes_and_no_other_envs(tmp_path, redis_server, run_name):
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    options = f"options: {{journal: '{journal_dir}', sleep_s: 0.05}}"
    cfg = load("envs=none", "orchestrator.max_turns=7", "orchestrator.episode_timeout_s=50",
               f"+envs.services.long={{target: tests.orchestrator.timed_env.TimedEnv, max_turns: 3, "
               f"episode_timeout_s: 40, {options}}}",
               f"+envs.services.short={{target: tests.orchestrator.timed_env.TimedEnv, {options}}}")
    section = orchestrator_section(cfg, redis_server.url, "http://unused-gateway")
    assert (section.max_turns, section.episode_timeout_s) == (7, 50.0)
    assert (section.max_turns_by_env, section.episode_timeout_s_by_env) == ({"long": 3}, {"long": 40.0})
    limits = ["--max-turns", "7", "--episode-timeout-s", "50.0", "--max-turns-by-env", "long=3",
              "--episode-timeout-s-by-env", "long=40.0"]  # the section's limits, as flags (the helper gives --llm-url)
    orch = Orchestrator(tmp_path, redis_server.url, run_name, *limits, "--group-size", "2", "--max-groups", "200")
    services = []
    try:
        for env in cfg.envs.services.values():  # the launcher's command line, as its supervisor runs it
            services.append((env.name, *spawn_service(env_service_args(tmp_path, env, orch.url), ROOT,
                                                      tmp_path / f"{env.name}.log")))
        # The first env up takes the groups until the other's task list is read; then they alternate.
        status = orch.wait(lambda s: all(s["by_env"].get(name, {}).get("groups_completed", 0) >= 2
                                         for name in ("long", "short")), timeout_s=120, what="groups of both envs")
    finally:
        codes = [stop(proc) for _, proc, _ in services]
        assert orch.stop() == 0, orch.proc.log()
    assert codes == [0, 0] and status["failed"] == 0
    pids = {proc.pid: name for name, proc, _ in services}
    seen: dict[str, set] = {}
    for entry in journal(journal_dir, run_name):
        if entry["event"] == "start":
            seen.setdefault(pids[entry["pid"]], set()).add((entry["max_turns"], entry["deadline_s"]))
    assert seen == {"long": {(3, 40.0)}, "short": {(7, 50.0)}}


@pytest.mark.slow
def test_a_user_env_in_the_runs_directory_imports_under_the_launchers_ray(tmp_path):
    """The launcher's own path: _start_ray (a fresh local cluster), Job._start_env (a supervised service in a
    Ray actor), from a driver started in the user's project directory. The script is called driver.py, as Ray
    users name theirs: it must not shadow the run layer's package."""
    project = user_project(tmp_path / "project")
    (project / "driver.py").write_text(f'''
import json, sys
from contextlib import ExitStack
from pathlib import Path

from hydra import compose, initialize_config_dir

from asyncrl.config import CONFIG_DIR, register_configs, to_dataclass
from asyncrl_run.launcher import Job, _start_ray

register_configs()
with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
    cfg = to_dataclass(compose("config", overrides=[
        "envs=none", "+envs.services.mine={{target: user_env.UserEnv}}",
        "+envs.services.loose={{target: 'scripts/loose_env.py:PlainEnv'}}", "ray.num_cpus=1",
        "run_dir={tmp_path / 'run'}"]))
with ExitStack() as stack:
    _start_ray(cfg, stack)
    job = Job(cfg, Path(cfg.run_dir), "redis://127.0.0.1:1")
    try:
        print(json.dumps([job._start_env(env, 0, sys.argv[1]) for env in cfg.envs.services.values()]), flush=True)
        sys.stdin.readline()  # until the test has seen the registrations
    finally:
        job.shutdown(False)  # after the work: the unhurried stop
''')
    orchestrator = RecordingOrchestrator().start()
    driver = subprocess.Popen([sys.executable, "driver.py", orchestrator.url], cwd=project, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.log", "wb"), text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""})
    try:
        urls = json.loads(driver.stdout.readline() or "null")
        assert urls, (tmp_path / "driver.log").read_text()[-5000:]
        orchestrator.wait_for(lambda: len(orchestrator.registrations()) == 2, timeout_s=60)
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(120) == 0, (tmp_path / "driver.log").read_text()[-5000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        orchestrator.stop()
    registered = {c.body["name"]: (c.body["domain"], c.body["url"]) for c in orchestrator.registrations()}
    assert registered == {"mine": ("toy", urls[0]), "loose": ("loose", urls[1])}
    # job.shutdown(False) stopped both services the clean way (SIGTERM: they deregistered)
    assert sorted(c.path for c in orchestrator.of("DELETE")) == ["/v1/envs/env-1", "/v1/envs/env-2"]


def test_sandbox_options_reach_the_services_sandbox_config(tmp_path):
    """A list (ro_paths) and a number cross the section file as the service reads them."""
    env = load("experiment=tiny_demo", "+envs.services.sh={target: envs.terminal.TerminalEnv, "
               "sandbox_options: {ro_paths: [/usr/share], memory_mb: 1024}}").envs.services["sh"]
    sandbox = sandbox_config(parse_service_args(env_service_args(tmp_path, env, None)).section)
    assert (sandbox.type, sandbox.ro_paths, sandbox.memory_mb) == ("namespace", ["/usr/share"], 1024)


def test_env_options_reach_the_service_with_their_types(tmp_path):
    """Constructor options cross the section file as JSON: a list, a boolean and a string of digits
    arrive as themselves (they once arrived as "['a']", "True" and 5)."""
    env = load("experiment=tiny_demo", "+envs.services.t={target: envs.tasks.ArithmeticEnv, "
               "options: {tags: [a, b], verbose: true, code: '5', sleep_s: 0.5}}").envs.services["t"]
    assert parse_service_args(env_service_args(tmp_path, env, None)).section.options == {
        "tags": ["a", "b"], "verbose": True, "code": "5", "sleep_s": 0.5}


def test_the_launcher_warns_when_an_env_runs_on_the_unsafe_sandbox(tmp_path, caplog):
    cfg = load("experiment=tiny_demo", "+envs.services.sh={target: envs.terminal.TerminalEnv, sandbox: local_unsafe}")
    job = Job(cfg, tmp_path, "redis://unused")
    started = []
    job._service = lambda name, module, args, _resources, env=None, port=0, python=None: (started.append(args)
                                                                                           or "http://env")
    with caplog.at_level("WARNING", logger="asyncrl_run.launcher"):
        for env in cfg.envs.services.values():
            for replica in range(2):
                job._start_env(env, replica, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(started) == 4 and len(warnings) == 1  # once per env, not per replica; not for arithmetic
    assert warnings[0].startswith("UNSAFE SANDBOX: env service sh (envs.terminal.TerminalEnv)")
    assert "local_unsafe" in warnings[0] and "WITHOUT isolation" in warnings[0]


def test_the_env_token_reaches_env_services_orchestrator_and_eval(tmp_path, monkeypatch):
    """envs.auth_token: env services want it and the orchestrator sends it (both take it by environment,
    off their command lines); asyncrl eval's orchestrator, started with its eval section, gets it alike."""
    cfg = load("experiment=tiny_demo", "envs.auth_token=env-secret")
    job, started = Job(cfg, tmp_path, "redis://unused"), {}
    job._service = lambda name, module, args, _resources, env=None, port=0, python=None: (
        started.update({name: (args, env)}) or "http://env")
    job._start_env(cfg.envs.services["arithmetic"], 0, None)
    job._start_orchestrator("http://gateway")
    assert all(env[SERVICE_TOKEN_ENV] == "env-secret" and "env-secret" not in args for args, env in started.values())
    monkeypatch.setenv(SERVICE_TOKEN_ENV, "env-secret")
    assert parse_service_args(started["env-arithmetic-0"][0]).auth_token == "env-secret"
    assert parse_args(started["orchestrator"][0])[0].env_token == "env-secret"
    eval_orchestrator = eval_section(orchestrator_section(cfg, "redis://unused", "http://gateway"),
                                     EvalSpec(cfg.envs.services["arithmetic"]))
    job._start_orchestrator("http://gateway", eval_orchestrator)
    assert started["orchestrator"][1][SERVICE_TOKEN_ENV] == "env-secret"
    assert parse_args(started["orchestrator"][0])[0].task_order == "listed"


def test_an_envs_python_is_the_interpreter_the_launcher_starts_it_with(tmp_path):
    """envs.services.<env>.python (relative to the working directory) reaches the service's supervisor as an
    absolute path; one that names no interpreter stops the run before anything starts, naming the field.
    tests/envs/test_light_sdk.py runs a service with another venv's interpreter through the supervisor."""
    python = Path(sys.executable)
    relative = os.path.relpath(python, Path.cwd())
    cfg = load("experiment=tiny_demo", f"envs.services.arithmetic.python={relative}")
    job, started = Job(cfg, tmp_path, "redis://unused"), {}
    job._service = lambda name, module, args, _resources, env=None, port=0, python=None: (
        started.update({name: python}) or "url")
    job._start_env(cfg.envs.services["arithmetic"], 0, None)
    assert started == {"env-arithmetic-0": str(Path.cwd() / relative)}
    wrong = Job(load("experiment=tiny_demo", f"envs.services.arithmetic.python={tmp_path}/no-venv/bin/python"),
                tmp_path, "redis://unused")
    wrong._initial_weights = lambda: pytest.fail("the run went on past a missing interpreter")
    with pytest.raises(ComponentFailed, match=f"envs.services.arithmetic.python: no executable interpreter at "
                                              f"{tmp_path}/no-venv/bin/python"):
        wrong.start()
