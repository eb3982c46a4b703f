"""Hosts on one machine: a Linux network namespace per host, joined by a bridge, one address each, and a
private mount namespace per process tree, in which the host's own directory is mounted at a path every
host shares (`mount_point`) and /dev/shm is a fresh tmpfs. So two hosts see different files at the same
path, as two machines with the same image do, and reach each other only over the bridge.

    with Hosts(tmp_path, ["head", "worker"]) as hosts:
        head = hosts["head"]
        proc = hosts.popen(head, ["ray", "start", "--head", "--node-ip-address", head.address, "--block"])
        head.disk / "run"          # what the head wrote under mount_point/run, seen from outside

Needs root and `ip netns` (CI is root); `Hosts.unavailable()` says why when they are not there.
Everything a host runs carries ASYNCRL_TEST_TAG, by which `close()` stops it (tests.services.stop_tagged).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tests.services import stop_tagged


@dataclass
class Host:
    name: str
    netns: str
    address: str
    disk: Path
    """The host's own directory, as the test sees it; the host sees it at Hosts.mount_point."""


def _ip(*args: str, netns: Optional[str] = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, root: Path, names: list[str]) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"arl{self.tag}br"
        subnet = f"10.{random.randint(64, 127)}.{random.randint(0, 255)}"
        self.mount_point = Path(f"/tmp/arl-{self.tag}")
        """Short (Ray's socket paths live under it) and the same on every host."""
        self.hosts = {name: Host(name, f"arl{self.tag}h{i}", f"{subnet}.{i + 1}", root / name)
                      for i, name in enumerate(names)}
        self.gateway_address = f"{subnet}.254"
        """The machine's own end of the bridge."""

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why hosts cannot be built here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if not (shutil.which("ip") and shutil.which("unshare")):
            return "no `ip` / `unshare` (iproute2, util-linux)"
        probe = f"arlprobe{os.getpid()}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "Hosts":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        self.mount_point.mkdir()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts.values()):
            host.disk.mkdir(parents=True, exist_ok=True)
            inside, outside = f"arl{self.tag}v{i}", f"arl{self.tag}p{i}"
            _ip("netns", "add", host.netns)
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", host.netns)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", inside, netns=host.netns)
            _ip("link", "set", inside, "up", netns=host.netns)
            _ip("link", "set", "lo", "up", netns=host.netns)

    def environment(self, env: dict[str, str], home: Path) -> dict[str, str]:
        return {**env, "ASYNCRL_TEST_TAG": self.tag, "HOME": str(home)}

    def popen(self, host: Host, argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
        """`argv` on `host`: in its network namespace, in a mount namespace of its own where the host's disk is
        at mount_point and /dev/shm is private, with the host's name."""
        (host.disk / "home").mkdir(exist_ok=True)
        setup = (f'mount --bind "{host.disk}" "{self.mount_point}" && mount -t tmpfs tmpfs /dev/shm && '
                 f'hostname {host.name} && exec "$@"')
        command = ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--uts", "--propagation", "private",
                   "--", "bash", "-c", setup, "host", *argv]
        with open(log, "ab") as out:
            return subprocess.Popen(command, cwd=cwd, env=self.environment(env, self.mount_point / "home"), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, host: Host, argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float
            ) -> subprocess.CompletedProcess:
        """`argv` on `host`'s network only (the machine's files, HOME the host's): a client such as `ray job submit`."""
        return subprocess.run(["ip", "netns", "exec", host.netns, *argv], cwd=cwd,
                              env=self.environment(env, host.disk / "home"), capture_output=True, text=True,
                              timeout=timeout_s)

    def close(self) -> None:
        stop_tagged(self.tag)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        try:
            self.mount_point.rmdir()
        except OSError:
            pass
