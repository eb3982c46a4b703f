"""`asyncrl dashboard`: serve the web dashboard of a run (docs/run.md "Dashboard").

    asyncrl dashboard --run-dir runs/tiny_demo                 # http://127.0.0.1:8390, while or after it runs
    asyncrl dashboard --redis-url redis://host:6379/0 --run NAME --host 0.0.0.0 --auth-token ...

Read-only. Binds loopback unless --host says otherwise; with a token (--auth-token, $ASYNCRL_DASHBOARD_TOKEN,
else the run's $ASYNCRL_ORCHESTRATOR_TOKEN) every route but /health, /metrics and /login wants it.
Stops cleanly on SIGINT/SIGTERM. Exit code 2 when the arguments name no run directory.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from typing import Optional

from asyncrl.service import serve
from asyncrl_run.dashboard.access import resolve_token
from asyncrl_run.dashboard.app import build_app
from asyncrl_run.watch import WatchError, resolve

DEFAULT_PORT = 8390
log = logging.getLogger("asyncrl_run.dashboard")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl dashboard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", help="the run directory (its redis.url names the run's Redis)")
    p.add_argument("--redis-url")
    p.add_argument("--run", help="run name (default: the run directory's name, else the one run in that Redis)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    p.add_argument("--url-file", help="write the bound URL here once serving (for scripts and tests)")
    p.add_argument("--auth-token", help="token the dashboard asks for (default $ASYNCRL_DASHBOARD_TOKEN, "
                                        "else $ASYNCRL_ORCHESTRATOR_TOKEN; none: open)")
    p.add_argument("--orchestrator-token", default=os.environ.get("ASYNCRL_ORCHESTRATOR_TOKEN"),
                   help="sent to the orchestrator's /v1 routes (default $ASYNCRL_ORCHESTRATOR_TOKEN)")
    p.add_argument("--gateway-token", default=os.environ.get("ASYNCRL_GATEWAY_TOKEN"),
                   help="sent to the gateway's /health (default $ASYNCRL_GATEWAY_TOKEN)")
    p.add_argument("--tokenizer", help="decode samples with this tokenizer (default: the run's, from "
                                       "<run_dir>/config/gateway.json, else builtin:tiny)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not args.redis_url and not args.run_dir:
        p.error("give --run-dir or --redis-url")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe
    try:
        target = resolve(args)
    except WatchError as err:
        print(f"asyncrl dashboard: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    token = resolve_token(args.auth_token)
    if token is None and not _loopback(args.host):
        log.warning("serving %s on %s without a token: anyone who reaches it reads the run (set --auth-token)",
                    target.run_dir or target.redis_url, args.host)
    app = build_app(target, auth_token=token, orchestrator_token=args.orchestrator_token,
                    gateway_token=args.gateway_token, tokenizer=args.tokenizer)
    serve(app, args.host, args.port, url_file=args.url_file)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    main()
