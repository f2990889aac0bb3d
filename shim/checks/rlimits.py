"""Whether CRIU can read the resource limits of a container's processes.

CRIU reads each task's limits with prlimit(2), which the kernel allows for a task whose uids and
gids are not all CRIU's own (root's) only with CAP_SYS_RESOURCE. On a node whose capability
bounding set lacks it, a CRIU without podshim's patch 0016 (it reads /proc/PID/limits then)
fails the dump of every non-root container: CheckpointPod refuses that before the freeze
(FAILED_PRECONDITION) instead of failing in CRIU.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import psutil

from shim import errors

CAP_SYS_RESOURCE = 24
PATCH = "0016-dump-rlimits-from-proc-when-prlimit-is-refused.patch"
MARKER = b"prlimit is refused without CAP_SYS_"  # a string the patch adds to CRIU's binary


def node_has_sys_resource() -> bool:
    """CAP_SYS_RESOURCE in this process's bounding set (hence possibly in the CRIU it runs)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapBnd:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return True  # unknown: let CRIU try


@functools.lru_cache(maxsize=8)
def _carries_patch(path: str, mtime_ns: int, size: int) -> bool:
    return MARKER in Path(path).read_bytes()


def criu_reads_proc_limits(criu: str) -> bool:
    """Whether the CRIU binary `criu` (a path or a name on PATH) carries patch 0016; True when it
    cannot be read (the dump then says what is wrong)."""
    path = criu if "/" in criu else shutil.which(criu)
    if not path:
        return True
    try:
        st = os.stat(path)
        return _carries_patch(os.path.realpath(path), st.st_mtime_ns, st.st_size)
    except OSError:
        return True


def check(name: str, pid: int, criu: str) -> None:
    """Refuse container `name` (main process `pid`) when a process of it runs with a non-root uid
    or gid and `criu` could not read its limits on this node."""
    if node_has_sys_resource() or criu_reads_proc_limits(criu):
        return
    try:
        main = psutil.Process(pid)
        procs = [main, *main.children(recursive=True)]
    except psutil.Error:
        return  # gone: check_dumpable says so
    for p in procs:
        try:
            uids, gids = p.uids(), p.gids()
        except psutil.Error:
            continue
        if any(uids) or any(gids):
            raise errors.FailedPrecondition(
                f"container {name!r} runs as uid {uids.effective} gid {gids.effective} (process {p.pid}), "
                f"and {criu} cannot read the resource limits of a non-root process on this node: the "
                "node's capability bounding set lacks CAP_SYS_RESOURCE, and this CRIU lacks podshim's "
                f"patch {PATCH} (scripts/patches/criu); nothing was frozen: use podshim's CRIU "
                "(/opt/podshim/sbin/criu)"
            )
