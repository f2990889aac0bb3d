"""The page check of an eager restore (docs/design/restore-pod.md (RestorePod) step 4): the sha256 of
each page image, in threads beside CRIU's restore, and its verdict once the restore ended: the
tasks CRIU left stopped continued, or killed with what they leave. Run by podshim-runc's hook or by
podshim's restore broker (shim/ops/restore_broker.py), started early at RestorePod."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shim import contract
from shim.wrapper.cleanup import continue_tasks, delete_state, kill_tasks, remove_cgroups

HASH_READ = 4 << 20  # the page check's read size (hashlib releases the GIL on buffers this large)


PAGE_CHECK_LOG = "page-check.json"  # in the work dir: the page check's timing beside CRIU's stats


class PageImages:
    """The sha256 check of a container's page images (PAGE_DIGESTS_ANNOTATION) in threads of its own,
    beside CRIU's restore: largest first, up to `workers` files at a time (one file is one thread:
    sha256 is sequential), HASH_READ reads, no symlink followed. `problem` is "" when every image
    matched, else what failed, naming the member."""

    def __init__(self, root: Path, digests: dict[str, str], workers: int = 2, nice: int = 0) -> None:
        self.root = root
        self.digests = digests
        self.workers = max(1, min(workers, len(digests)))
        # RestorePod's early check yields the CPU to the new sandbox's containerd, runc and CNI
        # (nice is per thread on Linux); boost() puts it back once the restore waits for it
        self.nice = nice
        self._tids: list[int] = []
        self.stop = threading.Event()
        self.problem = ""
        self.bytes = 0
        self.started = 0.0
        self.seconds = 0.0  # the hashing's wall time (until its last thread ended)
        self._fsutil: Any = None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _size(self, rel: str) -> int:
        try:
            return os.lstat(self.root / rel).st_size
        except OSError:
            return 0

    def start(self) -> None:
        from shim.archive import fsutil  # imported here, not by each thread

        self._fsutil = fsutil
        hashlib.sha256()  # OpenSSL's set-up in this thread, before any other thread (the watchdog forks)
        todo = sorted(self.digests, key=lambda r: (-self._size(r), r))
        self.started = time.monotonic()

        def work() -> None:
            if self.nice:
                with self._lock:
                    self._tids.append(threading.get_native_id())
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, self._tids[-1], self.nice)
            while not self.stop.is_set():
                with self._lock:
                    if not todo:
                        break
                    rel = todo.pop(0)
                problem = self._check(rel)
                with self._lock:
                    if problem and not self.problem:
                        self.problem = problem
                        self.stop.set()  # one failure decides: the others need not finish
            with self._lock:
                self.seconds = max(self.seconds, time.monotonic() - self.started)

        for i in range(self.workers):
            t = threading.Thread(target=work, name=f"podshim-page-check-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def boost(self) -> None:
        """Back to podshim's own priority: a restore now waits for this check."""
        with self._lock:
            self.nice = 0
            for tid in self._tids:
                with contextlib.suppress(OSError):  # ended already
                    os.setpriority(os.PRIO_PROCESS, tid, 0)

    def _check(self, rel: str) -> str:
        try:
            size, digest = self._fsutil.hash_file(self.root / rel, HASH_READ, self.stop)
        except self._fsutil.Stopped:
            return ""
        except OSError as e:
            return f"cannot read {rel} to verify its checksum ({e.strerror or e})"
        with self._lock:
            self.bytes += size
        if digest != self.digests[rel]:
            return (
                f"{contract.PAGE_MISMATCH}{rel} ({size} bytes with sha256 {digest}, RestorePod recorded "
                f"sha256 {self.digests[rel]} from the archive's manifest)"
            )
        return ""

    def wait(self) -> str:
        for t in self._threads:
            t.join()
        return self.problem


def settler(
    pages: PageImages,
    cgroups_path: str,
    pid_file: str | None,
    work: Path,
    delete: list[str] | None = None,
    hit: Callable[[str], None] | None = None,
) -> Callable[[int], None]:
    """What runs once `runc restore` ended, still under the watchdog: wait for the page check;
    every image matched → continue every task of the container (SIGCONT); else kill them all, run
    `delete` (the runtime's `delete --force`) and remove the container's cgroups (pages.problem
    says why, podshim-runc then fails the create).
    A restore that failed stops the check and kills whatever its cgroup holds: a runc killed after
    CRIU restored the tasks (stopped) must not leave them there for good."""

    def settle(returncode: int) -> None:
        restored = time.monotonic()
        if returncode != 0:
            pages.stop.set()
            kill_tasks(cgroups_path, None)  # not the pid file: a failed restore may leave a stale one
            pages.wait()
            return
        problem = pages.wait()
        if not problem:
            # tests/faults: a death while the tasks are held (the broker's `hit` acts on podshim-runc)
            (hit or _hit)("runc-wrapper.held-stopped")
            problem = continue_tasks(cgroups_path, pid_file)
        if problem:
            pages.problem = problem
            kill_tasks(cgroups_path, pid_file)
            if delete:
                delete_state(delete)
            remove_cgroups(cgroups_path)
        _log_page_check(work, pages, restored)

    return settle


def _hit(name: str) -> None:
    from shim import faults

    faults.hit(name)


def _log_page_check(work: Path, pages: PageImages, restored: float) -> None:
    """The overlap of the page check with CRIU's restore, for the operator and bench/restore."""
    doc = {
        "files": len(pages.digests),
        "bytes": pages.bytes,
        "hash_s": round(pages.seconds, 4),
        "restore_s": round(restored - pages.started, 4),  # from the check's start (RestorePod, or prepare)
        "wait_s": round(max(0.0, pages.started + pages.seconds - restored), 4),  # after the restore
        "ok": not pages.problem,
    }
    with contextlib.suppress(OSError):
        (work / PAGE_CHECK_LOG).write_text(json.dumps(doc) + "\n")
