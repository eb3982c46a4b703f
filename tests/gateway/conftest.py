"""Real engines and gateways for the gateway tests, stopped by the handles that started them."""

from __future__ import annotations

import httpx
import pytest

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.model.io import load_pretrained
from asyncrl.store import Store
from asyncrl.tokenizer import load_tokenizer
from tests.gateway.scripted import save_scripted_checkpoint
from tests.rollout.conftest import reference_model, start_engine  # noqa: F401 (fixture)
from tests.services import ServiceProcess

AUTH_TOKEN = "test-token-123"


@pytest.fixture(scope="session")
def template() -> GlmChatTemplate:
    return GlmChatTemplate(load_tokenizer("builtin:tiny"))


@pytest.fixture(scope="session")
def scripted_checkpoint(tmp_path_factory, tiny_arch, template):
    return save_scripted_checkpoint(tiny_arch, template, tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="session")
def scripted_model(scripted_checkpoint):
    return load_pretrained(scripted_checkpoint).eval()


@pytest.fixture(scope="session")
def random_engine(tiny_checkpoint, tmp_path_factory):
    proc = start_engine(tiny_checkpoint, tmp_path_factory.mktemp("engine-random"), name="engine-random")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="session")
def scripted_engine(scripted_checkpoint, tmp_path_factory):
    """Streams incrementally (SGLang's --incremental-streaming-output), as the run config's engines do; the
    random engine streams cumulatively (SGLang's default): the gateway is exercised against both."""
    proc = start_engine(scripted_checkpoint, tmp_path_factory.mktemp("engine-scripted"),
                        "--incremental-streaming-output", name="engine-scripted")
    yield proc
    assert proc.stop() == 0, proc.log()


def start_gateway(workdir, engines, redis_url: str, run: str, *extra: str, name: str = "gateway") -> ServiceProcess:
    args = [arg for engine in engines for arg in ("--engine", engine.url)]
    return ServiceProcess("gateway.server", [*args, "--redis-url", redis_url, "--run", run,
                                             "--health-interval-s", "0.5", *extra], workdir, name=name)


@pytest.fixture(scope="session")
def gateway_run() -> str:
    return "gateway-tests"


@pytest.fixture(scope="session")
def scripted_gateway(scripted_engine, redis_server, gateway_run, tmp_path_factory):
    """Over the scripted engine; small request limit (64 KiB) to test 413."""
    proc = start_gateway(tmp_path_factory.mktemp("gw-scripted"), [scripted_engine], redis_server.url, gateway_run,
                         "--max-request-bytes", "65536", name="gateway-scripted")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="session")
def random_gateway(random_engine, redis_server, gateway_run, tmp_path_factory):
    """Over the random engine, with a bearer token on every route."""
    proc = start_gateway(tmp_path_factory.mktemp("gw-random"), [random_engine], redis_server.url, gateway_run,
                         "--auth-token", AUTH_TOKEN, name="gateway-random")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
async def store(redis_server, gateway_run):
    s = Store.connect(redis_server.url, gateway_run)
    yield s
    await s.close()


class GatewayClient:
    """Sessions API over httpx (what the orchestrator does), with an optional bearer token."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(base_url=url, headers=self.headers, timeout=120)

    async def create(self, **body) -> dict:
        r = await self.http.post("/sessions", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    async def record(self, sid: str) -> dict:
        r = await self.http.get(f"/sessions/{sid}")
        assert r.status_code == 200, r.text
        return r.json()

    async def finish(self, sid: str, **body) -> dict:
        r = await self.http.post(f"/sessions/{sid}/finish", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def close(self) -> None:
        await self.http.aclose()


@pytest.fixture
async def scripted_client(scripted_gateway):
    c = GatewayClient(scripted_gateway.url)
    yield c
    await c.close()


@pytest.fixture
async def random_client(random_gateway):
    c = GatewayClient(random_gateway.url, AUTH_TOKEN)
    yield c
    await c.close()


def error_message(response: httpx.Response) -> str:
    """The message of an error reply in either shape (asyncrl's or OpenAI's)."""
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


@pytest.fixture
async def openai_client():
    """Factory of AsyncOpenAI clients, closed at teardown."""
    import openai

    clients = []

    def make(base_url: str, api_key: str = "unused", **kwargs):
        clients.append(openai.AsyncOpenAI(base_url=base_url, api_key=api_key, **kwargs))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()
