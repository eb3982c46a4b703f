"""The gateway keeps answering while it handles the largest request its limit admits: a chat turn whose
message is megabytes of text is rendered and tokenized off the event loop, then refused by the engine, as a 400.

/health stays under 1 s, not under a few ms: one stall is left, in the tokenizers library, which holds the GIL
while it turns the 4.5M ids of this request into a Python list (~140 ms on an idle 2-core host; the longest
/health answer was 220-390 ms with two busy loops beside it, and 545 ms once in CI). Tokenizing on the event
loop would take seconds."""

import time

import httpx

from asyncrl.config import GatewayConfig
from tests.gateway.conftest import start_gateway
from tests.services import health_latencies_while

MAX_BYTES = GatewayConfig().max_request_bytes
"""The default limit: the largest request a gateway admits out of the box."""


async def test_health_answers_fast_while_a_maximal_chat_turn_is_tokenized(random_engine, redis_server, tmp_path):
    gateway = start_gateway(tmp_path, [random_engine], redis_server.url, "gateway-maximal",
                            "--max-request-bytes", str(MAX_BYTES))
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
            sid = (await http.post("/sessions", json={})).json()["session_id"]
            text = "hello world, " * ((MAX_BYTES - 4096) // 13)
            chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
            started = time.monotonic()
            response, latencies = await health_latencies_while(http, f"/sessions/{sid}/v1/chat/completions", chat)
        # refused by the engine: past its context length, or (its ids being ~2x the text's bytes) its body limit
        assert response.status_code == 400 and ("context" in response.text or "exceeds" in response.text), \
            response.text[:300]
        assert time.monotonic() - started > 1.0 and len(latencies) >= 5, "the request was too quick to test anything"
        print(f"/health: {len(latencies)} polls, max {max(latencies) * 1000:.0f} ms")  # -s shows it
        assert max(latencies) < 1.0, latencies
    finally:
        assert gateway.stop() == 0, gateway.log()
