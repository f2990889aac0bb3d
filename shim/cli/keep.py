"""`checkpointpod --keep N`: periodic checkpoints of one pod under a prefix, and the prune that
removes the older ones.

Each run writes a marker beside its directory *before* it makes the directory
(`.<name>.podshim-keep`: the pod, "in-progress", the run's pid and start time) and turns it into
"complete" (an atomic rename) once the checkpoint is. The prune removes a directory only when it
can prove it is its own complete checkpoint of that pod: a complete marker naming the pod, and a
manifest that checks against the tree (every listed file present with its size, nothing else). An
in-progress marker whose run is gone is cleaned when its directory is empty or missing. Anything
else is kept and reported as skipped with the reason; a directory that changes under the prune
(a symlink swapped in, a rename) is skipped, never fatal.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from shim.cli.base import CliError
from shim.procs import running_start_time

MARKER = ".{}.podshim-keep"
STAMP = r"\d{8}T\d{6}\.\d{6}Z"
IN_PROGRESS, COMPLETE = "in-progress", "complete"


def keep_name(prefix: Path) -> Path:
    """`<prefix>-<UTC time to the µs>`: sorts by time, one per call."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
    return prefix.with_name(f"{prefix.name}-{stamp}")


def marker_of(d: Path) -> Path:
    return d.with_name(MARKER.format(d.name))


def _write_marker(path: Path, doc: dict[str, object], replace: bool) -> None:
    data = json.dumps(doc).encode()
    if not replace:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def begin(path: Path, pod_id: str) -> None:
    """The in-progress marker of this run, before its directory exists."""
    pid = os.getpid()
    doc = {"pod": pod_id, "state": IN_PROGRESS, "pid": pid, "start": running_start_time(pid)}
    try:
        _write_marker(marker_of(path), doc, replace=False)
    except OSError as e:
        raise CliError(f"cannot create {marker_of(path)}: {e.strerror}") from None


def complete(path: Path, pod_id: str) -> None:
    _write_marker(marker_of(path), {"pod": pod_id, "state": COMPLETE}, replace=True)


def abandon(path: Path) -> None:
    """A run that failed (its directory already removed when empty): its marker goes too."""
    if not path.exists():
        with contextlib.suppress(OSError):
            marker_of(path).unlink()


@dataclass
class Pruned:
    removed: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"path", "reason"}

    def skip(self, d: Path, reason: str) -> None:
        self.skipped.append({"path": str(d), "reason": reason})


def _read_marker(d: Path) -> dict[str, object] | None:
    try:
        with open(marker_of(d), "rb", opener=lambda p, fl: os.open(p, fl | os.O_NOFOLLOW)) as f:
            doc = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _run_alive(doc: dict[str, object]) -> bool:
    pid, start = doc.get("pid"), doc.get("start")
    return isinstance(pid, int) and pid > 0 and bool(start) and running_start_time(pid) == start


def _open_dir(d: Path) -> int:
    """The directory itself, never what a symlink in its place points at."""
    return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _same(fd: int, d: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(b.st_mode) and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _why_not_complete(fd: int, pod_id: str) -> str | None:
    """None when the directory open at `fd` is a complete checkpoint of `pod_id` by its manifest
    (sizes, the exact set of files); else why not."""
    from shim.archive import manifest  # the archive code loads only when a prune needs it
    from shim.errors import ShimError

    root = Path(f"/proc/self/fd/{fd}")
    try:
        m = manifest.read_manifest(root)
        if m.sandbox.id != pod_id:
            return f"its manifest is of pod {m.sandbox.id[:13]}, not {pod_id[:13]}"
        manifest.check_tree(root, m)
    except ShimError as e:
        return "not a complete checkpoint: " + e.message.replace(str(root), "the directory")
    except OSError as e:
        return f"cannot read it: {e.strerror}"
    return None


def _remove(d: Path, fd: int, pod_id: str, out: Pruned) -> bool:
    """Remove the verified directory open at `fd` through that descriptor: its entries are those
    of the directory that was checked, whatever is put at its name meanwhile."""
    why = _why_not_complete(fd, pod_id)  # again, just before anything is removed
    if why is not None:
        out.skip(d, why)
        return False
    try:
        for name in os.listdir(fd):
            st = os.lstat(name, dir_fd=fd)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        if not _same(fd, d):
            out.skip(d, "it was replaced while it was being removed; its contents were podshim's")
            return False
        os.rmdir(d)
    except OSError as e:
        out.skip(d, f"it changed while it was being removed ({e.strerror})")
        return False
    return True


def _clean_abandoned(d: Path, out: Pruned) -> None:
    """An in-progress marker whose run is gone: its directory is removed if empty (the run died
    before anything was written, or podshim removed what it wrote)."""
    try:
        fd = _open_dir(d)
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            marker_of(d).unlink()
        return
    except OSError as e:
        out.skip(d, f"an interrupted checkpoint that is not a directory ({e.strerror})")
        return
    try:
        if os.listdir(fd):
            out.skip(d, "an interrupted checkpoint that is not empty: inspect and remove it by hand")
            return
        if _same(fd, d):
            with contextlib.suppress(OSError):
                os.rmdir(d)
    finally:
        os.close(fd)
    if not d.exists():
        with contextlib.suppress(OSError):
            marker_of(d).unlink()
        out.removed.append(str(d))


def _consider(d: Path, pod_id: str, out: Pruned) -> int | None:
    """A descriptor of `d` when it is this pod's complete kept checkpoint; else None (a run's
    leftovers are cleaned, anything else is reported as skipped)."""
    doc = _read_marker(d)
    if doc is None:
        if d.exists() or d.is_symlink():
            out.skip(d, "no marker of checkpointpod --keep beside it")
        return None
    if doc.get("pod") != pod_id:
        return None  # another pod's, under the same prefix
    if doc.get("state") == IN_PROGRESS:
        if not _run_alive(doc):
            _clean_abandoned(d, out)
        return None
    try:
        fd = _open_dir(d)
    except OSError as e:
        symlink = e.errno in (errno.ELOOP, errno.ENOTDIR) and d.is_symlink()
        reason = "a symlink, not a directory" if symlink else e.strerror
        out.skip(d, f"cannot open it ({reason})")
        return None
    why = _why_not_complete(fd, pod_id)
    if why is not None:
        os.close(fd)
        out.skip(d, why)
        return None
    return fd


def prune(prefix: Path, pod_id: str, keep: int) -> Pruned:
    """Remove all but the newest `keep` of this pod's complete kept checkpoints under `prefix`,
    and the leftovers of runs that died; report what was removed and what was kept and why."""
    out = Pruned()
    pattern = re.compile(re.escape(prefix.name) + "-" + STAMP)
    try:
        listing = os.listdir(prefix.parent)
    except OSError:
        return out
    names = set()
    for n in listing:
        if pattern.fullmatch(n):
            names.add(n)
        elif n.startswith(".") and n.endswith(".podshim-keep") and pattern.fullmatch(n[1:-13]):
            names.add(n[1:-13])  # a marker whose directory is gone
    mine: list[tuple[Path, int]] = []
    try:
        for n in sorted(names):
            d = prefix.parent / n
            try:
                fd = _consider(d, pod_id, out)
            except (OSError, ValueError) as e:  # anything a directory changing under us raises
                out.skip(d, f"it changed while it was being checked ({e})")
                continue
            if fd is not None:
                mine.append((d, fd))
        for d, fd in mine[: max(0, len(mine) - keep)]:
            if _remove(d, fd, pod_id, out):
                with contextlib.suppress(OSError):
                    marker_of(d).unlink()
                out.removed.append(str(d))
    finally:
        for _, fd in mine:
            with contextlib.suppress(OSError):
                os.close(fd)
    return out
