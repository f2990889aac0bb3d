"""Writeback started from the first MiB (shim/archive/writeback.py): which byte ranges are handed
to sync_file_range and when, the kernel's dirty counters read and compared, the page images of a
dump followed as they grow through the held directories, and their sha256 taken as they grow
(used by the archive only while it holds). The kernel's side (the pages going to
disk) is measured by bench/freeze_profile.py, not asserted here."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from shim.archive import fsutil, writeback
from shim.archive.dirfd import DirHandle

MIB = 1 << 20


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every start_writeback as (file name, offset, bytes); the real call still runs."""
    seen: list[tuple[str, int, int]] = []
    real = writeback.start_writeback

    def record(fd: int, offset: int, nbytes: int) -> bool:
        seen.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(writeback, "start_writeback", record)
    return seen


def test_start_writeback_on_a_file_not_on_a_pipe(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    r, w = os.pipe()
    try:
        os.write(fd, b"x" * MIB)
        assert writeback.start_writeback(fd, 0, MIB)
        assert not writeback.start_writeback(r, 0, MIB)  # ESPIPE: no head start, no exception
    finally:
        for x in (fd, r, w):
            os.close(x)


def test_ahead_starts_each_step_once_then_gives_up_on_a_refusal(
    tmp_path: Path, calls: list[tuple[str, int, int]]
) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        ahead = writeback.Ahead(fd, step=4 * MIB)
        for n in (3 * MIB, 2 * MIB, 3 * MIB + 5, 4 * MIB):  # 3, 5, 8+5, 12+5 MiB written
            os.write(fd, b"y" * n)
            ahead.wrote(n)
        # whole steps only, each range once, in order: [0, 4), [4, 8), [8, 12) MiB
        assert calls == [("f", 0, 4 * MIB), ("f", 4 * MIB, 4 * MIB), ("f", 8 * MIB, 4 * MIB)]
        assert (ahead.end, ahead.started) == (12 * MIB + 5, 12 * MIB)
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        pipe = writeback.Ahead(r, step=MIB)
        pipe.written(2 * MIB)  # refused (a pipe): never asked again
        pipe.written(5 * MIB)
        assert not pipe.enabled and [c for c in calls if c[0].startswith("pipe:")] == [
            (os.path.basename(os.readlink(f"/proc/self/fd/{r}")), 0, 2 * MIB)
        ]
    finally:
        os.close(r)
        os.close(w)


def test_dirty_state_and_the_throttle_point(tmp_path: Path) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    vmstat = tmp_path / "vmstat"
    vmstat.write_text(
        "nr_free_pages 1000\nnr_dirty 100\nnr_writeback 50\n"
        "nr_dirty_threshold 4000\nnr_dirty_background_threshold 2000\nnr_written 7\n"
    )
    state = writeback.dirty_state(vmstat)
    assert state == writeback.DirtyState(100 * page, 50 * page, 2000 * page, 4000 * page)
    assert state.throttle_point == 3000 * page  # half-way between the two thresholds
    # 150 pages there already: the dumps may add up to 2850 pages before the kernel throttles
    assert not writeback.would_be_throttled(2850 * page, state)
    assert writeback.would_be_throttled(2851 * page, state)
    assert not writeback.would_be_throttled(1 << 40, None)  # counters unknown: leave it to the kernel
    # this kernel's own counters are there and consistent
    real = writeback.dirty_state()
    assert real is not None and 0 < real.background < real.threshold
    vmstat.write_text("nr_dirty 1\nnr_writeback 2\n")  # a kernel without the thresholds
    assert writeback.dirty_state(vmstat) is None
    assert writeback.dirty_state(tmp_path / "missing") is None


def test_images_followed_as_they_grow(tmp_path: Path, calls: list[tuple[str, int, int]]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    outside = tmp_path / "outside.img"
    outside.write_bytes(b"o" * 3 * MIB)
    (a / "link.img").symlink_to(outside)  # never followed
    (a / "small.img").write_bytes(b"s" * 100)  # under one step: never opened
    dirs = [DirHandle.open(a), DirHandle.open(b)]
    try:
        images = writeback.ImagesWriteback(dirs, interval=3600, step=MIB)  # polled by hand here
        with open(a / "pages-1.img", "wb") as pa, open(b / "pages-1.img", "wb") as pb:
            pa.write(b"a" * (2 * MIB + 10))
            pa.flush()
            images.poll()
            pb.write(b"b" * 3 * MIB)
            pa.write(b"a" * MIB)
            pa.flush()
            pb.flush()
            images.poll()
            fds = [x.fd for x in images.files.values()]
            pb.write(b"b" * MIB)  # appended after the last look: started by stop()
            pb.flush()
            images.stop()
        assert calls == [
            ("pages-1.img", 0, 2 * MIB),
            ("pages-1.img", 2 * MIB, MIB),
            ("pages-1.img", 0, 3 * MIB),
            ("pages-1.img", 3 * MIB, MIB),
        ]
        assert images.started_bytes == 7 * MIB and images.files == {}
        for fd in fds:  # stop() closed what it opened
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        for d in dirs:
            d.close()


def test_the_thread_starts_and_stops(tmp_path: Path, calls: list[tuple[str, int, int]]) -> None:
    (tmp_path / "pages-1.img").write_bytes(b"p" * 2 * MIB)
    with DirHandle.open(tmp_path) as d:
        images = writeback.ImagesWriteback([d], interval=0.01, step=MIB).start()
        images.stop()
    assert images.started_bytes == 2 * MIB
    assert calls == [("pages-1.img", 0, 2 * MIB)]  # once, by the thread or by stop()


def test_stop_soon_does_not_wait_for_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the pod is thawed while the thread's last writeback request still waits for the disk's
    # queue (docs/design/checkpoint-pod.md (The freeze window)); stop() after the thaw waits for it
    entered, release = threading.Event(), threading.Event()

    def stuck(fd: int, offset: int, nbytes: int) -> bool:
        entered.set()
        release.wait(30)
        return True

    monkeypatch.setattr(writeback, "start_writeback", stuck)
    (tmp_path / "pages-1.img").write_bytes(b"p" * 2 * MIB)
    with DirHandle.open(tmp_path) as d:
        images = writeback.ImagesWriteback([d], interval=0.01, step=MIB).start()
        assert entered.wait(10)
        begin = time.monotonic()
        images.stop_soon()
        assert time.monotonic() - begin < 0.5
        assert images.files  # still open: the thread is in its request
        release.set()
        images.stop()
        assert images.files == {} and images.started_bytes == 2 * MIB


def test_page_images_hashed_as_they_grow(tmp_path: Path) -> None:
    # CRIU's page images hashed by the follower while the dump writes them (a core the dumps left
    # idle): the digest is the whole file's, keyed by its inode; other images are left alone
    with DirHandle.open(tmp_path) as d:
        images = writeback.ImagesWriteback([d], interval=3600, step=MIB, writeback=False, hash_pages=True)
        with open(tmp_path / "pages-1.img", "wb") as pages, open(tmp_path / "core-1.img", "wb") as core:
            pages.write(os.urandom(3 * MIB + 5))
            core.write(os.urandom(2 * MIB))
            pages.flush()
            core.flush()
            images.poll()
            pages.write(os.urandom(MIB))  # appended after the last look: hashed by the last one
            pages.flush()
        got = images.digests()
    st = (tmp_path / "pages-1.img").stat()
    assert got == {
        (st.st_dev, st.st_ino): fsutil.FileDigest(
            st.st_size, hashlib.sha256((tmp_path / "pages-1.img").read_bytes()).hexdigest(), st.st_mtime_ns
        )
    }
    assert images.files == {}


def test_hashing_ahead_is_abandoned_when_the_checkpoint_is(tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(os.urandom(4 * MIB))
    cancelled = threading.Event()
    cancelled.set()
    with DirHandle.open(tmp_path) as d:
        # the caller was cancelled: no digest, whatever the thread had hashed
        images = writeback.ImagesWriteback([d], interval=0.01, step=MIB, writeback=False, hash_pages=True)
        assert images.start().digests(cancelled) == {}
        # a failed checkpoint's stop(): the hashing is abandoned too
        images = writeback.ImagesWriteback([d], interval=0.01, step=MIB, writeback=False, hash_pages=True)
        images.start().stop()
        assert images.hashed == {} and images.files == {}


def test_the_archive_takes_a_digest_only_while_it_holds(tmp_path: Path) -> None:
    # hash_and_flush does not read a file whose digest was taken ahead and still holds (the same
    # inode, size and mtime): shown by a digest it could not compute; a file changed since is read
    kept, changed, plain = tmp_path / "pages-1.img", tmp_path / "pages-2.img", tmp_path / "x"
    for p in (kept, changed, plain):
        p.write_bytes(os.urandom(MIB))
    ahead = {}
    for p in (kept, changed):
        st = p.stat()
        ahead[(st.st_dev, st.st_ino)] = fsutil.FileDigest(st.st_size, "ab" * 32, st.st_mtime_ns)
    with open(changed, "r+b") as f:  # rewritten in place after the last look: same size
        f.write(b"changed")
    os.utime(changed, ns=(0, 0))  # a different mtime, whatever the clock's granularity
    asked: list[threading.Event | None] = []

    def hashed_ahead(stop: threading.Event | None) -> dict[tuple[int, int], fsutil.FileDigest]:
        asked.append(stop)
        return ahead

    stop = threading.Event()
    got = fsutil.hash_and_flush([kept, changed, plain], workers=2, stop=stop, hashed_ahead=hashed_ahead)
    assert asked == [stop]
    assert got == [
        (MIB, "ab" * 32),
        (MIB, hashlib.sha256(changed.read_bytes()).hexdigest()),
        (MIB, hashlib.sha256(plain.read_bytes()).hexdigest()),
    ]
