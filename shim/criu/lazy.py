"""`criu lazy-pages`, the mechanisms (docs/design/restore-pod.md (Lazy restore)): whether a runtime
restores lazily, the daemon as a process (its start time, its status fd, its exit through a pidfd,
the userfaultfds it holds and their duplicates, the guard process that holds them beyond podshim),
and the background check of the page images it serves against the manifest. The daemons'
lifecycle (start, supervision, journal, recovery) is shim/ops/lazy_pages.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import fnmatch
import functools
import hashlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim import errors
from shim.archive import layout, manifest
from shim.criu import uffd_guard
from shim.deadlines import LAZY_CHECK_PAUSE_SECONDS, VERSION_TIMEOUT

_SYS_PIDFD_GETFD = 438  # the same number on x86_64 and arm64 (the generic table)
UFFD_LINK = "anon_inode:[userfaultfd]"
PAGE_IMAGES = "pages-*.img"  # CRIU's memory contents: what is checksummed while the daemon serves
CHECK_READ = 8 << 20  # the background checksum pass's read size
# its thread's nice value: on a busy node the restore path (containerd, runc, CRIU, the process's
# first faults) goes first; the pass takes the CPU they leave (docs/design/restore-pod.md (Lazy restore))
CHECK_NICE = 10


@functools.lru_cache(maxsize=8)
def runtime_supports(binary: str) -> bool:
    """Whether the OCI runtime's `restore` has `--lazy-pages` (runc has; crun 1.21 has not)."""
    try:
        out = subprocess.run(
            [binary, "restore", "--help"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--lazy-pages" in out.stdout + out.stderr


def check_runtime(binary: str, handler: str) -> None:
    """FAILED_PRECONDITION unless the handler's runtime can restore lazily."""
    if not runtime_supports(binary):
        raise errors.FailedPrecondition(
            f"option lazy-pages=true: the runtime of handler {handler or 'runc'!r} ({binary}) has no "
            "lazy restore (its `restore` lacks --lazy-pages); restore without lazy-pages, or with runc"
        )


def pidfd_getfd(pidfd: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(got)


def start_guard() -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A uffd guard (shim/criu/uffd_guard.py) in a session of its own, and podshim's end of the
    socket it reads: the only one, so that it sees podshim's death as the socket's end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", uffd_guard.__name__],
            stdin=theirs.fileno(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a podshim crash or stop leaves it holding
        )
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


def guard_hold(sock: socket.socket, fd: int) -> None:
    """Hand the guard a duplicate of `fd` (a userfaultfd); once sent, the socket holds it even if
    podshim dies before the guard has read it."""
    socket.send_fds(sock, [uffd_guard.FD], [fd])


def guard_release(sock: socket.socket) -> None:
    """The guard closes what it holds and exits."""
    with contextlib.suppress(OSError):
        sock.send(uffd_guard.RELEASE)
    sock.close()


def daemon_uffds(pid: int) -> list[int]:
    """The descriptor numbers of the userfaultfds `pid` holds."""
    out: list[int] = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for n in names:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{n}") == UFFD_LINK:
                out.append(int(n))
    return out


def page_images(m: manifest.Manifest, container_rel: str) -> list[str]:
    """The archive members holding one container's memory contents (CRIU's pages-*.img in its
    checkpoint/ dir): what a lazy restore checksums in the background instead of before."""
    prefix = f"{container_rel}/{layout.CHECKPOINT_DIR}/"
    return sorted(
        rel
        for rel in m.files
        if rel.startswith(prefix) and fnmatch.fnmatchcase(rel[len(prefix) :], PAGE_IMAGES)
    )


@dataclass(frozen=True)
class PageCheck:
    """What a daemon's background checksum pass reads: `rels` under `root`, against the manifest."""

    root: Path
    manifest: manifest.Manifest
    rels: list[str]


def restore_pending(work: Path) -> bool:
    """Whether the container served from `work` has not been restored yet: CRIU has not written its
    stats-restore there (at its end, once the process runs). Until then the restore path (the new
    sandbox, CreateContainer, podshim-runc's start, CRIU) runs, and the checksum pass waits."""
    return not (work / "stats-restore").exists()


def check_pages(check: PageCheck, stop: threading.Event, paused: Any = None) -> str:
    """Hash each page image (largest first, CHECK_READ reads, one descriptor, no symlink followed)
    and compare it with the manifest: "" when all match (or `stop` was set), else why not, naming
    the file. Runs in a thread of its own beside the daemon; while `paused()` (the container is not
    restored yet: its restore path goes first) it reads nothing, up to LAZY_CHECK_PAUSE_SECONDS in all."""
    expected = check.manifest.files
    buf = bytearray(CHECK_READ)
    view = memoryview(buf)
    pause_end = 0.0
    for rel in sorted(check.rels, key=lambda r: (-expected[r].size, r)):
        h = hashlib.sha256()
        size = 0
        try:
            fd = os.open(check.root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while True:
                    while paused is not None and paused() and not stop.is_set():
                        now = time.monotonic()
                        pause_end = pause_end or now + LAZY_CHECK_PAUSE_SECONDS
                        if now >= pause_end:
                            break
                        time.sleep(0.01)
                    if stop.is_set():
                        return ""
                    n = os.readv(fd, [buf])
                    if not n:
                        break
                    h.update(view[:n])  # hashlib releases the GIL for large buffers
                    size += n
            finally:
                os.close(fd)
        except OSError as e:
            return f"cannot read {rel} to verify its checksum ({e.strerror or e})"
        digest = h.hexdigest()
        if size != expected[rel].size or digest != expected[rel].sha256:
            return (
                f"checksum mismatch in {rel} of {check.root} ({size} bytes with sha256 {digest}, the "
                f"manifest says {expected[rel].size} bytes with sha256 {expected[rel].sha256})"
            )
    return ""


def error_lines(path: Path, limit: int = 3) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    bad = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
    return "; ".join(bad[-limit:])


# The daemon's account of its page transfer (CRIU patches 0014, 0015; docs/design/migration.md (Live
# migration)), once per thread at its end: "uffd: page transfer time split: pages=N wall=S wait=S ..."
# (the thread that receives) and "uffd: copier time split: copy=S idle=S ..." (the copier).
_SPLIT_RE = re.compile(rb"uffd: (page transfer|copier) time split: ([^\n]*)")
_SPLIT_TAIL = 64 << 10  # the lines are among the log's last


def transfer_split(path: Path) -> dict[str, float]:
    """Where the daemon's time went, from its log: the receiving thread's figures as they are
    (pages, wall, wait, recv, sock, copy, copies, other, cpu, runnable: seconds but the counts),
    the copier's prefixed "copier_"; {} when the log has none (a CRIU without the patches)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _SPLIT_TAIL))
            tail = f.read()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for who, fields in _SPLIT_RE.findall(tail):
        prefix = "copier_" if who == b"copier" else ""
        for item in fields.split():
            key, _, value = item.decode(errors="replace").partition("=")
            with contextlib.suppress(ValueError):
                out[prefix + key] = float(value)
    return out


def in_thread(fn: Any, check: PageCheck, stop: threading.Event, name: str) -> asyncio.Future[str]:
    """`fn(check, stop)` in a thread of its own (the default executor is not held for seconds);
    a future of its answer, an unexpected error turned into a reason."""
    cf: concurrent.futures.Future[str] = concurrent.futures.Future()

    def run() -> None:
        with contextlib.suppress(OSError):  # Linux: a thread's own nice value
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CHECK_NICE)
        try:
            cf.set_result(fn(check, stop))
        except Exception as e:  # noqa: BLE001 - a check that cannot finish is a failed one
            cf.set_result(f"checking the page images failed: {e}")

    threading.Thread(target=run, name=name, daemon=True).start()
    return asyncio.wrap_future(cf)


async def wait_status(fd: int, timeout: float) -> bytes:
    """The first byte a CRIU writes to its status fd (`\0`: ready), b"" at EOF (it died) or after
    `timeout`; woken by the event loop (no thread). `fd` is closed."""
    try:
        return await asyncio.wait_for(_read_status(fd), timeout)
    except TimeoutError:
        return b""
    finally:
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)


def _read_status(fd: int) -> asyncio.Future[bytes]:
    """A future of the first byte the daemon writes to its status fd (b"" at EOF: it died), set by
    the event loop when `fd` turns readable; the caller removes the reader."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bytes] = loop.create_future()

    def readable() -> None:
        loop.remove_reader(fd)
        if not fut.done():
            try:
                fut.set_result(os.read(fd, 1))
            except OSError:
                fut.set_result(b"")

    loop.add_reader(fd, readable)
    return fut


def exited(proc: subprocess.Popen[bytes], pidfd: int) -> asyncio.Future[int]:
    """A future of `proc`'s exit status (negative: the signal), set when its pidfd turns readable."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()

    def done() -> None:
        rc = proc.poll()
        if rc is None:
            return  # not yet reaped (a spurious wake-up)
        loop.remove_reader(pidfd)
        if not fut.done():
            fut.set_result(rc)

    if pidfd < 0:  # no pidfd: a thread waits instead
        return asyncio.ensure_future(asyncio.to_thread(proc.wait))
    loop.add_reader(pidfd, done)
    done()
    return fut


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped (state T): a daemon whose page server failed stops itself, its
    userfaultfds kept open, until it is killed (CRIU patch 0005)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def daemon_serving(work: str) -> int:
    """The pid of a `criu lazy-pages` serving from the work dir `work`, 0 if none."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lazy-pages" in argv and os.fsencode(work) in argv:
            return int(entry)
    return 0
