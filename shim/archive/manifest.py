"""manifest.json: the versioned description and completion marker of a pod checkpoint (the
container checkpoint tar's podshim-manifest.json: shim/archive/container_tar.py).

`write_manifest` records size + sha256 of every other file of the tree, fsyncs the tree and
only then writes manifest.json atomically: a directory without manifest.json is partial.
`load_and_verify` refuses anything that does not match it, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shim.archive import crypto, tree_check
from shim.archive.dirfd import DirHandle, held
from shim.archive.fsutil import (
    HashedAhead,
    hash_and_flush,
    hash_file,
    map_in_threads,
)
from shim.archive.layout import (
    CHECKPOINT_DIR,
    CONFIG_DUMP_FILE,
    DELETED_FILES_FILE,
    MANIFEST_FILE,
    ROOTFS_DIFF_TAR,
    SPEC_DUMP_FILE,
)
from shim.archive.paths import check_member_path, validate_archive_dir
from shim.errors import (
    DataLoss,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    storage_error,
)

FORMAT = "podshim.checkpoint.v1"
SUPPORTED_FORMATS = frozenset({FORMAT})
FORMAT_PREFIX = "podshim.checkpoint."

# A manifest lists one line per file; far beyond any real pod, small enough to parse safely.
MAX_MANIFEST_BYTES = 64 << 20
# Largest member read whole into memory (read_verified: config.dump, network.json).
MAX_READ_BYTES = 64 << 20
# Read size of the checksum pass: fewer system calls than fsutil's 1 MiB, still streamed.
VERIFY_CHUNK = 4 << 20
# What every checkpointed container of a podshim archive has (relative to its dir): CheckpointPod
# has written each since the first format, so a manifest without `members` must list them too.
REQUIRED_MEMBERS = (
    CONFIG_DUMP_FILE,
    SPEC_DUMP_FILE,
    f"{CHECKPOINT_DIR}/inventory.img",
    ROOTFS_DIFF_TAR,
    DELETED_FILES_FILE,
)

POST_CHECKPOINT_RUNNING = "RUNNING"
# a live migration's archive (docs/design/migration.md (Live migration))
PAGES_OPTION, PAGES_SERVED_BY_SOURCE = "pages", "served-by-source"
POST_CHECKPOINT_STOPPED = "STOPPED"


def rfc3339_now() -> str:
    """Current UTC time as RFC 3339 with milliseconds, e.g. 2026-07-22T10:15:00.123Z."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class HostInfo:
    """Versions of the checkpointing host; restore compares them to its own."""

    podshim_version: str = ""
    criu_version: str = ""
    runtime_name: str = ""
    runtime_version: str = ""
    kernel: str = field(default_factory=lambda: platform.release())
    arch: str = field(default_factory=lambda: platform.machine())
    # the compatibility record (shim/archive/compat.py); "" in older manifests: not compared
    cgroup_version: str = ""  # "1" (v1 or hybrid) or "2"
    cpuinfo: str = ""  # base64 of `criu cpuinfo dump`'s cpuinfo.img


OPTIONAL_HOST_FIELDS = ("cgroup_version", "cpuinfo")
OPTIONAL_CONTAINER_FIELDS = ("image_id", "user_specified_image")


@dataclass
class SandboxInfo:
    id: str
    metadata: dict[str, Any]  # PodSandboxMetadata: name, uid, namespace, attempt
    config: dict[str, Any]  # PodSandboxConfig as JSON (protobuf MessageToDict)


@dataclass
class ContainerEntry:
    name: str
    id: str
    image: str
    state: str  # CRI state at checkpoint time, e.g. CONTAINER_RUNNING
    restart_count: int
    checkpointed: bool  # False: recorded for the pod view only (e.g. exited)
    dir: str  # relative to the archive root, e.g. "containers/app"
    # the files of a checkpointed container, relative to `dir` (write_manifest fills it); None in
    # manifests written before it existed (then REQUIRED_MEMBERS is what is checked)
    members: list[str] | None = None
    # the image's ID and its name as the pod spec gives it (docs/design/archive.md (Image
    # identity)); "" in manifests written before they existed
    image_id: str = ""
    user_specified_image: str = ""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass
class Encryption:
    """How the archive's files are encrypted (shim/archive/crypto.py); no such entry: plaintext."""

    scheme: str
    key_id: str  # first 16 hex digits of the sha256 of the node key
    mac: str = ""  # HMAC-SHA256 of the canonical manifest without this field (crypto.manifest_mac)


@dataclass
class Manifest:
    sandbox: SandboxInfo
    containers: list[ContainerEntry] = field(default_factory=list)
    host: HostInfo = field(default_factory=HostInfo)
    created: str = field(default_factory=rfc3339_now)
    timings: dict[str, float] = field(default_factory=dict)  # seconds, e.g. "freeze_window"
    criu_stats: dict[str, Any] = field(default_factory=dict)  # per container name
    options: dict[str, str] = field(default_factory=dict)
    post_checkpoint_state: str = POST_CHECKPOINT_RUNNING
    files: dict[str, FileEntry] = field(default_factory=dict)  # relpath -> size, sha256
    format: str = FORMAT
    encryption: Encryption | None = None
    # set by write_manifest(key=...): every to_json() then computes the MAC again
    mac_key: bytes | None = field(default=None, repr=False, compare=False)

    def container(self, name: str) -> ContainerEntry:
        for c in self.containers:
            if c.name == name:
                return c
        raise NotFound(f"container {name!r} is not in this checkpoint")

    def to_dict(self) -> dict[str, Any]:
        d = {
            "format": self.format,
            "created": self.created,
            "host": vars(self.host).copy(),
            "sandbox": {
                "id": self.sandbox.id,
                "metadata": self.sandbox.metadata,
                "config": self.sandbox.config,
            },
            "containers": [_container_dict(c) for c in self.containers],
            "timings": self.timings,
            "criu_stats": self.criu_stats,
            "options": self.options,
            "post_checkpoint_state": self.post_checkpoint_state,
            "files": {k: {"size": v.size, "sha256": v.sha256} for k, v in sorted(self.files.items())},
        }
        if self.encryption is not None:
            d["encryption"] = vars(self.encryption).copy()
        return d

    def to_json(self) -> bytes:
        d = self.to_dict()
        if self.encryption is not None and self.mac_key is not None:
            self.encryption.mac = d["encryption"]["mac"] = _mac(self.mac_key, d)
        return (json.dumps(d, indent=1, ensure_ascii=False) + "\n").encode()

    @classmethod
    def from_dict(cls, d: Any, where: str = MANIFEST_FILE) -> Manifest:
        """Parse a decoded manifest. Unknown format: FailedPrecondition; bad shape: DataLoss."""
        p = _Parser(where)
        if not isinstance(d, dict):
            raise p.bad("top level", "an object")
        fmt = d.get("format")
        if not isinstance(fmt, str):
            raise p.bad("format", "a string")
        check_format(fmt, where)
        sb = p.obj(d, "sandbox")
        host = p.obj(d, "host")
        containers = []
        for i, c in enumerate(p.typed(d, "containers", list)):
            cw = f"containers[{i}]"
            if not isinstance(c, dict):
                raise p.bad(cw, "an object")
            containers.append(
                ContainerEntry(
                    name=p.typed(c, "name", str, cw),
                    id=p.typed(c, "id", str, cw),
                    image=p.typed(c, "image", str, cw),
                    state=p.typed(c, "state", str, cw),
                    restart_count=p.typed(c, "restart_count", int, cw),
                    checkpointed=p.typed(c, "checkpointed", bool, cw),
                    dir=p.typed(c, "dir", str, cw),
                    members=_parse_members(p, c, cw),
                    **{k: p.typed(c, k, str, cw) for k in OPTIONAL_CONTAINER_FIELDS if k in c},
                )
            )
        files = {}
        for rel, fe in p.obj(d, "files").items():
            fw = f"files[{rel!r}]"
            if not isinstance(fe, dict):
                raise p.bad(fw, "an object")
            size = p.typed(fe, "size", int, fw)
            digest = p.typed(fe, "sha256", str, fw)
            if size < 0 or len(digest) != 64:
                raise p.bad(fw, "a non-negative size and a 64-hex-digit sha256")
            files[rel] = FileEntry(size=size, sha256=digest.lower())
        timings = p.obj(d, "timings")
        if not all(isinstance(v, int | float) for v in timings.values()):
            raise p.bad("timings", "numbers")
        options = p.obj(d, "options")
        if not all(isinstance(v, str) for v in options.values()):
            raise p.bad("options", "strings")
        return cls(
            format=fmt,
            created=p.typed(d, "created", str),
            host=HostInfo(
                **{
                    k: p.typed(host, k, str, "host")
                    for k in HostInfo.__dataclass_fields__
                    if k in host or k not in OPTIONAL_HOST_FIELDS
                }
            ),
            sandbox=SandboxInfo(
                id=p.typed(sb, "id", str, "sandbox"),
                metadata=p.obj(sb, "metadata", "sandbox"),
                config=p.obj(sb, "config", "sandbox"),
            ),
            containers=containers,
            timings=timings,
            criu_stats=p.obj(d, "criu_stats"),
            options=options,
            post_checkpoint_state=p.typed(d, "post_checkpoint_state", str),
            files=files,
            encryption=_parse_encryption(p, d),
        )


def _container_dict(c: ContainerEntry) -> dict[str, Any]:
    d = vars(c).copy()
    if c.members is None:
        del d["members"]  # as a manifest written before the field existed
    for key in OPTIONAL_CONTAINER_FIELDS:
        if not d[key]:
            del d[key]
    return d


def _parse_members(p: _Parser, c: dict[str, Any], where: str) -> list[str] | None:
    if "members" not in c:
        return None
    members = p.typed(c, "members", list, where)
    if not all(isinstance(x, str) for x in members):
        raise p.bad(f"{where}.members", "a list of strings")
    return members


def check_container_members(root: Path, m: Manifest, c: ContainerEntry) -> None:
    """A checkpointed container's files, as the manifest lists them, are all it must have: the
    members it records (exactly), and in any case REQUIRED_MEMBERS. DataLoss otherwise: a
    rootfs-diff.tar removed with its manifest entry would restore without the writable layer."""
    prefix = c.dir.rstrip("/") + "/"
    listed = {rel[len(prefix) :] for rel in m.files if rel.startswith(prefix)}
    missing = sorted((set(REQUIRED_MEMBERS) | set(c.members or ())) - listed)
    if missing:
        said = "its manifest entry lists" if c.members is not None else "every podshim checkpoint has"
        raise DataLoss(
            f"checkpoint {root} is incomplete: container {c.name!r} has no {_names(missing)} "
            f"({said} them): the archive lost part of the container's state; take a new checkpoint"
        )
    extra = sorted(listed - set(c.members)) if c.members is not None else []
    if extra:
        raise DataLoss(
            f"checkpoint {root} was modified: container {c.name!r} has {_names(extra)}, which its "
            "manifest entry does not list; the archive cannot be trusted, take a new checkpoint"
        )


def _parse_encryption(p: _Parser, d: dict[str, Any]) -> Encryption | None:
    if "encryption" not in d:
        return None
    enc = p.obj(d, "encryption")
    return Encryption(**{k: p.typed(enc, k, str, "encryption") for k in ("scheme", "key_id", "mac")})


def _mac(mac_key: bytes, doc: dict[str, Any]) -> str:
    """The MAC of a manifest document: over its JSON form without encryption.mac."""
    return crypto.manifest_mac(mac_key, _without_mac(json.loads(json.dumps(doc))))  # as a reader decodes it


def check_encryption(root: Path, doc: dict[str, Any], m: Manifest, key: crypto.NodeKey | None) -> None:
    """An encrypted archive needs this node's key (FailedPrecondition without one, DataLoss for
    another one) and a manifest whose MAC matches (DataLoss)."""
    enc = m.encryption
    if enc is None:
        return
    if enc.scheme != crypto.SCHEME:
        raise FailedPrecondition(
            f"{root} is encrypted with scheme {enc.scheme!r}, this podshim supports {crypto.SCHEME!r}: "
            "restore it with a podshim version that supports that scheme"
        )
    if key is None:
        raise FailedPrecondition(
            f"{root} is encrypted (key id {enc.key_id}) and this node has no "
            "checkpoint.encryption_key_file: configure the node key that wrote it"
        )
    if enc.key_id != key.key_id:
        raise DataLoss(
            f"{root} was encrypted with another key (key id {enc.key_id}, this node's key "
            f"{key.path} has id {key.key_id}): wrong key; restore it on a node with that key"
        )
    if not enc.mac or not crypto.mac_matches(key.manifest_key(), _without_mac(doc), enc.mac):
        raise DataLoss(
            f"{root / MANIFEST_FILE} does not authenticate (its MAC does not match): it was modified; "
            "the checkpoint cannot be trusted, take a new checkpoint"
        )


def _without_mac(doc: dict[str, Any]) -> dict[str, Any]:
    out = dict(doc)
    out["encryption"] = {k: v for k, v in doc["encryption"].items() if k != "mac"}
    return out


class _Parser:
    """Field access that turns a malformed manifest into one clear DataLoss."""

    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, name: str, expected: str) -> DataLoss:
        return DataLoss(
            f"{self.where}: field {name} is missing or not {expected}: the checkpoint is "
            "corrupt or was not written by podshim; take a new checkpoint"
        )

    def typed(self, d: dict[str, Any], key: str, typ: type, parent: str = "") -> Any:
        v = d.get(key)
        # bool is an int subclass: a count must not accept true/false
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise self.bad(f"{parent}.{key}" if parent else key, f"a {typ.__name__}")
        return v

    def obj(self, d: dict[str, Any], key: str, parent: str = "") -> dict[str, Any]:
        return self.typed(d, key, dict, parent)


def check_format(fmt: str, where: str = MANIFEST_FILE) -> None:
    if fmt in SUPPORTED_FORMATS:
        return
    known = ", ".join(sorted(SUPPORTED_FORMATS))
    if fmt.startswith(FORMAT_PREFIX):
        raise FailedPrecondition(
            f"{where}: checkpoint format {fmt!r} is not supported by this podshim "
            f"(supports {known}); restore it with a podshim version that writes that format"
        )
    raise FailedPrecondition(f"{where}: format {fmt!r} is not a podshim checkpoint (expected {known})")


def _check_members(root: Path, m: Manifest) -> None:
    for rel in m.files:
        norm = check_member_path(rel, f"{root}: manifest file entry")
        if str(norm) != rel:
            raise InvalidArgument(
                f"{root}: manifest file entry {rel!r} is not in normal form ({str(norm)!r})"
            )
        if rel == MANIFEST_FILE:
            raise InvalidArgument(f"{root}: manifest lists itself as a member")
    names: set[str] = set()
    for c in m.containers:
        check_member_path(c.dir, f"{root}: container {c.name!r} dir")
        if c.name in names:
            raise DataLoss(f"{root}: container {c.name!r} appears twice in the manifest")
        names.add(c.name)


# ---------------------------------------------------------------------------- write / read


def write_manifest(
    root: Path | DirHandle,
    manifest: Manifest,
    workers: int = 1,
    key: crypto.NodeKey | None = None,
    stop: threading.Event | None = None,
    hashed_ahead: HashedAhead | None = None,
) -> Manifest:
    """Checksum every file under `root`, fsync the tree, then write manifest.json atomically.

    Fills `manifest.files` (replacing any previous value) and returns the manifest. With `key`
    (the files were encrypted with it: crypto.encrypt_tree) it records the encryption and
    authenticates the manifest (its MAC is computed at every to_json()). `hashed_ahead`: digests
    taken as the files were written (fsutil.hash_and_flush). `stop` set: raises fsutil.Stopped at
    the next chunk (the caller was cancelled). `root` is listed, read and written only through
    descriptors (a DirHandle the caller holds, or the path opened once).
    """
    with held(root) as h:
        _check_members(h.path, manifest)
        with h.tree(lambda msg: Internal(f"unexpected entry in checkpoint: {msg}")) as tree:
            rels = sorted(rel for rel in tree.files if rel != MANIFEST_FILE)
            try:
                results = hash_and_flush([tree.path(rel) for rel in rels], workers, stop, hashed_ahead)
            except OSError as e:
                raise storage_error(
                    e, f"cannot checksum/fsync checkpoint {h.path} (check the disk)", h.proc
                ) from e
            manifest.files = {
                rel: FileEntry(size=s, sha256=d) for rel, (s, d) in zip(rels, results, strict=True)
            }
            _record_members(manifest, rels)
            try:
                tree.fsync_dirs()  # entries of every dir durable before the marker exists
            except OSError as e:
                raise storage_error(e, f"cannot fsync checkpoint {h.path} (check the disk)", h.proc) from e
        if key is not None:
            manifest.encryption = Encryption(scheme=crypto.SCHEME, key_id=key.key_id)
            manifest.mac_key = key.manifest_key()
        h.write_file(MANIFEST_FILE, manifest.to_json())
    return manifest


def _record_members(manifest: Manifest, rels: list[str]) -> None:
    """Each checkpointed container's files (what RestorePod checks it still has)."""
    for c in manifest.containers:
        if c.checkpointed:
            prefix = c.dir.rstrip("/") + "/"
            c.members = [rel[len(prefix) :] for rel in rels if rel.startswith(prefix)]


def read_manifest(root: Path) -> Manifest:
    """Parse `root`/manifest.json without checking the files (see load_and_verify)."""
    path, doc = _read_doc(Path(root))
    return Manifest.from_dict(doc, str(path))


def _read_doc(root: Path) -> tuple[Path, Any]:
    """`root`/manifest.json decoded (read once: what is parsed is what is authenticated)."""
    path = root / MANIFEST_FILE
    try:
        st = os.lstat(path)
    except FileNotFoundError as e:
        raise NotFound(
            f"{root} has no {MANIFEST_FILE}: it is not a complete podshim checkpoint "
            "(an interrupted checkpoint never gets one); take a new checkpoint"
        ) from e
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{path} is not a regular file (symlink or special file)")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise DataLoss(f"{path} is {st.st_size} bytes, over the {MAX_MANIFEST_BYTES} limit")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise Internal(f"cannot read {path}: {e}") from e
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise DataLoss(
            f"{path} is truncated or not valid JSON ({e}): the checkpoint is corrupt; take a new checkpoint"
        ) from e
    return path, doc


def verify_files(
    root: Path, manifest: Manifest, workers: int = 1, stop: threading.Event | None = None
) -> None:
    """Check the tree under `root` against `manifest.files`: exact set, sizes, sha256.

    Sizes are compared before any byte is hashed, so truncation fails fast; so is a member that
    cannot be what podshim wrote without reading it: a sparse file (tree_check.check_allocated). `stop`
    set (the caller was cancelled): fsutil.Stopped at the next chunk.
    """
    check_tree(root, manifest, stop)
    verify_digests(root, manifest, list(manifest.files), workers, stop)


def check_tree(root: Path, manifest: Manifest, stop: threading.Event | None = None) -> None:
    """verify_files without reading the files' bytes: the exact set of files, their sizes, no
    sparse member. What RestorePod checks before it creates anything; verify_digests then."""
    root = Path(root)
    _check_members(root, manifest)
    on_disk = tree_check.scan_tree(root, InvalidArgument)
    expected = manifest.files
    missing = sorted(set(expected) - set(on_disk))
    if missing:
        raise DataLoss(
            f"checkpoint {root} is incomplete: {_names(missing)} listed in the manifest "
            "are missing; take a new checkpoint"
        )
    extra = sorted(set(on_disk) - set(expected))
    if extra:
        raise DataLoss(
            f"checkpoint {root} was modified: {_names(extra)} not listed in the manifest; "
            "the archive cannot be trusted, take a new checkpoint"
        )
    wrong_size = [r for r in sorted(expected) if on_disk[r] != expected[r].size]
    if wrong_size:
        r = wrong_size[0]
        raise DataLoss(
            f"checkpoint {root} is corrupt: {r} is {on_disk[r]} bytes, the manifest says "
            f"{expected[r].size}" + (f" (and {len(wrong_size) - 1} more)" if wrong_size[1:] else "")
        )
    rels = sorted(expected)
    tree_check.check_allocated(root, {r: expected[r].size for r in rels}, stop)


def verify_digests(
    root: Path, manifest: Manifest, rels: Sequence[str], workers: int = 1, stop: threading.Event | None = None
) -> None:
    """The sha256 (and size) of each of `rels` against the manifest (DataLoss naming the first
    file that differs). Largest first on `workers` threads, so that a single large memory image
    does not start last: the pass takes about max(largest file, all / workers)."""
    root = Path(root)
    expected = manifest.files
    rels = sorted(rels, key=lambda r: (-expected[r].size, r))
    try:
        results = map_in_threads(lambda rel: hash_file(root / rel, VERIFY_CHUNK, stop), rels, workers)
    except OSError as e:
        raise Internal(f"cannot read checkpoint {root}: {e}") from e
    bad = sorted(
        (rel, digest)
        for rel, (size, digest) in zip(rels, results, strict=True)
        if digest != expected[rel].sha256 or size != expected[rel].size
    )
    if bad:
        rel, digest = bad[0]
        raise DataLoss(
            f"checkpoint {root} is corrupt: {rel} has sha256 {digest}, the manifest says "
            f"{expected[rel].sha256}"
            + (f" (and {len(bad) - 1} more files differ)" if bad[1:] else "")
            + "; take a new checkpoint"
        )


def read_verified(root: Path, manifest: Manifest, rel: str, limit: int = MAX_READ_BYTES) -> bytes:
    """A small member's bytes, read once through one descriptor (no symlink followed) and checked
    against the manifest's size and sha256 before anyone parses them: what is checked is what is
    used (RestorePod's config.dump and sandbox/network.json). DataLoss when they differ."""
    root = Path(root)
    entry = manifest.files.get(rel)
    if entry is None:
        raise DataLoss(f"checkpoint {root}: {rel} is not listed in the manifest; take a new checkpoint")
    if entry.size > limit:
        raise DataLoss(f"checkpoint {root}: {rel} is {entry.size} bytes, over the {limit} limit")
    try:
        fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise DataLoss(
            f"checkpoint {root}: cannot read {rel} ({e.strerror}): take a new checkpoint"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != entry.size or digest != entry.sha256:
        raise DataLoss(
            f"checkpoint {root} is corrupt: {rel} has sha256 {digest}, the manifest says {entry.sha256}; "
            "take a new checkpoint"
        )
    return data


def _names(rels: list[str], limit: int = 5) -> str:
    shown = ", ".join(rels[:limit])
    return shown + (f" and {len(rels) - limit} more" if len(rels) > limit else "")


def load_and_verify(
    path: str | Path,
    allowed_roots: Sequence[str],
    workers: int = 1,
    key: crypto.NodeKey | None = None,
    stop: threading.Event | None = None,
) -> Manifest:
    """Validate the archive dir, parse its manifest and verify every file; return the manifest.

    NotFound: missing dir or manifest. DataLoss: truncated/unparseable manifest, size or
    checksum mismatch (naming the file), missing or extra file. FailedPrecondition: unknown
    format. InvalidArgument: path outside the roots, escaping member paths, symlinks inside.
    Encrypted archives (check_encryption): FailedPrecondition without `key` (this node's key),
    DataLoss for another key or a manifest whose MAC does not match. `stop` set (the caller
    was cancelled): fsutil.Stopped at the next chunk read.
    """
    root = validate_archive_dir(str(path), allowed_roots)
    manifest = load_and_check(root, allowed_roots, key, stop)
    verify_digests(root, manifest, list(manifest.files), workers, stop)
    return manifest


def load_and_check(
    path: str | Path,
    allowed_roots: Sequence[str],
    key: crypto.NodeKey | None = None,
    stop: threading.Event | None = None,
    pages_from_source: bool = False,
) -> Manifest:
    """load_and_verify without the checksum pass (check_tree instead of verify_files): the same
    refusals except a file whose bytes differ, which verify_digests (or read_verified) finds.
    A live migration's archive (PAGES_OPTION) is refused unless `pages_from_source` (its destination)."""
    root = validate_archive_dir(str(path), allowed_roots)
    where, doc = _read_doc(root)
    manifest = Manifest.from_dict(doc, str(where))
    if manifest.options.get(PAGES_OPTION) == PAGES_SERVED_BY_SOURCE and not pages_from_source:
        why = "its memory pages stayed on the source node, which served them to the destination"
        raise FailedPrecondition(f"{path} is a live migration's archive ({why}): it cannot be restored")
    check_encryption(root, doc, manifest, key)
    check_tree(root, manifest, stop)
    return manifest
