"""`podshim push DIR REF`: a complete pod checkpoint becomes one OCI artifact (artifact.py).

Each layer is produced, compressed (optional zstd), hashed and uploaded in one pass (a chunked
PATCH of the upload session, then its PUT with the digest): nothing is staged on disk and the
archive is read once. A file carried as a raw layer (artifact.raw_files) is not hashed here: its
digest is its sha256 in manifest.json, which the registry checks the bytes against at the PUT
(a file whose bytes are not what the manifest says is refused there: DATA_LOSS).

The archive must be complete: manifest.json present, its files exactly
those the manifest lists, with its sizes (DATA_LOSS otherwise); symlinks or special files in it
are refused. The OCI manifest is put last, so the tag names nothing until every blob is there.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import oras.utils

from shim.archive import manifest as mf
from shim.archive.dirfd import DirHandle, HeldTree
from shim.archive.fsutil import CHUNK_SIZE
from shim.archive.layout import MANIFEST_FILE
from shim.distribution import artifact
from shim.distribution.registry_auth import RegistryClient, client_for
from shim.errors import DataLoss, Internal, InvalidArgument, NotFound

Progress = Callable[[int, int], None]  # (bytes done, bytes in all), archive bytes
ZSTD_LEVEL = 1  # measured: ~3x faster than level 3 for a few percent less ratio on CRIU pages


@dataclass
class PushedLayer:
    title: str
    digest: str
    size: int  # as stored in the registry (compressed or not)
    archive_bytes: int  # the files it carries


@dataclass
class PushResult:
    ref: str
    digest: str  # the OCI manifest's
    manifest: dict[str, Any]
    layers: list[PushedLayer] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def archive_bytes(self) -> int:
        return sum(x.archive_bytes for x in self.layers)

    @property
    def stored_bytes(self) -> int:
        return sum(x.size for x in self.layers)


def read_archive(d: DirHandle) -> tuple[bytes, mf.Manifest, HeldTree]:
    """manifest.json's bytes, the parsed manifest, and the tree held open, checked against it."""
    try:
        raw = d.read_bytes(MANIFEST_FILE, limit=mf.MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise NotFound(
            f"{d.path} has no {MANIFEST_FILE}: not a complete podshim checkpoint (push only complete ones)"
        ) from None
    except OSError as e:
        raise InvalidArgument(f"cannot read {d.path / MANIFEST_FILE}: {e.strerror}") from None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise DataLoss(f"{d.path / MANIFEST_FILE} is not valid JSON ({e})") from None
    m = mf.Manifest.from_dict(doc, str(d.path / MANIFEST_FILE))
    tree = d.tree(lambda msg: InvalidArgument(f"checkpoint {msg}"))
    try:
        on_disk = {k: v for k, v in tree.files.items() if k != MANIFEST_FILE}
        expected = {k: v.size for k, v in m.files.items()}
        missing = sorted(set(expected) - set(on_disk))
        extra = sorted(set(on_disk) - set(expected))
        wrong = sorted(k for k in set(expected) & set(on_disk) if expected[k] != on_disk[k])
        if missing or extra or wrong:
            what = (
                f"{missing[0]} is missing"
                if missing
                else f"{extra[0]} is not in the manifest"
                if extra
                else f"{wrong[0]} is {on_disk[wrong[0]]} bytes, the manifest says {expected[wrong[0]]}"
            )
            raise DataLoss(f"checkpoint {d.path} does not match its manifest ({what}): not pushed")
    except BaseException:
        tree.close()
        raise
    return raw, m, tree


def _tar_stream(tree: HeldTree, unit: artifact.Unit) -> Iterator[bytes]:
    """The layer's tar, chunk by chunk (artifact.tar_header: deterministic)."""
    for d in unit.dirs():
        yield artifact.tar_header(d, 0, True)
    for rel in sorted(unit.files):
        size = unit.files[rel]
        yield artifact.tar_header(rel, size, False)
        yield from _file_chunks(tree, rel, size)
        yield artifact.tar_padding(size)
    yield artifact.TAR_END


def _file_chunks(tree: HeldTree, rel: str, size: int) -> Iterator[bytes]:
    """The `size` bytes of the archive's file `rel`, CHUNK_SIZE at a time (DataLoss when it holds
    another count)."""
    buf = bytearray(CHUNK_SIZE)
    view = memoryview(buf)
    parent, _, name = rel.rpartition("/")
    fd = tree.dirs[parent].open_read(name)
    try:
        done = 0
        while True:
            n = os.readv(fd, [view])
            if not n:
                break
            done += n
            if done > size:
                break
            yield bytes(view[:n])
    finally:
        os.close(fd)
    if done != size:
        raise DataLoss(f"{tree.root.path / rel} changed while it was pushed (size {size} in the manifest)")


class _RawFile:
    """A file's bytes as a layer of their own: the digest is the manifest's sha256 of the file,
    not computed here (the registry holds the bytes to it)."""

    def __init__(self, source: Iterator[bytes], sha256: str) -> None:
        self.source = source
        self.digest = "sha256:" + sha256

    def __iter__(self) -> Iterator[bytes]:
        return self.source


class _Counted:
    """Compresses (zstd), hashes and counts what goes up."""

    def __init__(self, source: Iterator[bytes], compression: str) -> None:
        self.source = source
        self.sha = hashlib.sha256()
        self.size = 0
        self.raw = 0
        self.compressor: Any = None
        if compression == "zstd":
            import zstandard

            self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=-1)

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.source:
            self.raw += len(chunk)
            if self.compressor is not None:
                chunk = self.compressor.compress(chunk)
            if chunk:
                yield self._out(chunk)
        if self.compressor is not None:
            tail = self.compressor.flush()
            if tail:
                yield self._out(tail)

    def _out(self, chunk: bytes) -> bytes:
        self.sha.update(chunk)
        self.size += len(chunk)
        return chunk

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def _upload(client: RegistryClient, body: Any, digest: str | None = None, what: str = "a blob") -> Any:
    """One blob: open an upload session, send `body` (bytes: monolithic PUT; an iterator: one
    streamed PATCH), close it with the digest (computed as the bytes went, when not given)."""
    c = client.ref.container
    r = client.check(
        client.do_request(client.url(c.upload_blob_url()), "POST", headers={"Content-Length": "0"}),
        "starting a blob upload",
    )
    location = client._get_location(r, c)
    if not location:
        raise DataLoss(f"registry {client.ref.host} gave no upload location")
    if isinstance(body, bytes):
        assert digest is not None
        url = oras.utils.append_url_params(location, {"digest": digest})
        client.check(
            client.do_request(url, "PUT", data=body, headers={"Content-Type": "application/octet-stream"}),
            "uploading a blob",
        )
        return digest
    r = client.check(
        client.do_request(
            location, "PATCH", data=iter(body), headers={"Content-Type": "application/octet-stream"}
        ),
        "uploading a layer",
    )
    location = client._get_location(r, c) or location
    url = oras.utils.append_url_params(location, {"digest": body.digest})
    closed = client.do_request(url, "PUT", headers={"Content-Length": "0"})
    if isinstance(body, _RawFile) and _digest_invalid(closed):
        closed.close()  # the registry's digest check: the file's bytes are not the manifest's
        raise DataLoss(
            f"{what}: its bytes do not have the sha256 manifest.json records ({body.digest}; the "
            f"registry refused them): the checkpoint is corrupt, not pushed"
        )
    client.check(closed, "closing a layer upload")
    return body.digest


def _digest_invalid(r: Any) -> bool:
    """The registry refused an upload's bytes for not having the digest it was closed with."""
    if r.status_code != 400:
        return False
    try:
        errors = r.json().get("errors") or []
    except ValueError:
        return False
    return any(isinstance(e, dict) and e.get("code") == "DIGEST_INVALID" for e in errors)


def push(
    archive: str | os.PathLike[str],
    ref: str,
    *,
    compression: str = "none",
    insecure: bool = False,
    registry_config: str | None = None,
    progress: Progress | None = None,
) -> PushResult:
    """Push the complete pod checkpoint at `archive` to `ref` (HOST[:PORT]/REPO[:TAG])."""
    try:
        return _push(archive, ref, compression, insecure, registry_config, progress)
    except OSError as e:  # reading the archive
        raise Internal(f"cannot read checkpoint {archive}: {e.strerror or e}") from None


def _push(
    archive: str | os.PathLike[str],
    ref: str,
    compression: str,
    insecure: bool,
    registry_config: str | None,
    progress: Progress | None,
) -> PushResult:
    if compression not in artifact.COMPRESSIONS:
        raise InvalidArgument(f"compression {compression!r}: one of {', '.join(artifact.COMPRESSIONS)}")
    start = time.monotonic()
    client = client_for(ref, insecure=insecure, registry_config=registry_config)
    with DirHandle.open(os.path.realpath(archive)) as d:
        raw, m, tree = read_archive(d)
        with tree:
            units = artifact.units_of(m)
            total = sum(u.size for u in units)
            done = 0

            def advance(n: int) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(done, total)

            result = PushResult(ref=ref, digest="", manifest={})
            layers = []
            media = artifact.LAYER_MEDIA_TYPE_ZSTD if compression == "zstd" else artifact.LAYER_MEDIA_TYPE
            if compression == "none":
                artifact.split_raw(units, artifact.raw_files(units))
            for unit in units:
                before = done
                counted = _Counted(_progressing(_tar_stream(tree, unit), advance), compression)
                _upload(client, counted)
                layers.append(
                    artifact.descriptor(
                        media, counted.digest, counted.size, artifact.layer_annotations(unit, m)
                    )
                )
                result.layers.append(PushedLayer(unit.title, counted.digest, counted.size, done - before))
                for rel, size in unit.raw.items():
                    chunks = _progressing(_file_chunks(tree, rel, size), advance)
                    raw_file = _RawFile(chunks, m.files[rel].sha256)
                    _upload(client, raw_file, what=f"{d.path / rel}")
                    layers.append(
                        artifact.descriptor(
                            artifact.FILE_MEDIA_TYPE, raw_file.digest, size, artifact.file_annotations(rel)
                        )
                    )
                    result.layers.append(PushedLayer(rel, raw_file.digest, size, size))
            config_digest = "sha256:" + hashlib.sha256(raw).hexdigest()
            if not client.blob_exists({"digest": config_digest}, client.ref.container):
                _upload(client, raw, config_digest)
            doc = artifact.oci_manifest(
                artifact.descriptor(artifact.CONFIG_MEDIA_TYPE, config_digest, len(raw)),
                layers,
                artifact.manifest_annotations(m, compression, units),
            )
            body = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
            r = client.check(
                client.do_request(
                    client.url(client.ref.container.manifest_url()),
                    "PUT",
                    data=body,
                    headers={"Content-Type": artifact.OCI_MANIFEST},
                ),
                "putting the manifest",
            )
            result.digest = (
                r.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(body).hexdigest()
            )
            result.manifest = doc
    result.seconds = time.monotonic() - start
    return result


def _progressing(chunks: Iterator[bytes], advance: Callable[[int], None]) -> Iterator[bytes]:
    for c in chunks:
        advance(len(c))
        yield c
