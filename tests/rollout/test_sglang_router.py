"""SGLang's own router (the sglang-router wheel, unmodified) in front of two built-in engines.

The drop-in claim of the engine, checked with a real SGLang component: the router discovers the engines
through /server_info and /model_info, polls their /get_load, and forwards /generate, streaming, batches and
/flush_cache to them. Its default cache-aware policy keeps a multi-turn session on the engine that holds
the session's prefix, so the engine's radix cache serves each new turn.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import orjson
import pytest

from tests.rollout.conftest import start_engine
from tests.services import free_port

GREEDY = {"max_new_tokens": 6, "temperature": 0}
PROMPT = [1006, 1008, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("routed-engines")
    procs = [start_engine(tiny_checkpoint, workdir, name=f"engine{i}") for i in range(2)]
    yield procs
    for proc in procs:
        assert proc.stop() == 0, proc.log()


@contextmanager
def sglang_router(engines, workdir: Path, *args: str) -> Iterator[httpx.Client]:
    """`python -m sglang_router.launch_router` over the engines; a client once both workers are healthy."""
    port = free_port()
    log_path = workdir / f"router-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                 "--port", str(port), "--worker-urls", *[e.url for e in engines],
                                 "--prometheus-port", str(free_port()), "--log-level", "warn", *args], stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        deadline = time.monotonic() + 60
        while not _healthy_workers(client) == len(engines):
            assert proc.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, "router did not register the engines:\n" + log_path.read_text()
            time.sleep(0.2)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=20)


def _healthy_workers(client: httpx.Client) -> int:
    try:
        workers = client.get("/workers").json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(w["is_healthy"] for w in workers)


@pytest.fixture(scope="module")
def round_robin(engines, tmp_path_factory):
    with sglang_router(engines, tmp_path_factory.mktemp("router"), "--policy", "round_robin") as client:
        yield client


def finished_requests(engine_url: str) -> int:
    text = httpx.get(f"{engine_url}/metrics").text
    return sum(int(float(v)) for v in re.findall(r'^sglang_num_requests_total\{[^}]*\} (\S+)$', text, re.M))


def test_router_discovers_the_engines_and_spreads_requests(engines, round_robin):
    workers = round_robin.get("/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(e.url for e in engines)
    assert all(w["metadata"]["model_type"] == "glm_moe_dsa" for w in workers)  # read from our /model_info

    direct = httpx.post(f"{engines[0].url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                            "return_logprob": True}, timeout=60).json()
    before = [finished_requests(e.url) for e in engines]
    routed = [round_robin.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                  "return_logprob": True}).json() for _ in range(4)]
    served = [finished_requests(e.url) - b for e, b in zip(engines, before)]
    assert served == [2, 2]
    for out in routed:
        assert out["output_ids"] == direct["output_ids"]
        got, want = out["meta_info"]["output_token_logprobs"], direct["meta_info"]["output_token_logprobs"]
        assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-6)  # [logprob, token, text]
        assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 6}]


def test_streaming_and_batches_pass_through_the_router(round_robin):
    whole = round_robin.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    events = []
    with round_robin.stream("POST", "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                       "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(orjson.loads(line[len("data: "):]))
    assert len(events) > 1 and events[-1]["output_ids"] == whole["output_ids"]
    assert [len(e["output_ids"]) for e in events] == sorted(len(e["output_ids"]) for e in events)

    batch = round_robin.post("/generate", json={"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": GREEDY}).json()
    assert isinstance(batch, list) and len(batch) == 2 and batch[0]["output_ids"] == whole["output_ids"]


def test_router_sees_engine_load(engines, round_robin):
    """/get_loads asks every engine's /get_load (SGLang's list shape): a long request shows, then drains."""
    request = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1200, "ignore_eos": True}}
    long = threading.Thread(target=httpx.post, args=(round_robin.base_url.join("/generate"),),  # own connection
                            kwargs={"json": request, "timeout": 120})
    long.start()
    try:
        deadline, peak = time.monotonic() + 30, 0
        while peak <= len(PROMPT) and time.monotonic() < deadline and long.is_alive():
            peak = max(w["load"] for w in round_robin.get("/get_loads").json()["workers"])
            time.sleep(0.1)
        assert peak > len(PROMPT)  # the KV tokens of prompt and output in use on the engine that runs it
    finally:
        long.join(timeout=120)
    assert [w["load"] for w in round_robin.get("/get_loads").json()["workers"]] == [0, 0]


def test_engine_errors_and_flush_pass_through_the_router(round_robin):
    bad = round_robin.post("/generate", json={"input_ids": [1006, 99999], "sampling_params": GREEDY})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]
    flushed = round_robin.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2


def test_cache_aware_routing_keeps_a_session_on_its_engine(engines, tmp_path_factory):
    """SGLang's default policy routes a turn to the engine holding its history: each turn is served
    from that engine's radix cache (with round robin every other turn would start cold)."""
    with sglang_router(engines, tmp_path_factory.mktemp("router-cache-aware")) as client:
        history, previous = [1006, 1008, *range(100, 150)], None
        for _ in range(4):
            out = client.post("/generate", json={"input_ids": history, "sampling_params": GREEDY}).json()
            if previous is not None:
                assert out["meta_info"]["cached_tokens"] >= previous  # the whole previous prompt was reused
            previous = len(history)
            history = history + out["output_ids"] + [1011, 20, 21]
