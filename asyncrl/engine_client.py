"""Typed async client for every engine endpoint (engine.md), used by the gateway and the trainer.

It speaks SGLang's native API, so it drives the built-in CPU engine and a real SGLang server alike.
Timeouts are per call. Retries: idempotent reads retry on connection errors and 5xx; /generate
retries only when the connection failed before the request was sent (never a duplicate generation).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import aiohttp
import httpx
import orjson
import torch

from asyncrl.engine_response import StreamAccumulator
from asyncrl.protocols.engine import GenerateResponse, LoadsResponse, WeightsUpdateResponse
from asyncrl.tensor_codec import TENSOR_LOAD_FORMAT, encode_named_tensors

log = logging.getLogger("asyncrl.engine_client")

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

LONG_PROMPT_IDS = 65536
"""Prompts longer than this (tokens) are serialized in a worker thread, a chunk of this many ids per call:
orjson holds the GIL through a call (~40 ms for two million ids, several times that on a loaded host), and
the event loop of a gateway must keep serving its other sessions meanwhile."""


class EngineError(RuntimeError):
    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass
class RawResponse:
    """Status and body of a unary call, whichever transport carried it."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class AiohttpTransport:
    """Unary requests over one shared aiohttp session, for hot paths: on a 2-core machine a /generate
    round trip costs ~1.7 ms less than through httpx (measured, bench/results/gateway_bench.md).
    Failures are raised as httpx's exceptions, so callers catch one family whatever the transport.
    The session is opened lazily inside the running event loop."""

    KEEPALIVE_S = 4.0
    """Idle pooled connections are closed before uvicorn's 5 s keep-alive closes them under us."""

    def __init__(self, connect_timeout_s: float = 10.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._session: Optional[aiohttp.ClientSession] = None

    async def request(self, method: str, url: str, content: Optional[bytes], headers: Optional[dict[str, str]],
                      timeout_s: float) -> RawResponse:
        for attempt in range(2):
            try:
                return await self._request(method, url, content, headers, timeout_s)
            except aiohttp.ServerDisconnectedError as err:
                # A pooled connection the server closed as we reused it: the request was not read. Once
                # more on a fresh connection (a dead server then fails to connect).
                if attempt:
                    raise httpx.ReadError(f"{method} {url}: server disconnected") from err
        raise AssertionError("unreachable")

    async def _request(self, method: str, url: str, content: Optional[bytes], headers: Optional[dict[str, str]],
                       timeout_s: float) -> RawResponse:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=self.KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._session.request(method, url, data=content, headers=headers, timeout=timeout) as reply:
                return RawResponse(reply.status, await reply.read())
        except aiohttp.ServerDisconnectedError:
            raise
        except aiohttp.ClientConnectorError as err:
            raise httpx.ConnectError(str(err)) from err
        except asyncio.TimeoutError as err:
            raise httpx.ReadTimeout(f"{method} {url}: no answer in {timeout_s}s") from err
        except aiohttp.ClientError as err:  # disconnected, reset, truncated payload
            raise httpx.ReadError(f"{type(err).__name__}: {err}") from err

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, retries: int = 3,
                 client: Optional[httpx.AsyncClient] = None, transport: Optional[AiohttpTransport] = None,
                 api_key: Optional[str] = None) -> None:
        """`client` carries streams (and unary calls unless `transport` is given); both may be shared
        by many EngineClients and are then closed by their owner. `api_key`: the engine's --api-key,
        sent as `Authorization: Bearer <key>` on every call."""
        self.base_url = base_url.rstrip("/")
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._json_headers = {"content-type": "application/json", **self._auth}
        self.timeout_s = timeout_s
        self.retries = retries
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
        self._owns_client = client is None
        self._transport = transport

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # Transport ---------------------------------------------------------------------------------
    async def _request(self, method: str, path: str, body: Any = None, idempotent: bool = False,
                       timeout_s: Optional[float] = None) -> httpx.Response | RawResponse:
        """`body`: a JSON value, or its serialization (bytes)."""
        url = f"{self.base_url}{path}"
        content = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
        headers = self._json_headers if body is not None else (self._auth or None)
        retryable = httpx.TransportError if idempotent else (httpx.ConnectError, httpx.ConnectTimeout)
        for attempt in range(self.retries + 1):
            try:
                response = await self._send(method, url, content, headers, timeout_s or self.timeout_s)
            except retryable:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(0.1 * 2 ** attempt)
                continue
            if response.status_code >= 500 and idempotent and attempt < self.retries:
                await asyncio.sleep(0.1 * 2 ** attempt)
                continue
            return response
        raise AssertionError("unreachable")

    async def _send(self, method: str, url: str, content: Optional[bytes], headers: Optional[dict[str, str]],
                    timeout_s: float) -> httpx.Response | RawResponse:
        if self._transport is not None:
            return await self._transport.request(method, url, content, headers, timeout_s)
        return await self._client.request(method, url, content=content, headers=headers, timeout=timeout_s)

    async def _json(self, method: str, path: str, body: Any = None, idempotent: bool = False,
                    timeout_s: Optional[float] = None) -> Any:
        response = await self._request(method, path, body, idempotent, timeout_s)
        if response.status_code >= 400:
            raise EngineError(self.base_url, response.status_code, _error_message(response))
        return orjson.loads(response.content)

    # Generation --------------------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, rid: Optional[str] = None,
                       return_logprob: bool = True, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                       return_routed_experts: bool = False, timeout_s: Optional[float] = None) -> GenerateResponse:
        if sampling_params.get("n", 1) != 1:
            raise ValueError("generate() returns one sample: use generate_samples() for n > 1")
        [out] = await self.generate_samples(input_ids, sampling_params, 1, rid=rid, return_logprob=return_logprob,
                                            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                            return_routed_experts=return_routed_experts, timeout_s=timeout_s)
        return out

    async def generate_samples(self, input_ids: list[int], sampling_params: dict[str, Any], n: int, *,
                               rid: Optional[str] = None, return_logprob: bool = True, logprob_start_len: int = -1,
                               top_logprobs_num: int = 0, return_routed_experts: bool = False,
                               timeout_s: Optional[float] = None) -> list[GenerateResponse]:
        """n samples of one prompt in one call (SGLang's n: the prompt is prefilled once). With
        return_routed_experts, decode each meta_info with asyncrl.protocols.engine.routed_experts."""
        body = {"input_ids": input_ids, "sampling_params": {**sampling_params, "n": n},
                "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num, **({"rid": rid} if rid is not None else {}),
                **({"return_routed_experts": True} if return_routed_experts else {})}
        out = await self._json("POST", "/generate", await generate_content(body), timeout_s=timeout_s)
        return [GenerateResponse.model_validate(o) for o in (out if isinstance(out, list) else [out])]

    async def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any], *,
                              rid: Optional[str] = None, return_logprob: bool = True, top_logprobs_num: int = 0,
                              return_routed_experts: bool = False) -> AsyncIterator[GenerateResponse]:
        """Cumulative snapshots until the request finishes, whichever streaming mode the engine runs
        (SGLang's default cumulative events, or --incremental-streaming-output deltas). Routed experts,
        if asked, come with the last snapshot only."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob,
                "stream": True, **({"rid": rid} if rid else {}),
                **({"top_logprobs_num": top_logprobs_num} if top_logprobs_num else {}),
                **({"return_routed_experts": True} if return_routed_experts else {})}
        async with self._client.stream("POST", f"{self.base_url}/generate", content=await generate_content(body),
                                       headers=self._json_headers) as response:
            if response.status_code >= 400:
                await response.aread()
                raise EngineError(self.base_url, response.status_code, _error_message(response))
            snapshots = StreamAccumulator()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield snapshots.add(orjson.loads(line[6:]))

    # Health and info ---------------------------------------------------------------------------
    async def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return (await self._request("GET", "/health", idempotent=True, timeout_s=timeout_s)).status_code == 200
        except httpx.TransportError:
            return False

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            response = await self._request("GET", "/health_generate", timeout_s=timeout_s)
            return response.status_code == 200
        except httpx.TransportError:
            return False

    async def model_info(self) -> dict[str, Any]:
        return await self._json("GET", "/get_model_info", idempotent=True)

    async def server_info(self) -> dict[str, Any]:
        return await self._json("GET", "/get_server_info", idempotent=True)

    async def loads(self) -> LoadsResponse:
        return LoadsResponse.model_validate(await self._json("GET", "/v1/loads", idempotent=True))

    async def weight_version(self) -> str:
        return str((await self.model_info())["weight_version"])

    # Control -----------------------------------------------------------------------------------
    async def flush_cache(self) -> bool:
        return (await self._request("POST", "/flush_cache")).status_code == 200

    async def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        await self._json("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def pause(self, mode: str = "abort") -> None:
        await self._json("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._json("POST", "/continue_generation", {})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        """Relabel the current weights (SGLang's /update_weight_version)."""
        await self._json("POST", "/update_weight_version", {"new_version": new_version,
                                                            "abort_all_requests": abort_all_requests})

    async def weights_by_name(self, name: str, truncate_size: int = 100) -> torch.Tensor:
        """The first truncate_size rows of an HF-named tensor, as the engine holds it (fp32)."""
        rows = await self._json("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size},
                                idempotent=True)
        return torch.tensor(rows, dtype=torch.float32)

    async def release_memory(self, tags: Optional[list[str]] = None) -> None:
        """SGLang's release_memory_occupation (the engine must be idle); tags: weights, kv_cache, cuda_graph."""
        await self._json("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: Optional[list[str]] = None) -> None:
        await self._json("POST", "/resume_memory_occupation", {"tags": tags})

    # Weights -----------------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                       flush_cache: bool = True) -> WeightsUpdateResponse:
        return await self._update("/update_weights_from_disk", {
            "model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache})

    async def update_weights_from_tensor(self, tensors: dict[str, torch.Tensor], weight_version: Optional[str] = None,
                                         flush_cache: bool = True) -> WeightsUpdateResponse:
        return await self._update("/update_weights_from_tensor", {
            "serialized_named_tensors": [encode_named_tensors(tensors)], "load_format": TENSOR_LOAD_FORMAT,
            "weight_version": weight_version, "flush_cache": flush_cache})

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "gloo") -> WeightsUpdateResponse:
        return await self._update("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, tensors: dict[str, torch.Tensor], weight_version: Optional[str] = None,
                                              group_name: str = "weight_update_group",
                                              flush_cache: bool = True) -> WeightsUpdateResponse:
        """Announce the tensors; the caller (rank 0) broadcasts them in this order meanwhile."""
        return await self._update("/update_weights_from_distributed", {
            "names": list(tensors), "dtypes": [_DTYPE_NAMES[t.dtype] for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()], "group_name": group_name,
            "weight_version": weight_version, "flush_cache": flush_cache})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> WeightsUpdateResponse:
        return await self._update("/destroy_weights_update_group", {"group_name": group_name})

    async def _update(self, path: str, body: dict[str, Any]) -> WeightsUpdateResponse:
        response = await self._request("POST", path, body)
        payload = orjson.loads(response.content) if response.content else {}
        if "success" not in payload:
            raise EngineError(self.base_url, response.status_code, _error_message(response))
        result = WeightsUpdateResponse.model_validate(payload)
        if not result.success:
            raise EngineError(self.base_url, response.status_code, result.message)
        return result


async def generate_content(body: dict[str, Any]) -> bytes:
    """A /generate body's JSON; a long prompt's off the event loop (LONG_PROMPT_IDS)."""
    if len(body["input_ids"]) <= LONG_PROMPT_IDS:
        return orjson.dumps(body)
    return await asyncio.to_thread(_dumps_in_chunks, body)


def _dumps_in_chunks(body: dict[str, Any]) -> bytes:
    """orjson.dumps(body), its input_ids a chunk per call: between calls the GIL passes to the event loop."""
    ids = body["input_ids"]
    chunks = [orjson.dumps(ids[i:i + LONG_PROMPT_IDS])[1:-1] for i in range(0, len(ids), LONG_PROMPT_IDS)]
    rest = orjson.dumps({key: value for key, value in body.items() if key != "input_ids"})
    return b'{"input_ids":[' + b",".join(chunks) + b"]" + (b"," + rest[1:] if len(rest) > 2 else b"}")


def _error_message(response: httpx.Response | RawResponse) -> str:
    try:
        body = orjson.loads(response.content)
        return str(body.get("error") or body.get("message") or body)
    except orjson.JSONDecodeError:
        return response.text[:500]
