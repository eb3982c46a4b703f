"""Sandbox init: pid 1 of fresh pid, mount and network namespaces, still root.

    python -I -S sandbox_init.py WORKDIR TMP_MB CGROUP_PROCS_FILES(colon-separated) -- COMMAND...

Joins the episode's cgroups, gives the command a private /tmp, remounts every other mount
read-only except WORKDIR, then runs COMMAND (which sets rlimits and drops to the episode's uid) as
its child and exits with its status (128+N if a signal N killed it). It stays pid 1 and root on
purpose: `unshare --kill-child` kills it when the sandbox is stopped (a uid change would clear that
parent-death signal), and when pid 1 dies the kernel kills every process left in the namespace.
Any failure before the command starts aborts the sandbox: it fails closed.

Mount calls go straight to libc: one process instead of one `mount` per mount point (~20).
"""

import ctypes
import os
import re
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 32, 4096, 1024, 2048, 1 << 21
KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
"""Per-mount flags a read-only remount must restate, or it would drop them."""

libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    encode = lambda s: s.encode() if s is not None else None  # noqa: E731
    if libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def mounts() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount, from /proc/self/mountinfo."""
    out = []
    for line in open("/proc/self/mountinfo"):
        fields = line.split()
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        out.append((point, sum(KEPT_FLAGS.get(opt, 0) for opt in fields[5].split(","))))
    return out


def hidden_or_ours(point: str, work: str) -> bool:
    """Mounts left writable: ours (WORKDIR, the new /tmp and /proc) and those hidden beneath them."""
    return point == work or any(point == top or point.startswith(top + "/") for top in ("/tmp", "/proc"))


def isolate(work: str, tmp_mb: str, cgroups: str) -> None:
    for procs in filter(None, cgroups.split(":")):
        with open(procs, "w") as f:
            f.write("0")  # "0" = the writing process; children inherit the cgroup
    os.chdir(work)
    mount("sandbox-tmp", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    # Where WORKDIR lies under /tmp the new tmpfs hides it: recreate the path there and bind the real
    # directory (still our cwd, ".") onto it. Elsewhere this binds the directory onto itself.
    os.makedirs(work, exist_ok=True)
    mount(".", work, None, MS_BIND)
    for point, kept in mounts():
        if not hidden_or_ours(point, work):
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
    os.chdir(work)


def main() -> int:
    work, tmp_mb, cgroups, separator, *command = sys.argv[1:]
    assert separator == "--" and command, __doc__
    isolate(work, tmp_mb, cgroups)
    child = os.fork()
    if child == 0:
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
