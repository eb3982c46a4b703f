"""The services' own Prometheus /metrics, scraped by the launcher's metrics collector for W&B: the
metrics only the services hold (gateway latencies and tokens, engine load, env service histograms,
the orchestrator's per-env counters) next to the run's `metrics` stream.

Each value gets a panel key: `system/gateway/<name>`, `system/orchestrator/<name>`,
`system/trainer/<name>`, `system/engine/<engine id>/<name>`, and `env/<env>/service/<name>` (env
services, replicas summed) or `env/<env>/orchestrator/<name>` (an orchestrator metric of one env).
<name> is the metric's name without its component prefix, then one `/<label>=<value>` per label
(`system/gateway/turns_total/api=chat/finish_reason=stop`); counters keep `_total`, a histogram is
`<name>_count` and `<name>_mean` (its _sum / _count), the labels after them.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Optional

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.store import Store

log = logging.getLogger("asyncrl.service_metrics")

PREFIXES = ("asyncrl_gateway_", "asyncrl_orchestrator_", "asyncrl_trainer_", "asyncrl_engine_", "asyncrl_env_",
            "sglang_")
"""Component prefixes of metric names (docs/run.md "Metrics"), dropped from the panel key."""
HISTOGRAMS = ("histogram", "gaugehistogram", "summary")
HISTOGRAM_PARTS = {"_sum": 0, "_gsum": 0, "_count": 1, "_gcount": 1}
"""Samples of a histogram kept: its sum and its count (slot 0, 1)."""


@dataclass(frozen=True)
class Target:
    """One /metrics endpoint: its URL, the panel its values go under, and the credential it wants."""

    name: str
    """For the one log line of a failing scrape."""
    url: str
    panel: str
    """Key prefix of its values (`system/gateway`, `env/arithmetic/service`, ...)."""
    env_panel: str
    """A sample labelled env=<env> goes under `env/<env>/<env_panel>` instead."""
    headers: tuple[tuple[str, str], ...] = ()


class Values:
    """Panel values of several /metrics scrapes; the same key in two of them (replicas of an env service) is
    summed, histograms by their sums and counts."""

    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}
        self.histograms: dict[tuple[str, str], list[float]] = {}
        """(prefix/name, label tail) -> [sum, count]."""

    def add(self, families: list[Metric], panel: str, env_panel: str) -> None:
        for family in families:
            if family.name.endswith("_created"):  # a counter's or histogram's creation time (its own family)
                continue
            base = _short(family.name)
            for sample in family.samples:
                part = sample.name[len(family.name):]  # "", _total, _sum, _count, _bucket, _created, ...
                if part in ("_created", "_bucket"):
                    continue
                labels = {k: v for k, v in sample.labels.items() if k not in ("le", "quantile")}
                env = labels.pop("env", None)
                prefix = f"env/{_clean(env)}/{env_panel}" if env else panel
                tail = "".join(f"/{k}={_clean(v)}" for k, v in sorted(labels.items()))
                if family.type in HISTOGRAMS:
                    if part in HISTOGRAM_PARTS:
                        slot = self.histograms.setdefault((f"{prefix}/{base}", tail), [0.0, 0.0])
                        slot[HISTOGRAM_PARTS[part]] += sample.value
                else:
                    key = f"{prefix}/{_short(sample.name)}{tail}"
                    self.scalars[key] = self.scalars.get(key, 0.0) + sample.value

    def result(self) -> dict[str, float]:
        out = dict(self.scalars)
        for (name, tail), (total, count) in self.histograms.items():
            out[f"{name}_count{tail}"] = count
            if count:
                out[f"{name}_mean{tail}"] = total / count
        return out


def _short(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _clean(value: str) -> str:
    """A label value as one key segment: no `/` (a nested panel) nor `.` (W&B nests summary keys by it)."""
    return re.sub(r"[^\w:=-]", "_", value)


class ServiceScraper:
    """Finds the run's /metrics endpoints at every scrape (services restart on new ports): the `services`
    hash (gateways, trainer_metrics), the `engines` hash, the orchestrator itself and its healthy env
    services (GET /v1/envs; a resumed run's registry still lists the previous run's). A failing endpoint
    is logged once (again once it recovered and failed anew) and skipped; a scrape never fails the run."""

    def __init__(self, orchestrator_url: str, orchestrator_headers: dict[str, str],
                 gateway_headers: dict[str, str]) -> None:
        self.orchestrator_url = orchestrator_url
        self.orchestrator_headers, self.gateway_headers = orchestrator_headers, gateway_headers
        self._failing: set[str] = set()

    async def targets(self, http: httpx.AsyncClient, store: Store) -> list[Target]:
        services = {k.decode(): v.decode() for k, v in (await store.redis.hgetall(store.key("services"))).items()}
        out = [Target("orchestrator", self.orchestrator_url, "system/orchestrator", "orchestrator")]
        for i, url in enumerate(filter(None, services.get("gateways", services.get("gateway", "")).split(","))):
            name = "gateway" if i == 0 else f"gateway-{i}"
            out.append(Target(name, url, f"system/{name}", "gateway", tuple(self.gateway_headers.items())))
        if services.get("trainer_metrics"):
            out.append(Target("trainer", services["trainer_metrics"], "system/trainer", "trainer"))
        for engine_id, url in sorted((await store.engines()).items()):
            out.append(Target(f"engine {engine_id}", url, f"system/engine/{_clean(engine_id)}", "engine"))
        for env in await self._envs(http):
            out.append(Target(f"env service {env['name']} ({env['url']})", env["url"],
                              f"env/{_clean(env['name'])}/service", "service"))
        return out

    async def scrape(self, http: httpx.AsyncClient, store: Store) -> dict[str, float]:
        values = Values()
        targets = await self.targets(http, store)
        scraped = await asyncio.gather(*(self._get(http, t) for t in targets))
        for target, families in zip(targets, scraped):
            if families is not None:
                values.add(families, target.panel, target.env_panel)
        return values.result()

    async def _envs(self, http: httpx.AsyncClient) -> list[dict]:
        reply = await self._request(http, "orchestrator /v1/envs", f"{self.orchestrator_url}/v1/envs",
                                    self.orchestrator_headers)
        if reply is None:
            return []
        try:
            return [env for env in reply.json() if env.get("healthy") and env.get("name") and env.get("url")]
        except (ValueError, AttributeError) as err:
            self._failed("orchestrator /v1/envs", f"unreadable reply ({err!r})")
            return []

    async def _get(self, http: httpx.AsyncClient, target: Target) -> Optional[list[Metric]]:
        reply = await self._request(http, target.name, f"{target.url}/metrics", dict(target.headers))
        if reply is None:
            return None
        try:
            return list(text_string_to_metric_families(reply.text))
        except ValueError as err:  # that endpoint's failure, not the scrape's
            self._failed(target.name, f"unparsable /metrics ({err})")
            return None

    async def _request(self, http: httpx.AsyncClient, name: str, url: str,
                       headers: dict[str, str]) -> Optional[httpx.Response]:
        try:
            reply = await http.get(url, headers=headers)
        except httpx.HTTPError as err:
            self._failed(name, repr(err))
            return None
        if reply.status_code != 200:
            self._failed(name, f"HTTP {reply.status_code}")
            return None
        self._failing.discard(name)
        return reply

    def _failed(self, name: str, reason: str) -> None:
        if name not in self._failing:
            self._failing.add(name)
            log.warning("W&B: %s metrics not scraped (%s); skipped until it answers", name, reason)
