"""Encryption at rest of pod checkpoints (memory images hold secrets): every archive file encrypted
with the node key in authenticated chunks, the manifest authenticated by an HMAC, and the
decrypted copies a restore reads (docs/design/archive.md (Encryption at rest)).

`cryptography` is imported lazily: podshim-runc imports this package for every restore."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from shim import contract
from shim.archive.dirfd import DirHandle, held
from shim.archive.fsutil import FILE_MODE, make_private_dir, temp_name_for
from shim.archive.fsutil import Stopped as Stopped  # one stop signal for all tree work
from shim.deadlines import STALE_DECRYPTED_SECONDS as STALE_DECRYPTED_SECONDS
from shim.errors import DataLoss, FailedPrecondition, Internal, ShimError, storage_error

SCHEME = "aes-256-gcm-chunked-v1"
KEY_SIZE = 32
CHUNK_SIZE = 1 << 20  # 1 MiB of plaintext per AEAD chunk
TAG_SIZE = 16
MAGIC = b"PSHIMENC"
VERSION = 1
_HEADER = struct.Struct(">8sBI16s")  # magic, version, chunk size, salt
HEADER_SIZE = _HEADER.size
_MIN_CHUNK, _MAX_CHUNK = 4 << 10, 64 << 20  # what a header may declare
AAD_PREFIX = b"podshim.checkpoint.file.v1\0"
FILE_INFO = b"podshim checkpoint file key v1"
MANIFEST_INFO = b"podshim checkpoint manifest mac v1"

DECRYPTED_DIR = contract.DECRYPTED_DIR  # <state_dir>/decrypted/<random>/: one container's plaintext
DECRYPTED_MARKER = contract.DECRYPTED_MARKER  # JSON {archive, container, container_id, created}


# ---------------------------------------------------------------------------- the node key


@dataclass(frozen=True)
class NodeKey:
    """The node key; `key_id` (first 16 hex digits of its sha256) is what archives record."""

    raw: bytes = field(repr=False)
    path: str = ""

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()[:16]

    def _derive(self, info: bytes, salt: bytes | None = None) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(self.raw)

    def file_key(self, salt: bytes) -> bytes:
        return self._derive(FILE_INFO, salt)

    def manifest_key(self) -> bytes:
        return self._derive(MANIFEST_INFO)


def load_key(path: str) -> NodeKey:
    """Read the node key file; FailedPrecondition naming the key when it is unusable (missing,
    not a root-owned 0600 regular file, not 32 bytes) — the node's configuration is broken."""
    from shim.config import key_file_problem

    problem = key_file_problem(path)
    if problem is None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                raw = f.read(KEY_SIZE + 1)
        except OSError as e:
            problem = f"cannot be read: {e.strerror}"
        else:
            if len(raw) != KEY_SIZE:
                problem = f"holds {len(raw)} bytes, must hold exactly {KEY_SIZE} random bytes"
    if problem is not None:
        raise FailedPrecondition(f"checkpoint.encryption_key_file {path} {problem}")
    return NodeKey(raw, path)


# ---------------------------------------------------------------------------- manifest MAC


def canonical_json(doc: Any) -> bytes:
    """The bytes the manifest MAC covers: sorted keys, no spaces, ASCII only."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_mac(mac_key: bytes, doc: Any) -> str:
    """HMAC-SHA256 (hex) of the canonical form of `doc` (a decoded manifest without its mac)."""
    return hmac.new(mac_key, canonical_json(doc), hashlib.sha256).hexdigest()


def mac_matches(mac_key: bytes, doc: Any, mac: str) -> bool:
    return hmac.compare_digest(manifest_mac(mac_key, doc), mac)


# ---------------------------------------------------------------------------- one file


def _aesgcm(key: bytes) -> Any:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def _nonce(index: int) -> bytes:
    return index.to_bytes(12, "big")


def _aad(header: bytes, rel: str, index: int, last: bool) -> bytes:
    return b"".join(
        (
            AAD_PREFIX,
            header,
            rel.encode("utf-8", "surrogateescape"),
            b"\0",
            index.to_bytes(8, "big"),
            b"\1" if last else b"\0",
        )
    )


def _check_stop(stop: Any) -> None:
    if stop is not None and stop.is_set():
        raise Stopped


def _fill(src: IO[bytes], view: memoryview) -> int:
    """Read into `view` until it is full or `src` ends; returns the bytes read."""
    got = 0
    while got < len(view):
        n = src.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            break
        got += n
    return got


def _write_all(dst: IO[bytes], view: memoryview) -> None:
    while view:
        n = dst.write(view)
        view = view[n:]


def encrypt_stream(src: IO[bytes], dst: IO[bytes], rel: str, key: NodeKey, stop: Any = None) -> int:
    """Encrypt `src` into `dst` (header + chunks) as the archive member `rel`; returns bytes written.

    Preallocated buffers (read ahead by one chunk to know the last one): no allocation per chunk."""
    salt = secrets.token_bytes(16)
    header = _HEADER.pack(MAGIC, VERSION, CHUNK_SIZE, salt)
    aes = _aesgcm(key.file_key(salt))
    _write_all(dst, memoryview(header))
    written = len(header)
    cur, nxt = memoryview(bytearray(CHUNK_SIZE)), memoryview(bytearray(CHUNK_SIZE))
    out = memoryview(bytearray(CHUNK_SIZE + TAG_SIZE))
    index = 0
    n = _fill(src, cur)
    while True:
        _check_stop(stop)
        m = _fill(src, nxt) if n == CHUNK_SIZE else 0
        last = m == 0
        size = aes.encrypt_into(_nonce(index), cur[:n], _aad(header, rel, index, last), out[: n + TAG_SIZE])
        _write_all(dst, out[:size])
        written += size
        if last:
            return written
        cur, nxt, n = nxt, cur, m
        index += 1


def decrypt_stream(
    src: IO[bytes],
    dst: IO[bytes] | None,
    rel: str,
    key: NodeKey,
    stop: Any = None,
    limit: int | None = None,
) -> bytes:
    """Decrypt `src` (the archive member `rel`) into `dst`, or return the plaintext when `dst` is
    None (then at most `limit` bytes). DataLoss naming `rel` when anything does not authenticate."""
    from cryptography.exceptions import InvalidTag

    def corrupt(why: str) -> DataLoss:
        return DataLoss(
            f"encrypted checkpoint file {rel} {why}: it was modified, truncated or encrypted with "
            "another key; the checkpoint cannot be trusted, take a new checkpoint"
        )

    hbuf = memoryview(bytearray(HEADER_SIZE))
    if _fill(src, hbuf) != HEADER_SIZE:
        raise corrupt("is shorter than its header")
    header = bytes(hbuf)
    magic, version, chunk, salt = _HEADER.unpack(header)
    if magic != MAGIC:
        raise corrupt("is not a podshim-encrypted file (bad magic)")
    if version != VERSION or not _MIN_CHUNK <= chunk <= _MAX_CHUNK:
        raise corrupt(f"has an unknown header (version {version}, chunk size {chunk})")
    aes = _aesgcm(key.file_key(salt))
    block = chunk + TAG_SIZE
    cur, nxt = memoryview(bytearray(block)), memoryview(bytearray(block))
    plain = memoryview(bytearray(chunk))
    out: list[bytes] = []
    total = 0
    index = 0
    n = _fill(src, cur)
    while True:
        _check_stop(stop)
        if n < TAG_SIZE:
            raise corrupt(f"is truncated (chunk {index} is missing or short)")
        m = _fill(src, nxt) if n == block else 0
        last = m == 0
        try:
            size = aes.decrypt_into(
                _nonce(index), cur[:n], _aad(header, rel, index, last), plain[: n - TAG_SIZE]
            )
        except InvalidTag:
            raise corrupt(f"does not authenticate (chunk {index})") from None
        total += size
        if dst is not None:
            _write_all(dst, plain[:size])
        else:
            if limit is not None and total > limit:
                raise corrupt(f"is over {limit} bytes")
            out.append(bytes(plain[:size]))
        if last:
            return b"".join(out)
        cur, nxt, n = nxt, cur, m
        index += 1


def is_encrypted_bytes(data: bytes) -> bool:
    return data[: len(MAGIC)] == MAGIC


def _open_new(path: Path) -> IO[bytes]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "wb", buffering=0)  # whole chunks are written: no buffer copy


def _open_read(path: Path) -> IO[bytes]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    return os.fdopen(fd, "rb", buffering=0)  # read into the caller's buffers


def encrypt_file(path: Path, rel: str, key: NodeKey, stop: Any = None) -> int:
    """Replace `path` by its encrypted form: a temporary sibling, then an atomic rename (the file
    is either plaintext or complete ciphertext). Not fsynced: write_manifest flushes the tree
    before the completion marker exists. Returns the new size."""
    path = Path(path)
    tmp = path.parent / temp_name_for(path.name)
    try:
        with _open_read(path) as src, _open_new(tmp) as dst:
            size = encrypt_stream(src, dst, rel, key, stop)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


class _Hashed:
    """A reader that hashes what passes through it: the ciphertext decrypt_stream reads once."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def readinto(self, view: memoryview) -> int:
        n = self.raw.readinto(view) or 0  # type: ignore[attr-defined]
        if n:
            self.sha256.update(view[:n])
            self.size += n
        return n


def decrypt_file(
    src_path: Path,
    dst_path: Path,
    rel: str,
    key: NodeKey,
    stop: Any = None,
    expect: tuple[int, str] | None = None,
) -> None:
    """Decrypt `src_path` into the new file `dst_path`. With `expect` (the manifest's size and
    sha256 of the encrypted file), the ciphertext is hashed as it is read, in the same pass, and
    must match (DataLoss naming the file): RestorePod's checksum pass skips what it decrypts."""
    with _open_read(src_path) as raw, _open_new(dst_path) as dst:
        src = _Hashed(raw) if expect is not None else raw
        decrypt_stream(src, dst, rel, key, stop)  # type: ignore[arg-type]
        if isinstance(src, _Hashed) and expect is not None:
            rest = memoryview(bytearray(CHUNK_SIZE))
            while src.readinto(rest):  # decrypt_stream stops at the last chunk: nothing may follow
                _check_stop(stop)
            digest = src.sha256.hexdigest()
            if (src.size, digest) != (expect[0], expect[1]):
                raise DataLoss(
                    f"checkpoint {Path(src_path).parent} is corrupt: {rel} has sha256 {digest} "
                    f"({src.size} bytes), the manifest says {expect[1]} ({expect[0]} bytes); take a new "
                    "checkpoint"
                )


def decrypt_bytes(path: Path, rel: str, key: NodeKey, limit: int = 64 << 20) -> bytes:
    """The plaintext of a small archive member (e.g. config.dump), read whole."""
    with _open_read(path) as src:
        return decrypt_stream(src, None, rel, key, limit=limit)


def decrypt_buffer(data: bytes, rel: str, key: NodeKey, limit: int = 64 << 20) -> bytes:
    """The plaintext of the archive member `rel` whose encrypted bytes the caller already read
    (and checked against the manifest: manifest.read_verified)."""
    import io

    return decrypt_stream(io.BytesIO(data), None, rel, key, limit=limit)


# ---------------------------------------------------------------------------- trees


class _Either:
    """Stop when the caller says so or when a sibling worker failed."""

    def __init__(self, outer: threading.Event | None) -> None:
        self.outer = outer
        self.local = threading.Event()

    def is_set(self) -> bool:
        return self.local.is_set() or (self.outer is not None and self.outer.is_set())


def _run_all(fn: Any, items: list[str], workers: int, stop: threading.Event | None) -> None:
    """fn(item, stop) for every item, on `workers` threads; the first failure stops the rest."""
    either = _Either(stop)
    if workers > 1 and len(items) > 1:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="podshim-crypt") as pool:
            futures = [pool.submit(fn, i, either) for i in items]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                either.local.set()  # the running ones stop at their next chunk
                for f in futures:
                    f.cancel()
                raise
    else:
        for i in items:
            fn(i, either)


def encrypt_tree(
    root: Path | DirHandle,
    key: NodeKey,
    skip: Iterable[str] = ("manifest.json",),
    workers: int = 1,
    stop: Any = None,
) -> int:
    """Encrypt every regular file under `root` in place (except `skip`, relative paths); returns
    the number of files. Anything but directories and regular files is Internal. The tree is
    walked and rewritten through descriptors only (shim/archive/dirfd.py)."""
    skipped = set(skip)
    with held(root) as h, h.tree(lambda msg: Internal(f"unexpected entry in checkpoint: {msg}")) as tree:
        rels = sorted(rel for rel in tree.files if rel not in skipped)
        try:
            _run_all(lambda rel, ev: encrypt_file(tree.path(rel), rel, key, ev), rels, workers, stop)
        except (Stopped, DataLoss):
            raise
        except OSError as e:
            raise storage_error(
                e, f"cannot encrypt checkpoint {h.path}", h.proc, "room for the ciphertext"
            ) from e
    return len(rels)


def decrypt_members(
    archive: Path,
    rels: Iterable[str],
    prefix: str,
    dest: Path | DirHandle,
    key: NodeKey,
    workers: int = 1,
    stop: Any = None,
    expect: dict[str, tuple[int, str]] | None = None,
) -> None:
    """Decrypt the archive members `rels` that lie under `prefix` ("containers/<name>") into
    `dest`, keeping their paths below `prefix` (directories 0700, files 0600). `dest` is opened
    once (O_NOFOLLOW at every level) and written only through descriptors (dirfd.py). `expect`:
    the manifest's (size, sha256) of each member, checked in the decryption's own read
    (decrypt_file)."""
    archive = Path(archive)
    mine = sorted(r for r in rels if r.startswith(prefix + "/"))
    with held(dest) as d:
        parents: dict[str, DirHandle] = {"": d}
        try:
            for rel in mine:
                parent = rel[len(prefix) + 1 :].rpartition("/")[0]
                if parent not in parents:
                    parents[parent] = d.sub(parent, create=True)

            def one(rel: str, ev: Any) -> None:
                parent, _, name = rel[len(prefix) + 1 :].rpartition("/")
                want = expect.get(rel) if expect is not None else None
                if expect is not None and want is None:
                    raise DataLoss(f"checkpoint {archive}: {rel} is not listed in the manifest")
                decrypt_file(archive / rel, parents[parent].at(name), rel, key, ev, want)

            _run_all(one, mine, workers, stop)
        except (Stopped, DataLoss):
            raise
        except OSError as e:
            raise storage_error(
                e, f"cannot decrypt checkpoint {archive} into {d.path}", d.proc, "room for the plaintext"
            ) from e
        finally:
            for k, sub in parents.items():
                if k:
                    sub.close()


# ---------------------------------------------------------------------------- decrypted dirs


def decrypted_root(state_dir: str | Path) -> Path:
    return Path(state_dir) / DECRYPTED_DIR


def decrypted_dir_path(state_dir: str | Path) -> Path:
    """A fresh name `<state_dir>/decrypted/<random>`, chosen before the directory is made, so that
    a caller cancelled while new_decrypted_dir runs in a thread still knows what to remove."""
    return decrypted_root(state_dir) / secrets.token_hex(8)


def new_decrypted_dir(state_dir: str | Path, archive: Path, container: str, name: str | None = None) -> Path:
    """A fresh `<state_dir>/decrypted/<name>/` (0700, `name` from decrypted_dir_path, else random)
    holding its marker, made through `<state_dir>/decrypted` opened with O_NOFOLLOW (dirfd.py)."""
    root = make_private_dir(decrypted_root(state_dir))
    name = name or secrets.token_hex(8)
    with DirHandle.open(os.path.realpath(root)) as r, r.mkdir(name) as d:
        _write_marker(d, {"archive": str(archive), "container": container, "created": time.time()})
    return root / name


def _write_marker(d: DirHandle, data: dict[str, Any]) -> None:
    d.write_file(DECRYPTED_MARKER, (json.dumps(data) + "\n").encode())


def write_marker(d: Path, data: dict[str, Any]) -> None:
    with held(d) as h:
        _write_marker(h, data)


def read_marker(d: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(d) / DECRYPTED_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def set_owner(d: Path, container_id: str) -> None:
    """Record the container that uses decrypted dir `d` (once CreateContainer returned)."""
    data = read_marker(d)
    if data is None:  # podshim-runc already consumed it (RestorePod option start=true)
        return
    data["container_id"] = container_id
    write_marker(d, data)


def is_decrypted_dir(d: Path) -> bool:
    return (Path(d) / DECRYPTED_MARKER).is_file()


def list_decrypted(state_dir: str | Path) -> list[tuple[Path, dict[str, Any] | None, float]]:
    """(dir, marker or None, age in seconds) of every decrypted dir."""
    out = []
    try:
        entries = sorted(os.scandir(decrypted_root(state_dir)), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    now = time.time()
    for e in entries:
        if not e.is_dir(follow_symlinks=False):
            continue
        try:
            age = now - e.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        out.append((Path(e.path), read_marker(Path(e.path)), age))
    return out


def remove_decrypted(d: Path) -> None:
    """Remove decrypted dir `d` through its parent opened with O_NOFOLLOW (never by path)."""
    d = Path(d)
    with contextlib.suppress(OSError, ShimError), DirHandle.open(os.path.realpath(d.parent)) as parent:
        parent.remove(d.name)
