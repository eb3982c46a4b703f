"""`asyncrl env register|list|remove`: the operator's side of the env registry.

    asyncrl env register --url http://host:port [--name N --domain D --capacity C --weight W]
    asyncrl env list
    asyncrl env remove ENV_ID

The orchestrator is `--orchestrator URL` or $ASYNCRL_ORCHESTRATOR_URL, its token
`--token` or $ASYNCRL_ORCHESTRATOR_TOKEN. `register` fills what is not given from the service's
GET /info and registers it in probe mode: the orchestrator GETs its /health as the heartbeat.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import httpx

from asyncrl.auth import bearer_headers
from asyncrl.protocols.env_service import InfoResponse
from asyncrl.protocols.orchestrator import EnvRecord, RegisterRequest, RegisterResponse, RemoveResponse


def _parser(prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("--orchestrator", default=os.environ.get("ASYNCRL_ORCHESTRATOR_URL"),
                   help="orchestrator URL (default $ASYNCRL_ORCHESTRATOR_URL)")
    p.add_argument("--token", default=os.environ.get("ASYNCRL_ORCHESTRATOR_TOKEN"),
                   help="bearer token (default $ASYNCRL_ORCHESTRATOR_TOKEN)")
    return p


def _client(args: argparse.Namespace) -> httpx.Client:
    if not args.orchestrator:
        sys.exit("no orchestrator: pass --orchestrator URL or set ASYNCRL_ORCHESTRATOR_URL")
    headers = bearer_headers(args.token)
    return httpx.Client(base_url=args.orchestrator.rstrip("/"), headers=headers, timeout=30)


def _checked(reply: httpx.Response) -> dict | list:
    if reply.status_code >= 400:
        sys.exit(f"orchestrator answered {reply.status_code}: {reply.text}")
    return reply.json()


def register(argv: Optional[list[str]] = None) -> int:
    p = _parser("asyncrl env register", "register an env service; the orchestrator probes its /health")
    p.add_argument("--url", required=True, help="the env service's base URL")
    p.add_argument("--name", help="env name (default: the service's /info)")
    p.add_argument("--domain", help="domain (default: the service's /info)")
    p.add_argument("--capacity", type=int, help="concurrent episodes (default: the service's /info)")
    p.add_argument("--weight", type=float, default=1.0)
    args = p.parse_args(argv)
    if None in (args.name, args.domain, args.capacity):
        info = InfoResponse.model_validate(_checked(httpx.get(f"{args.url.rstrip('/')}/info", timeout=30)))
        args.name, args.domain = args.name or info.name, args.domain if args.domain is not None else info.domain
        args.capacity = args.capacity or info.capacity
    body = RegisterRequest(name=args.name, domain=args.domain, url=args.url, capacity=args.capacity,
                           weight=args.weight, heartbeat="probe")
    with _client(args) as client:
        reply = RegisterResponse.model_validate(_checked(client.post("/v1/envs", json=body.model_dump())))
    print(reply.env_id)
    return 0


def list_envs(argv: Optional[list[str]] = None) -> int:
    args = _parser("asyncrl env list", "list the env services the orchestrator knows").parse_args(argv)
    with _client(args) as client:
        records = [EnvRecord.model_validate(r) for r in _checked(client.get("/v1/envs"))]
    print(f"{'ENV_ID':<18} {'NAME':<16} {'DOMAIN':<10} {'HEALTHY':<8} {'IN_FLIGHT':>9} {'CAPACITY':>8} "
          f"{'HEARTBEAT':<9} URL")
    for r in sorted(records, key=lambda r: (r.name, r.url)):
        print(f"{r.env_id:<18} {r.name:<16} {r.domain:<10} {str(r.healthy).lower():<8} {r.in_flight:>9} "
              f"{r.capacity:>8} {r.heartbeat:<9} {r.url}")
    return 0


def remove(argv: Optional[list[str]] = None) -> int:
    p = _parser("asyncrl env remove", "deregister an env service (its running episodes finish)")
    p.add_argument("env_id")
    args = p.parse_args(argv)
    with _client(args) as client:
        reply = RemoveResponse.model_validate(_checked(client.delete(f"/v1/envs/{args.env_id}")))
    print(f"removed {reply.env_id} ({reply.draining} episodes draining)")
    return 0
