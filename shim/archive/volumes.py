"""A pod's emptyDir volumes and its /dev/shm in its checkpoint: tarred while the pod is frozen
(`sandbox/empty-dirs/<name>.tar`, `sandbox/dev-shm.tar`, listed in `sandbox/volumes.json`) and
applied to the new pod's volumes before any container is created, never following a symlink
(docs/design/archive.md (Archive layout))."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import tarfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shim.archive.fsutil import CHUNK_SIZE, FILE_MODE, TAR_ENTRY_BYTES, Stopped, tar_tree_bytes
from shim.archive.paths import check_component
from shim.archive.rootfs_diff import (
    _add_xattrs,
    _mtime_ns,
    _read_xattrs,
    _remove,
    _Rootfs,
    _set_xattrs,
    _split,
    _tarinfo,
    _write_all,
)
from shim.errors import DataLoss, FailedPrecondition, Internal, InvalidArgument, storage_error

EMPTY_DIR_PLUGIN = "kubernetes.io~empty-dir"
EMPTY_DIRS_DIR = "empty-dirs"  # sandbox/empty-dirs/<name>.tar
DEV_SHM_TAR = "dev-shm.tar"  # sandbox/dev-shm.tar: the pod's /dev/shm
VOLUMES_FILE = "volumes.json"  # sandbox/volumes.json: what was recorded
DEV_SHM = "/dev/shm"
RECORD_VERSION = 1
# <root-dir>/pods/<uid>/volumes/kubernetes.io~empty-dir/<name>: the kubelet's layout
_HOST_PATH = re.compile(r"/pods/([^/]+)/volumes/kubernetes\.io~empty-dir/([^/]+)/?$")
# ustar's size field (11 octal digits): a sparse member's stored size must fit in it, as the
# sparse map in the PAX header is read only without a PAX "size" record
_USTAR_MAX_SIZE = 8**11 - 1
_SPARSE_NAME = "GNUSparseFile.0/f"  # the header's own name; the real one is GNU.sparse.name


@dataclass(frozen=True)
class EmptyDir:
    """One emptyDir of a pod, as its containers mount it."""

    name: str  # the volume's name (the last component of its host path)
    host_path: str
    mounts: tuple[tuple[str, str], ...]  # (container name, container path)


@dataclass(frozen=True)
class Prior:
    """A volume's directory as its caller made it, before a fill: what `clear` gives back."""

    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Prior:
        return cls(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_atime_ns, st.st_mtime_ns)


@dataclass
class Summary:
    """What a capture wrote or an apply did."""

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    fifos: int = 0
    bytes: int = 0  # regular file content, holes excluded
    sparse_files: int = 0
    skipped: list[str] = field(default_factory=list)  # sockets, device nodes (relative paths)
    prior: Prior | None = None  # an apply's target as it was before (for `clear`)


def volume_name(host_path: str, pod_uid: str = "") -> str | None:
    """The emptyDir name of a bind mount's host path, or None when it is not an emptyDir (of the
    pod `pod_uid`, when given)."""
    m = _HOST_PATH.search(os.path.normpath(host_path))
    if m is None or (pod_uid and m.group(1) != pod_uid):
        return None
    return m.group(2)


def bind_sources(spec: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    """(source, destination) of each bind mount of an OCI spec."""
    mounts = spec.get("mounts")
    for m in mounts if isinstance(mounts, list) else []:
        if not isinstance(m, dict):
            continue
        raw = m.get("options")
        options = {o for o in raw if isinstance(o, str)} if isinstance(raw, list) else set()
        if m.get("type") == "bind" or {"bind", "rbind"} & options:
            yield str(m.get("source") or ""), str(m.get("destination") or "")


def find_empty_dirs(containers: Sequence[tuple[str, Mapping[str, Any]]], pod_uid: str) -> list[EmptyDir]:
    """The emptyDirs of the pod `pod_uid` that `containers` ((name, OCI spec) pairs) mount, by name."""
    found: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    for cname, spec in containers:
        for source, dest in bind_sources(spec):
            name = volume_name(source, pod_uid)
            if name is None:
                continue
            host, mounts = found.setdefault(name, (os.path.normpath(source), []))
            if os.path.normpath(source) != host:
                raise FailedPrecondition(
                    f"emptyDir {name!r} is mounted from two host paths ({host}, {source}): "
                    "not a kubelet's pod"
                )
            mounts.append((cname, os.path.normpath(dest)))
    return [EmptyDir(n, h, tuple(m)) for n, (h, m) in sorted(found.items())]


def _data_bytes(st: os.stat_result) -> int:
    # what a sparse member stores: the allocated bytes, never more than the file's size
    return min(st.st_size, st.st_blocks * 512)


def tree_bytes(root: str | Path, stop: threading.Event | None = None) -> int:
    """What the tar of the directory `root` takes: its own header, and the data of its regular
    files (holes not counted) plus a header per entry."""
    return TAR_ENTRY_BYTES + tar_tree_bytes(root, _data_bytes, stop)


def dev_shm_source(spec: Mapping[str, Any]) -> str | None:
    """The host path of the pod's /dev/shm in an OCI spec (the sandbox's or a container's), None
    when it has none of its own (host IPC: the node's /dev/shm is not the pod's to carry)."""
    for source, dest in bind_sources(spec):
        if os.path.normpath(dest) == DEV_SHM:
            src = os.path.normpath(source)
            return None if src == DEV_SHM or not source else src
    return None


def check_limit(sizes: Mapping[str, int], limit: int, key: str) -> None:
    """FAILED_PRECONDITION, before anything is frozen, when the volumes of a pod (its emptyDirs,
    and its /dev/shm under the name "/dev/shm") take more than `limit` bytes together (`key`: the
    config key that raises it)."""
    total = sum(sizes.values())
    if total <= limit:
        return
    largest = max(sizes, key=lambda n: sizes[n])
    raise FailedPrecondition(
        f"the pod's emptyDir volumes and /dev/shm hold {_mib(total)} (the largest, {largest!r}, "
        f"{_mib(sizes[largest])}), over the node's limit of {_mib(limit)} ({key}): nothing was frozen; "
        f"raise {key} or empty the volumes"
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


# ---------------------------------------------------------------------------- capture


def _segments(fd: int, size: int) -> list[tuple[int, int]]:
    """The data segments (offset, length) of a file, from SEEK_DATA/SEEK_HOLE; the whole file
    as one segment where the file system cannot tell."""
    out: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole from pos to the end
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            out.append((start, end - start))
            pos = end
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        return [(0, size)]
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    return out


class _SparseReader:
    """A sparse member's stored data, read in order by tarfile: the GNU 1.0 sparse map (padded
    to a block), then the data segments one after the other."""

    def __init__(self, fd: int, segments: list[tuple[int, int]]) -> None:
        lines = [str(len(segments))] + [f"{o}\n{n}" for o, n in segments]
        head = ("\n".join(lines) + "\n").encode()
        self.head = head + b"\0" * (-len(head) % tarfile.BLOCKSIZE)
        self.fd = fd
        self.pending = list(segments)
        self.stored = len(self.head) + sum(n for _, n in segments)

    def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes, fewer only at the end (tarfile's copy takes a short read as EOF)."""
        out = bytearray()
        while n < 0 or len(out) < n:
            want = -1 if n < 0 else n - len(out)
            if self.head:
                k = len(self.head) if want < 0 else want
                out += self.head[:k]
                self.head = self.head[k:]
                continue
            if not self.pending:
                break
            off, left = self.pending[0]
            if left == 0:
                self.pending.pop(0)
                continue
            data = os.pread(self.fd, left if want < 0 else min(want, left), off)
            if not data:  # shrank meanwhile: not the frozen pod, someone else
                raise Internal("an emptyDir file shrank while it was read")
            self.pending[0] = (off + len(data), left - len(data))
            out += data
        return bytes(out)


class _Capture:
    def __init__(self, tar: tarfile.TarFile, stop: threading.Event | None) -> None:
        self.tar = tar
        self.stop = stop
        self.links: dict[tuple[int, int], str] = {}
        self.summary = Summary()

    def walk(self, dfd: int, rel: str) -> None:
        if self.stop is not None and self.stop.is_set():
            raise Stopped("capturing an emptyDir stopped: the operation was cancelled")
        with os.scandir(dfd) as it:
            names = sorted(e.name for e in it)  # sorted: the same tree gives the same tar
        for name in names:
            self.entry(dfd, name, f"{rel}/{name}" if rel else name)

    def root(self, dfd: int) -> None:
        st = os.fstat(dfd)
        ti = _tarinfo(".", st, tarfile.DIRTYPE)  # the volume's own mode and owner
        _add_xattrs(ti, _read_xattrs(dfd, "."))
        self.tar.addfile(ti)
        self.walk(dfd, "")

    def entry(self, dfd: int, name: str, rel: str) -> None:
        s = self.summary
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            ti = _tarinfo(rel, st, tarfile.DIRTYPE)
            _add_xattrs(ti, _read_xattrs(dfd, name))
            self.tar.addfile(ti)
            s.dirs += 1
            cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                self.walk(cfd, rel)
            finally:
                os.close(cfd)
        elif stat.S_ISREG(mode):
            self.regular(dfd, name, rel, st)
        elif stat.S_ISLNK(mode):
            ti = _tarinfo(rel, st, tarfile.SYMTYPE)
            ti.linkname = os.readlink(name, dir_fd=dfd)
            self.tar.addfile(ti)
            s.symlinks += 1
        elif stat.S_ISFIFO(mode):
            ti = _tarinfo(rel, st, tarfile.FIFOTYPE)
            self.tar.addfile(ti)
            s.fifos += 1
        else:
            s.skipped.append(rel)

    def regular(self, dfd: int, name: str, rel: str, st: os.stat_result) -> None:
        s = self.summary
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in self.links:
            ti = _tarinfo(rel, st, tarfile.LNKTYPE)
            ti.linkname = self.links[key]
            self.tar.addfile(ti)
            s.hardlinks += 1
            return
        if st.st_nlink > 1:
            self.links[key] = rel
        ti = _tarinfo(rel, st, tarfile.REGTYPE)
        _add_xattrs(ti, _read_xattrs(dfd, name))
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            size = os.fstat(fd).st_size
            segments = _segments(fd, size) if _data_bytes(st) < size else [(0, size)]
            data = sum(n for _, n in segments)
            reader = _SparseReader(fd, segments) if data < size else None
            if reader is not None and reader.stored <= _USTAR_MAX_SIZE:
                # GNU tar's PAX 1.0 sparse member: the real name and size in the PAX header, the
                # map at the start of the data (what tarfile and GNU tar both read)
                ti.pax_headers = {
                    **ti.pax_headers,
                    "GNU.sparse.major": "1",
                    "GNU.sparse.minor": "0",
                    "GNU.sparse.name": rel,
                    "GNU.sparse.realsize": str(size),
                }
                ti.name = _SPARSE_NAME
                ti.size = reader.stored
                self.tar.addfile(ti, reader)  # tarfile only calls read()
                s.sparse_files += 1
            else:
                ti.size = size
                with os.fdopen(os.dup(fd), "rb") as f:
                    self.tar.addfile(ti, f)
                data = size
        finally:
            os.close(fd)
        s.files += 1
        s.bytes += data


def capture(src: str | Path, out_tar: Path, stop: threading.Event | None = None) -> Summary:
    """Tar the emptyDir `src` into the new file `out_tar` (0600). On error the partial tar is
    removed. `stop` set: Stopped at the next directory."""
    try:
        sfd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise FailedPrecondition(f"cannot open emptyDir {src}: {e.strerror}") from None
    try:
        tfd = os.open(out_tar, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        os.close(sfd)
        raise storage_error(e, f"cannot create {out_tar}", Path(out_tar).parent, "one inode") from e
    try:
        with os.fdopen(tfd, "wb") as raw:
            with tarfile.open(  # type: ignore[call-overload]  # copybufsize: a TarFile argument typeshed's open() lacks
                fileobj=raw, mode="w", format=tarfile.PAX_FORMAT, copybufsize=CHUNK_SIZE
            ) as tar:
                cap = _Capture(tar, stop)
                cap.root(sfd)
    except BaseException as e:
        try:
            os.unlink(out_tar)  # never a partial tar that looks complete
        except OSError:
            pass
        if isinstance(e, OSError):
            raise storage_error(
                e, f"cannot record emptyDir {src} into {out_tar}", Path(out_tar).parent, "room for it"
            ) from e
        raise
    finally:
        os.close(sfd)
    return cap.summary


# ---------------------------------------------------------------------------- record


@dataclass(frozen=True)
class Record:
    """sandbox/volumes.json as RestorePod reads it."""

    empty_dirs: tuple[str, ...]  # names, each with sandbox/empty-dirs/<name>.tar
    dev_shm: bool  # sandbox/dev-shm.tar holds the pod's /dev/shm


def record_bytes(
    dirs: Sequence[EmptyDir], summaries: Mapping[str, Summary], dev_shm: tuple[str, Summary] | None = None
) -> bytes:
    """sandbox/volumes.json: the emptyDirs captured (`summaries` by name) and the pod's /dev/shm
    (its host path and summary), when captured."""
    doc = {
        "version": RECORD_VERSION,
        "empty_dirs": [
            {
                "name": d.name,
                "tar": f"{EMPTY_DIRS_DIR}/{d.name}.tar",
                "source": d.host_path,
                "mounts": [{"container": c, "path": p} for c, p in d.mounts],
                "files": summaries[d.name].files,
                "bytes": summaries[d.name].bytes,
            }
            for d in dirs
            if d.name in summaries
        ],
        "dev_shm": None
        if dev_shm is None
        else {"tar": DEV_SHM_TAR, "source": dev_shm[0], "files": dev_shm[1].files, "bytes": dev_shm[1].bytes},
    }
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def parse_record(data: bytes, where: str) -> Record:
    """A verified sandbox/volumes.json; DataLoss when malformed."""
    try:
        doc = json.loads(data)
        names = tuple(str(e["name"]) for e in doc["empty_dirs"])
        shm = doc["dev_shm"] is not None
        ok = doc.get("version") == RECORD_VERSION
    except (ValueError, KeyError, TypeError) as e:
        raise DataLoss(f"{where} is not a valid volume record ({e}): take a new checkpoint") from None
    if not ok:
        raise FailedPrecondition(f"{where}: volume record version {doc.get('version')!r} is not supported")
    for n in names:
        check_component(n, "emptyDir name")
    return Record(names, shm)


def targets(
    names: Sequence[str], configs: Sequence[Any], pod_uid: str, missing_ok: bool = False
) -> dict[str, str]:
    """The new pod's host path of each recorded emptyDir, from the request's container configs
    (cri.ContainerConfig): FailedPrecondition for one no container mounts (`missing_ok`: left out)."""
    found: dict[str, str] = {}
    for cc in configs:
        for m in cc.mounts:
            name = volume_name(m.host_path, pod_uid)
            if name is not None and name in names:
                found.setdefault(name, os.path.normpath(m.host_path))
    missing = [n for n in names if n not in found]
    if missing and not missing_ok:
        raise FailedPrecondition(
            f"the checkpoint holds emptyDir volume(s) {', '.join(map(repr, missing))} that no container "
            f"config of the request mounts (a host path under pods/{pod_uid or '<uid>'}/volumes/"
            f"{EMPTY_DIR_PLUGIN}/<name>): give the containers their volumes; nothing was created"
        )
    return found


# ---------------------------------------------------------------------------- apply


def _members(tar: tarfile.TarFile, where: Path) -> list[tarfile.TarInfo]:
    try:
        members = tar.getmembers()
    except (tarfile.TarError, EOFError) as e:
        raise DataLoss(f"emptyDir tar {where} is truncated or corrupt ({e})") from e
    seen_links: set[tuple[str, ...]] = set()
    for ti in members:
        if ti.name in (".", "./"):
            if not ti.isdir():
                raise InvalidArgument(f"emptyDir tar {where}: its root is not a directory")
            continue
        parents, name = _split(ti.name)
        for i in range(1, len(parents) + 1):
            if parents[:i] in seen_links:
                raise InvalidArgument(
                    f"emptyDir tar {where}: member {ti.name!r} goes through the symlink "
                    f"{'/'.join(parents[:i])}; refusing to write through it"
                )
        if ti.issym():
            seen_links.add((*parents, name))
        elif ti.islnk():
            _split(ti.linkname)
        elif not (ti.isreg() or ti.isdir() or ti.isfifo()):
            raise InvalidArgument(
                f"emptyDir tar {where}: member {ti.name!r} has unsupported type {ti.type!r}"
            )
    return members


def check_tar(tar_path: Path) -> None:
    """Refuse, before anything is created, a tar that apply would refuse for its content."""
    with _open(tar_path) as tar:
        _members(tar, tar_path)


def _open(tar_path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(tar_path, mode="r:", copybufsize=CHUNK_SIZE)  # type: ignore[call-overload]  # copybufsize: a TarFile argument typeshed's open() lacks
    except (tarfile.TarError, EOFError) as e:
        raise DataLoss(f"emptyDir tar {tar_path} is not a readable tar ({e}): the archive is corrupt") from e
    except OSError as e:
        raise Internal(f"cannot read emptyDir tar {tar_path}: {e}") from e


def _sparse_map(ti: tarfile.TarInfo) -> list[tuple[int, int]] | None:
    """The (offset, length) data segments of a sparse member (None: not sparse)."""
    m: list[tuple[int, int]] | None = getattr(ti, "sparse", None)  # typeshed types it as an int
    return m


def _write_regular(tar: tarfile.TarFile, ti: tarfile.TarInfo, pfd: int, name: str) -> int:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
    try:
        src = tar.extractfile(ti)
        n = 0
        if src is not None:
            for off, length in _sparse_map(ti) or [(0, ti.size)]:
                src.seek(off)
                left = length
                while left > 0:
                    chunk = src.read(min(left, CHUNK_SIZE))
                    if not chunk:
                        raise DataLoss(f"emptyDir tar member {ti.name!r} is truncated")
                    os.lseek(fd, off + length - left, os.SEEK_SET)
                    _write_all(fd, chunk)
                    left -= len(chunk)
                    n += len(chunk)
        os.ftruncate(fd, ti.size)  # a hole at the end stays a hole
        os.fchown(fd, ti.uid, ti.gid)  # owner before mode: chown clears setuid/setgid
        os.fchmod(fd, ti.mode)
        _set_xattrs(fd, ti, symlink=False)
        os.utime(fd, ns=(_mtime_ns(ti),) * 2)
    finally:
        os.close(fd)
    return n


def is_empty(target: str | Path) -> bool:
    """Whether the directory `target` holds nothing (opened without following a symlink)."""
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with os.scandir(fd) as it:
            return next(it, None) is None
    finally:
        os.close(fd)


def apply(tar_path: Path, target: Path, stop: threading.Event | None = None) -> Summary:
    """Fill the existing, empty directory `target` (the new pod's emptyDir or /dev/shm) from `tar_path`:
    FailedPrecondition when it holds anything. `stop` set: Stopped before the next member. On any
    failure it is emptied again before the error is raised."""
    target = Path(target)
    try:
        prior = Prior.of(os.stat(target, follow_symlinks=False))
        if not is_empty(target):
            raise FailedPrecondition(
                f"emptyDir {target} of the new pod is not empty: a restore fills a fresh emptyDir only"
            )
    except OSError as e:
        raise FailedPrecondition(f"emptyDir {target} of the new pod cannot be opened: {e.strerror}") from None
    s = Summary(prior=prior)
    try:
        _apply(tar_path, target, stop, s)
    except BaseException:  # a half-filled volume would pass for a filled one: empty it again
        try:
            clear(target, prior)
        except OSError as e:
            raise storage_error(e, f"cannot empty {target} again after its fill failed", target) from e
        raise
    return s


def clear(target: str | Path, prior: Prior) -> None:
    """Remove everything in `target`, a volume filled while it was empty by a restore that then
    failed, and give it back its mode, owner and times (`prior`), so that a retry finds it as the
    caller made it. Never follows a symlink: entries are removed through the directory's descriptor."""
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for name, is_dir in entries:
            if is_dir:
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        os.fchown(fd, prior.uid, prior.gid)
        os.fchmod(fd, prior.mode)
        os.utime(fd, ns=(prior.atime_ns, prior.mtime_ns))
    finally:
        os.close(fd)


def _apply(tar_path: Path, target: Path, stop: threading.Event | None, s: Summary) -> None:
    with _open(tar_path) as tar:
        members = _members(tar, tar_path)
        tree = _Rootfs(target)
        dir_times: list[tuple[tuple[str, ...], str, int]] = []
        try:
            for ti in members:
                if stop is not None and stop.is_set():
                    raise Stopped(f"filling {target} stopped: the restore's caller is gone")
                if ti.name in (".", "./"):
                    os.fchown(tree.fd, ti.uid, ti.gid)
                    os.fchmod(tree.fd, ti.mode)
                    dir_times.append(((), ".", _mtime_ns(ti)))
                    continue
                parents, name = _split(ti.name)
                pfd = tree.parent(parents, create=True, member=ti.name)
                assert pfd is not None
                _apply_member(tar, ti, tree, pfd, name, s)
                if ti.isdir():
                    dir_times.append((parents, name, _mtime_ns(ti)))
            for parents, name, ns in reversed(dir_times):  # after their entries were made
                pfd = tree.parent(parents, create=False, member=name)
                if pfd is not None:
                    os.utime(name, ns=(ns, ns), dir_fd=pfd, follow_symlinks=False)
        except (tarfile.TarError, EOFError) as e:
            raise DataLoss(f"emptyDir tar {tar_path} is truncated or corrupt ({e})") from e
        except OSError as e:
            raise storage_error(e, f"cannot fill emptyDir {target} from {tar_path}", target) from e
        finally:
            tree.close()


def _apply_member(
    tar: tarfile.TarFile, ti: tarfile.TarInfo, tree: _Rootfs, pfd: int, name: str, s: Summary
) -> None:
    if ti.isdir():
        try:
            os.mkdir(name, 0o700, dir_fd=pfd)
        except FileExistsError:
            pass
        dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        try:
            os.fchown(dfd, ti.uid, ti.gid)
            os.fchmod(dfd, ti.mode)
            _set_xattrs(dfd, ti, symlink=False)
        finally:
            os.close(dfd)
        s.dirs += 1
        return
    _remove(pfd, name)
    if ti.isreg():
        s.bytes += _write_regular(tar, ti, pfd, name)
        s.files += 1
        s.sparse_files += _sparse_map(ti) is not None
        return
    if ti.islnk():
        lparents, lname = _split(ti.linkname)
        src = _Rootfs(tree.root)  # its own walker: the cached parent fd must stay valid
        try:
            sfd = src.parent(lparents, create=False, member=ti.linkname)
            if sfd is None:
                raise InvalidArgument(f"emptyDir hard link {ti.name!r} -> {ti.linkname!r}: target is missing")
            try:
                os.link(lname, name, src_dir_fd=sfd, dst_dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                raise InvalidArgument(
                    f"emptyDir hard link {ti.name!r} -> {ti.linkname!r}: target is missing"
                ) from None
        finally:
            src.close()
        s.hardlinks += 1
        return
    if ti.issym():
        os.symlink(ti.linkname, name, dir_fd=pfd)
        s.symlinks += 1
    else:
        os.mkfifo(name, 0o600, dir_fd=pfd)
        os.chmod(name, ti.mode, dir_fd=pfd)  # just made by us: not a symlink
        s.fifos += 1
    os.chown(name, ti.uid, ti.gid, dir_fd=pfd, follow_symlinks=False)
    ns = _mtime_ns(ti)
    os.utime(name, ns=(ns, ns), dir_fd=pfd, follow_symlinks=False)
