"""Durable file-system primitives: atomic writes, fsync of trees, hashing, private modes.

Every durable state file of podshim (journal records, manifest.json) goes through
`atomic_write`, so a crash leaves either the old or the new content, never a torn file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

# one stop signal for all blocking work (shim/aio.py); from shim.errors, so that podshim-runc's
# restore, which uses this module, does not import asyncio (docs/design/runtime-wrapper.md (The
# runtime wrapper))
from shim.errors import InvalidArgument, NotFound, storage_error
from shim.errors import Stopped as Stopped

T = TypeVar("T")
R = TypeVar("R")

CHUNK_SIZE = 1 << 20  # 1 MiB: large enough to amortise syscalls, small enough to stream

# nice of hash_and_flush's hash threads: below the node's work (nice 0). They use every core only
# when the cores are otherwise idle; a busy node's pods, and the pod just thawed, come first.
BACKGROUND_NICE = 10

FILE_MODE = 0o600  # memory images hold secrets (docs/design/archive.md (Archive layout))
DIR_MODE = 0o700

_TMP_MARK = ".tmp-"


def temp_name_for(name: str) -> str:
    """The name atomic_write uses for the temporary sibling of `name`."""
    # os.urandom as secrets.token_hex does (secrets imports `random`: podshim-runc's start-up)
    return f".{name}{_TMP_MARK}{os.urandom(6).hex()}"


def is_temp_name(name: str) -> bool:
    """True for a leftover temporary file of atomic_write (a crash between write and rename)."""
    return name.startswith(".") and _TMP_MARK in name


TAR_ENTRY_BYTES = 1536  # a tar header with a PAX record, per entry


def tar_tree_bytes(
    root: str | os.PathLike[str],
    file_bytes: Callable[[os.stat_result], int],
    stop: threading.Event | None = None,
) -> int:
    """What a tar of the entries under `root` takes: a header per entry plus `file_bytes` of each
    regular file. Symlinks are not followed; a directory that vanishes is skipped."""
    total = 0
    stack = [os.fspath(root)]
    while stack:
        if stop is not None and stop.is_set():
            break
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    total += TAR_ENTRY_BYTES
                    if stat.S_ISREG(st.st_mode):
                        total += file_bytes(st)
                    elif stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
        except OSError:
            continue
    return total


def fsync_dir(path: Path) -> None:
    """fsync a directory so that entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Replace `path` with `data` atomically: temp file in the same dir, fsync, rename, fsync dir.

    The temp file is created with O_EXCL|O_NOFOLLOW so a planted symlink cannot redirect it.
    """
    path = Path(path)
    parent = path.parent
    tmp = parent / temp_name_for(path.name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileNotFoundError as e:
        raise NotFound(f"cannot write {path}: directory {parent} does not exist; create it first") from e
    except OSError as e:
        raise storage_error(
            e, f"cannot create temporary file {tmp} to write {path}", parent, "one inode"
        ) from e
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed or the caller asked wider
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise storage_error(e, f"cannot write {path}", parent, f"{len(data)} bytes") from e
        raise
    fsync_dir(parent)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raise(e: OSError) -> None:
    raise e


def fsync_tree(root: Path, workers: int = 1, files: bool = True) -> None:
    """fsync every regular file and directory under `root` (inclusive), children first.

    Symlinks are not followed. `workers` > 1 fsyncs files in parallel, which lets the block
    layer merge the flushes of many small files. files=False flushes the directories only
    (for callers that already flushed the files).
    """
    paths: list[Path] = []
    root = Path(root)
    dirs: list[Path] = []
    try:
        for dirpath, _dirnames, filenames in os.walk(root, topdown=False, onerror=_raise):
            d = Path(dirpath)
            for name in filenames:
                p = d / name
                if files and stat.S_ISREG(os.lstat(p).st_mode):
                    paths.append(p)
            dirs.append(d)
        if workers > 1 and len(paths) > 1:
            from concurrent.futures import ThreadPoolExecutor  # here: podshim-runc never needs it

            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(_fsync_file, paths))
        else:
            for p in paths:
                _fsync_file(p)
        for d in dirs:  # bottom-up: a directory after its entries
            fsync_dir(d)
    except OSError as e:
        raise storage_error(e, f"cannot fsync {root} (check the disk)", root) from e


@dataclass(frozen=True)
class FileDigest:
    """The sha256 of a file's `size` bytes taken while it was written, and the file's mtime when
    the last of them was read (writeback.ImagesWriteback.digests)."""

    size: int
    sha256: str
    mtime_ns: int

    def holds(self, st: os.stat_result) -> bool:
        """Is this still the digest of the file `st` describes (same size, unchanged since)? The
        caller found `st` under the digest's (device, inode)."""
        return stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns)


# digests taken while files were written, by (st_dev, st_ino); called with the caller's stop event
# (writeback.ImagesWriteback.digests)
HashedAhead = Callable[[threading.Event | None], Mapping[tuple[int, int], FileDigest]]


def map_in_threads(fn: Callable[[T], R], items: list[T], workers: int, nice: int = 0) -> list[R]:
    """[fn(i) for i in items], on up to `workers` threads (hashing releases the GIL), each at
    `nice` (added to the thread's own; Linux sets a thread's priority by its thread id)."""
    if workers > 1 and len(items) > 1:
        from concurrent.futures import ThreadPoolExecutor  # here: podshim-runc never needs it

        with ThreadPoolExecutor(
            workers, thread_name_prefix="podshim-hash", initializer=lower_thread_priority, initargs=(nice,)
        ) as pool:
            return list(pool.map(fn, items))
    return [fn(i) for i in items]


def lower_thread_priority(nice: int) -> None:
    """The calling thread's nice value raised by `nice` (Linux: per thread, by its thread id)."""
    if nice:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


def hash_and_flush(
    paths: list[Path],
    workers: int = 1,
    stop: threading.Event | None = None,
    hashed_ahead: HashedAhead | None = None,
) -> list[tuple[int, str]]:
    """(size, sha256) of each file, and every file fsynced, with the two side by side.

    Hashing is CPU work and flushing is disk work, so a flusher thread writes the files back
    (largest first) while `workers` threads hash them from the page cache (largest first too, at
    BACKGROUND_NICE): the cost is the longer of the two, not their sum. `hashed_ahead(stop)`, called
    once the flusher runs, gives digests taken while the files were written (by (st_dev, st_ino):
    writeback.ImagesWriteback.digests); a file whose digest still holds (same size, unchanged
    since) is not read again. `stop` set: both stop at their next file or chunk.
    """
    from concurrent.futures import ThreadPoolExecutor  # here: podshim-runc never needs it

    stats = {p: os.lstat(p) for p in paths}

    def flush_all() -> None:
        for p in sorted(paths, key=lambda p: stats[p].st_size, reverse=True):
            if stop is not None and stop.is_set():
                return
            _fsync_file(p)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="podshim-flush") as flusher:
        flushed = flusher.submit(flush_all)
        try:
            ahead = hashed_ahead(stop) if hashed_ahead is not None else {}
            hashed: dict[Path, tuple[int, str]] = {}
            for p, st in stats.items():
                d = ahead.get((st.st_dev, st.st_ino))
                if d is not None and d.holds(st):
                    hashed[p] = (d.size, d.sha256)
            by_size = sorted(
                (p for p in paths if p not in hashed), key=lambda p: stats[p].st_size, reverse=True
            )
            digests = map_in_threads(lambda p: hash_file(p, stop=stop), by_size, workers, BACKGROUND_NICE)
            hashed.update(zip(by_size, digests, strict=True))
        except BaseException:
            if stop is not None:
                stop.set()  # the flusher stops at its next file; waiting for it is bounded
            raise
        flushed.result()
    if stop is not None and stop.is_set():
        raise Stopped("flushing the checkpoint stopped: the operation was cancelled")
    return [hashed[p] for p in paths]


def hash_file(
    path: Path, chunk_size: int = CHUNK_SIZE, stop: threading.Event | None = None
) -> tuple[int, str]:
    """Stream `path` (not following a final symlink) and return (bytes read, sha256 hex).

    `stop` set: raises Stopped at the next chunk, so a cancelled caller is not held up.
    """
    h = hashlib.sha256()
    size = 0
    buf = bytearray(chunk_size)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while n := os.readv(fd, [buf]):
            h.update(view[:n])  # hashlib releases the GIL for large buffers: threads scale
            size += n
            if stop is not None and stop.is_set():
                raise Stopped(f"checksumming {path} stopped: the operation was cancelled")
    finally:
        os.close(fd)
    return size, h.hexdigest()


def hole_bytes(path: Path, limit: int, stop: threading.Event | None = None) -> int:
    """How many bytes of `path` are holes (read back as zeros, stored nowhere), counting up to
    just past `limit` (the caller only asks whether there are more). 0 at once for a file whose
    allocated blocks cover its size (every file CRIU, tar and podshim write); otherwise the
    holes are found with SEEK_DATA/SEEK_HOLE, so a file system that compresses (its blocks
    undercount without any hole) is not mistaken for a sparse file. `stop` set: Stopped."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if st.st_blocks * 512 >= size:
            return 0
        holes = pos = 0
        while pos < size and holes <= limit:
            if stop is not None and stop.is_set():
                raise Stopped(f"checking {path} stopped: the operation was cancelled")
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no data after pos, the rest is a hole
                    raise
                data = size
            holes += min(data, size) - pos
            if data >= size:
                break
            pos = os.lseek(fd, data, os.SEEK_HOLE)
        return holes
    finally:
        os.close(fd)


def make_private_dir(path: Path, exist_ok: bool = True) -> Path:
    """Create `path` (and missing parents) with mode 0700, whatever the umask."""
    path = Path(path)
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=exist_ok)
        os.chmod(path, DIR_MODE)
    except FileExistsError as e:
        raise InvalidArgument(f"cannot create directory {path}: it already exists") from e
    except OSError as e:
        raise storage_error(e, f"cannot create directory {path}", path.parent, "one inode") from e
    return path


def write_private_file(path: Path, data: bytes) -> None:
    """Write a new 0600 file durably (atomic_write); the shape every archive file takes."""
    atomic_write(path, data, FILE_MODE)


def make_tree_private(root: Path) -> None:
    """Files 0600, directories 0700 (docs/design/archive.md (Archive layout)): runc and CRIU create
    theirs with the umask's 0644/0755. Symlinks are left alone (write_manifest refuses them)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if stat.S_ISDIR(os.lstat(p).st_mode):
                os.chmod(p, DIR_MODE)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.chmod(p, FILE_MODE)
