"""The dashboard's HTTP app: the page (static/), its JSON API, /health, /metrics and the login page.

Read-only: every route is a GET but the login form's POST, which sets a cookie and changes nothing in
the run. The API:

    GET /api/overview                 progress, state (live / replayed / waiting / unreachable), last records
    GET /api/curves?after=N           trainer records from index N (the page appends what it lacks)
    GET /api/services                 engines, env services, orchestrator, gateway: health and load
    GET /api/samples?env=&outcome=&min_reward=&max_reward=&step=&before=&count=&scan=
                                      recorded samples, newest first, filtered (trajectories.SampleFilter)
    GET /api/samples/{ref}            one sample: turns, tool calls, per-token arrays, its trained record

A bad query parameter is a 400 naming it (asyncrl/service.py's error handlers).
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, TypeVar
from urllib.parse import parse_qs

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, Counter, Histogram

from asyncrl.service import install_error_handlers, install_metrics
from asyncrl.store import Store
from asyncrl_run.dashboard.access import COOKIE, DashboardGuard, cookie_value
from asyncrl_run.dashboard.probes import Probes
from asyncrl_run.dashboard.source import RunSource, Unreadable
from asyncrl_run.dashboard.trajectories import PAGE_MAX, SCAN_MAX, SampleFilter, TrajectoryView, page
from asyncrl_run.watch import Target

STATIC = Path(str(resources.files("asyncrl_run.dashboard") / "static"))
STREAM_ID = r"^(\+|\d+-\d+)$"
T = TypeVar("T")


class DashboardMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("asyncrl_dashboard_requests_total", "API requests answered", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("asyncrl_dashboard_request_seconds", "API request latency", ["route"],
                                 registry=self.registry, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))


def build_app(target: Target, auth_token: Optional[str] = None, orchestrator_token: Optional[str] = None,
              gateway_token: Optional[str] = None, tokenizer: Optional[str] = None) -> FastAPI:
    metrics = DashboardMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.source = RunSource(target)
        app.state.probes = Probes(orchestrator_token, gateway_token)
        app.state.view = TrajectoryView(target.run_dir, tokenizer)
        try:
            yield
        finally:
            await app.state.probes.close()
            await app.state.source.close()

    app = FastAPI(title="asyncrl dashboard", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(DashboardGuard, auth_token=auth_token)
    install_error_handlers(app)
    install_metrics(app, metrics.registry)
    _count_requests(app, metrics)
    _page_routes(app, auth_token)
    _run_routes(app)
    _sample_routes(app)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _count_requests(app: FastAPI, metrics: DashboardMetrics) -> None:
    @app.middleware("http")
    async def count(request: Request, call_next):
        if not request.url.path.startswith("/api/"):
            return await call_next(request)
        route = request.url.path.split("/")[2]
        started = time.monotonic()
        response = await call_next(request)
        metrics.requests.labels(route, str(response.status_code)).inc()
        metrics.latency.labels(route).observe(time.monotonic() - started)
        return response


def _page_routes(app: FastAPI, auth_token: Optional[str]) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/")
    @app.get("/index.html")
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/login")
    async def login_page() -> HTMLResponse:
        return HTMLResponse((STATIC / "login.html").read_text())

    @app.post("/login", openapi_extra={"requestBody": {"content": {"application/x-www-form-urlencoded": {
        "schema": {"type": "object", "properties": {"token": {"type": "string"}}, "required": ["token"]}}}}})
    async def login(request: Request) -> Response:
        """The login form's POST (form-encoded `token`; parsed here: no multipart dependency)."""
        fields = parse_qs((await request.body()).decode("utf-8", errors="replace"))
        token = (fields.get("token") or [""])[0]
        if auth_token is None:
            return RedirectResponse("/", status_code=303)
        if not _same(token, auth_token):
            return HTMLResponse((STATIC / "login.html").read_text().replace("<!--error-->",
                                '<p class="error">wrong token</p>'), status_code=401)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, cookie_value(auth_token), httponly=True, samesite="strict")
        return response


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def source_of(request: Request) -> RunSource:
    return request.app.state.source


def _run_routes(app: FastAPI) -> None:
    @app.get("/api/overview")
    async def overview(request: Request) -> dict[str, Any]:
        source = source_of(request)
        await source.refresh()
        return source.overview()

    @app.get("/api/curves")
    async def curves(request: Request, after: int = Query(0, ge=0)) -> dict[str, Any]:
        source = source_of(request)
        await source.refresh()
        return source.curves(after)

    @app.get("/api/services")
    async def services(request: Request) -> dict[str, Any]:
        source = source_of(request)
        try:
            engines = await source.read(Store.engines)
        except Unreadable:  # no Redis to read (the overview says why): the services' own answers still count
            engines = {}
        return await request.app.state.probes.services(engines, source.view.services, source.view.orchestrator,
                                                       live=source.state == "live")


def _sample_routes(app: FastAPI) -> None:
    @app.get("/api/samples")
    async def samples(request: Request, env: Optional[str] = Query(None, max_length=200),
                      outcome: Optional[str] = Query(None, max_length=200),
                      min_reward: Optional[float] = Query(None, allow_inf_nan=False),
                      max_reward: Optional[float] = Query(None, allow_inf_nan=False),
                      step: Optional[int] = Query(None, ge=0),
                      before: str = Query("+", pattern=STREAM_ID),
                      count: int = Query(50, ge=1, le=PAGE_MAX),
                      scan: int = Query(1000, ge=1, le=SCAN_MAX)) -> dict[str, Any]:
        if before != "+" and not _is_stream_id(before):
            raise HTTPException(400, f"before: {before[:60]!r} is not a stream id (ms-seq, each below 2^64)")
        before = before if before == "+" else "-".join(str(int(p)) for p in before.split("-"))  # 007-0: 7-0
        wanted = SampleFilter(env or None, min_reward, max_reward, step, outcome or None)
        return await _read(request, lambda store: page(store, wanted, before, count, scan))

    @app.get("/api/samples/{ref}")
    async def sample(request: Request, ref: str) -> dict[str, Any]:
        if ref == "+" or not _is_stream_id(ref):
            raise HTTPException(400, f"ref: {ref[:60]!r} is not a sample's stream id (e.g. 1712345678901-0)")

        async def read(store: Store):
            try:
                [found] = await store.get_samples([ref])
            except KeyError:
                raise HTTPException(404, f"no sample {ref} (never recorded, trimmed by retention, or deleted with "
                                         f"its group by dynamic sampling)") from None
            return found, (await store.trained([ref])).get(ref)

        found, trained = await _read(request, read)
        return request.app.state.view.detail(ref, found, trained)


def _is_stream_id(ref: str) -> bool:
    """A Redis stream id: ms-seq, both unsigned 64-bit (ASCII digits: str.isdigit takes other scripts' too)."""
    ms, _, seq = ref.partition("-")
    return all(part.isascii() and part.isdigit() and int(part) < 2 ** 64 for part in (ms, seq))


async def _read(request: Request, what: Callable[[Store], Awaitable[T]]) -> T:
    """`what` on the run's data (RunSource.read); a 503 saying why where it cannot be read."""
    try:
        return await source_of(request).read(what)
    except Unreadable as err:
        raise HTTPException(503, str(err)) from None
