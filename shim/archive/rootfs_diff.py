"""A container's writable layer as an OCI layer tar, and its safe application onto a rootfs.

The overlayfs upper dir of a container IS its diff against the image: capture tars it,
turning overlay whiteouts (char device 0/0) into OCI `.wh.<name>` files and opaque dirs
(`trusted.overlay.opaque=y`) into `<dir>/.wh..wh..opq`. Apply replays such a tar onto a new
rootfs without ever following a symlink, so a hostile tar cannot write outside the rootfs.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tarfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from shim.archive.fsutil import CHUNK_SIZE, FILE_MODE, Stopped, atomic_write
from shim.archive.paths import NAME_MAX, PATH_MAX, check_member_path
from shim.errors import DataLoss, FailedPrecondition, Internal, InvalidArgument, NotFound, storage_error

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
# Mount destinations whose content never belongs to the image layer (CRI-O skips the same).
DEFAULT_EXCLUDES: tuple[str, ...] = ("/dev", "/proc", "/sys", "/run/secrets")

_XATTR_PAX = "SCHILY.xattr."
# overlay keeps its bookkeeping in these namespaces; never copy it into a layer
_OVERLAY_XATTR_PREFIXES = ("trusted.overlay.", "user.overlay.")
_OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_WHITEOUT_XATTRS = ("trusted.overlay.whiteout", "user.overlay.whiteout")  # kernel >= 6.7
_INCOMPLETE_XATTRS = (  # the upper entry alone does not hold the data: not a self-contained diff
    "trusted.overlay.metacopy",
    "trusted.overlay.redirect",
    "user.overlay.metacopy",
    "user.overlay.redirect",
)
_SKIPPED_XATTRS = ("security.selinux",)  # relabelled by the runtime on restore


@dataclass
class DiffSummary:
    """What a capture wrote or an apply did (counts and container-absolute paths)."""

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    devices: int = 0  # char/block devices and fifos
    bytes: int = 0  # regular file content
    whiteouts: int = 0
    deleted: list[str] = field(default_factory=list)  # e.g. "/etc/motd" (deleted.files)
    opaque_dirs: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # excluded mounts, sockets, reserved names


def _norm_excludes(exclude: Sequence[str]) -> list[str]:
    out = []
    for e in exclude:
        if not e.startswith("/"):
            raise InvalidArgument(f"rootfs diff exclude {e!r} is not an absolute container path")
        n = os.path.normpath(e)
        if n != "/":  # excluding "/" would mean no diff at all: a caller bug, not a mount
            out.append(n)
    return out


def _excluded(cpath: str, excludes: list[str]) -> bool:
    return any(cpath == e or cpath.startswith(e + "/") for e in excludes)


def _proc_path(dfd: int, name: str) -> str:
    # xattr calls take no dir_fd: go through the fd's magic link, final component not followed
    return f"/proc/self/fd/{dfd}/{name}"


def _read_xattrs(dfd: int, name: str) -> dict[str, bytes]:
    p = _proc_path(dfd, name)
    try:
        keys = os.listxattr(p, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return {}
        raise
    out = {}
    for k in keys:
        try:
            out[k] = os.getxattr(p, k, follow_symlinks=False)
        except OSError as e:
            if e.errno != errno.ENODATA:  # removed between list and get
                raise
    return out


def _tarinfo(name: str, st: os.stat_result, typ: bytes) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = typ
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.uid, ti.gid = st.st_uid, st.st_gid
    ti.uname = ti.gname = ""  # numeric owners only: host names mean nothing in the container
    sec, nsec = divmod(st.st_mtime_ns, 1_000_000_000)
    ti.mtime = sec
    if nsec and sec >= 0:
        # exact decimal in PAX: a float would round the nanoseconds
        ti.pax_headers = {"mtime": f"{sec}.{nsec:09d}"}
    return ti


def _add_xattrs(ti: tarfile.TarInfo, xattrs: dict[str, bytes]) -> None:
    headers = dict(ti.pax_headers)
    for k, v in xattrs.items():
        if k.startswith(_OVERLAY_XATTR_PREFIXES) or k in _SKIPPED_XATTRS:
            continue
        # surrogateescape round-trips binary values (e.g. security.capability) through PAX
        headers[_XATTR_PAX + k] = v.decode("utf-8", "surrogateescape")
    ti.pax_headers = headers


class _Capture:
    def __init__(self, tar: tarfile.TarFile, excludes: list[str]) -> None:
        self.tar = tar
        self.excludes = excludes
        self.links: dict[tuple[int, int], str] = {}
        self.summary = DiffSummary()

    def _empty_member(self, name: str) -> None:
        ti = tarfile.TarInfo(name)
        ti.mode = 0o644
        ti.uname = ti.gname = ""
        self.tar.addfile(ti)

    def walk(self, dfd: int, rel: str) -> None:
        with os.scandir(dfd) as it:
            names = sorted(e.name for e in it)  # sorted: the same tree gives the same tar
        for name in names:
            crel = f"{rel}/{name}" if rel else name
            self.entry(dfd, name, crel)

    def entry(self, dfd: int, name: str, crel: str) -> None:
        cpath = "/" + crel
        s = self.summary
        if _excluded(cpath, self.excludes):
            s.skipped.append(cpath)
            return
        if name.startswith(WHITEOUT_PREFIX):
            # a real file with a reserved OCI name cannot be represented in a layer
            s.skipped.append(cpath)
            return
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        mode = st.st_mode
        xattrs = _read_xattrs(dfd, name)
        for k in _INCOMPLETE_XATTRS:
            if k in xattrs:
                raise FailedPrecondition(
                    f"overlay upper entry {cpath} carries {k}: the upper dir is not a "
                    "self-contained diff; mount the container's overlay without "
                    "metacopy/redirect_dir to checkpoint it"
                )
        parent = crel.rpartition("/")[0]
        if (stat.S_ISCHR(mode) and st.st_rdev == 0) or (
            stat.S_ISREG(mode) and any(k in xattrs for k in _WHITEOUT_XATTRS)
        ):
            wh = f"{parent}/{WHITEOUT_PREFIX}{name}" if parent else f"{WHITEOUT_PREFIX}{name}"
            self._empty_member(wh)
            s.whiteouts += 1
            s.deleted.append(cpath)
            return
        if stat.S_ISDIR(mode):
            ti = _tarinfo(crel, st, tarfile.DIRTYPE)
            _add_xattrs(ti, xattrs)
            self.tar.addfile(ti)
            s.dirs += 1
            if any(xattrs.get(k) == b"y" for k in _OPAQUE_XATTRS):
                self._empty_member(f"{crel}/{OPAQUE_MARKER}")
                s.opaque_dirs.append(cpath)
            cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            try:
                self.walk(cfd, crel)
            finally:
                os.close(cfd)
            return
        if stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in self.links:
                ti = _tarinfo(crel, st, tarfile.LNKTYPE)
                ti.linkname = self.links[key]
                self.tar.addfile(ti)
                s.hardlinks += 1
                return
            if st.st_nlink > 1:
                self.links[key] = crel
            ti = _tarinfo(crel, st, tarfile.REGTYPE)
            _add_xattrs(ti, xattrs)
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                ti.size = os.fstat(fd).st_size
                self.tar.addfile(ti, f)
            s.files += 1
            s.bytes += ti.size
            return
        if stat.S_ISLNK(mode):
            ti = _tarinfo(crel, st, tarfile.SYMTYPE)
            ti.linkname = os.readlink(name, dir_fd=dfd)
            _add_xattrs(ti, xattrs)
            self.tar.addfile(ti)
            s.symlinks += 1
            return
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
            typ = (
                tarfile.CHRTYPE
                if stat.S_ISCHR(mode)
                else tarfile.BLKTYPE
                if stat.S_ISBLK(mode)
                else tarfile.FIFOTYPE
            )
            ti = _tarinfo(crel, st, typ)
            if typ != tarfile.FIFOTYPE:
                ti.devmajor, ti.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
            _add_xattrs(ti, xattrs)
            self.tar.addfile(ti)
            s.devices += 1
            return
        s.skipped.append(cpath)  # sockets: no tar representation, recreated by the process


def capture_rootfs_diff(
    upperdir: Path,
    out_tar: Path,
    exclude: Sequence[str] = (),
    compress: bool = False,
    deleted_files: Path | None = None,
    default_excludes: bool = True,
) -> DiffSummary:
    """Tar the overlay upper dir `upperdir` into the new file `out_tar` (0600) as an OCI diff.

    `exclude`: container paths (mount destinations such as bind-mount targets) skipped with
    their subtree, in addition to DEFAULT_EXCLUDES unless default_excludes=False.
    `compress`: gzip (level 1: capture runs inside the freeze window).
    `deleted_files`: if set, also write the deleted paths there as a JSON list (CRI-O's
    `deleted.files`). Modes, numeric owners, mtimes, xattrs, symlinks, hardlinks, devices
    and fifos are preserved. On error the partial tar is removed.
    """
    upper, out = Path(upperdir), Path(out_tar)
    excludes = _norm_excludes([*(DEFAULT_EXCLUDES if default_excludes else ()), *exclude])
    try:
        ufd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise NotFound(f"overlay upper dir {upper} does not exist: is the container running?") from e
    except NotADirectoryError as e:
        raise InvalidArgument(f"overlay upper dir {upper} is not a directory") from e
    try:
        tfd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        os.close(ufd)
        if isinstance(e, FileExistsError):
            raise FailedPrecondition(f"rootfs diff {out} already exists; refusing to overwrite") from e
        raise storage_error(e, f"cannot create rootfs diff {out}", Path(out).parent, "one inode") from e
    try:
        with os.fdopen(tfd, "wb") as raw:
            kw: dict[str, int] = {"compresslevel": 1} if compress else {}
            with tarfile.open(  # type: ignore[call-overload]  # copybufsize: a TarFile argument typeshed's open() lacks
                fileobj=raw,
                mode="w:gz" if compress else "w",
                format=tarfile.PAX_FORMAT,
                copybufsize=CHUNK_SIZE,
                **kw,
            ) as tar:
                cap = _Capture(tar, excludes)
                cap.walk(ufd, "")
            raw.flush()
            os.fsync(raw.fileno())
        if deleted_files is not None:
            atomic_write(Path(deleted_files), json.dumps(cap.summary.deleted).encode())
    except BaseException as e:
        try:
            os.unlink(out)  # never leave a partial diff that looks complete
        except OSError:
            pass
        if isinstance(e, OSError):
            raise storage_error(
                e,
                f"cannot capture the rootfs diff of {upper} into {out}",
                Path(out).parent,
                "room for the diff",
            ) from e
        raise
    finally:
        os.close(ufd)
    return cap.summary


# ---------------------------------------------------------------------------- apply


class _Rootfs:
    """Resolves member parents under the rootfs one component at a time, never following
    a symlink (openat + O_NOFOLLOW), so no member can land outside the rootfs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._cache: tuple[tuple[str, ...], int] | None = None  # last parent: most hits

    def close(self) -> None:
        self.invalidate()
        os.close(self.fd)

    def invalidate(self) -> None:
        if self._cache is not None:
            os.close(self._cache[1])
            self._cache = None

    def parent(self, parts: tuple[str, ...], create: bool, member: str) -> int | None:
        """A borrowed fd of the directory `parts` (do not close). None when it does not exist
        or is not a real directory and create is False; with create, missing dirs are made
        and a symlink or file in the way is an InvalidArgument."""
        if self._cache is not None and self._cache[0] == parts:
            return self._cache[1]
        self.invalidate()
        fd = os.dup(self.fd)
        try:
            for comp in parts:
                try:
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    if not create:
                        os.close(fd)
                        return None
                    raise InvalidArgument(
                        f"rootfs diff member {member!r}: {'/'.join(parts)} is a symlink or "
                        "file in the target rootfs; refusing to write through it"
                    ) from e
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        self._cache = (parts, fd)
        return fd


def _remove(pfd: int, name: str) -> bool:
    """Remove `name` in dir `pfd` whatever it is (dirs recursively). False when absent."""
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=pfd)
    else:
        os.unlink(name, dir_fd=pfd)
    return True


def _clear(pfd: int, name: str) -> None:
    """Empty directory `name` in `pfd` (an opaque marker) if it is a real directory."""
    try:
        dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
    except OSError:
        return  # missing, or a symlink/file: nothing below it belongs to this dir
    try:
        with os.scandir(dfd) as it:
            names = [e.name for e in it]
        for n in names:
            _remove(dfd, n)
    finally:
        os.close(dfd)


def _set_xattrs(target: int | str, ti: tarfile.TarInfo, symlink: bool) -> None:
    for k, v in ti.pax_headers.items():
        if not k.startswith(_XATTR_PAX):
            continue
        name = k[len(_XATTR_PAX) :]
        if name.startswith(_OVERLAY_XATTR_PREFIXES):
            continue  # never let a layer forge overlay metadata
        try:
            os.setxattr(target, name, v.encode("utf-8", "surrogateescape"), follow_symlinks=not symlink)
        except OSError as e:
            # user.* is not allowed on symlinks; a target fs may lack xattrs entirely
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP) or not symlink:
                raise


def _write_file(tar: tarfile.TarFile, ti: tarfile.TarInfo, pfd: int, name: str) -> int:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
    try:
        src = tar.extractfile(ti)
        n = 0
        if src is not None:
            while chunk := src.read(CHUNK_SIZE):
                _write_all(fd, chunk)
                n += len(chunk)
        # owner before mode: chown clears setuid/setgid bits; xattrs after chown, which
        # drops security.capability
        os.fchown(fd, ti.uid, ti.gid)
        os.fchmod(fd, ti.mode)
        _set_xattrs(fd, ti, symlink=False)
        os.utime(fd, ns=(_mtime_ns(ti),) * 2)
    finally:
        os.close(fd)
    return n


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _mtime_ns(ti: tarfile.TarInfo) -> int:
    raw = ti.pax_headers.get("mtime")
    if raw and "." in raw and not raw.startswith("-"):
        sec, _, frac = raw.partition(".")
        if sec.isdigit() and frac.isdigit():
            return int(sec) * 1_000_000_000 + int(frac[:9].ljust(9, "0"))
    return int(ti.mtime * 1_000_000_000)


def _deleted_entry(entry: object) -> tuple[tuple[str, ...], str]:
    """A deleted.files entry (a container-absolute path) as (parent dirs, name), confined."""
    if not isinstance(entry, str):
        raise InvalidArgument(f"deleted.files entry {entry!r} is not a string")
    return _split(entry.lstrip("/"))


def _split(name: str) -> tuple[tuple[str, ...], str]:
    p = check_member_path(name, "rootfs diff member")
    *dirs, last = p.parts
    if last.startswith(WHITEOUT_PREFIX):  # ".wh.<name>" may be 4 bytes over what it deletes
        last = last[len(WHITEOUT_PREFIX) :]
    if any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX for part in (*dirs, last)):
        # no file system takes such a name: refused up front, not as ENAMETOOLONG when applied
        raise InvalidArgument(f"rootfs diff member {name[:120]!r}: a component is over {NAME_MAX} bytes")
    return tuple(p.parts[:-1]), p.parts[-1]


@contextmanager
def _open_tar(path: Path) -> Iterator[tarfile.TarFile]:
    try:
        tar = tarfile.open(path, mode="r:*", copybufsize=CHUNK_SIZE)  # type: ignore[call-overload]  # copybufsize: a TarFile argument typeshed's open() lacks
    except FileNotFoundError as e:
        raise NotFound(f"rootfs diff {path} does not exist") from e
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DataLoss(f"rootfs diff {path} is not a readable tar ({e}): the archive is corrupt") from e
    with tar:
        yield tar


def apply_deleted_files(rootfs: Path, deleted: Sequence[str]) -> int:
    """Remove CRI-O style `deleted.files` entries (container-absolute paths) from `rootfs`.

    Paths are confined to the rootfs and parents are never followed through symlinks.
    Returns how many existed and were removed.
    """
    tree = _Rootfs(Path(rootfs))
    n = 0
    try:
        for d in deleted:
            parents, name = _deleted_entry(d)
            pfd = tree.parent(parents, create=False, member=d)
            if pfd is not None:  # absent parent or a symlink: nothing of it to delete
                n += _remove(pfd, name)
    finally:
        tree.close()
    return n


def apply_rootfs_diff(
    tar_path: Path, rootfs: Path, deleted: Sequence[str] | None = None, stop: threading.Event | None = None
) -> DiffSummary:
    """Apply an OCI layer tar (plain or gzip) onto the existing directory `rootfs`.

    Every member must stay under rootfs: absolute names, '..', hardlinks leaving the tree
    and writes through symlinks (pre-existing or created by the tar) are InvalidArgument.
    Symlink *targets* are stored as they are: they resolve in the container's root, and
    nothing here follows them. Whiteouts delete their target, opaque markers empty their
    directory (both before any member is written, so member order does not matter). Owners,
    modes, mtimes and xattrs are restored. `deleted`: CRI-O `deleted.files` entries removed
    as well. `stop` set (the restore's caller is gone): Stopped before the next member.
    """
    tar_path, rootfs = Path(tar_path), Path(rootfs)
    if not rootfs.is_dir() or rootfs.is_symlink():
        raise NotFound(f"target rootfs {rootfs} is not an existing directory")
    s = DiffSummary()
    with _open_tar(tar_path) as tar:
        plan, deletions = _plan(tar, tar_path, s)
        tree = _Rootfs(rootfs)
        dir_times: list[tuple[tuple[str, ...], str, int]] = []
        try:
            for parents, name, opaque in deletions:
                pfd = tree.parent(parents, create=False, member="/".join((*parents, name)))
                if pfd is None:
                    continue  # parent absent or a symlink: nothing of it to delete
                if opaque:
                    _clear(pfd, name)
                else:
                    _remove(pfd, name)
            if deleted:
                apply_deleted_files(rootfs, deleted)
                s.deleted.extend(deleted)
            for ti, parents, name in plan:
                if stop is not None and stop.is_set():
                    raise Stopped(f"applying {tar_path} stopped: the restore's caller is gone")
                pfd = tree.parent(parents, create=True, member=ti.name)
                assert pfd is not None
                _apply_member(tar, ti, tree, pfd, name, s)
                if ti.isdir():
                    dir_times.append((parents, name, _mtime_ns(ti)))
            for parents, name, ns in reversed(dir_times):
                pfd = tree.parent(parents, create=False, member=name)
                if pfd is not None:
                    os.utime(name, ns=(ns, ns), dir_fd=pfd, follow_symlinks=False)
        except (tarfile.TarError, EOFError) as e:
            raise DataLoss(f"rootfs diff {tar_path} is truncated or corrupt ({e})") from e
        except OSError as e:
            raise Internal(f"cannot apply rootfs diff {tar_path} onto {rootfs}: {e}") from e
        finally:
            tree.close()
    return s


_Member = tuple[tarfile.TarInfo, tuple[str, ...], str]  # member, its parent dirs, its name
_Deletion = tuple[tuple[str, ...], str, bool]  # parent dirs, name, opaque


def _plan(tar: tarfile.TarFile, tar_path: Path, s: DiffSummary) -> tuple[list[_Member], list[_Deletion]]:
    """Sort the members into what to write and what to delete, refusing bad names and types."""
    try:
        members = tar.getmembers()
    except (tarfile.TarError, EOFError) as e:
        raise DataLoss(f"rootfs diff {tar_path} is truncated or corrupt ({e})") from e
    plan: list[_Member] = []
    deletions: list[_Deletion] = []
    for ti in members:
        if ti.name in (".", "./", ""):
            continue  # the rootfs itself: its mode/owner are the new sandbox's
        parents, name = _split(ti.name)
        if name == OPAQUE_MARKER:
            if not parents:
                raise InvalidArgument("rootfs diff marks the rootfs itself opaque")
            deletions.append((parents[:-1], parents[-1], True))
            s.opaque_dirs.append("/" + "/".join(parents))
        elif name.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX):
            continue  # other aufs metadata (.wh..wh.plnk etc.): not content
        elif name.startswith(WHITEOUT_PREFIX):
            target = name[len(WHITEOUT_PREFIX) :]
            if target in ("", ".", ".."):
                raise InvalidArgument(f"rootfs diff member {ti.name!r} is a bad whiteout")
            deletions.append((parents, target, False))
            s.whiteouts += 1
            s.deleted.append("/" + "/".join((*parents, target)))
        else:
            if ti.islnk():
                check_member_path(ti.linkname, f"hardlink target of {ti.name!r}")
            elif ti.issym() and len(ti.linkname.encode("utf-8", "surrogateescape")) >= PATH_MAX:
                raise InvalidArgument(
                    f"rootfs diff member {ti.name[:120]!r}: symlink target over {PATH_MAX} bytes"
                )
            elif not (ti.isreg() or ti.isdir() or ti.issym() or ti.isdev()):
                raise InvalidArgument(f"rootfs diff member {ti.name!r} has unsupported type {ti.type!r}")
            plan.append((ti, parents, name))
    return plan, deletions


def read_deleted_files(path: Path) -> list[str] | None:
    """The entries of a `deleted.files` (a JSON list of container paths), or None without one."""
    try:
        entries = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{path} is unreadable: {e}") from e
    if not isinstance(entries, list):
        raise InvalidArgument(f"{path} is not a JSON list")
    return entries


def check_rootfs_diff(
    tar_path: Path, deleted: Sequence[str] | None = None, stop: threading.Event | None = None
) -> None:
    """Refuse, without touching any rootfs, a diff that apply_rootfs_diff would refuse for its
    own content: corrupt tar, bad names or types, and members written through a symlink the
    same tar creates. (A symlink already in the target image is only seen when applying.)
    RestorePod runs this before it creates anything, so a hostile archive fails there. `stop`
    set (the caller was cancelled): Stopped at the next member (a gzip diff is decompressed
    to find its headers)."""
    tar_path = Path(tar_path)
    with _open_tar(tar_path) as tar:
        if stop is not None:
            try:
                for _member in tar:  # loads the members one by one; _plan then has them all
                    if stop.is_set():
                        raise Stopped(f"checking {tar_path} stopped: the operation was cancelled")
            except (tarfile.TarError, EOFError) as e:
                raise DataLoss(f"rootfs diff {tar_path} is truncated or corrupt ({e})") from e
        plan, _deletions = _plan(tar, tar_path, DiffSummary())
    symlinks = {(*parents, name) for ti, parents, name in plan if ti.issym()}
    for ti, parents, _name in plan:
        for i in range(1, len(parents) + 1):
            if parents[:i] in symlinks:
                raise InvalidArgument(
                    f"rootfs diff member {ti.name!r}: {'/'.join(parents[:i])} is a symlink in the "
                    "diff; refusing to write through it"
                )
    for d in deleted or []:
        _deleted_entry(d)


def _apply_member(
    tar: tarfile.TarFile, ti: tarfile.TarInfo, tree: _Rootfs, pfd: int, name: str, s: DiffSummary
) -> None:
    if ti.isdir():
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=pfd)  # a file or symlink replaced by a directory
                os.mkdir(name, 0o700, dir_fd=pfd)
        except FileNotFoundError:
            os.mkdir(name, 0o700, dir_fd=pfd)
        dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
        try:
            os.fchown(dfd, ti.uid, ti.gid)
            os.fchmod(dfd, ti.mode)
            _set_xattrs(dfd, ti, symlink=False)
        finally:
            os.close(dfd)
        s.dirs += 1
        return
    _remove(pfd, name)  # a child of the cached parent: the cache stays valid
    if ti.isreg():
        s.bytes += _write_file(tar, ti, pfd, name)
        s.files += 1
    elif ti.issym():
        os.symlink(ti.linkname, name, dir_fd=pfd)
        os.chown(name, ti.uid, ti.gid, dir_fd=pfd, follow_symlinks=False)
        _set_xattrs(_proc_path(pfd, name), ti, symlink=True)
        ns = _mtime_ns(ti)
        os.utime(name, ns=(ns, ns), dir_fd=pfd, follow_symlinks=False)
        s.symlinks += 1
    elif ti.islnk():
        lparents, lname = _split(ti.linkname)
        # resolve the source with its own walker: the cached parent fd must stay valid
        src = _Rootfs(tree.root)
        try:
            sfd = src.parent(lparents, create=False, member=ti.linkname)
            if sfd is None:
                raise InvalidArgument(
                    f"rootfs diff hardlink {ti.name!r} -> {ti.linkname!r}: target is missing"
                )
            try:
                os.link(lname, name, src_dir_fd=sfd, dst_dir_fd=pfd, follow_symlinks=False)
            except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
                raise InvalidArgument(
                    f"rootfs diff hardlink {ti.name!r} -> {ti.linkname!r} cannot be made: {e.strerror}"
                ) from e
        finally:
            src.close()
        s.hardlinks += 1
    else:  # char/block device, fifo
        if ti.isfifo():
            os.mkfifo(name, 0o600, dir_fd=pfd)
        else:
            kind = stat.S_IFCHR if ti.ischr() else stat.S_IFBLK
            os.mknod(name, kind | 0o600, os.makedev(ti.devmajor, ti.devminor), dir_fd=pfd)
        os.chown(name, ti.uid, ti.gid, dir_fd=pfd, follow_symlinks=False)
        os.chmod(name, ti.mode, dir_fd=pfd)  # just created by us: not a symlink
        _set_xattrs(_proc_path(pfd, name), ti, symlink=False)
        ns = _mtime_ns(ti)
        os.utime(name, ns=(ns, ns), dir_fd=pfd, follow_symlinks=False)
        s.devices += 1
