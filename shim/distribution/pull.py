"""`podshim pull REF DIR`: a registry artifact back into a pod checkpoint directory, as untrusted
input: the target held, the manifest and every layer's size, digest and members checked as they
stream, everything staged in `DIR/.podshim-pull-<random>` and renamed in (manifest.json last)
only when all verified (docs/design/distribution.md (Checkpoints through a registry))."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import tarfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests

from shim import faults
from shim.archive import manifest as mf
from shim.archive import paths, tree_check, writeback
from shim.archive.dirfd import DirHandle, open_checked
from shim.archive.fsutil import CHUNK_SIZE, FILE_MODE
from shim.archive.layout import MANIFEST_FILE
from shim.distribution import artifact
from shim.distribution.registry_auth import RegistryClient, client_for
from shim.errors import (
    Aborted,
    DataLoss,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    ShimError,
    Unavailable,
)

STAGING_PREFIX = ".podshim-pull-"
# Writes end on 1 MiB boundaries of the file: one covering an aligned 2 MiB makes the kernel fill a
# 2 MiB page-cache folio, which costs this VM ~13 times the CPU (docs/design/versions.md (This
# machine)).
WRITE_SIZE = CHUNK_SIZE
Progress = Callable[[int, int], None]


@dataclass
class PullResult:
    ref: str
    path: str
    digest: str  # the OCI manifest's
    manifest: mf.Manifest
    annotations: dict[str, str] = field(default_factory=dict)
    bytes_fetched: int = 0
    seconds: float = 0.0


def _stream_error(client: RegistryClient, e: BaseException) -> ShimError:
    return Unavailable(
        f"the transfer from registry {client.ref.host} broke off ({type(e).__name__}); "
        "nothing was kept: retry"
    )


class _Blob:
    """A blob's bytes as they arrive: at most `size` (DataLoss the moment there are more), hashed;
    `finish()` checks the count and the digest (hashed in a lane of its own, beside the reads)."""

    def __init__(
        self, client: RegistryClient, digest: str, size: int, what: str, on_bytes: Callable[[int], None]
    ) -> None:
        self.client = client
        self.digest = digest
        self.size = size
        self.what = what
        self.on_bytes = on_bytes
        self.sha = hashlib.sha256()
        self.count = 0
        self.buf = memoryview(b"")
        r = client.check(
            client.do_request(client.url(client.ref.container.get_blob_url(digest)), "GET", stream=True),
            f"fetching {what}",
        )
        self.response = r
        self.chunks = r.iter_content(chunk_size=CHUNK_SIZE)
        self.hasher = _Lane("podshim-pull-digest")  # the digest beside the socket reads

    def _next(self) -> bytes:
        try:
            chunk = next(self.chunks, b"")
        except (requests.exceptions.RequestException, OSError) as e:
            raise _stream_error(self.client, e) from None
        if chunk:
            self.count += len(chunk)
            if self.count > self.size:
                raise DataLoss(
                    f"registry artifact {self.client.ref.text}: {self.what} is larger than the {self.size} "
                    "bytes its descriptor announces: refused, nothing was kept"
                )
            self.hasher.submit(self.sha.update, chunk)
            self.on_bytes(len(chunk))
        return chunk

    def read(self, n: int = -1) -> bytes | memoryview:
        """At most `n` bytes of the chunk that arrived (a short read: the tar reader and zstd ask
        again; a view, not a copy of the rest: zstd asks for 128 KiB at a time), or everything
        with n < 0; empty at the end."""
        if n < 0:
            parts: list[bytes | memoryview] = [self.buf]
            while chunk := self._next():
                parts.append(chunk)
            self.buf = memoryview(b"")
            return b"".join(parts)
        if not self.buf:
            self.buf = memoryview(self._next())
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def finish(self) -> None:
        """Drain what the tar reader left (end blocks), then hold the blob to its descriptor."""
        self.buf = memoryview(b"")
        while self._next():
            pass
        self.response.close()
        self.hasher.drain()
        if self.count != self.size:
            raise DataLoss(
                f"registry artifact {self.client.ref.text}: {self.what} is {self.count} bytes, its "
                f"descriptor announces {self.size}: refused, nothing was kept"
            )
        got = "sha256:" + self.sha.hexdigest()
        if got != self.digest:
            raise DataLoss(
                f"registry artifact {self.client.ref.text}: {self.what} has digest {got}, its descriptor "
                f"says {self.digest}: it was tampered with or corrupted; refused, nothing was kept"
            )

    def close(self) -> None:
        self.response.close()
        self.hasher.close()


class _Capped:
    """A decompressed stream held to `cap` bytes (a small layer cannot inflate into a big one)."""

    def __init__(self, reader: Any, cap: int, what: str) -> None:
        self.reader = reader
        self.cap = cap
        self.what = what
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self.reader.read(n if n >= 0 else CHUNK_SIZE)
        self.count += len(data)
        if self.count > self.cap:
            raise DataLoss(
                f"registry artifact: {self.what} decompresses to more than the {self.cap} bytes its files "
                "can take: refused, nothing was kept"
            )
        return data


def _read_all(blob: _Blob) -> bytes:
    try:
        data = blob.read(-1)
        blob.finish()
    finally:
        blob.close()
    assert isinstance(data, bytes)  # read(-1) joins the chunks: bytes, never a view
    return data


def pull(
    ref: str,
    dest: str | os.PathLike[str],
    *,
    allowed_roots: Sequence[str],
    insecure: bool = False,
    registry_config: str | None = None,
    progress: Progress | None = None,
) -> PullResult:
    """Pull the pod checkpoint artifact `ref` into the empty directory `dest` (inside
    `allowed_roots`). Returns what was pulled; any failure leaves `dest` empty."""
    start = time.monotonic()
    asked = os.fspath(dest)
    real = paths.validate_archive_dir(asked, allowed_roots)  # confined, existing (NotFound)
    d = open_checked(real, asked, "pull target")
    with d:
        try:  # one pull per target (released when the process ends, a killed pull's too)
            fcntl.flock(d.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Aborted(f"another pull into {asked} is running: wait for it or pull elsewhere") from None
        _clear_stale_staging(d)
        names = d.names()
        if names:
            raise InvalidArgument(
                f"pull target {asked} is not empty (contains {names[0]!r}): pull into an empty directory"
            )
        client = client_for(ref, insecure=insecure, registry_config=registry_config)
        staging_name = STAGING_PREFIX + secrets.token_hex(4)
        staging = d.mkdir(staging_name)
        try:
            with staging:
                result = _pull_into(client, ref, staging, progress)
                result.path = str(real)
                try:
                    _publish(d, staging, staging_name)
                except OSError as e:
                    raise Internal(f"cannot move the pulled checkpoint into {asked}: {e.strerror}") from None
        except BaseException:
            with contextlib.suppress(OSError):
                d.remove(staging_name)
                d.fsync()
            raise
    result.seconds = time.monotonic() - start
    return result


def _clear_stale_staging(d: DirHandle) -> None:
    """Staging dirs an earlier pull left when it was killed: nothing else may be in `d` then."""
    names = d.names()
    if names and all(n.startswith(STAGING_PREFIX) for n in names):
        for n in names:
            d.remove(n)
        d.fsync()


def _fetch_manifest(client: RegistryClient) -> tuple[dict[str, Any], str]:
    c = client.ref.container
    r = client.check(
        client.do_request(
            client.url(c.manifest_url()), "GET", headers={"Accept": artifact.OCI_MANIFEST}, stream=True
        ),
        "fetching the manifest",
    )
    try:
        raw = b""
        for chunk in r.iter_content(chunk_size=65536):
            raw += chunk
            if len(raw) > artifact.MAX_OCI_MANIFEST_BYTES:
                raise DataLoss(
                    f"registry artifact {client.ref.text}: manifest is over "
                    f"{artifact.MAX_OCI_MANIFEST_BYTES} bytes"
                )
    except (requests.exceptions.RequestException, OSError) as e:
        raise _stream_error(client, e) from None
    finally:
        r.close()
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    if c.digest and c.digest != digest:
        raise DataLoss(f"registry artifact {client.ref.text}: the manifest served has digest {digest}")
    try:
        doc = json.loads(raw)
    except ValueError:
        raise DataLoss(f"registry artifact {client.ref.text}: the manifest is not JSON") from None
    return doc, digest


def _pull_into(client: RegistryClient, ref: str, staging: DirHandle, progress: Progress | None) -> PullResult:
    doc, digest = _fetch_manifest(client)
    art = artifact.parse_oci_manifest(doc)
    fetched = 0
    total = art.config_size + sum(x.size for x in art.layers)

    def on_bytes(n: int) -> None:
        nonlocal fetched
        fetched += n
        if progress is not None:
            progress(fetched, total)

    config = _read_all(
        _Blob(client, art.config_digest, art.config_size, "the config (manifest.json)", on_bytes)
    )
    try:
        mdoc = json.loads(config)
    except ValueError:
        raise DataLoss(
            f"registry artifact {ref}: its config is not podshim's manifest.json (not JSON)"
        ) from None
    m = mf.Manifest.from_dict(mdoc, f"{ref} config")
    for rel in m.files:
        if str(paths.check_member_path(rel, f"{ref}: manifest file entry")) != rel or rel == MANIFEST_FILE:
            raise InvalidArgument(
                f"registry artifact {ref}: manifest file entry {rel[:120]!r} is not allowed"
            )
    unit_list = artifact.units_of(m)
    file_layers = [x for x in art.layers if x.is_file]
    for layer in file_layers:  # one file's bytes: its digest must be the manifest's sha256 of it
        entry = m.files.get(layer.title)
        if entry is None:
            raise DataLoss(
                f"registry artifact {ref}: file layer {layer.title[:120]!r} is not in the checkpoint's "
                "manifest: refused"
            )
        if layer.digest != "sha256:" + entry.sha256 or layer.size != entry.size:
            raise DataLoss(
                f"registry artifact {ref}: file layer {layer.title} is {layer.digest} ({layer.size} bytes), "
                f"the manifest says sha256:{entry.sha256} ({entry.size} bytes): refused before fetching it"
            )
    artifact.split_raw(unit_list, {x.title for x in file_layers})  # the tars hold the rest
    units = {u.title: u for u in unit_list}
    titles = [x.title for x in art.layers if not x.is_file]
    missing = sorted(set(units) - set(titles))
    extra = sorted(set(titles) - set(units))
    if missing or extra:
        raise DataLoss(
            f"registry artifact {ref}: its layers ({', '.join(titles)}) are not the checkpoint's "
            f"({', '.join(units)})" + (f": {missing[0]} is missing" if missing else f": {extra[0]} is extra")
        )
    for layer in art.layers:  # before a byte of any layer is fetched
        if layer.is_file:
            continue  # its size is the file's (checked above)
        cap = artifact.layer_cap(units[layer.title], layer.media_type)
        if layer.size > cap:
            raise DataLoss(
                f"registry artifact {ref}: layer {layer.title} announces {layer.size} bytes, its files "
                f"(per the manifest) take at most {cap}: refused before fetching it"
            )
    written: set[str] = set()
    for layer in art.layers:
        _pull_layer(client, ref, staging, layer, units.get(layer.title), m, written, on_bytes)
    missing_files = sorted(set(m.files) - written)
    if missing_files:
        raise DataLoss(f"registry artifact {ref}: {missing_files[0]} (in the manifest) is in no layer")
    staging.write_file(MANIFEST_FILE, config)  # last, fsynced: the completion marker
    return PullResult(ref, "", digest, m, art.annotations, fetched)


def _pull_layer(
    client: RegistryClient,
    ref: str,
    staging: DirHandle,
    layer: artifact.Layer,
    unit: artifact.Unit | None,
    m: mf.Manifest,
    written: set[str],
    on_bytes: Callable[[int], None],
) -> None:
    """A unit's tar (`unit`), or one file's raw bytes (a file layer, `unit` None)."""
    what = f"layer {layer.title}"
    blob = _Blob(client, layer.digest, layer.size, what, on_bytes)
    try:
        source: Any = blob
        if layer.compression == "zstd" and unit is not None:
            import zstandard

            source = _Capped(
                zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True),  # type: ignore[arg-type]  # any object with read() works; the stub asks for IO[bytes]
                unit.tar_cap(),
                what,
            )
        writer = _Lane("podshim-pull-write")
        try:
            if unit is None:
                _write_raw(blob, ref, staging, layer.title, written, writer)
            else:
                tar = _TarStream(source)
                for member in _members(tar, ref, layer.title):
                    _extract(tar, member, ref, staging, m, written, writer)
            writer.drain()
        except (tarfile.TarError, EOFError) as e:
            raise DataLoss(f"registry artifact {ref}: {what} is not a readable tar ({e})") from None
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            raise InvalidArgument(
                f"registry artifact {ref}: {what} names an entry twice (as a file and a directory): "
                "refused, nothing was kept"
            ) from None
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted(
                    f"the pull target's file system is full while writing {what}: nothing was kept; "
                    "free space and retry"
                ) from None
            raise Internal(f"cannot write {what} of {ref} into the pull target: {e.strerror}") from None
        except Exception as e:
            if type(e).__name__ == "ZstdError":
                raise DataLoss(f"registry artifact {ref}: {what} is not valid zstd ({e})") from None
            raise
        finally:
            writer.drain_quietly()
            writer.close()
        blob.finish()
    finally:
        blob.close()


class _TarStream:
    """A tar read straight off the stream: headers parsed by tarfile.TarInfo.frombuf (PAX `path`/
    `size` records and GNU long names applied), file data handed out in the chunks as they came,
    without the copies tarfile's stream mode makes. Truncation or a bad header: tarfile.TarError."""

    MAX_META = 1 << 20  # a PAX or long-name record larger than this is not podshim's

    def __init__(self, source: Any) -> None:
        self.source = source
        self.buf = memoryview(b"")
        self.owed = 0  # data of the current member nobody read yet

    def _chunk(self) -> memoryview:
        if not self.buf:
            data = self.source.read(CHUNK_SIZE)
            if not data:
                raise tarfile.ReadError("unexpected end of data")
            self.buf = memoryview(data)
        return self.buf

    def read_exact(self, n: int) -> bytes:
        parts = []
        while n:
            c = self._chunk()
            take = c[:n]
            parts.append(bytes(take))
            self.buf = c[len(take) :]
            n -= len(take)
        return b"".join(parts)

    def data(self, n: int) -> Iterator[memoryview]:
        """`n` bytes of member data as they arrive, then the padding to the next block skipped."""
        self.owed = 0
        left = n
        while left:
            c = self._chunk()
            take = c[:left]
            self.buf = c[len(take) :]
            left -= len(take)
            yield take
        self.read_exact(-n % tarfile.BLOCKSIZE)

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        pax: dict[str, str] = {}
        longname = ""
        while True:
            block = self.read_exact(tarfile.BLOCKSIZE)
            if block.count(0) == tarfile.BLOCKSIZE:
                return  # the end-of-archive blocks (what follows is drained and counted by _Blob)
            ti = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            if ti.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME):
                if ti.size > self.MAX_META:
                    raise tarfile.HeaderError(f"a {ti.size}-byte extended header")
                meta = b"".join(bytes(x) for x in self.data(ti.size))
                if ti.type == tarfile.GNUTYPE_LONGNAME:
                    longname = meta.rstrip(b"\0").decode("utf-8", "surrogateescape")
                elif ti.type == tarfile.XHDTYPE:
                    pax.update(_pax_records(meta))
                continue
            if "path" in pax or longname:
                ti.name = pax.get("path") or longname
            if "size" in pax:
                try:
                    ti.size = int(pax["size"])
                except ValueError:
                    raise tarfile.HeaderError("a PAX size that is not a number") from None
            if ti.size < 0:
                raise tarfile.HeaderError("a negative size")
            pax, longname = {}, ""
            self.owed = ti.size
            yield ti
            for _ in self.data(self.owed):  # what the reader left of this member (a directory's)
                pass


def _pax_records(meta: bytes) -> dict[str, str]:
    """`<len> <key>=<value>\\n` records (POSIX pax extended header)."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(meta) and meta[pos] != 0:
        sp = meta.find(b" ", pos)
        if sp < 0 or not meta[pos:sp].isdigit():
            raise tarfile.HeaderError("a malformed PAX record")
        length = int(meta[pos:sp])
        rec = meta[sp + 1 : pos + length]
        if length <= sp - pos or pos + length > len(meta) or not rec.endswith(b"\n") or b"=" not in rec:
            raise tarfile.HeaderError("a malformed PAX record")
        key, _, value = rec[:-1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def _members(tar: _TarStream, ref: str, title: str) -> Iterator[tarfile.TarInfo]:
    prefix = title + "/"
    for member in tar:
        name = member.name.rstrip("/")
        rel = str(paths.check_member_path(name, f"registry artifact {ref}: layer {title} member"))
        if rel != name or not (rel == title or rel.startswith(prefix)):
            raise InvalidArgument(
                f"registry artifact {ref}: layer {title} has member {member.name[:120]!r}, outside "
                f"{prefix}: refused, nothing was kept"
            )
        if rel.count("/") >= tree_check.MAX_TREE_DEPTH:
            raise InvalidArgument(f"registry artifact {ref}: member {rel[:120]!r}... nests too deep")
        if not (member.isreg() or member.isdir()):
            kind = "symlink" if member.issym() else "hard link" if member.islnk() else "special file"
            raise InvalidArgument(
                f"registry artifact {ref}: layer {title} member {rel[:120]!r} is a {kind}; a checkpoint "
                "holds only regular files and directories: refused, nothing was kept"
            )
        member.name = rel
        yield member


class _Lane:
    """Jobs run in order in a thread of its own (hashlib and os.write release the GIL), so the
    thread reading the socket and parsing the tar goes on meanwhile: one lane hashes a blob, one
    writes and hashes the extracted files. At most MAX_PENDING jobs (of up to CHUNK_SIZE bytes)
    wait; `drain()` raises the first failure."""

    MAX_PENDING = 8

    def __init__(self, name: str) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.pending: deque[Future[None]] = deque()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self.pending.append(self.pool.submit(fn, *args))
        while len(self.pending) > self.MAX_PENDING:
            self.pending.popleft().result()

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def drain_quietly(self) -> None:
        """Wait for what is queued, ignoring its failures (an error is already on its way)."""
        while self.pending:
            with contextlib.suppress(Exception):
                self.pending.popleft().result()

    def close(self) -> None:
        for f in self.pending:
            f.cancel()
        self.pool.shutdown(wait=True)
        self.pending.clear()


def _write(fd: int, sha: Any, ahead: writeback.Ahead, chunk: bytes | memoryview) -> None:
    """Hash `chunk` (unless `sha` is None: a file layer, whose blob digest is the file's) and append
    it to the file in writes that end on WRITE_SIZE boundaries of the file, starting its writeback
    as it goes (the disk starts on it now, not at the fsync)."""
    if sha is not None:
        sha.update(chunk)
    view = memoryview(chunk)
    while view:
        n = os.write(fd, view[: WRITE_SIZE - ahead.end % WRITE_SIZE])
        view = view[n:]
        ahead.wrote(n)


def _finish_file(fd: int, sha: Any, ref: str, rel: str, expected: str) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if sha is not None and sha.hexdigest() != expected:
        raise DataLoss(
            f"registry artifact {ref}: {rel} has sha256 {sha.hexdigest()}, the manifest says {expected}: "
            "it was tampered with or corrupted; refused, nothing was kept"
        )


def _extract(
    tar: _TarStream,
    member: tarfile.TarInfo,
    ref: str,
    staging: DirHandle,
    m: mf.Manifest,
    written: set[str],
    writer: _Lane,
) -> None:
    rel = member.name
    if member.isdir():
        staging.sub(rel, create=True).close()
        return
    entry = m.files.get(rel)
    if entry is None:
        raise DataLoss(f"registry artifact {ref}: {rel} is not in the checkpoint's manifest: refused")
    if member.size != entry.size:
        raise DataLoss(
            f"registry artifact {ref}: {rel} is {member.size} bytes in its layer, the manifest says "
            f"{entry.size}: refused before writing it"
        )
    _write_file(tar.data(member.size), ref, staging, rel, written, writer, hashlib.sha256(), entry.sha256)


def _write_raw(blob: _Blob, ref: str, staging: DirHandle, rel: str, written: set[str], writer: _Lane) -> None:
    """A file layer: its bytes as they arrive, not hashed again (the blob's digest, checked by
    `blob.finish()` before anything is published, is the manifest's sha256 of the file)."""
    _write_file(iter(lambda: blob.read(CHUNK_SIZE), b""), ref, staging, rel, written, writer, None, "")


def _write_file(
    chunks: Iterator[bytes | memoryview],
    ref: str,
    staging: DirHandle,
    rel: str,
    written: set[str],
    writer: _Lane,
    sha: Any,
    expected: str,
) -> None:
    """Create `rel` in the staging dir and queue its chunks, then its check and fsync, on `writer`."""
    if rel in written:
        raise DataLoss(f"registry artifact {ref}: {rel} appears twice")
    written.add(rel)
    parent, _, name = rel.rpartition("/")
    with staging.sub(parent, create=True) as pd:
        fd = pd.create(name, FILE_MODE)
    ahead = writeback.Ahead(fd)
    try:
        for chunk in chunks:
            writer.submit(_write, fd, sha, ahead, chunk)
            faults.hit("pull.chunk")
    except BaseException:
        writer.drain_quietly()
        os.close(fd)
        raise
    writer.submit(_finish_file, fd, sha, ref, rel, expected)  # closes fd


def _publish(d: DirHandle, staging: DirHandle, staging_name: str) -> None:
    """Move the verified tree from the staging dir into `d`: its directories, then manifest.json."""
    staging.fsync()
    for name in staging.names():
        if name != MANIFEST_FILE:
            os.rename(name, name, src_dir_fd=staging.fd, dst_dir_fd=d.fd)
    os.rename(MANIFEST_FILE, MANIFEST_FILE, src_dir_fd=staging.fd, dst_dir_fd=d.fd)
    os.rmdir(staging_name, dir_fd=d.fd)
    d.fsync()
