"""The SGLang path checked by SGLang's own code (SGLang 0.5.23, the version pyproject's `gpu` extra names).

SGLang itself cannot run here (it needs CUDA), but its argument parser and request types can: `make sglang-venv`
builds .venv-sglang with the sglang wheel and only the light modules its server_args and io_struct import
(tests/rollout/sglang_check.txt; triton and torchvision stubbed, tests/rollout/sglang_check.py says why). This
module builds, with asyncrl's real code, every command line the launcher gives SGLang and every request the
engine client (the gateway's and the trainer's only way to an engine) sends, and hands them to
tests/rollout/sglang_check.py, run by .venv-sglang's interpreter, which judges them with SGLang's code:

(a) each SGLangBackend.command, from RolloutConfig objects that turn on every option the config has (DSA flags,
    routed experts, MTP speculative decoding, the API key, streaming mode, memory and batching sizes, extra
    sglang_args: parallelism, memory fraction, deterministic inference), parses with
    `sglang.srt.server_args.prepare_server_args` (what `python -m sglang.launch_server` calls) into the ServerArgs
    fields meant; every flag is one of SGLang's option strings exactly (argparse would also take an abbreviation);
    a misspelling of any flag is refused by SGLang's parser (one negative case per flag). No GPU is needed: in
    0.5.23 ServerArgs.__post_init__ does nothing and the hardware/checkpoint resolution (`resolve_once`) runs
    only when an engine starts.
(b) each request body (generate with every sampling parameter the gateway forwards, n > 1, streaming, log-probs,
    routed experts; abort, pause in each mode, continue, flush, weight version, weights by name, memory release,
    the four weight-update calls) goes to the route and method SGLang's http_server.py serves, and builds the
    request type that route binds (read from http_server.py: GenerateReqInput, UpdateWeightFromDiskReqInput, ...)
    as a dataclass, so an unknown or misspelled key is a TypeError; then the type's own checks (the /generate
    schema gate, normalize_batch_and_arguments, SamplingParams(**...) with normalize and verify, as the tokenizer
    manager does). A misspelled key is refused (negative cases).
(c) a real built-in engine (tests/rollout/conftest.py's `engine`) answers with what SGLang's clients read: the
    meta_info keys SGLang's OpenAI layer reads by subscript, the /model_info keys of SGLang's handler, the
    weight-update reply keys; and it invents no meta_info key SGLang does not write. Key names come from SGLang's
    source (read by sglang_check.py), not from a hand list; and the engine client reads a stream shaped as
    SGLang's (weight_versions and e2e_latency on the finishing event only).
Also from SGLang's source: its deterministic-inference rule that SGLangBackend.check_available mirrors, and the
update_weights_from_tensor load formats it takes (not asyncrl's: a run with rollout.backend=sglang refuses
weight_push.method=tensor, and distributed without engine_kind=sglang).

Proved to bite: misspelling --dsa-topk-backend in rollout/backends.py fails every command-line case with SGLang's
"unrecognized arguments"; sending "return_logprobs" from asyncrl/engine_client.py fails every /generate case with
GenerateReqInput's TypeError.

Runs in `make test` (which builds .venv-sglang first); never skipped. Cost: the venv once (~80 s, torch from the
local wheel), then ~18 s on 2 busy cores (one checker run, ~10 s of it SGLang's imports; one engine for (c)).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import torch

from asyncrl.config import RolloutConfig
from asyncrl.engine_client import EngineClient, RawResponse
from gateway.generation import _call_params
from gateway.sampling import check_sampling
from rollout.backends import LaunchSpec, SGLangBackend
from trainer.weight_push import GROUP_NAME, PAUSE_MODES

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV = ROOT / os.environ.get("SGLANG_VENV", ".venv-sglang")
CHECKER = Path(__file__).with_name("sglang_check.py")
SGLANG_VERSION = "0.5.23"
VOCAB = 151552  # GLM-5's; only bounds the token ids sampling params may name

# (a) command lines ---------------------------------------------------------------------------------------------

SPEC = LaunchSpec(model_path="/ckpt/glm5", host="0.0.0.0", port=30001, weight_version="7",
                  log_path=Path("/tmp/engine.log"), seed=11)
EXTRA = ["--tp-size", "8", "--dp-size", "2", "--mem-fraction-static", "0.85", "--enable-deterministic-inference"]
CONFIGS = {
    "default": RolloutConfig(backend="sglang"),
    "routing_replay": RolloutConfig(backend="sglang", routing_replay=True),
    "speculative": RolloutConfig(backend="sglang", speculative=True, speculative_num_steps=3),
    "api_key": RolloutConfig(backend="sglang", api_key="k3y"),
    "cumulative_streaming": RolloutConfig(backend="sglang", incremental_streaming_output=False),
    "sizes": RolloutConfig(backend="sglang", max_running_requests=7, max_total_tokens=12345, chunked_prefill_size=256),
    "everything": RolloutConfig(backend="sglang", routing_replay=True, speculative=True, speculative_num_steps=2,
                                api_key="k3y", max_running_requests=64, max_total_tokens=1 << 20,
                                chunked_prefill_size=4096, sglang_args=EXTRA),
}


def sglang_argv(cfg: RolloutConfig) -> list[str]:
    """The launcher's argv for SGLang, less `python -m sglang.launch_server` (asserted separately)."""
    return SGLangBackend(cfg).command(SPEC)[3:]


def intended(cfg: RolloutConfig) -> dict:
    """The ServerArgs fields the launcher means to set for `cfg` (names as SGLang's ServerArgs has them)."""
    want = {"model_path": SPEC.model_path, "host": SPEC.host, "port": SPEC.port, "weight_version": SPEC.weight_version,
            "attention_backend": "dsa", "dsa_prefill_backend": "flashmla_sparse", "dsa_decode_backend": "flashmla_kv",
            "dsa_topk_backend": "torch", "max_running_requests": cfg.max_running_requests,
            "chunked_prefill_size": cfg.chunked_prefill_size, "max_total_tokens": cfg.max_total_tokens,
            "random_seed": SPEC.seed, "trust_remote_code": True,
            "incremental_streaming_output": cfg.incremental_streaming_output,
            "enable_return_routed_experts": cfg.routing_replay, "api_key": cfg.api_key}
    if cfg.speculative:
        steps = cfg.speculative_num_steps
        want |= {"speculative_algorithm": "EAGLE", "speculative_num_steps": steps, "speculative_eagle_topk": 1,
                 "speculative_num_draft_tokens": steps + 1}
    else:
        want |= {"speculative_algorithm": None}
    if cfg.sglang_args == EXTRA:
        want |= {"tp_size": 8, "dp_size": 2, "mem_fraction_static": 0.85, "enable_deterministic_inference": True}
    return want


def flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def misspell(flag: str) -> str:
    """A typo: two neighbouring letters swapped (not a truncation, which argparse would take as an abbreviation)."""
    for i in range(2, len(flag) - 1):
        if flag[i].isalpha() and flag[i + 1].isalpha() and flag[i] != flag[i + 1]:
            return flag[:i] + flag[i + 1] + flag[i] + flag[i + 2:]
    raise AssertionError(flag)


EVERYTHING = sglang_argv(CONFIGS["everything"])
MISSPELT = {flag: [misspell(a) if a == flag else a for a in EVERYTHING] for flag in flags(EVERYTHING)}

# (b) requests ---------------------------------------------------------------------------------------------------


class Recorder:
    """An EngineClient transport (unary calls) and httpx transport (streams) that keep every request and answer
    with a minimal reply of the route's shape, so the client's real code runs end to end."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def _keep(self, method: str, url: str, content) -> str:
        path = httpx.URL(url).path
        self.sent.append({"method": method, "path": path, "body": orjson.loads(content) if content else None})
        return path

    async def request(self, method, url, content, headers, timeout_s) -> RawResponse:
        return RawResponse(200, orjson.dumps(_reply(self._keep(method, url, content))))

    def stream(self, request: httpx.Request) -> httpx.Response:
        self._keep(request.method, str(request.url), request.content)
        event = b"data: " + orjson.dumps(_GENERATED) + b"\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=event, headers={"content-type": "text/event-stream"})


_GENERATED = {"text": "", "output_ids": [5], "meta_info": {
    "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3, "completion_tokens": 1,
    "cached_tokens": 0, "weight_version": "7", "weight_versions": [{"version": "7", "start": 0, "end": 1}],
    "e2e_latency": 0.1, "output_token_logprobs": [[-0.5, 5, None]]}}


def _reply(path: str):
    if path == "/generate":
        return _GENERATED
    if path in ("/get_model_info", "/model_info"):
        return {"weight_version": "7"}
    if path == "/v1/loads":
        return {"loads": []}
    if path == "/get_weights_by_name":
        return [[0.0]]
    return {"success": True, "message": "", "new_version": "8"}


def sampling_params() -> dict:
    """Every sampling parameter the gateway forwards to an engine (gateway.sampling.ENGINE_SAMPLING less the
    refused ones), at non-default values, through the gateway's own check and per-call budget."""
    given = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "min_new_tokens": 1, "max_new_tokens": 64,
             "stop": ["</s>"], "stop_token_ids": [2], "ignore_eos": False, "sampling_seed": 3, "n": 1,
             "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False,
             "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "logit_bias": {}, "json_schema": None}
    checked = check_sampling(given, allow_truncation=True)

    class Turn:  # what _call_params reads of a turn with forced tokens pending (tool_choice)
        generated_ids, forced_pending, forced_after = [1, 2], True, 9

    return _call_params(checked, 64, Turn())


async def engine_requests() -> list[dict]:
    """What EngineClient sends for every call it has (the gateway's and trainer's, with their arguments)."""
    rec = Recorder()
    stream = httpx.AsyncClient(transport=httpx.MockTransport(rec.stream))
    client = EngineClient("http://engine:30000", client=stream, transport=rec, api_key="k3y")
    params = sampling_params()
    tensors = {"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.ones(4, 2, dtype=torch.bfloat16)}
    await client.generate([1, 2, 3], params, rid="r1", return_routed_experts=True, top_logprobs_num=2)
    await client.generate([1, 2, 3], {"max_new_tokens": 4})
    try:
        await client.generate_samples([1, 2, 3], params, 4, rid="r2")
    except Exception:  # noqa: BLE001 - the canned reply is one sample; the request is what is checked
        pass
    [_ async for _ in client.generate_stream([1, 2, 3], params, rid="r3", top_logprobs_num=2,
                                             return_routed_experts=True)]
    await client.health()
    await client.health_generate()
    await client.model_info()
    await client.server_info()
    await client.loads()
    await client.flush_cache()
    await client.abort("r1")
    await client.abort(abort_all=True)
    for mode in PAUSE_MODES:
        await client.pause(mode)
    await client.resume()
    await client.update_weight_version("8")
    await client.weights_by_name("lm_head.weight", 4)
    await client.release_memory(["weights", "kv_cache"])
    await client.resume_memory(None)
    await client.update_weights_from_disk("/ckpt/v8", "8")
    await client.update_weights_from_tensor(tensors, "8")
    await client.init_weights_update_group("10.0.0.1", 29500, 1, 3, GROUP_NAME, "nccl")
    await client.update_weights_from_distributed(tensors, "8", GROUP_NAME)
    await client.destroy_weights_update_group(GROUP_NAME)
    await stream.aclose()
    return rec.sent


SENT = {f"{i:02d} {r['method']} {r['path']}": r for i, r in enumerate(asyncio.run(engine_requests()))}
BROKEN = {
    "generate: misspelt field": {"method": "POST", "path": "/generate",
                                 "body": {"input_ids": [1], "return_logprobs": True}},
    "generate: misspelt sampling param": {"method": "POST", "path": "/generate",
                                          "body": {"input_ids": [1], "sampling_params": {"temprature": 1.0}}},
    "update_weights_from_disk: misspelt field": {"method": "POST", "path": "/update_weights_from_disk",
                                                 "body": {"model_path": "/x", "weight_versoin": "1"}},
    "pause_generation: misspelt field": {"method": "POST", "path": "/pause_generation", "body": {"mdoe": "abort"}},
    "init_weights_update_group: missing field": {"method": "POST", "path": "/init_weights_update_group",
                                                 "body": {"master_address": "h", "master_port": 1}},
}

# The judge ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    """.venv-sglang's interpreter, after `make sglang-venv` (a no-op when the venv is up to date)."""
    built = subprocess.run(["make", "sglang-venv"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, f"make sglang-venv failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    return SGLANG_VENV / "bin" / "python"


@pytest.fixture(scope="module")
def verdicts(sglang_python) -> dict:
    """sglang_check.py's answer for every argv and request of this module (one run: SGLang imports in ~5 s)."""
    job = {"argvs": {**{name: sglang_argv(cfg) for name, cfg in CONFIGS.items()},
                     **{f"misspelt {flag}": argv for flag, argv in MISSPELT.items()},
                     "bad value": [*EVERYTHING, "--attention-backend", "dsaa"]},
           "requests": {**SENT, **BROKEN}, "vocab_size": VOCAB}
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([str(sglang_python), str(CHECKER)], input=json.dumps(job), capture_output=True, text=True,
                         env=environ, cwd=ROOT, timeout=300)
    assert ran.returncode == 0, ran.stderr[-5000:]
    return json.loads(ran.stdout)


def test_the_checked_sglang_is_the_version_pyproject_names(verdicts):
    assert verdicts["sglang"]["version"] == SGLANG_VERSION
    assert f'"sglang=={SGLANG_VERSION}"' in (ROOT / "pyproject.toml").read_text()
    assert f"sglang=={SGLANG_VERSION}" in (ROOT / "tests/rollout/sglang_check.txt").read_text()


def test_the_launcher_runs_sglangs_own_entry_point(verdicts):
    command = SGLangBackend(CONFIGS["default"]).command(SPEC)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert verdicts["sglang"]["launch_server_parses_with"] == "prepare_server_args"
    assert set(SGLangBackend(CONFIGS["default"]).environment()) <= set(verdicts["sglang"]["environment_variables"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_command_line_parses_into_the_server_args_meant(verdicts, name):
    cfg = CONFIGS[name]
    verdict = verdicts["argvs"][name]
    assert verdict["ok"], f"SGLang refuses {sglang_argv(cfg)}: {verdict['error']}"
    parsed = verdict["fields"]
    want = intended(cfg)
    assert {k: parsed[k] for k in want} == want
    options = set(verdicts["sglang"]["option_strings"])
    assert not [f for f in flags(sglang_argv(cfg)) if f not in options], "not SGLang's exact option strings"


def test_every_config_option_reaches_sglang():
    """Each RolloutConfig option the launcher turns into a flag changes the command line (none is dropped)."""
    default = sglang_argv(CONFIGS["default"])
    for name, cfg in CONFIGS.items():
        if name != "default":
            assert sglang_argv(cfg) != default, name
    assert set(flags(EVERYTHING)) >= {"--enable-return-routed-experts", "--speculative-algorithm", "--api-key",
                                      "--incremental-streaming-output", *flags(EXTRA)}
    assert "--incremental-streaming-output" not in sglang_argv(CONFIGS["cumulative_streaming"])


@pytest.mark.parametrize("flag", list(MISSPELT))
def test_sglang_refuses_a_misspelt_flag(verdicts, flag):
    verdict = verdicts["argvs"][f"misspelt {flag}"]
    # argparse's refusal: the unknown flag, or first the required one it was meant to be (--model-path)
    assert not verdict["ok"] and "sglang serve: error:" in str(verdict["error"]), verdict


def test_sglang_refuses_an_unknown_attention_backend(verdicts):
    assert not verdicts["argvs"]["bad value"]["ok"]


def test_stock_sglang_refuses_deterministic_inference_with_dsa_on_glm5(verdicts):
    """Why SGLangBackend.check_available refuses --enable-deterministic-inference without a patched SGLang:
    SGLang's own rule (arg_groups/attention_hook.py) for absorbed-MLA models such as GlmMoeDsaForCausalLM."""
    facts = verdicts["sglang"]["deterministic"]
    assert "dsa" not in facts["backends"] and "GlmMoeDsaForCausalLM" in facts["absorbed_mla_architectures"]


@pytest.mark.parametrize("key", list(SENT))
def test_each_engine_request_is_a_valid_sglang_request(verdicts, key):
    verdict = verdicts["requests"][key]
    assert verdict["ok"], f"{SENT[key]['method']} {SENT[key]['path']} {SENT[key]['body']}: {verdict['error']}"


def test_the_requests_cover_every_weight_update_and_control_route():
    sent = {r["path"] for r in SENT.values()}
    assert {"/generate", "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
            "/update_weights_from_distributed", "/destroy_weights_update_group", "/pause_generation",
            "/continue_generation", "/flush_cache", "/abort_request", "/update_weight_version"} <= sent
    generate = [r["body"] for r in SENT.values() if r["path"] == "/generate"]
    assert any(b.get("stream") for b in generate) and any(b["sampling_params"].get("n") == 4 for b in generate)
    assert any(b.get("return_routed_experts") for b in generate)


@pytest.mark.parametrize("key", list(BROKEN))
def test_sglang_refuses_a_misspelt_request(verdicts, key):
    assert not verdicts["requests"][key]["ok"], verdicts["requests"][key]


# (c) the built-in engine's answers --------------------------------------------------------------------------------


async def test_the_builtin_engine_answers_with_what_sglangs_clients_read(verdicts, engine, tmp_path, tiny_checkpoint):
    facts = verdicts["sglang"]
    routes = facts["routes"]
    async with httpx.AsyncClient(base_url=engine.url, timeout=120) as http:
        assert (await http.get("/health")).status_code == 200
        reply = (await http.post("/generate", json={
            "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 3, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1})).json()
        meta = reply["meta_info"]
        missing = [k for k in facts["meta_info_required_reads"] if k not in meta]
        assert not missing, f"SGLang's OpenAI layer reads meta_info{missing}, which the engine does not send"
        invented = sorted(set(meta) - set(facts["meta_info_written"]))
        assert not invented, f"meta_info keys SGLang does not write: {invented}"
        assert {"text", "output_ids", "meta_info"} <= set(reply)

        info = (await http.get("/get_model_info")).json()
        missing = [k for k in routes["/model_info"]["keys"] if k not in info]
        assert not missing, f"/get_model_info lacks SGLang's {missing}"
        defaults = verdicts["argvs"]["default"]["fields"]  # ServerArgs parsed from the launcher's argv
        for key in ("load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode"):
            assert info[key] == defaults[key], (key, info[key], defaults[key])

        update = (await http.post("/update_weights_from_disk", json={"model_path": str(tiny_checkpoint),
                                                                     "weight_version": "2"})).json()
        assert set(routes["/update_weights_from_disk"]["keys"]) <= set(update), update
        for path in ("/pause_generation", "/continue_generation"):
            answer = (await http.post(path, json={"mode": "in_place"} if "pause" in path else {})).json()
            assert set(routes[path]["keys"]) <= set(answer), (path, answer)
        version = (await http.post("/update_weight_version", json={"new_version": "3"})).json()
        assert set(routes["/update_weight_version"]["keys"]) <= set(version), version
        server = (await http.get("/get_server_info")).json()
        missing = [k for k in routes["/server_info"]["keys"] if k not in server]
        assert not missing, f"/get_server_info lacks SGLang's {missing}"


def test_the_client_reads_a_stream_as_sglang_sends_it(verdicts):
    """SGLang 0.5.23 writes meta_info.weight_versions and e2e_latency on the finishing event only
    (output_streamer.py, tokenizer_manager.py): an earlier event has the other keys alone, and the engine client
    (the gateway's) reads it; an incremental one's log-prob list holds the new entries only."""
    from asyncrl.engine_response import StreamAccumulator

    first = {"text": "a", "output_ids": [5], "meta_info": {
        "id": "r", "finish_reason": None, "prompt_tokens": 3, "weight_version": "7", "num_retractions": 0,
        "reasoning_tokens": 0, "completion_tokens": 1, "cached_tokens": 0, "input_token_logprobs": [],
        "output_token_logprobs": [[-0.5, 5, None]], "output_token_logprobs_length": 1}}
    last = {"text": "b", "output_ids": [6], "meta_info": {
        **first["meta_info"], "finish_reason": {"type": "length", "length": 2}, "completion_tokens": 2,
        "output_token_logprobs": [[-0.25, 6, None]], "output_token_logprobs_length": 2, "e2e_latency": 0.3,
        "weight_versions": [{"version": "7", "start": 0, "end": 2}]}}
    assert set(last["meta_info"]) <= set(verdicts["sglang"]["meta_info_written"])
    stream = StreamAccumulator()
    assert stream.add(first).meta_info.weight_versions == []
    done = stream.add(last)
    assert done.output_ids == [5, 6] and [e[0] for e in done.meta_info.output_token_logprobs] == [-0.5, -0.25]
    assert done.meta_info.e2e_latency == 0.3


def test_a_run_refuses_weight_pushes_sglang_cannot_take(verdicts):
    """The `tensor` method's load_format is asyncrl's own (the built-in engine's CPU-safe payload), which SGLang's
    update_weights_from_tensor refuses; and `distributed` needs SGLang's key space. The run refuses both up front."""
    from asyncrl.config import RunConfig, TrainerConfig, WeightPushConfig
    from asyncrl.tensor_codec import TENSOR_LOAD_FORMAT

    assert TENSOR_LOAD_FORMAT not in verdicts["sglang"]["tensor_load_formats"]
    assert None in verdicts["sglang"]["tensor_load_formats"]
    sglang = RolloutConfig(backend="sglang")
    for push in (WeightPushConfig(method="tensor"), WeightPushConfig(method="distributed")):
        with pytest.raises(ValueError, match="rollout.backend=sglang"):
            RunConfig(rollout=sglang, trainer=TrainerConfig(weight_push=push))
    RunConfig(rollout=sglang, trainer=TrainerConfig(weight_push=WeightPushConfig(method="distributed",
                                                                               engine_kind="sglang")))
    RunConfig(rollout=sglang)  # disk
    RunConfig(trainer=TrainerConfig(weight_push=WeightPushConfig(method="tensor")))  # the built-in engine takes it
