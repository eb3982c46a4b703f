"""Terminal env end to end (real service process, scripted model): rewards from the verifiers, every
shipped template solvable, abuse inside the sandbox contained while the service keeps serving."""

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from envs.terminal.generate import DATA, TEMPLATES, generate
from tests.envs.isolation import SANDBOX_ARGS, needs_namespaces
from tests.envs.scripted_llm import call, say
from tests.envs.service_process import ROOT, ServiceProcess, run_episode

TASKS = {t["task_id"]: t for t in map(json.loads, DATA.read_text().splitlines())}
SANDBOX_LIMITS = ("--sandbox-option", "command_timeout_s=5", "--sandbox-option", "cpu_s=3",
                  "--sandbox-option", "max_processes=32", "--sandbox-option", "max_output_bytes=20000")


@pytest.fixture(scope="module")
def service(start_services):
    (service,) = start_services(("envs.terminal.TerminalEnv", *SANDBOX_ARGS, *SANDBOX_LIMITS))
    return service


def test_shipped_tasks_are_the_generators_output():
    assert list(TASKS.values()) == generate(seed=0, per_template=4)
    assert len(TASKS) >= 50 and len({t["template"] for t in TASKS.values()}) == len(TEMPLATES)


async def test_right_and_wrong_scripts(service, scripted_llm):
    task = TASKS["csv_filter-1"]
    async with httpx.AsyncClient() as client:
        right_url, right = scripted_llm.script(call("bash", command="head -3 people.csv"),
                                               call("bash", command=task["solution"]), say("Done."))
        wrong_url, _ = scripted_llm.script(call("bash", command="cut -d, -f1 people.csv > older.txt"), say("Done."))
        lazy_url, _ = scripted_llm.script(say("I cannot do that."))
        good = await run_episode(client, service.url, "csv_filter-1", right_url)
        bad = await run_episode(client, service.url, "csv_filter-1", wrong_url)
        lazy = await run_episode(client, service.url, "csv_filter-1", lazy_url)
    assert (good["reward"], good["status"], good["num_turns"]) == (1.0, "completed", 3)
    assert (bad["reward"], bad["status"]) == (0.0, "completed") and bad["info"]["verifier_exit_code"] != 0
    assert lazy["reward"] == 0.0
    first = right.requests[0]
    assert [t["function"]["name"] for t in first["tools"]] == ["bash"]
    assert first["messages"][1] == {"role": "user", "content": task["instruction"]}
    observation = right.requests[1]["messages"][-1]
    assert observation["role"] == "tool" and observation["content"].startswith("exit code 0\nname,city,age\n")


async def test_every_template_is_solvable_through_the_service(service, scripted_llm):
    ids = [f"{template}-0" for template in TEMPLATES]
    async with httpx.AsyncClient() as client:
        urls = [scripted_llm.script(call("bash", command=TASKS[i]["solution"]), say("done"))[0] for i in ids]
        results = await asyncio.gather(*[run_episode(client, service.url, i, u) for i, u in zip(ids, urls)])
    assert {i: r["reward"] for i, r in zip(ids, results)} == {i: 1.0 for i in ids}


async def test_out_of_turns_is_truncated_and_still_verified(service, scripted_llm):
    task = TASKS["write_text-0"]
    url, _ = scripted_llm.script(call("bash", command=task["solution"]), call("bash", command="ls"))
    async with httpx.AsyncClient() as client:
        result = await run_episode(client, service.url, "write_text-0", url, max_turns=2)
    assert (result["status"], result["num_turns"], result["reward"]) == ("truncated", 2, 1.0)


ABUSE = [
    "bomb() { bomb | bomb & }; bomb; sleep 2",
    "python3 -c 'a = bytearray(3 << 30)'",
    "yes flood",
    "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2)' && echo REACHED",
    "echo pwned > /var/tmp/asyncrl-pwned; echo pwned > {root}/asyncrl-pwned",
    "sleep 1000 &",
]


@needs_namespaces
async def test_abuse_is_contained_and_the_service_keeps_serving(service, scripted_llm):
    task = TASKS["sum_numbers-2"]
    port = int(service.url.rsplit(":", 1)[1])
    abuse = [call("bash", command=cmd.replace("{port}", str(port)).replace("{root}", str(ROOT))) for cmd in ABUSE]
    async with httpx.AsyncClient() as client:
        url, script = scripted_llm.script(*abuse, call("bash", command=task["solution"]), say("done"))
        attack = asyncio.create_task(run_episode(client, service.url, "sum_numbers-2", url, max_turns=20))
        while not attack.done():  # health stays answered while the attack runs
            assert (await client.get(f"{service.url}/health", timeout=5)).status_code == 200
            await asyncio.sleep(0.3)
        result = attack.result()
        clean_url, _ = scripted_llm.script(call("bash", command=task["solution"]), say("done"))
        after = await run_episode(client, service.url, "sum_numbers-2", clean_url)
    observations = [r["messages"][-1]["content"] for r in script.requests[1:len(ABUSE) + 1]]
    assert "fork" in observations[0] or "killed" in observations[0]
    assert "MemoryError" in observations[1]
    assert "output truncated" in observations[2] and len(observations[2]) < 25_000
    assert "REACHED" not in observations[3] and "unreachable" in observations[3]
    assert observations[4].count("No such file or directory") == 2 and not (ROOT / "asyncrl-pwned").exists()
    assert not os.path.exists("/var/tmp/asyncrl-pwned")
    assert result["reward"] == 1.0 and after["reward"] == 1.0  # the episode itself still worked
    leftover = subprocess.run(["pgrep", "-f", "sleep 1000"], capture_output=True, text=True).stdout.split()
    assert leftover == []


def test_refuses_to_start_without_isolation_unless_unsafe_is_chosen(tmp_path):
    """No unshare on PATH stands for a machine without the isolation primitive."""
    broken = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}
    refused = subprocess.run([sys.executable, "-m", "envs.serve", "--env", "envs.terminal.TerminalEnv"], cwd=ROOT,
                             env=broken, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "refusing to start" in refused.stderr and "--unsafe-local-sandbox" in refused.stderr
    unsafe = ServiceProcess("envs.terminal.TerminalEnv", tmp_path, "--unsafe-local-sandbox").start()
    try:
        assert unsafe.get("/health").json() == {"status": "ok"}
        assert "WARNING envs.server UNSAFE SANDBOX: env terminal runs agent-controlled commands" in unsafe.log()
        assert 'asyncrl_env_sandbox_info{env="terminal",type="local_unsafe"} 1.0' in unsafe.get("/metrics").text
    finally:
        assert unsafe.stop() == 0
