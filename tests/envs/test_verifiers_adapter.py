"""A verifiers environment served by envs.verifiers_adapter in its own venv (.venv-verifiers, built
here by `make verifiers-venv` when missing or stale: never skipped), played through gateway sessions
opened the way the orchestrator opens them, over real tiny models on the CPU engine: the scripted one
(tests/gateway/scripted.py: its reply is one `bash` call with `ls`, so the toy env's task `ls` earns 1,
the others 0) and a random one behind a gateway token (its log-probs are far from 0). Each reward must be
the toy env's rubric applied to what the gateway recorded the model saying, and the samples in Redis must
carry those tokens and the model's log-probs of them."""

import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from asyncrl.store import Store
from tests.envs.service_process import ROOT, ServiceProcess, episode_request
from tests.gateway import scripted
from tests.gateway.checks import assert_teacher_forced
from tests.gateway.conftest import (AUTH_TOKEN, GatewayClient, random_engine, reference_model,  # noqa: F401
                                    scripted_checkpoint, scripted_engine, scripted_model, start_gateway, template)

VENV = ROOT / ".venv-verifiers"
ADAPTER = f"{ROOT}/envs/verifiers_adapter.py:VerifiersEnv"
"""By file, as docs/envs.md serves it: the venv's SDK need not ship the adapter."""
ENV_ARGS = '{"agent": {"runtime": {"type": "subprocess"}}}'
RUN = "verifiers-adapter"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def verifiers_python() -> Path:
    subprocess.run(["make", "-s", "verifiers-venv"], cwd=ROOT, check=True, timeout=600)
    return VENV / "bin" / "python"


@pytest.fixture(scope="module")
def service(verifiers_python, tmp_path_factory):
    proc = ServiceProcess(ADAPTER, tmp_path_factory.mktemp("vf-service"),
                          "--option", "env_id=asyncrl-vf-toy", "--option", f"env_args={ENV_ARGS}",
                          "--option", 'eval_taskset_args={"commands": ["date"]}',
                          python=verifiers_python).start(timeout_s=180)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def gateways(scripted_engine, random_engine, redis_server, tmp_path_factory):  # noqa: F811
    """name -> (gateway process, its token): the scripted model's without one, the random model's with one."""
    workdir = tmp_path_factory.mktemp("gw-verifiers")
    procs = {"scripted": (start_gateway(workdir, [scripted_engine], redis_server.url, RUN, name="gw-vf-scripted"),
                          None),
             "random": (start_gateway(workdir, [random_engine], redis_server.url, RUN, "--auth-token", AUTH_TOKEN,
                                      name="gw-vf-random"), AUTH_TOKEN)}
    yield procs
    assert [proc.stop() for proc, _ in procs.values()] == [0, 0]


def rubric(task_id: str, generated: list[int], template) -> float:  # noqa: F811
    """The toy env's reward (asyncrl_vf_toy.taskset), recomputed from asyncrl's own parse of the recorded reply."""
    reply = template.parse_assistant(generated, tools=[{"type": "function", "function": {
        "name": "bash", "parameters": {"properties": {"command": {"type": "string"}}}}}])
    return float(any(call.name == "bash" and call.arguments.get("command") == task_id for call in reply.tool_calls))


async def play(service, gateway, token, store, task_id: str) -> tuple[dict, object]:
    """One episode as the orchestrator plays it: open a session, POST the episode with the session's endpoint,
    finish the session with the result -> (the episode's response, its sample in Redis)."""
    sessions = GatewayClient(gateway.url, token)
    try:
        opened = await sessions.create(group_id=f"g-{uuid.uuid4().hex[:8]}", task_id=task_id, env="verifiers")
        llm = {"base_url": opened["base_url"], "model": "tiny", "api_key": opened.get("api_key"),
               "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": MAX_TOKENS}}
        async with httpx.AsyncClient(timeout=180) as http:
            reply = await http.post(f"{service.url}/episodes", json=episode_request(task_id, "", llm=llm))
        assert reply.status_code == 200, reply.text
        result = reply.json()
        finished = await sessions.finish(opened["session_id"], reward=result["reward"], status=result["status"],
                                         info=result["info"])
    finally:
        await sessions.close()
    (sample,) = await store.get_samples(finished["sample_refs"])
    return result, sample


async def test_held_out_split_and_a_failing_endpoint(service):
    """eval_taskset_args serves the taskset's held-out rows as the eval split; an endpoint that answers
    an error is the infrastructure's failure (llm_error), never a reward of 0 for the model. Every episode
    is a new endpoint (a gateway session): the service keeps no connection open per episode played."""
    assert service.get("/tasks?split=eval").json() == {"task_ids": ["eval:date"], "total": 1, "split": "eval"}
    open_files = Path(f"/proc/{service.proc.pid}/fd")
    async with httpx.AsyncClient(timeout=60) as http:
        for n in range(8):
            reply = await http.post(f"{service.url}/episodes",
                                    json=episode_request("eval:date", f"{service.url}/no-such-session-{n}/v1"))
            result = reply.json()
            assert (result["status"], result["reason"], result["outcome"]) == ("failed", "llm_error", "infrastructure")
            assert "404" in result["info"]["error"], result["info"]
            if n == 0:
                after_one = len(list(open_files.iterdir()))
    assert len(list(open_files.iterdir())) <= after_one + 2


def test_the_service_runs_verifiers_own_openai(verifiers_python):
    versions = subprocess.run([verifiers_python, "-c", "import openai, verifiers; print(verifiers.__version__, "
                               "openai.__version__)"], capture_output=True, text=True, check=True).stdout.split()
    assert versions[0] == "0.4.0" and versions[1].startswith("2."), versions


@pytest.mark.parametrize("model, task_ids", [("scripted", ["ls", "pwd", "whoami"]), ("random", ["ls", "pwd"])])
async def test_episodes_through_gateway_sessions_get_the_rubric_rewards(
        model, task_ids, service, gateways, redis_server, template, scripted_model, reference_model):  # noqa: F811
    assert service.get("/tasks").json() == {"task_ids": ["ls", "pwd", "whoami"], "total": 3, "split": "train"}
    gateway, token = gateways[model]
    store = Store.connect(redis_server.url, RUN)
    rewards = []
    try:
        for task_id in task_ids:
            result, sample = await play(service, gateway, token, store, task_id)
            generated = sample.tokens[sample.loss_mask == 1].tolist()
            expected = rubric(task_id, generated, template)
            cut = len(generated) == MAX_TOKENS and generated[-1] not in template.stop_token_ids
            ending = ("truncated", "max_tokens") if cut else ("completed", "completed")  # a reply cut at max_tokens
            assert (result["reward"], result["status"], result["reason"], result["outcome"]) == (expected, *ending,
                                                                                                  "model")
            assert result["info"]["rewards"] == {"ran_the_command": expected}
            assert result["num_turns"] == 1  # verifiers' count: its calls do not go through the SDK's client
            assert (sample.reward, sample.task_id, sample.num_turns) == (expected, task_id, 1)
            assert len(generated) > 0 and sample.rollout_logprobs.shape == sample.tokens.shape
            assert_teacher_forced(scripted_model if model == "scripted" else reference_model,
                                  {"tokens": sample.tokens.tolist(), "loss_mask": sample.loss_mask.tolist(),
                                   "rollout_logprobs": sample.rollout_logprobs.tolist()})
            rewards.append(result["reward"])
    finally:
        await store.close()
    if model == "scripted":  # the reply is known: reward 1 is reached, and a wrong command is not rewarded
        assert generated == scripted.reply_ids(template)
        assert rewards == [1.0, 0.0, 0.0]
    else:  # log-probs of a random model: the record holds real ones, not zeros
        assert (sample.rollout_logprobs[sample.loss_mask == 1] < -0.01).any()
