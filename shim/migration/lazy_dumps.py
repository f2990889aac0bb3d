"""The live migration source's lazy dumps and the pod's cgroups around them (docs/design/migration.md
(Live migration)): one container's `runc checkpoint --lazy-pages` (`LazyDump`), and the blocking
steps on the dumps and the cgroups that the source and its recovery run in worker threads: freeze
again, wait for or end the dumps, kill the frozen pod, keep the dumps' CRIU logs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from shim import errors, logs
from shim.archive import fsutil, layout
from shim.cgroups import PodCut, cgroup_procs, default_freezer
from shim.criu.dump_stop import end_dump, stop_dump
from shim.deadlines import FREEZE_TIMEOUT, KILL_WAIT
from shim.ops.checkpoint_pod import _Work

log = logs.get("shim.migration.lazy_dumps")

WORK_DIR = "migration"  # <state_dir>/migration/<id>/<container>: each lazy dump's work dir (its CRIU log)


@dataclass
class LazyDump:
    """One container's `runc checkpoint --lazy-pages`: it writes the images but the pages, then
    its CRIU serves the pages from a page server (one connection, TLS) until the destination's
    daemon has them all (or the connection ends), and exits."""

    work: _Work
    work_dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    serving: bool = False  # its page server listens: every task was cured (compel_cure_remote)

    @property
    def name(self) -> str:
        return self.work.view.name

    def end(self) -> None:
        """End runc and its CRIU (their process group, and a CRIU found by its image dir) once
        nothing of CRIU's runs in the tasks (at once when serving pages: every task is cured; let
        finish its dump otherwise: docs/design/crash-safety.md (Cancellation)), wait until none is
        left; then the pod's tasks are released (ptrace) but stay frozen (the cut)."""
        if self.proc is None:
            return
        if self.serving:
            # nothing of CRIU's is in the tasks any more, and podshim's freezer holds them
            # (freeze_again): stop_dump, which looks for tasks in their ptrace-stop, would see
            # frozen ones and wait for the dump to end, which a page server nobody asks never does
            end_dump(self.proc.pid, Path(self.work.images.proc))
        else:
            stop_dump(self.proc.pid, Path(self.work.images.proc))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=KILL_WAIT)


def freeze_again(cut: PodCut) -> None:
    """The cut's cgroups frozen by podshim again: CRIU thawed them once it held the tasks."""
    for cg in cut.frozen:
        cut.freezer.freeze(cg, timeout=FREEZE_TIMEOUT)


def freeze_paths(cgroups: list[str]) -> None:
    """Recovery's freeze: the cgroups a crash left, each as far as it can."""
    freezer = default_freezer()
    for cg in cgroups:
        with contextlib.suppress(errors.ShimError):
            freezer.freeze(cg, timeout=FREEZE_TIMEOUT)


def wait_dumps(dumps: list[LazyDump], timeout: float) -> None:
    """Wait until the dumps end by themselves (their pages sent), ending those still running."""
    end = time.monotonic() + timeout
    for d in dumps:
        if d.proc is None:
            continue
        try:
            d.proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("lazy dump still running after the transfer; ending it", container=d.name)
            d.end()


def end_dumps(dumps: list[LazyDump]) -> None:
    for d in dumps:
        d.end()


def kill_frozen(cgroups: list[str]) -> None:
    """SIGKILL every process of the (frozen) cgroups: it dies once thawed."""
    for cg in cgroups:
        for pid in cgroup_procs(cg):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def copy_logs(dumps: list[LazyDump], archive: layout.ArchiveLayout) -> None:
    """The dumps' CRIU logs (written until the transfer ended) next to the archive's containers:
    the operator's record of the source side (not in the manifest, not sent)."""
    assert archive.dir is not None
    for d in dumps:
        with contextlib.suppress(OSError, errors.ShimError):
            data = (d.work_dir / "dump.log").read_bytes()
            with archive.dir.sub(f"{layout.CONTAINERS_DIR}/{d.name}") as cd:
                fsutil.write_private_file(cd.at("migration-dump.log"), data)
