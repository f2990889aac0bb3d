"""Lazy restore: one `criu lazy-pages` daemon per restored container, started and supervised by
podshim; duplicates of its userfaultfds held here and by the guard (shim/criu/uffd_guard.py) so a
process never runs on with missing memory; the page images checksummed while the daemon serves;
any failure kills the container; `recover` after a restart (docs/design/restore-pod.md (Lazy
restore))."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from shim import contract, errors, kept_logs, logs, metrics
from shim.archive import crypto, layout
from shim.config import Config
from shim.criu.lazy import (
    PageCheck,
    check_pages,
    daemon_serving,
    daemon_uffds,
    error_lines,
    exited,
    guard_hold,
    guard_release,
    in_thread,
    pidfd_getfd,
    restore_pending,
    start_guard,
    stopped,
    transfer_split,
    wait_status,
)
from shim.deadlines import (
    GUARD_EXIT_WAIT,
    LAZY_CONTAINER_CHECK,
    LAZY_POLL,
    LAZY_READY_TIMEOUT,
    LAZY_STARTED_POLL,
    RETRY_MAX,
)
from shim.procs import process_start_time
from shim.state import Journal
from shim.state.records import LazyPagesRecord
from shim.upstream import Upstream, is_not_found

log = logs.get("shim.ops.lazy_pages")

KIND = "lazy-pages"  # the journal kind of a live daemon
LOG_NAME = "lazy-pages.log"  # the daemon's CRIU log, in its work dir


@dataclass
class Daemon:
    """One container's `criu lazy-pages`."""

    name: str  # the container's name in the pod
    work: Path
    images: Path
    decrypted: Path | None
    pid: int = 0
    start_time: int = 0
    # a plain Popen: asyncio's subprocess transport would SIGKILL a daemon still running when it
    # is closed or collected at podshim's exit, and the daemons must outlive a podshim stop
    proc: subprocess.Popen[bytes] | None = None
    rec: Any = None
    container_id: str = ""
    started: float = field(default_factory=time.monotonic)
    held: dict[tuple[int, int], int] = field(default_factory=dict)  # (dev, ino) -> our duplicate
    pidfd: int = -1
    # holds what `held` holds beyond podshim's death (shim/criu/uffd_guard.py); `guard_sock` our end
    guard: subprocess.Popen[bytes] | None = None
    guard_sock: socket.socket | None = None
    abandoned: bool = False  # podshim ended it (a failed RestorePod): no failure
    task: asyncio.Task[None] | None = None
    # the background checksum pass of its page images (plain archives): "" all match, else why not
    verify: asyncio.Future[str] | None = None
    verify_stop: threading.Event = field(default_factory=threading.Event)
    # set when the daemon has ended and been cleaned up: True when every page was delivered
    finished: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    complete: bool = False
    remote: bool = False  # its pages come from a page server (a migration), not the images
    source_failed: bool = False  # it stopped itself: its page server (another node) failed


class LazyPages:
    """Starts, supervises and recovers the lazy-pages daemons of this podshim."""

    def __init__(self, config: Config, upstream: Upstream, journal: Journal) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = journal
        self.live: dict[Path, Daemon] = {}
        self._recover_held: dict[str, list[int]] = {}  # op id -> userfaultfds held across retries
        self._by_op: dict[str, list[Daemon]] = {}  # a RestorePod's journal op id -> its daemons
        # a migration (shim/migration/destination.py): the images dir of a container whose pages
        # come from another node's page server -> the daemon's arguments naming it
        self.page_servers: dict[Path, list[str]] = {}

    # ------------------------------------------------------------------ start

    async def start_for(
        self, container_dir: Path, name: str, op: Any, decrypted: bool, pages: PageCheck | None = None
    ) -> Daemon:
        """RestorePod's call: a daemon for one planned container (its dir in the archive, or its
        decrypted copy when `decrypted`), owned by the restore's journal record `op` until attached.
        `pages`: the page images RestorePod did not checksum, hashed while the daemon serves."""
        rels = pages.rels if pages is not None else []
        d = await self.start(
            layout.ContainerLayout(root=container_dir, rel="").checkpoint_dir,
            name,
            op.pod_key,
            self.config.runtime.criu,
            container_dir if decrypted else None,
            op.op_id,
            verifying=len(rels),
        )
        if pages is not None and rels:
            paused = functools.partial(restore_pending, d.work)
            d.verify = in_thread(
                functools.partial(check_pages, paused=paused),
                pages,
                d.verify_stop,
                f"podshim-lazy-check-{name}",
            )
        return d

    def started(self, op_id: str, name: str) -> Daemon | None:
        """The daemon the RestorePod `op_id` started for its container `name`, if any."""
        return next((d for d in self._by_op.get(op_id, []) if d.name == name), None)

    async def start(
        self,
        images: Path,
        name: str,
        pod_key: str,
        criu: str,
        decrypted: Path | None,
        op_id: str = "",
        verifying: int = 0,
    ) -> Daemon:
        """Start a daemon serving `images` and wait until it listens; journaled before it runs, and
        owned by the RestorePod `op_id` (abandon_op ends it, even when this is cancelled).
        `verifying`: the page images its caller will checksum while it serves, journaled with its
        pid (one write: recovery's reason says their checksums were not known to match)."""
        root = contract.lazy_root(self.config.state_dir)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        work = root / secrets.token_hex(8)
        work.mkdir(mode=0o700)
        d = Daemon(name=name, work=work, images=images, decrypted=decrypted)
        d.rec = self.journal.begin(
            KIND,
            pod_key,
            LazyPagesRecord(
                container=name,
                work_dir=str(work),
                images=str(images),
                decrypted_dir=str(decrypted) if decrypted else "",
            ),
        )
        self.live[work] = d
        if op_id:
            self._by_op.setdefault(op_id, []).append(d)
        read_end, write_end = os.pipe()
        source = self.page_servers.get(images, [])
        d.remote = bool(source)
        try:
            guard, d.guard_sock = start_guard()  # before any userfaultfd exists
            d.guard = guard
            d.proc = subprocess.Popen(
                [
                    criu,
                    "lazy-pages",
                    "--images-dir",
                    str(images),
                    "--work-dir",
                    str(work),
                    "--status-fd",
                    str(write_end),
                    "-o",
                    LOG_NAME,
                    # info: the TLS session and where its time went (transfer_split); not each copy
                    "-v3",
                    *source,
                ],
                pass_fds=(write_end,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a podshim crash or stop leaves it serving (see recover)
            )
        except OSError as e:
            os.close(read_end)
            os.close(write_end)
            await self.abandon([d])
            raise errors.Internal(f"cannot start `criu lazy-pages` for container {name!r}: {e}") from None
        os.close(write_end)
        d.pid = d.proc.pid
        d.start_time = process_start_time(d.pid)
        with contextlib.suppress(OSError):
            d.pidfd = os.pidfd_open(d.pid)
        self.journal.update(
            d.rec,
            "serving",
            pid=d.pid,
            start_time=d.start_time,
            verifying=verifying,
            guard=guard.pid,
            guard_start_time=process_start_time(guard.pid),
        )
        ready = await wait_status(read_end, LAZY_READY_TIMEOUT)
        if ready != b"\0":
            detail = error_lines(work / LOG_NAME)
            await self.abandon([d])
            raise errors.Internal(
                f"the lazy-pages daemon of container {name!r} did not start serving {images}"
                f"{': ' + detail if detail else ''}"
            )
        log.info("lazy-pages daemon serving", container=name, pid=d.pid, work=str(work), images=str(images))
        return d

    def attach(self, d: Daemon, container_id: str) -> None:
        """The daemon's container exists: record it and supervise the daemon until it ends."""
        d.container_id = container_id
        self.journal.update(d.rec, "attached", container_id=container_id)
        d.task = asyncio.ensure_future(self._supervise(d))

    def forget_op(self, op_id: str) -> None:
        """The RestorePod ended: its daemons are supervised on their own."""
        self._by_op.pop(op_id, None)

    async def abandon_op(self, op_id: str) -> None:
        """A RestorePod failed, after its rollback: end its daemons and clean up after them."""
        await self.abandon(self._by_op.pop(op_id, []))

    async def abandon(self, daemons: list[Daemon]) -> None:
        """End `daemons` (a failed RestorePod) and clean up after them. A daemon whose container is
        still there (a rollback that failed) ends like a failed one: its container is killed."""
        for d in daemons:
            d.abandoned = True
            if d.proc is not None and d.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    d.proc.kill()
                await asyncio.to_thread(d.proc.wait)
            if d.task is None:
                self._release(d)
                await self._clean(d)

    # ------------------------------------------------------------------ supervision

    async def _supervise(self, d: Daemon) -> None:
        assert d.proc is not None
        waiter = exited(d.proc, d.pidfd)
        next_check = time.monotonic() + LAZY_CONTAINER_CHECK
        gone = bad = ""
        try:
            while not waiter.done():
                watched: set[asyncio.Future[Any]] = {waiter, *_pending(d.verify)}
                await asyncio.wait(watched, timeout=LAZY_POLL, return_when=asyncio.FIRST_COMPLETED)
                if waiter.done():
                    break
                self._hold_uffds(d)
                bad = _failed_check(d)
                if bad and not d.abandoned and not gone:
                    break
                if d.remote and stopped(d.pid) and not waiter.done():
                    # its page server failed: it holds the userfaultfds (and so do we) and waits
                    # to be killed; the container is killed first, by _ended
                    self._hold_uffds(d)
                    d.source_failed = True
                    with contextlib.suppress(ProcessLookupError):
                        d.proc.kill()
                    break
                if d.verify is not None and d.verify.done() and not bad and d.rec.data.verifying:
                    self.journal.update(d.rec, d.rec.phase, verifying=0)  # for recovery's reason
                if time.monotonic() >= next_check and not d.abandoned:
                    next_check = time.monotonic() + LAZY_CONTAINER_CHECK
                    gone = await self._container_gone(d.container_id)
                    if gone:
                        # a container removed (or never started and removed) needs no pages
                        with contextlib.suppress(ProcessLookupError):
                            d.proc.kill()
            if waiter.done() and waiter.result() == 0 and d.verify is not None and not gone:
                # every page delivered; the process runs on them once their checksums are known
                self._release(d)
                bad = await d.verify
            if bad and not d.abandoned and not gone:
                await self._checksum_failed(d, bad, waiter)
                return
            rc = await waiter
            await self._ended(d, rc, gone)
        except asyncio.CancelledError:
            raise  # podshim stops: the daemon and its record stay for the next start (recover)
        except Exception:  # noqa: BLE001 - logged; the record stays for recovery
            log.exception("supervising a lazy-pages daemon failed", container=d.container_id)

    def _hold_uffds(self, d: Daemon) -> None:
        """Duplicate every userfaultfd the daemon holds that podshim does not hold yet."""
        if d.pidfd < 0:
            return
        for fd in daemon_uffds(d.pid):
            try:
                st = os.stat(f"/proc/{d.pid}/fd/{fd}")
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in d.held:
                continue
            try:
                d.held[key] = pidfd_getfd(d.pidfd, fd)
            except OSError as e:
                log.warning("cannot hold a userfaultfd of the lazy-pages daemon", pid=d.pid, error=str(e))
                continue
            if d.guard_sock is not None:
                try:
                    guard_hold(d.guard_sock, d.held[key])
                except OSError as e:
                    log.warning("cannot hand a userfaultfd to the daemon's guard", pid=d.pid, error=str(e))

    async def _checksum_failed(self, d: Daemon, why: str, waiter: asyncio.Future[int]) -> None:
        """A page image differs from the manifest (or cannot be read): the container must not run on
        (or the daemon serve) memory that is not the checkpoint's. A created container is killed
        once it has started (stopping a created one is a no-op); one removed meanwhile needs
        nothing. The daemon is ended first: the faults it has not served stay blocked."""
        assert d.proc is not None
        reason = (
            f"lazy restore failed: {why}; the container was killed so that it never runs on memory "
            "that is not the checkpoint's (its page images are checksummed while it runs)"
        )
        running = waiter.done()  # every page delivered: the process runs
        if not running:
            self._hold_uffds(d)  # one received just now
            running = bool(d.held)  # the restore reached the daemon
            with contextlib.suppress(ProcessLookupError):
                d.proc.kill()
            await waiter
            # a restore not yet begun refuses with the reason instead of connecting to no daemon
            await asyncio.to_thread(_mark_failed, d.work, reason)
        if not await self._wait_started(d, running):
            log.warning(
                "lazy restore: page checksum failed; container already removed", container=d.container_id
            )
            self._release(d)
            await self._clean(d)
            return
        await self.fail(d.container_id, reason, "checksum", d)

    async def _wait_started(self, d: Daemon, running: bool) -> bool:
        """Until the container is no longer created (False: it was removed). `running`: its
        restore had reached the daemon, so it is looked at every LAZY_STARTED_POLL; else (no
        restore can start any more: LAZY_PAGES_FAILED) less and less often."""
        delay = LAZY_STARTED_POLL
        while True:
            try:
                st = await self.upstream.container_status(d.container_id)
            except errors.ShimError as e:
                if is_not_found(e):
                    return False
            else:
                if st.status.state != cri.CONTAINER_CREATED:
                    return True
            await asyncio.sleep(delay)
            if not running:
                delay = min(delay * 2, LAZY_CONTAINER_CHECK)

    def _release(self, d: Daemon) -> None:
        for fd in d.held.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        d.held.clear()
        if d.guard_sock is not None:
            guard_release(d.guard_sock)
            d.guard_sock = None
        if d.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(d.pidfd)
            d.pidfd = -1

    async def _container_gone(self, container_id: str) -> str:
        """Why the container needs no more pages ("" while it may): removed, or exited."""
        try:
            st = await self.upstream.container_status(container_id)
        except errors.ShimError as e:
            return "the container was removed" if is_not_found(e) else ""
        if st.status.state == cri.CONTAINER_EXITED:
            return "the container exited"
        return ""

    async def _ended(self, d: Daemon, rc: int, gone: str) -> None:
        seconds = round(time.monotonic() - d.started, 3)
        if rc == 0:
            d.complete = True
            log.info(
                "lazy restore complete",
                container=d.container_id,
                name=d.name,
                pid=d.pid,
                seconds=seconds,
                # where the daemon's time went (docs/design/migration.md (Live migration))
                transfer=transfer_split(d.work / LOG_NAME),
            )
        elif gone or await self._container_gone(d.container_id):
            log.info(
                "lazy-pages daemon ended with its container",
                container=d.container_id,
                reason=gone or "the container had ended",
                exit=rc,
            )
        else:
            if d.abandoned:  # a RestorePod that failed and whose rollback left this container
                await self._kill(d.container_id, retry=True)
                self._release(d)
                await self._clean(d)
                return
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            if d.source_failed:
                how = "lost its page server (the source node of the migration, or the link to it)"
            detail = error_lines(d.work / LOG_NAME)
            kept = await asyncio.to_thread(
                _keep_log, d.work / LOG_NAME, self.config.state_dir, d.container_id
            )
            reason = (
                f"lazy restore failed: the lazy-pages daemon (pid {d.pid}) {how} before every page of "
                f"the memory was delivered{' (' + detail + ')' if detail else ''}; the container was "
                f"killed so that it never runs with missing memory (daemon log: {kept})"
            )
            label = "source" if d.source_failed else "killed" if rc < 0 else "exit"
            await self.fail(d.container_id, reason, label, d)
            return  # fail() releases and cleans up (or keeps the record for a retry)
        self._release(d)
        await self._clean(d)

    async def fail(self, container_id: str, reason: str, label: str, d: Daemon | None = None) -> None:
        """Kill the container of a lazy restore that cannot complete and say why (podshim's log, the
        container's log, the metric). The held userfaultfds are closed only once it is dead: until
        then its faults stay blocked, never zero-filled."""
        log.error("lazy restore failed; killing the container", container=container_id, reason=reason)
        metrics.lazy_restore_failures.labels(label).inc()
        noted = await self._note_in_container_log(container_id, reason)
        await self._kill(container_id, retry=d is not None)
        if not noted:  # the upstream did not answer before: it does now (the kill went through)
            await self._note_in_container_log(container_id, reason)
        if d is not None:
            self._release(d)
            await self._clean(d)

    async def _kill(self, container_id: str, retry: bool) -> None:
        """StopContainer with no grace period (SIGKILL; a fault blocked on a held userfaultfd is
        killable). `retry`: keep trying while the upstream does not answer; else raise."""
        delay = 0.5
        while True:
            try:
                await self.upstream.stop_container(container_id, 0, doing=f"killing container {container_id}")
                return
            except errors.ShimError as e:
                if is_not_found(e):
                    return
                log.error(
                    "cannot kill the container of a failed lazy restore; its memory faults stay blocked",
                    container=container_id,
                    error=e.message,
                )
                if not retry:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _note_in_container_log(self, container_id: str, reason: str) -> bool:
        """A line in the container's CRI log (`crictl logs` shows it) naming the reason; False when
        the upstream did not say where that log is."""
        try:
            st = await self.upstream.container_status(container_id)
        except errors.ShimError as e:
            return is_not_found(e)  # a container gone has no log to tell
        path = st.status.log_path
        if not path:
            return True
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}Z"
        line = f"{ts} stderr F podshim: {reason}\n".encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return True
        try:
            os.write(fd, line)
        except OSError:
            pass
        finally:
            os.close(fd)
        return True

    async def _clean(self, d: Daemon) -> None:
        """After the daemon ended: its work dir (its log kept in <state_dir>/logs on failure, see
        _keep_log), the decrypted copy it served, its journal record."""
        self.live.pop(d.work, None)
        if d.guard is not None:  # released (_release) once nothing needs it: it exits at once
            if d.guard_sock is not None:
                guard_release(d.guard_sock)
                d.guard_sock = None
            await asyncio.to_thread(_reap, d.guard)
        if d.verify is not None:  # the checksum pass stops at its next read
            d.verify_stop.set()
            await asyncio.wait({d.verify})
        await asyncio.to_thread(_remove_dirs, d.work, d.decrypted)
        if d.rec is not None:
            self.journal.finish(d.rec)
        if not d.finished.done():
            d.finished.set_result(d.complete)

    # ------------------------------------------------------------------ recovery

    async def recover(self, rec: Any) -> None:
        """A daemon a previous podshim started and did not see end (docs/design/restore-pod.md
        (Lazy restore)): its exit status cannot be known any more, so its container is killed (with the
        userfaultfds held meanwhile by its guard, and by podshim from the guard and an alive daemon,
        so that no fault reads a zero page), then the daemon and the guard are ended; a container
        already gone only leaves files to remove. Raises (the record
        stays and is retried) while the container cannot be killed; the duplicates stay held."""
        data: LazyPagesRecord = rec.data
        pid = data.pid
        alive = pid > 0 and process_start_time(pid) == data.start_time
        work = data.work_dir
        if not alive and work:  # a crash before its pid was journaled: found by its work dir
            pid = daemon_serving(work) or pid
            alive = pid > 0 and process_start_time(pid) > 0 and daemon_serving(work) == pid
        held = self._recover_held.setdefault(rec.op_id, [])
        pidfd = _hold_from(pid, held) if alive else -1
        # the guard holds them too, and for certain: the daemon may have died with podshim
        guard = (
            data.guard if data.guard > 0 and process_start_time(data.guard) == data.guard_start_time else 0
        )
        guard_fd = _hold_from(guard, held) if guard else -1
        cid = data.container_id
        try:
            if cid and not await self._container_gone(cid):
                why = "was still serving" if alive else "had ended"
                checking = ", its page images' checksums not known to match" if data.verifying else ""
                reason = (
                    f"lazy restore interrupted: podshim restarted while the lazy-pages daemon (pid {pid}) "
                    f"of this container was serving, and the daemon {why} with no known result{checking}; "
                    "the container was killed so that it never runs with missing memory"
                )
                await self.fail(cid, reason, "podshim-restart")
            for fd in (pidfd, guard_fd):  # the container is dead: the daemon, then its guard
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            for fd in (pidfd, guard_fd):
                if fd >= 0:
                    os.close(fd)
        for fd in self._recover_held.pop(rec.op_id, []):
            with contextlib.suppress(OSError):
                os.close(fd)
        decrypted = data.decrypted_dir
        await asyncio.to_thread(
            _remove_dirs, Path(work) if work else None, Path(decrypted) if decrypted else None
        )
        log.warning("lazy-pages daemon of a previous podshim handled", container=cid, pid=pid, alive=alive)


def _hold_from(pid: int, held: list[int]) -> int:
    """Duplicates of the userfaultfds `pid` holds, appended to `held`; its pidfd (-1: it is gone)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return -1
    for fd in daemon_uffds(pid):
        with contextlib.suppress(OSError):
            held.append(pidfd_getfd(pidfd, fd))
    return pidfd


def _pending(fut: asyncio.Future[str] | None) -> set[asyncio.Future[str]]:
    return {fut} if fut is not None and not fut.done() else set()


def _failed_check(d: Daemon) -> str:
    """The background checksum pass's reason when it has ended with one, else ""."""
    if d.verify is None or not d.verify.done() or d.verify.cancelled():
        return ""
    return d.verify.result()


def _keep_log(log_path: Path, state_dir: str, container_id: str) -> str:
    """Copy a failed daemon's log out of its work dir (removed next) into <state_dir>/logs (0600)."""
    try:
        return str(kept_logs.keep(log_path.read_bytes(), state_dir, f"lazy-pages-{container_id}.log"))
    except OSError:
        return str(log_path)


def _mark_failed(work: Path, reason: str) -> None:
    """In the work dir of an ended daemon: the reason (LAZY_PAGES_FAILED, which podshim-runc reports)
    in place of the socket, so that a restore starting now fails with it."""
    with contextlib.suppress(OSError):
        fd = os.open(
            work / contract.LAZY_PAGES_FAILED, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600
        )
        try:
            os.write(fd, reason.encode())
        finally:
            os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(work / contract.LAZY_PAGES_SOCKET)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a released guard; one that does not exit holds nothing podshim needs: killed."""
    try:
        proc.wait(timeout=GUARD_EXIT_WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _remove_dirs(work: Path | None, decrypted: Path | None) -> None:
    if work is not None and work.parent.name == contract.LAZY_DIR:
        shutil.rmtree(work, ignore_errors=True)
    if decrypted is not None and decrypted.exists():
        crypto.remove_decrypted(decrypted)
