"""What a process in a container's cgroup but outside its process tree is, and what to do.

CRIU dumps a container's process tree; anything else in its cgroup fails the dump, so
CheckpointPod and CheckpointContainer refuse it up front (FAILED_PRECONDITION). Two kinds:

* an exec session (kubectl/crictl exec): its first process is a child of the runtime's shim
  (containerd-shim-*, conmon) or still of runc/crun; it ends when the session ends: retry then.
* a stray: anything else, e.g. a daemon that detached into the pod's shared PID namespace (its
  parent is then the namespace's init, the pause process). It never ends by itself: stop it or
  move it out of the container's cgroup.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from shim import errors

# Parents that start exec sessions: the runtime's shim, or runc/crun while it sets one up.
_EXEC_PARENTS = ("containerd-shim", "conmon", "runc", "crun")
SHOWN = 5  # processes named in a message


@dataclass(frozen=True)
class Stray:
    pid: int
    comm: str
    parent_pid: int
    parent_comm: str
    exec_session: bool

    def describe(self) -> str:
        return f"process {self.pid} ({self.comm}), child of {self.parent_pid} ({self.parent_comm})"


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "gone"


def outside_tree(root: int, pids: list[int]) -> list[int]:
    """Those of `pids` that are not `root` or a descendant of it, their parents read now: a
    process forked in the tree after the caller listed the tree is in it, one that has ended is
    not counted (it can no longer fail a dump)."""
    out = []
    for pid in pids:
        try:
            ancestor = pid
            while ancestor not in (root, 0, 1):
                ancestor = psutil.Process(ancestor).ppid()
        except psutil.Error:
            continue  # it (or an ancestor on the way) has ended
        if ancestor != root:
            out.append(pid)
    return out


def classify(pids: list[int]) -> list[Stray]:
    """Each of `pids`, with the parent of its group's first process: the nearest ancestor that is
    not itself one of `pids` (an exec session's children belong to that session)."""
    group = set(pids)
    out = []
    for pid in pids:
        comm = _name(pid)
        first, parent = pid, 0
        try:
            parent = psutil.Process(pid).ppid()
            while parent in group and parent != first:
                first, parent = parent, psutil.Process(parent).ppid()
        except psutil.Error:
            pass
        parent_comm = _name(parent) if parent else "none"
        out.append(Stray(pid, comm, parent, parent_comm, parent_comm.startswith(_EXEC_PARENTS)))
    return out


def refusal(container: str, pids: list[int]) -> errors.FailedPrecondition:
    """The error for processes `pids` of container `container`'s cgroup outside its tree."""
    found = classify(sorted(pids))
    strays = [s for s in found if not s.exec_session]
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    if not strays:
        shown = "; ".join(s.describe() for s in found[:SHOWN])
        return errors.FailedPrecondition(
            f"container {container!r} has an exec session ({shown}{more}): it runs in the container but "
            "outside its process tree, and CRIU cannot dump it; end the exec session (kubectl/crictl "
            "exec) and retry"
        )
    shown = "; ".join(s.describe() for s in strays[:SHOWN])
    rest = len(strays) - SHOWN
    execs = len(found) - len(strays)
    return errors.FailedPrecondition(
        f"container {container!r} has a process outside its process tree ({shown}"
        f"{f' and {rest} more' if rest > 0 else ''}): it runs in the container's cgroup but not under the "
        "container's main process (e.g. a daemon that detached into the pod's shared PID namespace), "
        "so CRIU cannot dump it, and it will not end by itself: stop it, or move it out of the "
        f"container's cgroup, then retry"
        + (f" (and end the {execs} exec session process(es) too)" if execs else "")
    )
