"""Containment by the namespace sandbox, each attack next to a control that shows it is real.

Controls run the same command in the unsafe local sandbox, where it must succeed: a test whose
attack could not have worked anyway proves nothing.
"""

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from envs.sdk.cgroups import find_hierarchies
from envs.sdk.sandbox import SandboxConfig, make_sandbox_backend
from envs.sdk.sandbox_namespace import RUNTIME_PATHS
from envs.swe.env import DATA as SWE_DATA
from envs.terminal.env import DATA as TERMINAL_DATA
from tests.envs.isolation import needs_namespaces
from tests.services import ROOT

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
        targets = [f"/var/tmp/{marker}", f"{isolated.root}/{marker}",
                   f"{neighbour.workdir}/{marker}", f"/root/{marker}", f"{Path.cwd()}/{marker}"]
        attempts = [await sandbox.run(WRITES.format(target=t)) for t in targets]
        inside = await sandbox.run(f"echo ok > {marker} && mkdir -p sub && echo ok > sub/x && cat {marker}")
        private_tmp = [await sandbox.run(f"echo x > {d}/{marker}-tmp && cat {d}/{marker}-tmp")
                       for d in ("/tmp", "/dev/shm")]
    async with unsafe.session("control") as sandbox:
        control = await sandbox.run(WRITES.format(target=f"/tmp/{marker}-control"))
    try:
        assert control.ok, "control: the unsafe sandbox could not write to /tmp either"
        for target, attempt in zip(targets, attempts):
            assert not attempt.ok and "WROTE" not in attempt.output, f"wrote {target}"
            assert not Path(target).exists(), target
        assert inside.ok and inside.output == "ok\n"
        # /tmp and /dev/shm inside are private tmpfs: writable, gone with the command, never the host's
        for directory, attempt in zip(("/tmp", "/dev/shm"), private_tmp):
            assert attempt.ok and attempt.output == "x\n" and not Path(f"{directory}/{marker}-tmp").exists()
    finally:
        Path(f"/tmp/{marker}-control").unlink(missing_ok=True)


SECRETS = [SWE_DATA, TERMINAL_DATA, ROOT / "pyproject.toml", Path(sys.executable), Path.home() / ".bashrc"]
"""Host files an agent must not read: the graders' hidden tests and verifiers, the project, the venv, /root."""


@needs_namespaces
async def test_the_host_filesystem_is_invisible(isolated, unsafe):
    """Only the allow-list exists inside: not the project, the envs' data, /root, /home nor a neighbour."""
    paths = [*SECRETS, Path("/home")]
    async with unsafe.session("control") as sandbox:
        controls = [await sandbox.run(["ls", "-d", "--", str(p)]) for p in paths]
    async with isolated.session("a") as sandbox, isolated.session("b") as neighbour:
        await neighbour.write_files({"answer.txt": "42\n"})
        secrets = [*paths, neighbour.workdir / "answer.txt"]
        running = asyncio.create_task(neighbour.run("sleep 2"))  # the neighbour's episode is mid-command
        attempts = [await sandbox.run(["ls", "-d", "--", str(p)]) for p in secrets]
        reads = [await sandbox.read_file(str(p)) for p in secrets]
        top = await sandbox.run("ls -A /")
        beside = await sandbox.run(["ls", "-A", str(sandbox.workdir.parent)])
        await running
    assert all(control.ok for control in controls), [c.output for c in controls if not c.ok]
    for path, attempt, read in zip(secrets, attempts, reads):
        assert not attempt.ok and "No such file or directory" in attempt.output and read is None, path
    runtime = {Path(p).parts[1] for p in RUNTIME_PATHS}
    assert {"usr", "etc", "dev", "proc", "tmp"} <= set(top.output.split()) <= runtime | {"dev", "proc", "tmp"}
    assert beside.output.split() == [sandbox.workdir.name]


@needs_namespaces
async def test_ro_paths_are_shown_read_only(tmp_path):
    (tmp_path / "tool.txt").write_text("tool\n")
    tmp_path.chmod(0o755)  # readable by the episode's uid
    backend = await open_backend("namespace", ro_paths=[str(tmp_path)])
    try:
        async with backend.session("ro") as sandbox:
            read = await sandbox.run(f"cat {tmp_path}/tool.txt")
            write = await sandbox.run(f"echo x > {tmp_path}/new.txt")
    finally:
        await backend.close()
    assert read.ok and read.output == "tool\n"
    assert not write.ok and "Read-only file system" in write.output and not (tmp_path / "new.txt").exists()
    with pytest.raises(ValueError, match="ro_paths"):
        SandboxConfig(ro_paths=["relative/dir"])


def sysv_segments() -> dict[str, int]:
    """The host's SysV shared-memory segments: shmid -> owner uid (/proc/sysvipc/shm)."""
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {row.split()[1]: int(row.split()[7]) for row in rows}


@needs_namespaces
async def test_ipc_objects_and_hostname_are_private(isolated, unsafe):
    async with unsafe.session("control") as sandbox:
        control = await sandbox.run("ipcmk -M 1048576")
    shmid = control.output.rsplit(":", 1)[-1].strip()
    leaked = shmid in sysv_segments()
    subprocess.run(["ipcrm", "-m", shmid], check=False)
    async with isolated.session("ipc") as sandbox:
        made = await sandbox.run("ipcmk -M 1048576 && ipcmk -S 1 && ipcmk -Q && ipcs -m | grep -c 0x")
        later = await sandbox.run("ipcs -m -s -q | grep -c 0x")  # the next command of the same episode
        host_segments = [i for i, uid in sysv_segments().items() if uid == sandbox.uid]
        hostname = await sandbox.run("hostname")
    assert control.ok and leaked, "control: a segment made outside the sandbox outlives its command"
    assert made.ok and made.output.splitlines()[-1] == "1", made.output
    assert later.output.strip() == "0" and host_segments == []
    assert hostname.output == "sandbox\n" and socket.gethostname() != "sandbox"


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
