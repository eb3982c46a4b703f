"""The sandbox boundary: where an episode executes agent-controlled commands.

A `SandboxBackend` (one per service, chosen by `SandboxConfig.type`) opens one `Sandbox` per
episode: a fresh directory plus a way to run commands in it under limits. Backends:

- `namespace` (envs.sdk.sandbox_namespace): Linux namespaces + rlimits + cgroups. No network, a
  filesystem that is an allow-list (the runtime and `ro_paths` read-only, the episode directory and a
  private /tmp writable, nothing else of the host), a per-episode unprivileged uid, pid, IPC and UTS
  namespaces that die with the command. Needs root (or equivalent) and util-linux.
- `local_unsafe` (envs.sdk.sandbox_local): a plain subprocess with rlimits and a timeout. NO
  isolation: only for operators who opt in explicitly on machines without namespaces.

An import path (`package.module:Class` or `package.module.Class`, asyncrl/plugins.py) selects a backend
written elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import tarfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncContextManager, Callable, Mapping, Optional, Sequence, Union

from asyncrl.plugins import load_plugin

SANDBOX_BACKENDS: dict[str, str] = {
    "namespace": "envs.sdk.sandbox_namespace:NamespaceBackend",
    "local_unsafe": "envs.sdk.sandbox_local:LocalUnsafeBackend",
}
"""Sandbox `type` built-ins -> import path of their SandboxBackend (asyncrl/plugins.py)."""

Command = Union[str, Sequence[str]]
"""A shell script (run by bash -c) or an argv list."""


class SandboxUnavailable(RuntimeError):
    """The configured isolation primitive does not work on this machine; the message says why."""


class SandboxError(OSError):
    """The sandbox itself failed (could not start a command, set up the episode directory, write files):
    an infrastructure failure of the episode (reason sandbox_error), never the agent's doing. Commands the
    agent breaks (non-zero exit, killed by a limit) are ExecResults, not this."""


@dataclass
class SandboxConfig:
    type: str = "namespace"
    """`namespace` (isolated, Linux + root), `local_unsafe` (no isolation, explicit opt-in) or an import path."""
    root_dir: Optional[str] = None
    """Where episode directories are created; None = a fresh temporary directory per service."""
    command_timeout_s: float = 30.0
    """Wall clock of one command; past it every process of the command is killed."""
    cpu_s: int = 20
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS) and, where a memory cgroup is writable, of the whole command."""
    max_processes: int = 64
    """Processes of the episode's uid at once (RLIMIT_NPROC) and pids cgroup limit where available."""
    max_file_mb: int = 16
    """Largest file a command may write (RLIMIT_FSIZE)."""
    max_open_files: int = 256
    max_output_bytes: int = 65536
    """Combined stdout+stderr kept per command; a command that prints more is killed and truncated."""
    workdir_mb: int = 256
    """Size of the episode directory (namespace: a tmpfs mounted for the episode, so disk use is bounded)."""
    tmp_mb: int = 64
    """Size of the private /tmp, and of the private /dev/shm, each command sees (namespace backend)."""
    base_uid: int = 2_000_000
    """Episodes run as base_uid + slot (namespace backend): unprivileged, and one uid per live episode."""
    ro_paths: list[str] = field(default_factory=list)
    """Host paths (absolute, existing) the namespace sandbox shows read-only besides the runtime (/usr,
    /lib*, a few /etc entries: sandbox_namespace.RUNTIME_PATHS), e.g. a toolchain under /opt."""

    def __post_init__(self) -> None:
        bad = [p for p in self.ro_paths if not os.path.isabs(p) or not os.path.lexists(p)]
        if bad:
            raise ValueError(f"ro_paths: {bad} are not absolute paths of existing files or directories")
        self.ro_paths = [os.path.normpath(p) for p in self.ro_paths]


@dataclass
class ExecResult:
    exit_code: int
    """The command's exit status (128+N: killed by signal N, e.g. 137 by a CPU or memory limit);
    negative -N: the sandbox itself was stopped by signal N (timeout, output cap)."""
    output_bytes: bytes
    """stdout and stderr interleaved, at most max_output_bytes."""
    truncated: bool
    """The command printed more than max_output_bytes and was killed."""
    timed_out: bool
    """The command ran past its wall-clock timeout and was killed."""
    duration_s: float

    @property
    def output(self) -> str:
        return self.output_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.truncated or self.timed_out)


class Sandbox(ABC):
    """One episode's sandbox: a working directory and commands run inside it under limits.

    Commands of one sandbox run one at a time (concurrent calls queue): the episode's process and
    memory limits then belong to one command, not to however many an env started at once."""

    def __init__(self, workdir: Path, config: SandboxConfig):
        self.workdir = workdir
        self.config = config
        self._one_at_a_time = asyncio.Lock()

    @abstractmethod
    async def _spawn(self, argv: Sequence[str], stdin: bool) -> asyncio.subprocess.Process:
        """Start argv confined to this sandbox, stdout+stderr on one pipe."""

    @abstractmethod
    def _kill(self, proc: asyncio.subprocess.Process) -> None:
        """Kill every process the command started."""

    async def run(self, command: Command, *, stdin: Optional[bytes] = None, timeout_s: Optional[float] = None,
                  max_output_bytes: Optional[int] = None) -> ExecResult:
        """Run a command in the working directory and wait for it (or its timeout / output cap)."""
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        async with self._one_at_a_time:
            return await self._run(argv, stdin, timeout_s, max_output_bytes)

    async def _run(self, argv: list[str], stdin: Optional[bytes], timeout_s: Optional[float],
                   max_output_bytes: Optional[int]) -> ExecResult:
        started = time.monotonic()
        try:
            proc = await self._spawn(argv, stdin is not None)
        except OSError as err:
            raise SandboxError(f"cannot start {argv[0]!r} in the sandbox: {err}") from err
        try:
            output, truncated, timed_out = await _collect(
                proc, stdin, cap=max_output_bytes or self.config.max_output_bytes,
                timeout_s=timeout_s or self.config.command_timeout_s, kill=lambda: self._kill(proc))
            exit_code = await _reap(proc)
        finally:
            if proc.returncode is None:  # cancelled mid-command: leave nothing running
                self._kill(proc)
        return ExecResult(exit_code, output, truncated, timed_out, time.monotonic() - started)

    async def write_files(self, files: Mapping[str, Union[str, bytes]]) -> None:
        """Create or overwrite files (relative paths) from inside the sandbox, as the episode's user."""
        result = await self.run(["tar", "-x", "--no-same-owner", "-f", "-"], stdin=_tar(files))
        if not result.ok:
            raise SandboxError(f"writing {sorted(files)} in the sandbox failed: {result.output[-500:]}")

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> Optional[bytes]:
        """A file's bytes as the sandbox sees it, or None when it does not exist or is unreadable."""
        result = await self.run(["cat", "--", path], max_output_bytes=max_bytes)
        return result.output_bytes if result.ok else None


class SandboxBackend(ABC):
    """Opens per-episode sandboxes; one instance per service."""

    type: str

    def __init__(self, config: SandboxConfig):
        self.config = config

    @abstractmethod
    async def probe(self) -> None:
        """Raise SandboxUnavailable (saying why) unless sandboxes work on this machine."""

    @abstractmethod
    def session(self, name: str) -> AsyncContextManager[Sandbox]:
        """`async with backend.session(episode_id) as sandbox:` a fresh sandbox, cleaned up on exit."""

    async def close(self) -> None:
        """Release what the backend holds (its root directory)."""


def dir_name(name: str) -> str:
    """A directory/cgroup-safe form of an episode id."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)[:64] or "episode"


def make_sandbox_backend(config: SandboxConfig) -> SandboxBackend:
    """The backend `config.type` names (a built-in or the import path of a SandboxBackend)."""
    return load_plugin(SANDBOX_BACKENDS, config.type, "sandbox type")(config)


async def _collect(proc: asyncio.subprocess.Process, stdin: Optional[bytes], *, cap: int, timeout_s: float,
                   kill: Callable[[], None]) -> tuple[bytes, bool, bool]:
    """Read the merged output to EOF, keeping `cap` bytes; kill the command on overflow or timeout.

    Reading continues after a kill: the pipe reports EOF only while it is read, and EOF is what
    tells us the killed processes are gone."""
    buf = bytearray()
    truncated = False

    async def pump() -> None:
        nonlocal truncated
        while chunk := await proc.stdout.read(65536):
            room = cap - len(buf)
            buf.extend(chunk[:room])
            if len(chunk) > room and not truncated:
                truncated = True
                kill()

    feeder = asyncio.create_task(_feed(proc, stdin)) if stdin is not None else None
    timed_out = False
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: on Python 3.11 it can lose a cancellation
            await pump()
    except TimeoutError:
        timed_out = True
        kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await pump()
    finally:
        if feeder is not None:
            feeder.cancel()
    return bytes(buf), truncated, timed_out


async def _reap(proc: asyncio.subprocess.Process, grace_s: float = 5.0) -> int:
    """The exit status. asyncio's wait() also waits for the output pipe to close, which a process the
    command left behind could hold open forever (possible in the unsafe sandbox): close it ourselves."""
    try:
        async with asyncio.timeout(grace_s):
            return await asyncio.shield(proc.wait())
    except TimeoutError:
        proc._transport.close()  # noqa: SLF001 - no public way to drop a subprocess's pipes
        return await proc.wait()


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command exited without reading all of its input


def _tar(files: Mapping[str, Union[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for path, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()

