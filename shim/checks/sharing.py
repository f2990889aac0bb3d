"""State shared between a pod's containers that separate CRIU runs cannot carry over (SysV IPC
objects of a shared IPC namespace, files of the node's /dev/shm, a unix stream connection between
two containers): refused before anything is frozen, naming the object and the containers
(docs/design/checkpoint-pod.md (CheckpointPod) step 1)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from shim import errors
from shim.cgroups import cgroup_procs
from shim.sandbox import ContainerView

CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
SHM_DIR = "/dev/shm/"
_SOCKET_RE = re.compile(r"socket:\[(\d+)\]")
SOCK_STREAM, SOCK_SEQPACKET = 1, 5
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
T = TypeVar("T")


def check_shared_state(selected: list[ContainerView], dev_shm_carried: bool = False) -> None:
    """FAILED_PRECONDITION when the selected containers share what podshim cannot restore
    (`dev_shm_carried`: the checkpoint carries the pod's /dev/shm, whose files are then fine)."""
    procs = {c.name: _pids(c) for c in selected}
    if not dev_shm_carried:
        _check_dev_shm(procs)
    if len(selected) > 1:
        _check_sysv_ipc(procs)
        _check_unix_connections(procs)


def _pids(c: ContainerView) -> list[int]:
    with contextlib.suppress(OSError, errors.ShimError):
        pids = list(cgroup_procs(c.cgroups_path))
        if pids:
            return pids
    return [c.pid] if c.pid > 0 else []


def _names(names: set[str] | list[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))


# ---------------------------------------------------------------------------- /dev/shm


def shm_files(pid: int) -> set[str]:
    """Files under /dev/shm (as the process sees its mounts) it has open or mapped."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM_DIR):
                    found.add(target.removesuffix(" (deleted)"))
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(SHM_DIR):
                found.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
    return found


def _check_dev_shm(procs: dict[str, list[int]]) -> None:
    users: dict[str, set[str]] = {}
    for name, pids in procs.items():
        for pid in pids:
            for path in shm_files(pid):
                users.setdefault(path, set()).add(name)
    if users:
        path = sorted(users)[0]
        more = f" (and {len(users) - 1} more)" if len(users) > 1 else ""
        raise errors.FailedPrecondition(
            f"POSIX shared memory {path}{more} in the pod's /dev/shm is in use by container(s) "
            f"{_names(users[path])}: podshim carries only a pod's own /dev/shm, in a pod checkpoint (not "
            "a host-IPC pod's, which is the node's, nor in a container checkpointed alone or a live "
            "migration), so the restore could not open it; nothing was frozen"
        )


# ---------------------------------------------------------------------------- SysV IPC


def _in_namespace(ns_path: str, nstype: int, fn: Callable[[], T]) -> T:
    """Run `fn` in a thread of its own that entered the namespace at `ns_path` (setns affects only
    the calling thread; the thread ends with the call, so no pooled thread stays in a pod's
    namespace, and nothing forks in the gRPC process)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, nstype) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            finally:
                os.close(fd)
            result["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    t = threading.Thread(target=run, name="podshim-ns", daemon=True)
    t.start()
    t.join()
    if "error" in result:
        raise errors.Internal(f"cannot inspect the namespace {ns_path}: {result['error']}")
    return result["value"]


def sysv_objects() -> list[str]:
    """The SysV IPC objects of the calling thread's IPC namespace, described for a message."""
    out = []
    for kind, what in (("shm", "shared memory segment"), ("sem", "semaphore set"), ("msg", "message queue")):
        with open(f"/proc/sysvipc/{kind}") as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            fields = line.split()
            if len(fields) >= 2:
                out.append(f"SysV {what} key {int(fields[0]):#x} id {fields[1]}")
    return out


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _by_namespace(procs: dict[str, list[int]], kind: str) -> dict[int, tuple[int, set[str]]]:
    """namespace inode -> (a pid in it, the containers with a process in it)."""
    out: dict[int, tuple[int, set[str]]] = {}
    for name, pids in procs.items():
        for pid in pids:
            ino = _ns_inode(pid, kind)
            if ino is not None:
                out.setdefault(ino, (pid, set()))[1].add(name)
    return out


def _check_sysv_ipc(procs: dict[str, list[int]]) -> None:
    for pid, names in _by_namespace(procs, "ipc").values():
        if len(names) < 2:
            continue
        objects = _in_namespace(f"/proc/{pid}/ns/ipc", CLONE_NEWIPC, sysv_objects)
        if objects:
            more = f" (and {len(objects) - 1} more)" if len(objects) > 1 else ""
            raise errors.FailedPrecondition(
                f"{objects[0]}{more} lives in the pod's IPC namespace, which containers {_names(names)} "
                "share: each container's checkpoint would hold it and the restore could create it only "
                "once; podshim restores SysV IPC objects of a pod checkpointed with one container only; "
                "nothing was frozen"
            )


# ---------------------------------------------------------------------------- unix sockets


def _socket_inodes(pid: int) -> set[int]:
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                m = _SOCKET_RE.fullmatch(os.readlink(f"/proc/{pid}/fd/{fd}"))
                if m:
                    found.add(int(m.group(1)))
    return found


def unix_peers() -> dict[int, tuple[int, int]]:
    """inode -> (peer inode, socket type) of every connected unix socket of the calling thread's
    network namespace (sock_diag, read with pyroute2)."""
    from pyroute2 import DiagSocket

    peers: dict[int, tuple[int, int]] = {}
    with DiagSocket() as ds:
        ds.bind()
        for msg in ds.get_sock_stats():
            peer = msg.get_attr("UNIX_DIAG_PEER")
            if peer:
                peers[int(msg["udiag_ino"])] = (int(peer), int(msg["udiag_type"]))
    return peers


def _check_unix_connections(procs: dict[str, list[int]]) -> None:
    owner: dict[int, str] = {}
    for name, pids in procs.items():
        for pid in pids:
            for ino in _socket_inodes(pid):
                owner.setdefault(ino, name)
    if not owner:
        return
    for pid, _names_in in _by_namespace(procs, "net").values():
        peers = _in_namespace(f"/proc/{pid}/ns/net", CLONE_NEWNET, unix_peers)
        for ino, (peer, kind) in sorted(peers.items()):
            if kind not in (SOCK_STREAM, SOCK_SEQPACKET):
                continue
            a, b = owner.get(ino), owner.get(peer)
            if a and b and a != b:
                raise errors.FailedPrecondition(
                    f"a unix {'stream' if kind == SOCK_STREAM else 'seqpacket'} connection joins containers "
                    f"{a!r} (socket {ino}) and {b!r} (socket {peer}): each container is checkpointed on its "
                    "own and CRIU cannot dump half of a connection (ext-unix-sk does not help); close it "
                    "before the checkpoint or checkpoint the containers in separate pods; nothing was frozen"
                )
