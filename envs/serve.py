"""Serve an environment: `python -m envs.serve --env envs.tasks.ArithmeticEnv --port 0 [--orchestrator URL]`.

Prints `listening on http://HOST:PORT` once the service accepts episodes (and writes the URL to
--url-file), registers with the orchestrator when one is given, and shuts down cleanly on SIGTERM:
deregister, finish or abort running episodes, exit 0. Exit status 2: the sandbox the env needs is
not available here (see docs/envs.md, "unsafe local mode").
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

TOKEN_ENV = "ASYNCRL_ORCHESTRATOR_TOKEN"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m envs.serve", description=__doc__.split("\n")[0])
    p.add_argument("--env", required=True, help="module.Class (or module:Class) of an envs.sdk.Environment")
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
    p.add_argument("--drain-grace-s", type=float, default=30.0, help="on SIGTERM, time running episodes get")
    p.add_argument("--sandbox-type", default="namespace", help="namespace | local_unsafe | module:Class")
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


def load_env(target: str, options: dict):
    module, _, cls = target.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), cls)(**options)


async def serve(args: argparse.Namespace) -> int:
    from envs.sdk.sandbox import SandboxConfig, SandboxUnavailable
    from envs.sdk.server import EnvService, ServiceConfig

    sandbox = SandboxConfig(**{"type": "local_unsafe" if args.unsafe_local_sandbox else args.sandbox_type,
                               **key_values(args.sandbox_option)})
    config = ServiceConfig(name=args.name, domain=args.domain, capacity=args.capacity, weight=args.weight,
                           host=args.host, port=args.port, public_url=args.public_url,
                           orchestrator_url=args.orchestrator, orchestrator_token=args.orchestrator_token,
                           drain_grace_s=args.drain_grace_s, sandbox=sandbox)
    service = EnvService(load_env(args.env, key_values(args.option)), config)
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
    await stop.wait()
    logging.info("shutting down (signal received)")
    await service.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
