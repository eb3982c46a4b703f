"""The isolating sandbox: Linux namespaces, an allow-listed filesystem, an unprivileged per-episode uid,
rlimits and cgroups.

One command runs as

  setpriv --pdeathsig KILL          dies with the service
  unshare --net --mount --pid --ipc --uts ...
                                    no network interface but a down loopback; own mounts, pids, SysV
                                    IPC objects and hostname
  python sandbox_init.py            joins the episode's cgroups; a new root holding only RUNTIME_PATHS
                                    + ro_paths (read-only), /dev, /proc, a private /tmp, the episode dir
  prlimit ...                       CPU seconds, address space, file size, processes, open files
  setpriv --reuid U ...             the episode's uid, no capabilities, no_new_privs
  env -i ... bash -c COMMAND

The command is pid 1 of its pid namespace, so when it exits or is killed (timeout, output cap,
cancellation) the kernel kills everything it started, and its IPC namespace goes with it. The
episode directory is a tmpfs of `workdir_mb` owned by the episode's uid, so its disk use is bounded too.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Optional, Sequence

from envs.sdk.cgroups import EpisodeCgroups, find_hierarchies
from envs.sdk.sandbox import Sandbox, SandboxBackend, SandboxConfig, SandboxError, SandboxUnavailable, dir_name

log = logging.getLogger("envs.sandbox")

INIT = Path(__file__).with_name("sandbox_init.py")
STAGE = ".stage"
"""An empty directory beside the episode directories: each command mounts its new root there, in its own
mount namespace, before making it `/`."""
REQUIRED_TOOLS = ("unshare", "setpriv", "prlimit", "mount", "umount", "bash", "tar")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
RUNTIME_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/alternatives",
                 "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
"""What every command sees of the host (read-only, where it exists): programs, libraries, the dynamic
linker's cache, the alternatives links (awk, ...), the time zone. SandboxConfig.ro_paths adds to it."""


class NamespaceSandbox(Sandbox):
    def __init__(self, workdir: Path, config: SandboxConfig, uid: int, cgroups: Optional[EpisodeCgroups]):
        super().__init__(workdir, config)
        self.uid = uid
        self.cgroups = cgroups

    async def _spawn(self, argv: Sequence[str], stdin: bool) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *self._wrap(argv), stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)

    def _kill(self, proc: asyncio.subprocess.Process) -> None:
        # proc is `unshare`; --kill-child takes the namespace's pid 1, and with it every process inside
        if proc.returncode is None:
            proc.kill()

    def _wrap(self, argv: Sequence[str]) -> list[str]:
        c, mb = self.config, 1 << 20
        spec = json.dumps({"workdir": str(self.workdir), "stage": str(self.workdir.parent / STAGE),
                           "tmp_mb": c.tmp_mb, "uid": self.uid, "cgroups": self.cgroups.procs_files if self.cgroups else [],
                           "ro_paths": [*RUNTIME_PATHS, *c.ro_paths]})
        return [
            "setpriv", "--pdeathsig", "KILL", "--",
            "unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--",
            sys.executable, "-I", "-S", str(INIT), spec, "--",
            "prlimit", f"--cpu={c.cpu_s}", f"--as={c.memory_mb * mb}", f"--fsize={c.max_file_mb * mb}",
            f"--nproc={c.max_processes}", f"--nofile={c.max_open_files}", "--core=0", "--",
            "setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all", "--",
            "env", "-i", f"PATH={SAFE_PATH}", f"HOME={self.workdir}", "TMPDIR=/tmp", "LANG=C.UTF-8",
            "TERM=dumb", "PYTHONDONTWRITEBYTECODE=1", *argv,
        ]


class NamespaceBackend(SandboxBackend):
    type = "namespace"

    def __init__(self, config: SandboxConfig):
        super().__init__(config)
        self._own_root = config.root_dir is None
        self.root = Path(config.root_dir or tempfile.mkdtemp(prefix="asyncrl-sandbox-"))
        self._free_uids: list[int] = []
        self._next_uid = itertools.count(config.base_uid)
        self._names = itertools.count()
        self._hierarchies = find_hierarchies()
        self._tmpfs_workdir = True

    async def probe(self) -> None:
        if os.geteuid() != 0:
            raise SandboxUnavailable("the namespace sandbox needs root (namespaces, mounts, switching uid)")
        missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
        if missing:
            raise SandboxUnavailable(f"the namespace sandbox needs {', '.join(missing)} (util-linux, coreutils)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)  # episode uids traverse it to reach their own directory, nothing more
        (self.root / STAGE).mkdir(mode=0o700, exist_ok=True)
        self._tmpfs_workdir = await self._tmpfs_works()
        async with self.session("probe") as sandbox:
            result = await sandbox.run(["id", "-u"])
        if not result.ok or result.output.strip() != str(sandbox.uid):
            raise SandboxUnavailable(f"a probe command in the namespace sandbox failed: {result.output[-1000:]!r}")
        log.info("namespace sandbox ready: root=%s cgroups=%s workdir=%s", self.root,
                 [h.controller for h in self._hierarchies] or "none (rlimits only)",
                 f"tmpfs {self.config.workdir_mb} MB" if self._tmpfs_workdir else "plain directory (disk unbounded)")

    @asynccontextmanager
    async def session(self, name: str) -> AsyncIterator[NamespaceSandbox]:
        uid = self._free_uids.pop() if self._free_uids else next(self._next_uid)
        workdir = self.root / f"{dir_name(name)}-{next(self._names)}"
        cgroups = None
        try:
            try:
                await self._make_workdir(workdir, uid)
                if self._hierarchies:
                    cgroups = EpisodeCgroups.create(self._hierarchies, f"{os.getpid()}-{workdir.name}",
                                                    self.config.memory_mb << 20, self.config.max_processes)
            except OSError as err:
                raise SandboxError(f"setting up the sandbox of {name} failed: {err}") from err
            yield NamespaceSandbox(workdir, self.config, uid, cgroups)
        finally:
            if cgroups is not None:
                await cgroups.remove()
            await self._remove_workdir(workdir)
            self._free_uids.append(uid)

    async def close(self) -> None:
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    async def _make_workdir(self, workdir: Path, uid: int) -> None:
        workdir.mkdir(mode=0o700)
        if self._tmpfs_workdir:
            await _check_call("mount", "-t", "tmpfs", "-o",
                              f"size={self.config.workdir_mb}m,mode=0700,uid={uid},gid={uid},nosuid,nodev",
                              "asyncrl-episode", str(workdir))
        else:
            os.chown(workdir, uid, uid)

    async def _remove_workdir(self, workdir: Path) -> None:
        if self._tmpfs_workdir and os.path.ismount(workdir):
            await _check_call("umount", "--lazy", str(workdir))
        shutil.rmtree(workdir, ignore_errors=True)

    async def _tmpfs_works(self) -> bool:
        trial = self.root / "tmpfs-probe"
        trial.mkdir(exist_ok=True)
        try:
            await _check_call("mount", "-t", "tmpfs", "-o", "size=1m", "asyncrl-probe", str(trial))
            await _check_call("umount", str(trial))
            return True
        except OSError as err:
            log.warning("cannot mount a tmpfs episode directory (%s): episode disk use is not bounded", err)
            return False
        finally:
            trial.rmdir()


async def _check_call(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxError(f"{' '.join(argv)}: {err.decode(errors='replace').strip()}")

