"""Sandbox init: pid 1 of fresh pid, mount, network, IPC and UTS namespaces, still root.

    python -I -S sandbox_init.py SPEC_JSON -- COMMAND...

SPEC_JSON: {"workdir", "stage", "tmp_mb", "uid", "cgroups": [cgroup.procs files], "ro_paths": [...]}.

Joins the episode's cgroups, names the host "sandbox", then builds the command's whole filesystem
as an allow-list and makes it the root (pivot_root): a read-only tmpfs holding read-only binds of
`ro_paths` (the runtime: /usr, /lib*, a few /etc entries; a symlink among them is recreated as
itself), generated /etc/passwd, group, hosts and nsswitch.conf, a minimal /dev (null, zero, full,
random, urandom, tty, a private /dev/shm), a fresh /proc, a private /tmp and WORKDIR, the only
writable host directory. Nothing else of the host exists for the command: not the project tree,
the envs' data, /root, /home, the run directory or other episodes' directories.

Then runs COMMAND (which sets rlimits and drops to the episode's uid) as its child and exits with
its status (128+N if a signal N killed it). It stays pid 1 and root on purpose: `unshare
--kill-child` kills it when the sandbox is stopped (a uid change would clear that parent-death
signal), and when pid 1 dies the kernel kills every process left in the namespace, and with the
last of them the IPC namespace (SysV shared memory, semaphores, message queues) and every mount.
Any failure before the command starts aborts the sandbox: it fails closed.

Mount calls go straight to libc: one process instead of one `mount` per mount point (~20).
"""

import ctypes
import json
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 32, 4096, 1024, 2048, 1 << 21
MNT_DETACH = 2
STATVFS_KEPT = {os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME,
                os.ST_RELATIME: MS_RELATIME}
"""Flags of a source mount its read-only bind restates: dropping them would widen it, and where the
host's mounts are locked (a user namespace) the remount would fail."""
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
HOSTNAME = "sandbox"

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    encode = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def bind(source: str, target: str, *, writable: bool = False, devices: bool = False) -> None:
    """Bind source onto target (created, as a file or a directory like source), then restrict it."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND)
    statvfs = os.statvfs(source).f_flag
    flags = MS_NOSUID | (0 if devices else MS_NODEV) | (0 if writable else MS_RDONLY)
    flags |= sum(flag for st, flag in STATVFS_KEPT.items() if statvfs & st)
    mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def tmpfs(target: str, options: str) -> None:
    os.makedirs(target, exist_ok=True)
    mount("sandbox", target, "tmpfs", MS_NOSUID | MS_NODEV, options)


def read_only(target: str) -> None:
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def build_root(root: str, spec: dict) -> None:
    """The command's filesystem, under `root` (a directory of the host): everything it will see."""
    work, uid = spec["workdir"], spec["uid"]
    tmpfs(root, "size=1m,mode=0755")
    etc = root + "/etc"
    os.makedirs(etc, exist_ok=True)
    write(etc + "/passwd", f"root:x:0:0:root:/:/bin/sh\nsandbox:x:{uid}:{uid}:sandbox:{work}:/bin/bash\n"
                           "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    write(etc + "/group", f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
    write(etc + "/hosts", f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost\n")
    write(etc + "/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files\n")
    dev = root + "/dev"
    tmpfs(dev, "size=64k,mode=0755")
    for name in DEVICES:
        bind(f"/dev/{name}", f"{dev}/{name}", writable=True, devices=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    tmpfs(dev + "/shm", f"size={spec['tmp_mb']}m,mode=1777")
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    tmpfs(root + "/tmp", f"size={spec['tmp_mb']}m,mode=1777")
    # after /tmp: paths under /tmp (WORKDIR, often) are recreated inside the private one
    for path in sorted(spec["ro_paths"]):
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind(path, root + path)
    bind(work, root + work, writable=True)
    read_only(dev)
    read_only(root)


def pivot_into(root: str) -> None:
    """Make `root` the filesystem root and drop the host's from this mount namespace."""
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(f"pivot_root: no syscall number known for {machine}")
    os.chdir(root)
    _check(libc.syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")  # the old root now lies over the new one...
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")  # ...and goes
    os.chdir("/")


def isolate(spec: dict) -> None:
    for procs in spec["cgroups"]:
        with open(procs, "w") as f:
            f.write("0")  # "0" = the writing process; children inherit the cgroup
    _check(libc.sethostname(HOSTNAME.encode(), len(HOSTNAME)), "sethostname")
    build_root(spec["stage"], spec)
    pivot_into(spec["stage"])
    os.chdir(spec["workdir"])


def main() -> int:
    spec, separator, *command = sys.argv[1:]
    assert separator == "--" and command, __doc__
    os.get_exec_path()  # imports what execvp needs while the host's standard library is still visible
    isolate(json.loads(spec))
    child = os.fork()
    if child == 0:
        try:
            os.execvp(command[0], command)
        except OSError as err:
            os.write(2, f"sandbox: cannot run {command[0]}: {err}\n".encode())
        finally:
            os._exit(127)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
