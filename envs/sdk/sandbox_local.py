"""The UNSAFE local sandbox: commands run as the service's own user, in its network, on its files.

It keeps the limits that need no privileges (wall clock, CPU seconds, address space, file size,
output cap, killing the command's process group) and nothing else: an agent can read and write
anything the service can, reach the network, and escape the kill with `setsid`. Only for
operators who choose it explicitly on machines without namespaces (laptops, locked-down CI).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import resource
import shutil
import signal
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Sequence

from envs.sdk.sandbox import Sandbox, SandboxBackend, SandboxConfig, SandboxError, SandboxUnavailable, dir_name


class LocalUnsafeSandbox(Sandbox):
    async def _spawn(self, argv: Sequence[str], stdin: bool) -> asyncio.subprocess.Process:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.workdir),
               "TMPDIR": str(self.workdir), "LANG": "C.UTF-8", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1"}
        return await asyncio.create_subprocess_exec(
            *argv, cwd=self.workdir, env=env, start_new_session=True, preexec_fn=self._limit,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)

    def _kill(self, proc: asyncio.subprocess.Process) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _limit(self) -> None:
        """Runs in the child before exec. No RLIMIT_NPROC: it would count every process of our user."""
        c, mb = self.config, 1 << 20
        for limit, value in ((resource.RLIMIT_CPU, c.cpu_s), (resource.RLIMIT_AS, c.memory_mb * mb),
                             (resource.RLIMIT_FSIZE, c.max_file_mb * mb), (resource.RLIMIT_NOFILE, c.max_open_files),
                             (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(limit, (value, value))


class LocalUnsafeBackend(SandboxBackend):
    type = "local_unsafe"

    def __init__(self, config: SandboxConfig):
        super().__init__(config)
        self._own_root = config.root_dir is None
        self.root = Path(config.root_dir or tempfile.mkdtemp(prefix="asyncrl-unsafe-"))
        self._names = itertools.count()

    async def probe(self) -> None:
        if shutil.which("bash") is None or shutil.which("tar") is None:
            raise SandboxUnavailable("the local sandbox needs bash and tar on PATH")
        self.root.mkdir(parents=True, exist_ok=True)  # the service warns that it runs unisolated (server.py)

    @asynccontextmanager
    async def session(self, name: str) -> AsyncIterator[LocalUnsafeSandbox]:
        workdir = self.root / f"{dir_name(name)}-{next(self._names)}"
        try:
            workdir.mkdir()
        except OSError as err:
            raise SandboxError(f"setting up the sandbox of {name} failed: {err}") from err
        try:
            yield LocalUnsafeSandbox(workdir, self.config)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def close(self) -> None:
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
