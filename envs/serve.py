"""Serve an environment: `python -m envs.serve --env envs.tasks.ArithmeticEnv --port 0 [--orchestrator URL]`.

`--env` names the class as `package.module.Class` (or `package.module:Class`), imported from the
current directory, $PYTHONPATH and each `--env-path DIR`; or as `path/to/file.py:Class`, a file
loaded directly (its directory goes on sys.path, so its sibling modules import too).

Prints `listening on http://HOST:PORT` once the service accepts episodes (and writes the URL to
--url-file), registers with the orchestrator when one is given, and shuts down cleanly on SIGTERM:
deregister, finish or abort running episodes, exit 0. Exit status 1: the env class cannot be
loaded; 2: the sandbox the env needs is not available here (see docs/envs.md, "unsafe local mode");
3: the orchestrator stayed unreachable for --orchestrator-gone-s.
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

from asyncrl.plugins import PluginNotFound, load_object, split_path
from asyncrl.protocols.env_service import SERVICE_TOKEN_ENV
from envs.sdk.registration import DEFAULT_GONE_AFTER_S

TOKEN_ENV = "ASYNCRL_ORCHESTRATOR_TOKEN"
EXIT_ORCHESTRATOR_GONE = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m envs.serve", description=__doc__.split("\n")[0])
    p.add_argument("--env", required=True, help="the envs.sdk.Environment class: package.module.Class, "
                                                "package.module:Class or path/to/file.py:Class")
    p.add_argument("--env-path", action="append", default=[], metavar="DIR",
                   help="a directory to import --env's module from (before $PYTHONPATH; repeatable)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the env class; VALUE is parsed as JSON when it can be")
    p.add_argument("--name", help="service name (default: the env's)")
    p.add_argument("--domain", help="service domain (default: the env's)")
    p.add_argument("--capacity", type=int, default=64, help="concurrent episodes; one more gets 429")
    p.add_argument("--weight", type=float, default=1.0, help="dispatch weight sent with the registration")
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
    p.add_argument("--sandbox-type", default="namespace",
                   help="namespace | local_unsafe | the import path of a SandboxBackend (package.module:Class)")
    p.add_argument("--sandbox-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a SandboxConfig field, e.g. memory_mb=1024 (see envs/sdk/sandbox.py)")
    p.add_argument("--unsafe-local-sandbox", action="store_true",
                   help="run agent commands WITHOUT isolation (same as --sandbox-type local_unsafe)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


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


def sandbox_config(args: argparse.Namespace):
    """The SandboxConfig the command line asks for (--sandbox-type, --sandbox-option, --unsafe-local-sandbox)."""
    from envs.sdk.sandbox import SandboxConfig

    return SandboxConfig(**{"type": "local_unsafe" if args.unsafe_local_sandbox else args.sandbox_type,
                            **key_values(args.sandbox_option)})


async def serve(args: argparse.Namespace) -> int:
    from envs.sdk.sandbox import SandboxUnavailable
    from envs.sdk.server import EnvService, ServiceConfig

    sandbox = sandbox_config(args)
    config = ServiceConfig(name=args.name, domain=args.domain, capacity=args.capacity, weight=args.weight,
                           host=args.host, port=args.port, public_url=args.public_url,
                           orchestrator_url=args.orchestrator, orchestrator_token=args.orchestrator_token,
                           auth_token=args.auth_token,
                           orchestrator_gone_s=args.orchestrator_gone_s or None, drain_grace_s=args.drain_grace_s,
                           sandbox=sandbox)
    service = EnvService(load_env(args.env, key_values(args.option), args.env_path), config)
    try:
        url = await service.start()
    except SandboxUnavailable as err:
        logging.critical("refusing to start %s: %s. To run WITHOUT isolation anyway, pass --unsafe-local-sandbox "
                         "(sandbox type local_unsafe): agent commands then run as this user, with network access.",
                         args.env, err)
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
