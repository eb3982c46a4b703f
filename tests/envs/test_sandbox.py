"""Containment by the namespace sandbox, each attack next to a control that shows it is real.

Controls run the same command in the unsafe local sandbox, where it must succeed: a test whose
attack could not have worked anyway proves nothing.
"""

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from envs.sdk.cgroups import find_hierarchies
from envs.sdk.sandbox import SandboxConfig, make_sandbox_backend
from tests.envs.isolation import needs_namespaces

LIMITS = dict(command_timeout_s=5, cpu_s=2, memory_mb=512, max_processes=32, max_output_bytes=32768)


async def open_backend(kind: str, **overrides):
    backend = make_sandbox_backend(SandboxConfig(type=kind, **{**LIMITS, **overrides}))
    await backend.probe()
    return backend


@pytest.fixture
async def isolated():
    backend = await open_backend("namespace")
    yield backend
    await backend.close()


@pytest.fixture
async def unsafe():
    backend = await open_backend("local_unsafe")
    yield backend
    await backend.close()


def uids_alive(uid: int) -> list[int]:
    """Pids of processes whose real uid is `uid`."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid:
            pids.append(int(status.parent.name))
    return pids


async def wait_gone(uid: int, timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := uids_alive(uid)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return alive


CONNECT = "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2); print(\"connected\")'"


@needs_namespaces
async def test_no_network(isolated, unsafe):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        async with unsafe.session("control") as sandbox:
            control = await sandbox.run(CONNECT.format(port=port))
        async with isolated.session("net") as sandbox:
            blocked = await sandbox.run(CONNECT.format(port=port))
            interfaces = await sandbox.run("cat /proc/net/dev")
    finally:
        listener.close()
    assert control.ok and "connected" in control.output
    assert not blocked.ok and "connected" not in blocked.output and "unreachable" in blocked.output
    assert [line.split(":")[0].strip() for line in interfaces.output.splitlines()[2:]] == ["lo"]


WRITES = "touch {target} && echo WROTE"


@needs_namespaces
async def test_no_writes_outside_the_episode_directory(isolated, unsafe):
    marker = f"asyncrl-escape-{uuid.uuid4().hex[:8]}"
    async with isolated.session("a") as sandbox, isolated.session("b") as neighbour:
        targets = [f"/var/tmp/{marker}", f"/dev/shm/{marker}", f"{isolated.root}/{marker}",
                   f"{neighbour.workdir}/{marker}", f"/root/{marker}", f"{Path.cwd()}/{marker}"]
        attempts = [await sandbox.run(WRITES.format(target=t)) for t in targets]
        inside = await sandbox.run(f"echo ok > {marker} && mkdir -p sub && echo ok > sub/x && cat {marker}")
        private_tmp = await sandbox.run(f"echo x > /tmp/{marker}-tmp && cat /tmp/{marker}-tmp")
    async with unsafe.session("control") as sandbox:
        control = await sandbox.run(WRITES.format(target=f"/tmp/{marker}-control"))
    try:
        assert control.ok, "control: the unsafe sandbox could not write to /tmp either"
        for target, attempt in zip(targets, attempts):
            assert not attempt.ok and "WROTE" not in attempt.output, f"wrote {target}"
            assert not Path(target).exists(), target
        assert inside.ok and inside.output == "ok\n"
        # /tmp inside is a private tmpfs: writable, gone with the command, never the host's /tmp
        assert private_tmp.ok and private_tmp.output == "x\n" and not Path(f"/tmp/{marker}-tmp").exists()
    finally:
        Path(f"/tmp/{marker}-control").unlink(missing_ok=True)


FORK_BOMB = "bomb() { bomb | bomb & }; bomb; sleep 3; echo still-here"


@needs_namespaces
async def test_fork_bomb_is_contained_and_cleaned_up(isolated):
    async with isolated.session("bomb") as sandbox:
        started = time.monotonic()
        result = await sandbox.run(FORK_BOMB)
        elapsed = time.monotonic() - started
        leftovers = await wait_gone(sandbox.uid)
        host_fork = await asyncio.create_subprocess_exec("true")
        assert await host_fork.wait() == 0  # the machine can still start processes
    assert elapsed < LIMITS["command_timeout_s"] + 3
    assert "fork" in result.output or result.timed_out  # it did hit the process limit
    assert leftovers == [], f"processes of the episode survived: {leftovers}"


@needs_namespaces
async def test_memory_hog_is_killed(isolated):
    async with isolated.session("hog") as sandbox:
        result = await sandbox.run("python3 -c 'a = bytearray(2 << 30); print(\"allocated\")'")
    assert result.exit_code != 0 and "MemoryError" in result.output and "allocated" not in result.output


@needs_namespaces
@pytest.mark.skipif(not any(h.controller == "memory" for h in find_hierarchies()), reason="no writable memory cgroup")
async def test_many_process_memory_hog_is_bounded_by_the_cgroup(isolated, unsafe):
    """Six 200 MB processes: each within RLIMIT_AS, 1.2 GB together against the episode's 512 MB."""
    hog = ("for i in 1 2 3 4 5 6; do python3 -c 'import time; a = b\"x\" * (200 << 20); time.sleep(1); "
           "print(\"survived\")' & done; wait")
    async with unsafe.session("control") as sandbox:
        control = await sandbox.run(hog, timeout_s=30)
    async with isolated.session("hogs") as sandbox:
        contained = await sandbox.run(hog, timeout_s=30)
    survivors = [result.output.splitlines().count("survived") for result in (control, contained)]
    assert survivors[0] == 6 and survivors[1] < 6 and "Killed" in contained.output


@needs_namespaces
async def test_output_flood_is_truncated(isolated):
    async with isolated.session("flood") as sandbox:
        started = time.monotonic()
        result = await sandbox.run("yes flood")
        after = await sandbox.run("echo fine")
    assert result.truncated and len(result.output_bytes) == LIMITS["max_output_bytes"]
    assert time.monotonic() - started < 4
    assert after.ok and after.output == "fine\n"


@needs_namespaces
async def test_cpu_and_wall_clock_limits(isolated):
    async with isolated.session("time") as sandbox:
        spin = await sandbox.run("while :; do :; done", timeout_s=30)  # ends by its CPU limit, not the clock
        sleeper = await sandbox.run("sleep 300 & echo started; sleep 300", timeout_s=1)
        leftovers = await wait_gone(sandbox.uid)
    assert spin.exit_code == 128 + 9 and not spin.timed_out
    assert sleeper.timed_out and sleeper.output == "started\n"
    assert leftovers == []  # the background sleep died with the command


@needs_namespaces
async def test_episode_uid_has_no_privileges(isolated):
    async with isolated.session("caps") as sandbox:
        result = await sandbox.run("id -u; grep CapEff /proc/self/status; su -c true root; mount -t tmpfs x x")
    lines = result.output.splitlines()
    assert lines[0] == str(sandbox.uid) and sandbox.uid >= 1_000_000
    assert lines[1].split()[1] == "0000000000000000"


async def test_unsafe_sandbox_runs_with_limits(unsafe):
    """The fallback still applies the limits that need no privileges (runs without root too)."""
    async with unsafe.session("basic") as sandbox:
        await sandbox.write_files({"d/in.txt": "hello\n"})
        ok = await sandbox.run("cat d/in.txt; pwd")
        flood = await sandbox.run("yes")
        slow = await sandbox.run("sleep 30", timeout_s=0.5)
        read = await sandbox.read_file("d/in.txt")
    assert ok.output == f"hello\n{sandbox.workdir}\n"
    assert flood.truncated and slow.timed_out and read == b"hello\n"
    assert not os.path.exists(sandbox.workdir)  # removed with the session
