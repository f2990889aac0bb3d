"""A CheckpointPod a crash interrupted, undone at podshim's next start (docs/design/crash-safety.md
(Crash safety)): the pod's netns lock removed, its cgroups thawed, a partial archive removed (a
complete one keeps its manifest)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from shim import errors, logs
from shim.archive import fsutil, layout
from shim.archive.dirfd import DirHandle, clear_dir_contents
from shim.cgroups import thaw_paths
from shim.criu.netns_lock import NetnsLock
from shim.state import OpRecord
from shim.state.records import CheckpointRecord

log = logs.get("shim.ops.checkpoint_pod_recovery")


async def recover(rec: OpRecord) -> None:
    """Undo a CheckpointPod a crash interrupted (its journal record; docs/design/crash-safety.md (Crash
    safety)): thaw its cgroups; remove a partial archive, or only the temporary file of an
    interrupted manifest rewrite of a complete one."""
    data: CheckpointRecord = rec.data  # or a ContainerCheckpointRecord without a staging dir
    if data.netns:
        # a crash between the netns lock and its unlock left the pod's network dropped
        NetnsLock.unlock_leftover(data.netns)
    thaw_paths(list(data.cgroups))
    out = data.output_path
    if out and not (Path(out) / layout.MANIFEST_FILE).exists():
        with contextlib.suppress(OSError, errors.NotFound):  # NotFound: dir removed since
            clear_dir_contents(Path(out))
    elif out:
        _remove_manifest_temps(Path(out))


def _remove_manifest_temps(out: Path) -> None:
    """A complete archive whose checkpoint died while rewriting manifest.json (the final timings)
    keeps the old manifest (the rename never happened) and the temporary file, which verifying
    would refuse as a file the manifest does not list: remove it."""
    try:
        # listed and cleaned through the directory opened with O_NOFOLLOW at every level
        # (docs/design/archive.md (Path confinement)): a path replaced by a symlink is left alone
        with DirHandle.open(out) as d, os.scandir(d.fd) as it:
            temps = [
                e.name
                for e in it
                if e.name.startswith(f".{layout.MANIFEST_FILE}")
                and fsutil.is_temp_name(e.name)
                and e.is_file(follow_symlinks=False)
            ]
            for name in temps:
                os.unlink(name, dir_fd=d.fd)
                log.warning(
                    "removed the temporary file of an interrupted manifest write", path=str(out / name)
                )
            if temps:
                d.fsync()
    except (FileNotFoundError, errors.NotFound, errors.InvalidArgument):
        return
