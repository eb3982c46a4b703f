#!/bin/sh
# Sandbox init: pid 1 of fresh pid, mount and network namespaces, still root.
# usage: sandbox_init.sh WORKDIR TMP_MB CGROUP_PROCS_FILES(colon-separated) -- COMMAND...
# Joins the episode's cgroups, gives the command a private /tmp, makes every other mount read-only
# except WORKDIR, then runs COMMAND (which sets rlimits and drops to the episode's uid) and exits
# with its status. This shell stays pid 1 and root on purpose: `unshare --kill-child` kills it when
# the sandbox is stopped (a uid change would clear that parent-death signal), and when pid 1 dies
# the kernel kills every process left in the namespace.
# Any failure aborts before the command runs: the sandbox fails closed.
set -eu
work="$1"; tmp_mb="$2"; cgroups="$3"; shift 3
[ "$1" = "--" ] && shift

for procs in $(echo "$cgroups" | tr ':' ' '); do echo 0 > "$procs"; done

cd "$work"
mount -t tmpfs -o "size=${tmp_mb}m,mode=1777,nosuid,nodev" sandbox-tmp /tmp
# Where WORKDIR lies under /tmp the new tmpfs hides it: recreate the path there and bind the real
# directory (still our cwd) onto it. Elsewhere this binds the directory onto itself.
mkdir -p "$work"
mount --no-canonicalize --bind . "$work"

# Mounts below /tmp and /proc are hidden under the fresh ones, out of reach: nothing to remount there.
awk '{print $2}' /proc/self/mounts | sort -u | while read -r m; do
  case "$m" in
    "$work"|/tmp|/tmp/*|/proc|/proc/*) ;;
    *) mount -o remount,bind,ro "$m" ;;
  esac
done

cd "$work"
set +e
"$@"
exit $?
