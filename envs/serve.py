"""Serve an environment: `python -m envs.serve --env envs.tasks.ArithmeticEnv --port 0 [--orchestrator URL]`.

`--env` names the class as `package.module.Class` (or `package.module:Class`), imported from the
current directory, $PYTHONPATH and each `--env-path DIR`; or as `path/to/file.py:Class`, a file
loaded directly (its directory goes on sys.path, so its sibling modules import too).

Prints `listening on http://HOST:PORT` once the service accepts episodes (and writes the URL to
--url-file), registers with the orchestrator when one is given, and shuts down cleanly on SIGTERM:
deregister, finish or abort running episodes, exit 0. Exit status 1: the env class cannot be
loaded; 2: the sandbox the env needs is not available here (see docs/envs.md, "unsafe local mode");
3: the orchestrator stayed unreachable for --orchestrator-gone-s.

The launcher starts it with `--config FILE`: the env's resolved section (asyncrl.config.EnvServiceConfig,
<run_dir>/config/env-<name>.json); GET /server_info reports the section the service runs with.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import sys
from pathlib import Path

from asyncrl.config import EnvServiceConfig, load_section
from asyncrl.plugins import PluginNotFound, load_object, split_path
from asyncrl.protocols.env_service import SERVICE_TOKEN_ENV
from envs.sdk.registration import DEFAULT_GONE_AFTER_S

TOKEN_ENV = "ASYNCRL_ORCHESTRATOR_TOKEN"
EXIT_ORCHESTRATOR_GONE = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m envs.serve", description=__doc__.split("\n")[0])
    section = {"default": argparse.SUPPRESS}  # the env's section: --config FILE, then these flags over it
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="the env's section (asyncrl.config.EnvServiceConfig) as JSON, as the launcher writes it; "
                        "--env, --name, --capacity, ... given as well override it")
    p.add_argument("--env", dest="target", **section, help="the envs.sdk.Environment class: package.module.Class, "
                                                          "package.module:Class or path/to/file.py:Class")
    p.add_argument("--env-path", action="append", default=[], metavar="DIR",
                   help="a directory to import --env's module from (before $PYTHONPATH; repeatable)")
    p.add_argument("--option", dest="options", action="append", **section, metavar="KEY=VALUE",
                   help="keyword argument for the env class; VALUE is parsed as JSON when it can be")
    p.add_argument("--name", **section, help="service name (default: the env's)")
    p.add_argument("--domain", **section, help="service domain (default: the env's)")
    p.add_argument("--capacity", **section, help="concurrent episodes; one more gets 429 (default 64)")
    p.add_argument("--weight", **section, help="dispatch weight sent with the registration (default 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port")
    p.add_argument("--public-url", help="URL the orchestrator should call, if not http://HOST:PORT")
    p.add_argument("--url-file", type=Path, help="write the bound URL here once serving")
    p.add_argument("--orchestrator", help="orchestrator base URL to self-register and heartbeat with")
    p.add_argument("--orchestrator-token", default=os.environ.get(TOKEN_ENV),
                   help=f"bearer token for the orchestrator (default: ${TOKEN_ENV})")
    p.add_argument("--auth-token", default=os.environ.get(SERVICE_TOKEN_ENV),
                   help=f"bearer token callers must send on every route but /health, /metrics "
                        f"(default: ${SERVICE_TOKEN_ENV}; none: any caller is served)")
    p.add_argument("--orchestrator-gone-s", type=float, default=DEFAULT_GONE_AFTER_S,
                   help="exit (status 3) when no registration or heartbeat has been accepted for this long "
                        "(default %(default)g; 0: wait for the orchestrator forever)")
    p.add_argument("--drain-grace-s", type=float, default=30.0, help="on SIGTERM, time running episodes get")
    p.add_argument("--sandbox-type", dest="sandbox", **section, help="namespace | local_unsafe | the import path of a SandboxBackend (package.module:Class)")
    p.add_argument("--sandbox-option", dest="sandbox_options", action="append", **section, metavar="KEY=VALUE",
                   help="a SandboxConfig field, e.g. memory_mb=1024 (see envs/sdk/sandbox.py)")
    p.add_argument("--context-option", dest="context", action="append", **section, metavar="KEY=VALUE",
                   help="a ContextConfig field, e.g. keep_recent_k=5 or discard_at_tokens=32768 (see envs/sdk/context.py)")
    p.add_argument("--unsafe-local-sandbox", dest="sandbox", action="store_const", const="local_unsafe",
                   **section, help="run agent commands WITHOUT isolation (same as --sandbox-type local_unsafe)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    try:
        args.section = env_section(args)
    except ValueError as err:
        p.error(f"{err} (give --env, or --config FILE)")
    try:
        args.context_config = context_config(args.section)
    except ValueError as err:
        p.error(str(err))
    return args


SECTION_FIELDS = ("target", "options", "name", "domain", "capacity", "weight", "sandbox", "sandbox_options", "context")
"""The EnvServiceConfig fields this command line can set (the rest come only by --config)."""


def env_section(args: argparse.Namespace) -> EnvServiceConfig:
    """The env's section: --config FILE (when given), then the section flags that were given."""
    given = {name: getattr(args, name) for name in SECTION_FIELDS if hasattr(args, name)}
    for name in ("options", "sandbox_options", "context"):
        if name in given:
            given[name] = key_values(given[name])
    return load_section(EnvServiceConfig, args.config, given)


def key_values(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def load_env_class(target: str, env_paths: list[str] = ()) -> type:
    """The Environment class `target` names (see the module docstring); SystemExit saying why not."""
    from envs.sdk.base import Environment

    for directory in reversed(env_paths):
        sys.path.insert(0, str(Path(directory).resolve()))
    source, sep, cls_name = target.rpartition(":")
    if sep and source.endswith(".py"):
        module = _load_file(Path(source), target)
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise SystemExit(f"--env {target!r}: {module.__name__} ({module.__file__}) has no {cls_name!r}")
    else:
        try:
            _, cls_name = split_path(target)
        except ValueError:
            raise SystemExit(f"--env {target!r}: expected package.module.Class or path/to/file.py:Class") from None
        cls = _import_env_class(target, cls_name, env_paths)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise SystemExit(f"--env {target!r}: {cls_name} is not a subclass of envs.sdk.Environment")
    return cls


def _import_env_class(target: str, cls_name: str, env_paths: list[str]) -> object:
    """The object import path `target` names; SystemExit saying where its module was looked for."""
    try:
        return load_object(target)
    except PluginNotFound as err:
        if err.missing_module is None:
            raise SystemExit(f"--env {target!r}: {err}") from None
        searched = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep), *env_paths]
        raise SystemExit(
            f"--env {target!r}: no module named {err.missing_module!r} on the import path. The module must be "
            f"importable from the current directory ({os.getcwd()}), $PYTHONPATH or --env-path DIR, "
            f"or name the file: --env path/to/file.py:{cls_name}. Searched first: "
            f"{', '.join(dict.fromkeys(filter(None, searched)))}") from None


def _load_file(path: Path, target: str):
    path = path.resolve()
    if not path.is_file():
        raise SystemExit(f"--env {target!r}: no file {path}")
    sys.path.insert(0, str(path.parent))
    name = path.stem if path.stem not in sys.modules else f"_asyncrl_env_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses, pickling and self-imports look it up
    spec.loader.exec_module(module)
    return module


def load_env(target: str, options: dict, env_paths: list[str] = ()):
    return load_env_class(target, env_paths)(**options)


def context_config(section: EnvServiceConfig):
    """The ContextConfig the env's section asks for (`context`); a ValueError names a wrong field."""
    from envs.sdk.context import ContextConfig

    try:
        return ContextConfig(**section.context)
    except TypeError as err:  # an unknown field
        raise ValueError(f"envs.services.<env>.context: {err}") from None


def sandbox_config(section: EnvServiceConfig):
    """The SandboxConfig the env's section asks for (sandbox, sandbox_options)."""
    from envs.sdk.sandbox import SandboxConfig

    return SandboxConfig(**{"type": section.sandbox, **section.sandbox_options})


async def serve(args: argparse.Namespace) -> int:
    from envs.sdk.sandbox import SandboxUnavailable
    from envs.sdk.server import EnvService, ServiceConfig

    env = args.section
    config = ServiceConfig(name=env.name, domain=env.domain, capacity=env.capacity, weight=env.weight,
                           host=args.host, port=args.port, public_url=args.public_url,
                           orchestrator_url=args.orchestrator, orchestrator_token=args.orchestrator_token,
                           auth_token=args.auth_token,
                           orchestrator_gone_s=args.orchestrator_gone_s or None, drain_grace_s=args.drain_grace_s,
                           sandbox=sandbox_config(env), context=args.context_config, section=env)
    service = EnvService(load_env(env.target, env.options, args.env_path), config)
    try:
        url = await service.start()
    except SandboxUnavailable as err:
        logging.critical("refusing to start %s: %s. To run WITHOUT isolation anyway, pass --unsafe-local-sandbox "
                         "(sandbox type local_unsafe): agent commands then run as this user, with network access.",
                         env.target, err)
        return 2
    print(f"listening on {url}", flush=True)
    if args.url_file:
        tmp = args.url_file.with_suffix(".tmp")
        tmp.write_text(url)
        tmp.replace(args.url_file)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    waits = [asyncio.create_task(stop.wait())]
    if service.registrar is not None:
        waits.append(asyncio.create_task(service.registrar.gone.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if not stop.is_set() and service.registrar is not None and service.registrar.gone.is_set():
        logging.critical("exiting (status %d): %s", EXIT_ORCHESTRATOR_GONE, service.registrar.gone_reason)
        await service.stop()
        return EXIT_ORCHESTRATOR_GONE
    logging.info("shutting down (signal received)")
    await service.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # httpx logs every request at INFO (each heartbeat, each model call): shown only at --log-level DEBUG.
    debug = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    logging.getLogger("httpx").setLevel(logging.INFO if debug else logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
