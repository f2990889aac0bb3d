"""What a test bed leaves on the host, found and removed by ``TestBed.stop()`` even when its
containerd died: the ids its containerd knew, its shims' sockets, its processes, its pods' network
namespaces and libcni cache entries, its containers' cgroups, and the directories containerd and
libcni share between beds. Everything is found from the bed's files and the host's /proc, never by
asking containerd."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from testbed import _sys

CNI_CACHE_DIR = Path("/var/lib/cni")  # libcni's cache; containerd 1.6 does not let us move it
NETNS_DIRS = ("/run/netns", "/var/run/netns")  # containerd 1.6 CRI creates pod netns here
SHIM_SOCKET_DIR = Path("/run/containerd/s")  # containerd 1.6 shims put their sockets here

_BED_PROGRAMS = {
    "containerd",
    "containerd-shim",
    "containerd-shim-runc-v1",
    "containerd-shim-runc-v2",
    "runc",
    "crun",
    "criu",
    "podshim",
    "podshim-runc",
    "podshim-runc-hook",  # the Python restore hook podshim-runc execs (a restore, its watchdog)
    "podshim-front",  # the server of podshim's socket, a child of podshim
    "runc-wrapper",
    "kubelet",  # testbed/kubelet.py
}

# Directories containerd, its shims and libcni create on first use outside any configurable
# root; removed (deepest first) when empty and no containerd runs on the host any more.
_SHARED_DIRS = (
    SHIM_SOCKET_DIR,
    SHIM_SOCKET_DIR.parent,
    Path("/run/netns"),
    CNI_CACHE_DIR / "results",
    CNI_CACHE_DIR,
)


def known_task_ids(dirs: Iterable[Path]) -> set[str]:
    """Sandbox and container ids a containerd knows on disk (works when it is dead): the names of
    the sub-directories of its task, sandbox and container dirs and of the runtimes' roots."""
    ids: set[str] = set()
    for d in dirs:
        with contextlib.suppress(OSError):
            ids.update(p.name for p in d.iterdir() if p.is_dir())
    return ids


def shim_sockets(task_dir: Path, ids: set[str]) -> set[str]:
    """The ttrpc sockets of the shims of `ids`, in /run/containerd/s: named in the task dir's
    ``address`` (containerd 1.6, 1.7) or ``bootstrap.json`` (2.x: {"address": ...})."""
    found = set()
    for task_id in ids:
        d = task_dir / task_id
        addrs = []
        with contextlib.suppress(OSError):
            addrs.append((d / "address").read_text().strip())
        with contextlib.suppress(OSError, ValueError, AttributeError):
            addrs.append(str(json.loads((d / "bootstrap.json").read_text()).get("address") or ""))
        for addr in addrs:
            path = addr.removeprefix("unix://")
            if Path(path).parent == SHIM_SOCKET_DIR:
                found.add(path)
    return found


def bed_pids(base_dir: Path, cgroups: Iterable[str]) -> set[int]:
    """Every live process of a bed: whatever mentions its base dir in its argv (containerd, shims,
    runc, podshim), their descendants, and whatever sits in its `cgroups` (relative paths)."""
    roots = {p for p in _sys.pids_mentioning(str(base_dir)) if _is_bed_program(p)}
    pids = roots | _sys.descendants(roots)
    for rel in filter(None, cgroups):
        pids |= _sys.cgroup_pids(rel)
    pids.discard(os.getpid())
    return {p for p in pids if _sys.alive(p)}


def _is_bed_program(pid: int) -> bool:
    """Whether ``pid`` runs one of the programs a bed starts (not, say, a shell tailing a log)."""
    argv = _sys.read_cmdline(pid)
    names = {os.path.basename(a) for a in argv[:2]}  # argv[1]: the script of an interpreter
    return bool(names & _BED_PROGRAMS) and pid not in _sys.ancestors(os.getpid())


def bed_netns(cache_files: list[Path], pids: set[int]) -> set[str]:
    """Network namespace files (bind mounts in /run/netns) of a bed's pods, from its libcni
    `cache_files` and the network namespaces of its live `pids`."""
    paths: set[str] = set()
    # 1. from libcni's result cache of our networks: interfaces[].sandbox is the netns path
    for f in cache_files:
        with contextlib.suppress(OSError, ValueError):
            cached = json.loads(f.read_text())
            for itf in (cached.get("result") or {}).get("interfaces") or []:
                if itf.get("sandbox"):
                    paths.add(itf["sandbox"])
    # 2. from live processes of the bed: match their netns inode with nsfs mounts
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
    for m in _sys.mounts():
        if m.fstype == "nsfs" and any(_sys.is_under(m.mount_point, d) for d in NETNS_DIRS):
            ino = m.root.removeprefix("net:[").rstrip("]")
            if ino.isdigit() and int(ino) in inodes:
                paths.add(m.mount_point)
    return {p for p in paths if any(_sys.is_under(p, d) for d in NETNS_DIRS)}


def cni_cache_files(network: str, ids: set[str]) -> list[Path]:
    """libcni's cached results of `network` and of the sandboxes `ids`."""
    results = CNI_CACHE_DIR / "results"
    out = []
    with contextlib.suppress(OSError):
        for f in results.iterdir():
            if (network and f.name.startswith(network + "-")) or any(f"-{i}-" in f.name for i in ids):
                out.append(f)
    return out


def runtime_cgroups(roots: Iterable[Path]) -> set[str]:
    """The cgroups (relative paths) of the containers in the runc/crun `roots`."""
    found = set()
    for root in roots:
        for state in root.glob("*/state.json"):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                path = json.loads(state.read_text())["config"]["cgroups"]["path"]
                if path and path.strip("/"):
                    found.add("/" + path.strip("/"))
    return found


def remove_cgroups(container_cgroups: set[str], cgroup_root: str) -> list[str]:
    """Remove the containers' cgroups, their pod level when empty, and the bed's `cgroup_root`
    subtree; the cgroups left."""
    left: list[str] = []
    for rel in sorted(container_cgroups):
        left += _sys.remove_cgroup_tree(rel)
        # the pod level (kubelet-style per-pod parent): only if empty, never recursively,
        # since a parent outside the bed's subtree may be shared
        parent = os.path.dirname(rel)
        if parent.strip("/") and not (cgroup_root and _sys.is_under(parent, cgroup_root)):
            for d in _sys.cgroup_dirs(parent):
                with contextlib.suppress(OSError):
                    d.rmdir()
    if cgroup_root:
        left += _sys.remove_cgroup_tree(cgroup_root)
    return left


def remove_shared_dirs_if_unused() -> None:
    if _sys.programs_running({"containerd", "containerd-shim-runc-v2", "containerd-shim"}):
        return  # another bed (or a system containerd) may be using them
    for d in _SHARED_DIRS:
        with contextlib.suppress(OSError):
            d.rmdir()


def remove_netns(paths: set[str]) -> None:
    for p in paths:
        _sys.umount_lazy(p)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def remove_sockets(paths: set[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(p).st_mode):
                os.unlink(p)
