"""Writeback started from the first MiB: `sync_file_range(SYNC_FILE_RANGE_WRITE)` on what podshim
writes (a pulled file) or has written for it (CRIU's page images) as the bytes arrive, so the disk
works beside the writer and the final fsync finds little left; the same thread can hash the page
images as they grow (`hash_pages`). A failure here only loses the head start: the fsync is what
makes the data durable (docs/design/checkpoint-pod.md (The freeze window),
docs/design/distribution.md (Checkpoints through a registry))."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shim.archive.dirfd import DirHandle
from shim.archive.fsutil import BACKGROUND_NICE, CHUNK_SIZE, FileDigest, lower_thread_priority

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the dirty pages, do not wait for it
STEP = 8 << 20  # start the writeback of every 8 MiB: requests big enough to stream, started early
POLL_INTERVAL = 0.05  # seconds between looks at the image files CRIU is writing
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
HASH_SLICE = 64 << 20  # at most this much of one file hashed per look: every file's writeback goes on
PAGE_IMAGE = re.compile(r"pages-[0-9]+\.img")  # CRIU's page images: written once, front to back

_libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL for the call
_sync_file_range = _libc.sync_file_range
_sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
_sync_file_range.restype = ctypes.c_int


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Queue the dirty pages of `fd` in [offset, offset + nbytes) for writeback without waiting
    for them; False when the file (a pipe, a file system without it) cannot: stop asking then."""
    if _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) == 0:
        return True
    ctypes.get_errno()  # ESPIPE, EINVAL, EBADF: no head start for this file, nothing else is lost
    return False


class Ahead:
    """One file written front to back through `fd`: the writeback of each `step` bytes is started
    as soon as they are written. After each write: `wrote(n)` (n bytes more), or `written(end)`
    (the file holds `end` bytes now)."""

    def __init__(self, fd: int, step: int = STEP) -> None:
        self.fd = fd
        self.step = step
        self.end = 0  # bytes written so far
        self.started = 0  # writeback started for [0, started)
        self.enabled = True

    def wrote(self, nbytes: int) -> None:
        self.written(self.end + nbytes)

    def written(self, end: int) -> None:
        self.end = end
        if self.enabled and end - self.started >= self.step:
            upto = end - end % self.step
            self.enabled = start_writeback(self.fd, self.started, upto - self.started)
            self.started = upto


@dataclass(frozen=True)
class DirtyState:
    """The kernel's dirty-page counters and thresholds, in bytes (/proc/vmstat)."""

    dirty: int
    writeback: int
    background: int  # the kernel starts writing back above this
    threshold: int  # writers are blocked above this

    @property
    def throttle_point(self) -> int:
        """Where balance_dirty_pages starts throttling writers: half-way between the two
        thresholds (its "freerun ceiling")."""
        return (self.background + self.threshold) // 2


def dirty_state(vmstat: Path = Path("/proc/vmstat")) -> DirtyState | None:
    """The counters now; None when they cannot be read (no /proc, an unknown kernel)."""
    keys = {"nr_dirty", "nr_writeback", "nr_dirty_background_threshold", "nr_dirty_threshold"}
    values: dict[str, int] = {}
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in keys:
                values[name] = int(value)
    except (OSError, ValueError):
        return None
    if values.keys() != keys:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    return DirtyState(
        dirty=values["nr_dirty"] * page,
        writeback=values["nr_writeback"] * page,
        background=values["nr_dirty_background_threshold"] * page,
        threshold=values["nr_dirty_threshold"] * page,
    )


def would_be_throttled(nbytes: int, state: DirtyState | None) -> bool:
    """Would writing `nbytes` more into the page cache, faster than the disk takes them, push the
    dirty + writeback pages past the kernel's throttle point? Unknown counters: no."""
    if state is None:
        return False
    return state.dirty + state.writeback + nbytes > state.throttle_point


class _Followed:
    """One growing file: its writeback (`ahead`) and, for a page image being hashed, the sha256 of
    its first `hashed` bytes."""

    def __init__(self, fd: int, step: int, hash_it: bool) -> None:
        self.fd = fd
        self.ahead = Ahead(fd, step)
        self.sha = hashlib.sha256() if hash_it else None
        self.hashed = 0

    def hash_upto(self, end: int, buf: bytearray, limit: int, abandon: threading.Event) -> None:
        """Hash the bytes in [hashed, end), at most `limit` of them; `abandon` set: stop at the
        next chunk."""
        assert self.sha is not None
        view = memoryview(buf)
        stop = min(end, self.hashed + limit)
        while self.hashed < stop and not abandon.is_set():
            n = os.preadv(self.fd, [view[: stop - self.hashed]], self.hashed)
            if n == 0:
                return
            self.sha.update(view[:n])  # hashlib releases the GIL for large buffers
            self.hashed += n


class ImagesWriteback:
    """The files a dump is writing into `dirs` (CRIU's images), followed as they grow by one
    thread that looks at them every `interval` seconds: with `writeback`, the writeback of every
    `step` bytes appended since is started; with `hash_pages`, the page images are hashed as far
    as they are written (at BACKGROUND_NICE). Files are opened read-only through the held
    directories (no path is followed), once they hold `step` bytes (the small images are left to
    the archive phase). The thread takes a last look and closes them once told to stop:
    `stop_soon()` tells it, `digests()` waits for it and returns the page images' sha256,
    `stop()` abandons the hashing (a failed or cancelled checkpoint) and waits."""

    def __init__(
        self,
        dirs: Sequence[DirHandle],
        interval: float = POLL_INTERVAL,
        step: int = STEP,
        *,
        writeback: bool = True,
        hash_pages: bool = False,
    ) -> None:
        self.dirs = list(dirs)
        self.interval = interval
        self.step = step
        self.writeback = writeback
        self.hash_pages = hash_pages
        self.files: dict[tuple[int, str], _Followed] = {}
        self.started_bytes = 0  # writeback started for this many bytes in all
        self.hashed: dict[tuple[int, int], FileDigest] = {}  # (st_dev, st_ino): filled by the last look
        self._buf = bytearray(CHUNK_SIZE) if hash_pages else bytearray()
        self._stop = threading.Event()
        self._abandon = threading.Event()  # set: no more hashing, no digest recorded
        self._thread = threading.Thread(target=self._run, name="podshim-writeback", daemon=True)

    def start(self) -> ImagesWriteback:
        self._thread.start()
        return self

    def stop_soon(self) -> None:
        """Tell the thread to end without waiting for it: its last look (the writeback of what
        was appended since the one before) may wait for the disk's queue, and the pod must not
        wait for that while frozen (docs/design/checkpoint-pod.md (The freeze window))."""
        self._stop.set()

    def stop(self) -> None:
        """End the thread and wait for it: it has started the writeback of what was appended
        since its last look (the dumps have ended) and closed the files. Hashing still going is
        abandoned: digests() (the archive's) was not called or is over."""
        self._abandon.set()
        self._end(None)

    def digests(self, stop: threading.Event | None = None) -> dict[tuple[int, int], FileDigest]:
        """End the thread as stop() does, but after it has hashed the page images to their ends,
        and return their sha256 by each file's (st_dev, st_ino). `stop` set (the caller was
        cancelled): the hashing is abandoned and no digest is returned."""
        self._end(stop)
        return {} if self._abandon.is_set() else dict(self.hashed)

    def _end(self, stop: threading.Event | None) -> None:
        self._stop.set()
        if self._thread.ident is None:  # never started: the last look is the caller's
            self._finish()
        while True:
            if stop is not None and stop.is_set():
                self._abandon.set()
            if not self._thread.is_alive():
                return
            self._thread.join(self.interval)

    def _run(self) -> None:
        try:
            if self.hash_pages:
                lower_thread_priority(BACKGROUND_NICE)
            behind = False
            while not self._stop.wait(0 if behind else self.interval):
                behind = self.poll()  # hashing behind the writer: look again at once
        finally:
            self._finish()

    def _finish(self) -> None:
        """The last look (every page image hashed to its end), then the files closed."""
        try:
            self.poll(last=True)
            for f in self.files.values():
                if f.sha is not None and not self._abandon.is_set():
                    st = os.fstat(f.fd)
                    if f.hashed == st.st_size:
                        self.hashed[(st.st_dev, st.st_ino)] = FileDigest(
                            f.hashed, f.sha.hexdigest(), st.st_mtime_ns
                        )
        except OSError:
            self.hashed.clear()  # no digest taken ahead: the archive phase hashes every file
        finally:
            for f in self.files.values():
                os.close(f.fd)
            self.files.clear()

    def poll(self, last: bool = False) -> bool:
        """One look at every file: writeback started for what was appended since the last one, the
        page images hashed on (by at most HASH_SLICE each, to their ends at the `last` look).
        True when a page image is left with bytes not hashed yet."""
        behind = False
        for i, d in enumerate(self.dirs):
            try:
                with os.scandir(d.fd) as it:
                    sizes = [(e.name, e.stat(follow_symlinks=False)) for e in it]
            except OSError:
                continue  # the directory is being cleared (a failed dump): nothing to flush
            for name, st in sizes:
                f = self.files.get((i, name))
                if f is None:
                    if not stat.S_ISREG(st.st_mode) or st.st_size < self.step:
                        continue
                    try:
                        fd = os.open(name, READ_FLAGS, dir_fd=d.fd)
                    except OSError:
                        continue  # gone already
                    hash_it = self.hash_pages and PAGE_IMAGE.fullmatch(name) is not None
                    f = self.files[(i, name)] = _Followed(fd, self.step, hash_it)
                try:
                    end = os.fstat(f.fd).st_size
                    if self.writeback:
                        before = f.ahead.started
                        f.ahead.written(end)
                        self.started_bytes += f.ahead.started - before
                    if f.sha is not None:
                        f.hash_upto(end, self._buf, end if last else HASH_SLICE, self._abandon)
                        behind = behind or f.hashed < end
                except OSError:
                    continue
        return behind
