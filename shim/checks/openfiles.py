"""What the processes to checkpoint hold that CRIU refuses with its defaults (deleted files held
open, inotify/fanotify watches), read from /proc before the freeze, so that a CheckpointPod
without options (the kubelet's) still succeeds: `ghost-limit` and `irmap-scan-path` fitted to them
(docs/design/checkpoint-pod.md (What the kubelet sends)). A process or descriptor that goes away
meanwhile is skipped."""

from __future__ import annotations

import os
import re
import stat
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shim import errors, logs
from shim.cgroups import cgroup_procs

if TYPE_CHECKING:
    from shim.criu.options import CriuOptions
    from shim.sandbox import ContainerView

log = logs.get("shim.checks.openfiles")

CRIU_GHOST_LIMIT = 1 << 20  # CRIU's default ghost-limit
MIB = 1 << 20
# deleted "files" CRIU dumps otherwise than as ghost files (memfd, SysV and anonymous shared memory)
NOT_GHOSTS = ("/memfd:", "/SYSV", "/dev/zero")
DELETED = " (deleted)"
# fdinfo of an inotify descriptor: "inotify wd:1 ino:a06898 sdev:5b mask:…"; of a fanotify inode
# mark: "fanotify ino:… sdev:… mflags:…" (hex; sdev is the kernel's dev_t, major << 20 | minor)
WATCH_RE = re.compile(r"^(?:inotify wd:\S+|fanotify) ino:([0-9a-f]+) sdev:([0-9a-f]+)", re.M)
WATCH_LINKS = ("anon_inode:inotify", "anon_inode:[fanotify]")
SCAN_LIMIT = 200_000  # entries looked at per watched file before giving up on finding it


@dataclass(frozen=True)
class DeletedFile:
    container: str
    pid: int
    path: str  # as the process sees it, without " (deleted)"
    size: int


def _kernel_dev(sdev: int) -> int:
    return os.makedev(sdev >> 20, sdev & 0xFFFFF)


def _fd_links(pid: int) -> Iterator[tuple[str, str]]:
    """(/proc path, link text) of each descriptor of `pid`."""
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return
    for n in names:
        try:
            yield f"{base}/{n}", os.readlink(f"{base}/{n}")
        except OSError:
            continue


def _deleted_mappings(pid: int) -> Iterator[tuple[str, str]]:
    """(/proc path, file name) of each mapping of a deleted file."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        if line.endswith(DELETED):
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                yield f"/proc/{pid}/map_files/{fields[0]}", fields[5]


def deleted_files(container: str, pids: list[int]) -> list[DeletedFile]:
    """The deleted regular files `pids` hold open or mapped, each once (by device and inode)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for pid in pids:
        for proc_path, name in [*_fd_links(pid), *_deleted_mappings(pid)]:
            if not name.endswith(DELETED) or name.startswith(NOT_GHOSTS):
                continue
            try:
                st = os.stat(proc_path)  # the open file itself, through the magic link
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 0 or key in seen:
                continue
            seen.add(key)
            out.append(DeletedFile(container, pid, name.removesuffix(DELETED), st.st_size))
    return out


def ghost_limit(files: list[DeletedFile], cap: int) -> int:
    """The ghost-limit the dump needs for `files` (0: CRIU's default will do): the largest with a
    quarter of headroom (a log still being written), in whole MiB, at most `cap`; a file over
    `cap` is refused (CRIU copies it inside the freeze window)."""
    big = [f for f in files if f.size > CRIU_GHOST_LIMIT]
    if not big:
        return 0
    over = [f for f in big if f.size > cap]
    if over:
        named = "; ".join(
            f"container {f.container!r}: process {f.pid} holds {f.path} ({f.size} bytes)" for f in over
        )
        raise errors.FailedPrecondition(
            f"deleted file(s) held open over the node's ghost-file cap ([checkpoint] ghost_limit_max, "
            f"{cap} bytes): {named}; CRIU would copy each into the checkpoint inside the freeze window. "
            f"Close or truncate it, raise ghost_limit_max, or pass the CheckpointPod option "
            f"ghost-limit={max(f.size for f in over)}; nothing was frozen"
        )
    needed = max(f.size for f in big)
    return min(cap, -(-(needed + needed // 4) // MIB) * MIB)


def watches(pid: int) -> set[tuple[int, int]]:
    """(device, inode) of every file `pid` watches with inotify or fanotify (inode marks)."""
    out = set()
    for proc_path, link in _fd_links(pid):
        if link not in WATCH_LINKS:
            continue
        try:
            with open(proc_path.replace("/fd/", "/fdinfo/", 1)) as f:
                text = f.read()
        except OSError:
            continue
        out |= {(_kernel_dev(int(dev, 16)), int(ino, 16)) for ino, dev in WATCH_RE.findall(text)}
    return out


def _mount_points(pid: int, dev: int) -> list[str]:
    """The mount points (as `pid` sees them) of the file system `dev`, shortest first."""
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        major, _, minor = fields[2].partition(":") if len(fields) > 4 else ("", "", "")
        if major.isdigit() and minor.isdigit() and os.makedev(int(major), int(minor)) == dev:
            out.append(_unescape(fields[4]))
    return sorted(set(out), key=len)


def _unescape(field: str) -> str:
    """A mountinfo field with its octal escapes (\\040 for a space, …) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def find_path(pid: int, dev: int, ino: int, limit: int = SCAN_LIMIT) -> str | None:
    """The path, as `pid` sees it, of inode `ino` of device `dev`: a breadth-first walk of the
    mounts of that device in `pid`'s mount namespace, never into another device, at most `limit`
    entries. None when not found."""
    root = f"/proc/{pid}/root"
    budget = limit
    for mount_point in _mount_points(pid, dev):
        try:
            if os.stat(root + mount_point).st_ino == ino:  # the mount's own root is watched
                return mount_point
        except OSError:
            continue
        todo = deque([mount_point])
        while todo and budget > 0:
            d = todo.popleft()
            try:
                with os.scandir(root + d) as it:
                    entries = list(it)
            except OSError:
                continue
            for e in entries:
                budget -= 1
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != dev:
                    continue  # another mount
                path = f"{d.rstrip('/')}/{e.name}"
                if st.st_ino == ino:
                    return path
                if stat.S_ISDIR(st.st_mode):
                    todo.append(path)
    return None


def watched_dirs(container: str, pids: list[int]) -> list[str]:
    """The directories (as the container sees them) holding the files `pids` watch: CRIU's
    irmap-scan-path for each, where it finds a watched file it cannot reopen by handle."""
    found = set()
    for pid in pids:
        for dev, ino in watches(pid):
            path = find_path(pid, dev, ino)
            if path is None:
                log.warning("watched file not found", container=container, pid=pid, device=dev, inode=ino)
                continue
            found.add(os.path.dirname(path) or "/")
    return sorted(found)


def fitted(criu: CriuOptions, containers: list[ContainerView], ghost_cap: int) -> CriuOptions:
    """`criu` with what these containers' processes need: ghost-limit sized to their deleted open
    files when `ghost_cap` (ghost-limit=auto; FAILED_PRECONDITION over it), and the directories
    of their watched files added to irmap-scan-path. Unchanged for a pod with neither, so its
    dump (and freeze window) is the same."""
    ghosts: list[DeletedFile] = []
    dirs: list[str] = []
    for c in containers:
        pids = cgroup_procs(c.cgroups_path)
        if ghost_cap:
            ghosts += deleted_files(c.name, pids)
        dirs += watched_dirs(c.name, pids)
    limit = ghost_limit(ghosts, ghost_cap) if ghost_cap else 0
    paths = tuple(dict.fromkeys([*criu.irmap_scan_paths, *sorted(dirs)]))
    if limit or paths != criu.irmap_scan_paths:
        log.info("criu options fitted", ghost_limit=limit or criu.ghost_limit, irmap_scan_paths=list(paths))
    return replace(criu, ghost_limit=limit or criu.ghost_limit, irmap_scan_paths=paths)
