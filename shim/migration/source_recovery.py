"""Recovery of a live migration out of this node that a crash interrupted (docs/design/migration.md
(Live migration)), dispatched by the journal's kind `migration-source` (shim/engine.py): the
dumps a crash left are ended, then the pod is killed (committed) or thawed (after the destination's
lease when it may have run).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

import psutil

from shim import errors, logs
from shim.aio import run_to_end
from shim.archive import layout
from shim.archive.dirfd import clear_dir_contents
from shim.cgroups import thaw_paths
from shim.criu.dump_stop import dump_processes, end_dump, stop_dump
from shim.deadlines import MIGRATION_FENCE_MARGIN, MIGRATION_LEASE
from shim.migration.lazy_dumps import WORK_DIR, freeze_paths, kill_frozen
from shim.state import OpRecord
from shim.state.records import MigrationSourceRecord
from shim.upstream import Upstream, is_not_found

log = logs.get("shim.migration.source_recovery")


async def recover(rec: OpRecord, upstream: Upstream) -> None:
    """A migration out of this node that a crash interrupted (docs/design/migration.md (Live
    migration)): its dumps are ended, then by phase: committed -> the pod's processes killed and
    its containers removed; handed-over -> the destination's lease waited out, then thawed;
    earlier -> thawed at once. Not committed: the partial archive is cleared."""
    data: MigrationSourceRecord = rec.data
    work = data.work_dir
    # from `served` on, every dump's page server listened (its tasks cured) and podshim's freeze
    # held the pod (freeze_again), not CRIU's ptrace alone
    served = rec.phase in ("served", "handed-over", "committed")
    if served:
        await run_to_end(freeze_paths, data.cgroups[1:])
    if work and data.output_path:
        await run_to_end(_end_leftovers, Path(work), Path(data.output_path), served)
    if rec.phase == "committed":
        await run_to_end(kill_frozen, data.cgroups[1:])
        await run_to_end(thaw_paths, list(data.cgroups))
        for cid in data.container_ids:
            for call in (upstream.stop_container, upstream.remove_container):
                try:
                    await call(cid)
                except errors.ShimError as e:
                    if not is_not_found(e):
                        raise
        log.warning("migration recovered: it was committed; the migrated pod's containers were removed")
    else:
        if rec.phase == "handed-over":
            # the destination ran or may have: it kills its copy MIGRATION_LEASE after the last
            # word from here, which came before this podshim died
            await asyncio.sleep(MIGRATION_LEASE + MIGRATION_FENCE_MARGIN)
        await run_to_end(thaw_paths, list(data.cgroups))
        out = data.output_path
        if out:
            with contextlib.suppress(OSError, errors.NotFound):
                await run_to_end(clear_dir_contents, Path(out))
        log.warning("migration recovered: the pod was thawed and runs on here", phase=rec.phase)
    if work and Path(work).parent.name == WORK_DIR:
        await run_to_end(shutil.rmtree, work, True)


def _end_leftovers(work_root: Path, output_path: Path, served: bool) -> None:
    """End the runc/CRIU processes of the migration's dumps a crash left, one dump (runc's
    process group, found by its work dir or its CRIU's image dir) at a time, and wait until they
    are gone: at once (end_dump) when every task of it was cured, its page server up (`served`,
    or a TCP socket of its CRIU's); else with stop_dump, which lets CRIU take its code out of the
    tasks first (docs/design/crash-safety.md (Cancellation))."""
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(work_root)):
            images = layout.ArchiveLayout(output_path).container(name).checkpoint_dir
            pgid = _dump_group([str(work_root / name), str(images)])
            if pgid is None:
                continue
            if served or _page_server_up(pgid, images):
                end_dump(pgid, images)
            else:
                stop_dump(pgid, images)


def _dump_group(needles: list[str]) -> int | None:
    """The process group of the dump whose runc or CRIU names one of `needles` in its argv."""
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info.get("cmdline") or []
        if p.pid != os.getpid() and any(n in a for a in argv for n in needles):
            with contextlib.suppress(OSError):
                return os.getpgid(p.pid)
    return None


def _page_server_up(pgid: int, images: Path) -> bool:
    """Whether a process of the dump has a TCP socket: its page server (listening, or serving the
    destination), which CRIU opens once every task is cured."""
    for pid in dump_processes(pgid, images):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).net_connections(kind="tcp"):
                return True
    return False
