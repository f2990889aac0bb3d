"""Directories held open: podshim writes into a caller's directory only through a descriptor opened
once with O_NOFOLLOW per component, and hands path-only code `/proc/self/fd/<fd>/<name>`
(docs/design/archive.md (Path confinement))."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from shim import faults
from shim.archive.fsutil import DIR_MODE, FILE_MODE, temp_name_for
from shim.errors import FailedPrecondition, Internal, InvalidArgument, NotFound, ShimError, storage_error

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _component(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\x00" in name:
        raise InvalidArgument(f"{name!r} is not a single path component")
    return name


def _parts(rel: str | Path) -> list[str]:
    return [_component(p) for p in str(rel).split("/") if p not in ("", ".")]


class DirHandle:
    """One directory opened with O_NOFOLLOW; `path` is where it was opened (messages only)."""

    def __init__(self, fd: int, path: Path, asked: str | None = None) -> None:
        self.fd = fd
        self.path = Path(path)
        self.asked = asked  # the caller's spelling of `path` (it may pass through a symlink)
        self._adopted: list[DirHandle] = []

    def __del__(self) -> None:  # a handle dropped on an error path still gives its fd back
        with contextlib.suppress(OSError, AttributeError):
            self.close()

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, path: str | Path) -> DirHandle:
        """Open the absolute `path` from `/`, one component at a time, following no symlink
        (give it a resolved path): ELOOP/ENOTDIR when a component is not a real directory."""
        p = Path(path)
        if not p.is_absolute():
            raise InvalidArgument(f"{p} is not absolute")
        fd = os.open("/", _DIR_FLAGS)
        try:
            for part in _parts(str(p).lstrip("/")):
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except FileNotFoundError as e:
            os.close(fd)
            raise NotFound(f"{p} does not exist") from e
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InvalidArgument(
                    f"{p} is not a directory (or a component was replaced by a symlink)"
                ) from e
            raise Internal(f"cannot open directory {p}: {e}") from e
        return cls(fd, p)

    def adopt(self, child: DirHandle) -> DirHandle:
        """Close `child` together with this handle (one close on every exit path)."""
        self._adopted.append(child)
        return child

    def close(self) -> None:
        while self._adopted:
            self._adopted.pop().close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sub(self, rel: str | Path, create: bool = False) -> DirHandle:
        """The directory `rel` below this one, each level opened with O_NOFOLLOW relative to its
        parent; `create`: missing levels are made 0700."""
        fd = os.dup(self.fd)
        path = self.path
        try:
            for part in _parts(rel):
                path = path / part
                if create:
                    try:
                        os.mkdir(part, DIR_MODE, dir_fd=fd)
                    except FileExistsError:
                        pass
                    else:
                        nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                        os.fchmod(nfd, DIR_MODE)  # whatever the umask
                        os.close(fd)
                        fd = nfd
                        continue
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return DirHandle(fd, path)

    def mkdir(self, name: str) -> DirHandle:
        """A new directory `name` (0700, FileExistsError if the name is taken), opened."""
        os.mkdir(_component(name), DIR_MODE, dir_fd=self.fd)
        d = self.sub(name)
        os.fchmod(d.fd, DIR_MODE)
        return d

    # ------------------------------------------------------------------ identity

    def identity(self) -> tuple[int, int]:
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def is_at(self, path: str | Path) -> bool:
        """True when `path` (symlinks followed, as the caller's path was when validated) still
        names the directory held here."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity()

    def check_in_place(self, what: str, during: str) -> None:
        """FailedPrecondition when the path this directory was opened at (or the caller's
        spelling of it) no longer names it: someone replaced or moved it meanwhile."""
        shown = self.asked or str(self.path)
        if self.is_at(self.path) and (self.asked is None or self.is_at(self.asked)):
            return
        raise FailedPrecondition(
            f"{what} {shown} was replaced during {during} (it no longer names the directory podshim "
            "opened): nothing was written outside it and the partial files were removed; retry with "
            "a directory nobody else renames or replaces"
        )

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still use on this directory's file system."""
        v = os.fstatvfs(self.fd)
        return v.f_bavail * v.f_frsize

    @property
    def proc(self) -> str:
        """A path to this very directory for code that only takes paths; in a child process too
        when the child inherits the descriptor (subprocess pass_fds keeps its number)."""
        return f"/proc/self/fd/{self.fd}"

    def at(self, name: str) -> Path:
        """`name` inside this directory as a path that cannot be redirected above it."""
        return Path(f"{self.proc}/{_component(name)}")

    # ------------------------------------------------------------------ files

    def create(self, name: str, mode: int = FILE_MODE) -> int:
        """A new file `name` (O_EXCL|O_NOFOLLOW), returned open for writing."""
        fd = os.open(
            _component(name),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            mode,
            dir_fd=self.fd,
        )
        os.fchmod(fd, mode)
        return fd

    def write_file(self, name: str, data: bytes, mode: int = FILE_MODE) -> None:
        """Replace `name` by `data` atomically: a temporary sibling, fsync, rename, fsync dir."""
        tmp = temp_name_for(_component(name))
        try:
            fd = self.create(tmp, mode)
        except OSError as e:
            raise storage_error(
                e, f"cannot create a temporary file in {self.path} to write {name}", self.proc, "one inode"
            ) from e
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            faults.hit(f"write-file.{name}")  # a crash here leaves the temporary file
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            if isinstance(e, OSError):
                raise storage_error(
                    e, f"cannot write {self.path / name}", self.proc, f"{len(data)} bytes"
                ) from e
            raise
        self.fsync()

    def open_read(self, rel: str | Path) -> int:
        """`rel` below this directory opened for reading, no level followed if a symlink."""
        parts = _parts(rel)
        if not parts:
            raise InvalidArgument(f"{rel!r} names no file")
        if len(parts) == 1:
            return os.open(parts[0], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        with self.sub("/".join(parts[:-1])) as d:
            return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d.fd)

    def read_bytes(self, rel: str | Path, limit: int = 64 << 20) -> bytes:
        fd = self.open_read(rel)
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise Internal(f"{self.path / str(rel)} is over {limit} bytes")
        return data

    def names(self) -> list[str]:
        with os.scandir(self.fd) as it:
            return sorted(e.name for e in it)

    def fsync(self) -> None:
        os.fsync(self.fd)

    # ------------------------------------------------------------------ trees

    def tree(self, err: Callable[[str], ShimError] | None = None) -> HeldTree:
        """Every directory below this one held open, and the regular files' sizes."""
        return HeldTree(self, err or (lambda msg: Internal(f"unexpected entry: {msg}")))

    def make_private(self) -> None:
        """Files 0600, directories 0700 below this one (the umask gave runc's and CRIU's
        0644/0755); symlinks and special files are left alone (the manifest refuses them)."""
        with os.scandir(self.fd) as it:
            entries = [(e.name, e.stat(follow_symlinks=False).st_mode) for e in it]
        for name, mode in entries:
            if stat.S_ISDIR(mode):
                with self.sub(name) as d:
                    os.fchmod(d.fd, DIR_MODE)
                    d.make_private()
            elif stat.S_ISREG(mode):
                self.chmod(name, FILE_MODE)

    def chmod(self, name: str, mode: int) -> None:
        """chmod `name` itself, never what a symlink there points to (O_PATH, then its fd)."""
        pfd = os.open(_component(name), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            if stat.S_ISLNK(os.fstat(pfd).st_mode):
                return
            os.chmod(f"/proc/self/fd/{pfd}", mode)
        finally:
            os.close(pfd)

    def remove(self, name: str) -> None:
        """Remove the entry `name` (a directory with its contents; symlinks not followed)."""
        st = os.stat(_component(name), dir_fd=self.fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            os.unlink(name, dir_fd=self.fd)

    def clear(self) -> None:
        """Remove everything inside this directory, never the directory itself."""
        for name in self.names():
            with contextlib.suppress(FileNotFoundError):
                self.remove(name)
        self.fsync()


def open_checked(real: Path, asked: str, what: str, empty: bool = False) -> DirHandle:
    """Open the directory `real` that paths.py validated for the request path `asked`, and make
    sure it is still that one (and, with `empty`, still empty) now that podshim holds it."""
    d = DirHandle.open(real)
    d.asked = asked
    if not d.is_at(asked):
        d.close()
        raise InvalidArgument(f"{what} {asked} changed while it was checked: retry")
    if empty:
        names = d.names()
        if names:
            d.close()
            raise InvalidArgument(
                f"{what} {asked} is not empty (contains {names[0]!r}): "
                "pass an empty directory; podshim never removes caller files"
            )
    return d


MAX_DEPTH = 32  # directories a held tree may nest (podshim's archives: 3); each level is an fd


def clear_dir_contents(path: Path) -> None:
    """Remove everything INSIDE `path`, never `path` itself (podshim never removes output_path).

    `path` is opened with no component followed if it is a symlink (DirHandle.open: a
    directory replaced by a symlink is refused, InvalidArgument) and cleared through that
    descriptor; symlinks inside are removed, not followed.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise NotFound(f"cannot clear {path}: it does not exist") from e
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"cannot clear {path}: it is not a directory")
    try:
        with DirHandle.open(path) as d:
            d.clear()
    except OSError as e:
        raise Internal(f"cannot remove the contents of {path}: {e}; remove them by hand") from e


class HeldTree:
    """The directories of a tree held open (O_NOFOLLOW, each relative to its parent) and its
    regular files (relative posix path -> size). Anything but directories and regular files,
    and directories nested deeper than MAX_DEPTH, raise `err(message)`."""

    def __init__(self, root: DirHandle, err: Callable[[str], ShimError]) -> None:
        self.root = root
        self.dirs: dict[str, DirHandle] = {"": root}
        self.files: dict[str, int] = {}
        self._owned: list[DirHandle] = []
        try:
            self._scan(root, "", err)
        except BaseException:
            self.close()
            raise

    def _scan(self, d: DirHandle, prefix: str, err: Callable[[str], ShimError]) -> None:
        with os.scandir(d.fd) as it:
            entries = sorted((e.name, e.stat(follow_symlinks=False)) for e in it)
        for name, st in entries:
            rel = f"{prefix}{name}"
            if stat.S_ISDIR(st.st_mode):
                if rel.count("/") + 1 > MAX_DEPTH:
                    raise err(
                        f"{self.root.path}: directories nest deeper than {MAX_DEPTH} ({rel[:120]!r}...)"
                    )
                sub = d.sub(name)
                self._owned.append(sub)
                self.dirs[rel] = sub
                self._scan(sub, rel + "/", err)
            elif stat.S_ISREG(st.st_mode):
                self.files[rel] = st.st_size
            elif stat.S_ISLNK(st.st_mode):
                raise err(f"{self.root.path}: {rel} is not a regular file but a symlink")
            else:
                raise err(f"{self.root.path}: {rel} is not a regular file or directory")

    def path(self, rel: str) -> Path:
        """The file `rel` as a path through its parent's descriptor (see DirHandle.at)."""
        parent, _, name = rel.rpartition("/")
        return self.dirs[parent].at(name)

    def fsync_dirs(self) -> None:
        """fsync every directory, deepest first (a directory after its entries)."""
        for rel in sorted(self.dirs, key=lambda r: r.count("/") + (r != ""), reverse=True):
            self.dirs[rel].fsync()

    def close(self) -> None:
        for d in self._owned:
            d.close()
        self._owned.clear()

    def __enter__(self) -> HeldTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def held(root: str | Path | DirHandle) -> Iterator[DirHandle]:
    """`root` itself when it is a DirHandle (left open), else the path (symlinks resolved first:
    for paths podshim chose itself) opened and closed after."""
    if isinstance(root, DirHandle):
        yield root
        return
    with DirHandle.open(os.path.realpath(root)) as h:
        yield h
