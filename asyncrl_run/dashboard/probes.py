"""How the run's services are, asked of them: engines (the `engines` hash; each one's /health and the load
gauges of its Prometheus /metrics, open on every engine), the orchestrator (GET /v1/status and /v1/envs:
each env's and each env service's health and load), the gateway (/health) and the trainer's /metrics URL.

A service that does not answer is reported as such (its error in one line), never raised: the page shows
what it can. A replayed (finished) run has no live services; the env table then comes from the last
`orchestrator` record of the metrics stream only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.auth import bearer_headers
from orchestrator.run_record import envs_of

PROBE_TIMEOUT_S = 3.0
ENGINE_GAUGES = {
    "sglang_num_running_reqs": "running", "sglang_num_queue_reqs": "queued", "sglang_token_usage": "token_usage",
    "sglang_generation_tokens_total": "generated_tokens", "sglang_prompt_tokens_total": "prompt_tokens",
}
"""The engine metrics shown (SGLang's names: the built-in engine and a real SGLang server alike)."""


class Probes:
    """One HTTP client for every probe; tokens: the orchestrator's and the gateway's bearer tokens."""

    def __init__(self, orchestrator_token: Optional[str] = None, gateway_token: Optional[str] = None) -> None:
        self.http = httpx.AsyncClient(timeout=PROBE_TIMEOUT_S)
        self.orchestrator_headers = bearer_headers(orchestrator_token)
        self.gateway_headers = bearer_headers(gateway_token)

    async def close(self) -> None:
        await self.http.aclose()

    async def services(self, engines: dict[str, str], services: dict[str, str], orchestrator_record: dict,
                       live: bool) -> dict[str, Any]:
        """Everything the services panel shows; with `live` False (a replay) nothing is asked over HTTP."""
        out: dict[str, Any] = {"envs": _env_rows(orchestrator_record), "live": live,
                               "trainer_metrics": services.get("trainer_metrics")}
        if not live:
            return {**out, "engines": [{"id": e, "url": u, "healthy": None} for e, u in sorted(engines.items())],
                    "env_services": [], "orchestrator": {"url": services.get("orchestrator")},
                    "gateway": {"url": services.get("gateway")}}
        engine_rows, orch, gateway = await asyncio.gather(
            asyncio.gather(*(self.engine(e, u) for e, u in sorted(engines.items()))),
            self.orchestrator(services.get("orchestrator")), self.gateway(services.get("gateway")))
        return {**out, "engines": list(engine_rows), "env_services": orch.pop("env_services", []),
                "orchestrator": orch, "gateway": gateway}

    async def engine(self, engine_id: str, url: str) -> dict[str, Any]:
        row: dict[str, Any] = {"id": engine_id, "url": url}
        try:
            health, metrics = await asyncio.gather(self.http.get(f"{url}/health"), self.http.get(f"{url}/metrics"))
        except httpx.HTTPError as err:
            return {**row, "healthy": False, "error": _one_line(err)}
        row["healthy"] = health.status_code == 200
        if metrics.status_code == 200:
            row.update(engine_gauges(metrics.text))
        return row

    async def orchestrator(self, url: Optional[str]) -> dict[str, Any]:
        if not url:
            return {"url": None}
        try:
            status, envs = await asyncio.gather(
                self.http.get(f"{url}/v1/status", headers=self.orchestrator_headers),
                self.http.get(f"{url}/v1/envs", headers=self.orchestrator_headers))
        except httpx.HTTPError as err:
            return {"url": url, "reachable": False, "error": _one_line(err)}
        if status.status_code != 200 or envs.status_code != 200:
            code = status.status_code if status.status_code != 200 else envs.status_code
            why = " (set --orchestrator-token)" if code == 401 else ""
            return {"url": url, "reachable": True, "error": f"HTTP {code}{why}"}
        now = time.time()
        rows = [{**e, "heartbeat_age_s": max(0.0, now - e.get("last_heartbeat", now))} for e in envs.json()]
        body = status.json()
        return {"url": url, "reachable": True, "paused": body.get("paused"),
                "pause_reasons": body.get("pause_reasons", []), "in_flight": body.get("in_flight"),
                "episodes_per_s": body.get("episodes_per_s"), "by_env": body.get("by_env", {}),
                "env_services": sorted(rows, key=lambda e: (e.get("name", ""), e.get("env_id", "")))}

    async def gateway(self, url: Optional[str]) -> dict[str, Any]:
        if not url:
            return {"url": None}
        try:
            response = await self.http.get(f"{url}/health", headers=self.gateway_headers)
        except httpx.HTTPError as err:
            return {"url": url, "healthy": False, "error": _one_line(err)}
        if response.status_code != 200:
            why = " (set --gateway-token)" if response.status_code == 401 else ""
            return {"url": url, "healthy": False, "error": f"HTTP {response.status_code}{why}"}
        return {"url": url, "healthy": True, **response.json()}


def engine_gauges(text: str) -> dict[str, float]:
    """ENGINE_GAUGES' values from a Prometheus text exposition (labelled samples summed)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ENGINE_GAUGES:
                key = ENGINE_GAUGES[sample.name]
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def _env_rows(record: dict[str, float]) -> list[dict[str, Any]]:
    """Per env, from an `orchestrator` record: health, load and outcome counts by class."""
    rows = []
    for env, values in sorted(envs_of(record).items()):
        outcomes = {k[len("outcome_"):]: v for k, v in values.items() if k.startswith("outcome_") and "/" not in k}
        fields = {k: v for k, v in values.items() if not k.startswith("outcome_")}
        rows.append({"env": env, **fields, "outcomes": outcomes})
    return rows


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
