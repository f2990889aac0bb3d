"""Restore from a container checkpoint tar (CRI-O's convention; docs/design/checkpoint-container.md
(CheckpointContainer)): a CreateContainer whose image is an absolute path to such a tar.
The tar is extracted (regular files and directories only, no member escaping) into
`<state_dir>/imports/<random>/archive`, and the container is created upstream with the
checkpoint's image and podshim's restore annotation; podshim-runc turns its `create` into a
CRIU restore at StartContainer. The import dir goes when the container does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import json
import os
import re
import secrets
import stat
import tarfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from shim import contract, errors, logs
from shim.aio import Steps, run_to_end
from shim.archive import fsutil, layout, paths, tree_check, volumes
from shim.archive.container_tar import (
    MANIFEST_FILE,
    MAX_METADATA_BYTES,
    REQUIRED_MEMBERS,
    ContainerTarManifest,
    container_tar_files,
    tar_error,
)
from shim.archive.dirfd import DirHandle
from shim.archive.dirfd import held as held_dir
from shim.archive.manifest import FileEntry
from shim.checks import mounts
from shim.checks.wiring import RestoredContainers, Verdict, WiringChecker
from shim.config import Config
from shim.contract import IMPORTS_DIR, RESTORE_ANNOTATION, RESTORE_OPTIONS_ANNOTATION
from shim.deadlines import CLEANUP_MARGIN, DEFAULT_DEADLINE, STALE_IMPORT_SECONDS
from shim.ops import pod_volumes
from shim.ops.restore_broker import PageChecks
from shim.ops.restore_checks import archived_config
from shim.sandbox.images import Images, is_image_id
from shim.sandbox.view import pod_status
from shim.state import Journal
from shim.upstream import Upstream, is_not_found

log = logs.get("shim.ops.restore_container")

IMPORT_TREE = "archive"  # <state_dir>/imports/<random>/archive: the extracted checkpoint
IMPORT_MARKER = "container-id"  # <state_dir>/imports/<random>/container-id: who uses it


def check_archive_file(path: str, allowed_roots: Sequence[str]) -> Path:
    """A CreateContainer image that is a path: a regular file strictly inside an allowed root."""
    norm = paths.check_syntax(path, "checkpoint archive")
    roots = paths.resolved_roots(allowed_roots)
    real = Path(os.path.realpath(norm))
    if not any(paths.is_inside(real, r) for r in roots):
        roots_text = ", ".join(str(r) for r in roots)
        raise errors.InvalidArgument(
            f"checkpoint archive {path} is outside the allowed checkpoint roots ({roots_text})"
        )
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise errors.NotFound(f"checkpoint archive {path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise errors.InvalidArgument(f"checkpoint archive {path} is not a regular file (a tar)")
    return real


def _open_outer(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, mode="r:*", copybufsize=fsutil.CHUNK_SIZE)  # type: ignore[call-overload]  # copybufsize: a TarFile argument typeshed's open() lacks
    except (tarfile.TarError, EOFError) as e:
        raise errors.DataLoss(f"checkpoint archive {path} is not a readable tar: {tar_error(e)}") from e
    except OSError as e:
        raise errors.Internal(f"cannot read checkpoint archive {path}: {e}") from e


def _members(tar: tarfile.TarFile, where: Path) -> Iterator[tuple[tarfile.TarInfo, str | None]]:
    """Each member with its normalised relative name (None for the archive's own root entry).
    Only regular files and directories are accepted (as containerd's hardened import)."""
    try:
        for m in tar:
            if m.name.strip("/.") == "" and m.isdir():
                yield m, None
                continue
            rel = str(paths.check_member_path(m.name.rstrip("/"), f"{where}: member"))
            parts = rel.split("/")
            if len(parts) > tree_check.MAX_TREE_DEPTH or any(len(p.encode()) > paths.NAME_MAX for p in parts):
                raise errors.InvalidArgument(
                    f"checkpoint archive {where}: member {m.name[:120]!r}... nests deeper than "
                    f"{tree_check.MAX_TREE_DEPTH} levels or has a component over {paths.NAME_MAX} bytes"
                )
            if not (m.isreg() or m.isdir()):
                kind = "symlink" if m.issym() else "hard link" if m.islnk() else "special file"
                raise errors.InvalidArgument(
                    f"checkpoint archive {where}: member {m.name!r} is a {kind}; "
                    "a container checkpoint holds only regular files and directories"
                )
            yield m, rel
    except (tarfile.TarError, EOFError) as e:
        raise errors.DataLoss(f"checkpoint archive {where} is truncated or corrupt: {tar_error(e)}") from e


def extract_archive(
    tar_path: Path, dest: Path | DirHandle, steps: Steps, pages_later: bool = False
) -> dict[str, FileEntry]:
    """Extract the container checkpoint `tar_path` into the new directory `dest` (0700 dirs,
    0600 files); returns the files written, in tar order, with the size and sha256 of what was
    written, hashed as it was copied (load_imported checks them against the manifest without
    reading the tree again). `pages_later`: the page images (contract.PAGE_IMAGE_RE) are copied
    unhashed (sha256 ""), their check left to podshim-runc beside CRIU's read. Members that
    escape (absolute, '..'), links and special files are refused (InvalidArgument); no member can
    follow a symlink, as none is ever created. A duplicate member is refused too. Every level is
    created and opened through descriptors (O_NOFOLLOW, relative to its parent: dirfd.py), never
    by path."""
    if not isinstance(dest, DirHandle):
        fsutil.make_private_dir(dest, exist_ok=False)
    written: dict[str, FileEntry] = {}
    with (
        _open_outer(tar_path) as tar,
        held_dir(dest) as root,
        ThreadPoolExecutor(1, thread_name_prefix="import-sha256") as hasher,
    ):
        for m, rel in _members(tar, tar_path):
            steps.check()
            if rel is None:
                continue
            if rel.count("/") >= tree_check.MAX_TREE_DEPTH:
                raise errors.InvalidArgument(
                    f"checkpoint archive {tar_path}: member {rel[:120]!r}... nests deeper than "
                    f"{tree_check.MAX_TREE_DEPTH} directories; a container checkpoint is at most that deep"
                )
            parent, _, name = rel.rpartition("/")
            try:
                if m.isdir():
                    root.sub(rel, create=True).close()
                    continue
                with root.sub(parent, create=True) as pd:
                    fd = pd.create(name, fsutil.FILE_MODE)
            except FileExistsError:
                raise errors.InvalidArgument(
                    f"checkpoint archive {tar_path}: member {m.name!r} repeats"
                ) from None
            except NotADirectoryError:
                raise errors.InvalidArgument(
                    f"checkpoint archive {tar_path}: member {m.name!r} is below a file"
                ) from None
            digest, size = hashlib.sha256(), 0
            hashing: Future[None] | None = None
            unhashed = pages_later and re.fullmatch(contract.PAGE_IMAGE_RE, rel) is not None
            with os.fdopen(fd, "wb") as out:
                src = tar.extractfile(m)
                if src is None:
                    raise errors.DataLoss(f"checkpoint archive {tar_path}: member {m.name!r} is unreadable")
                try:
                    copied = _copy_in_kernel(tar, m, out.fileno(), steps) if unhashed else None
                    if copied is not None and copied < m.size:
                        raise EOFError(f"{m.name} ends after {copied} of {m.size} bytes")
                    size = copied or 0
                    while copied is None and (chunk := src.read(fsutil.CHUNK_SIZE)):
                        steps.check()
                        # the chunk hashed on the other core while it is written (both release
                        # the GIL): extraction takes the longer of the two, not their sum
                        if hashing is not None:
                            hashing.result()
                        if not unhashed:
                            hashing = hasher.submit(digest.update, chunk)
                        out.write(chunk)
                        size += len(chunk)
                    if hashing is not None:
                        hashing.result()
                except (tarfile.TarError, EOFError) as e:
                    raise errors.DataLoss(
                        f"checkpoint archive {tar_path} is truncated: {tar_error(e)}"
                    ) from e
                except OSError as e:
                    raise errors.storage_error(
                        e,
                        f"cannot extract {m.name!r} of {tar_path}",
                        root.proc,
                        "room for the archive's files",
                    ) from e
            written[rel] = FileEntry(size=size, sha256="" if unhashed else digest.hexdigest())
    return written


KERNEL_COPY_CHUNK = 64 << 20  # a cancellation point every 64 MiB


def _copy_in_kernel(tar: tarfile.TarFile, m: tarfile.TarInfo, out: int, steps: Steps) -> int | None:
    """A member of a plain tar copied into `out` by the kernel (copy_file_range from its offset in
    the archive: no copy through podshim's memory), returning the bytes copied (fewer than its
    size: the archive is truncated); None when it cannot be (a compressed archive, a sparse
    member, a kernel or file system that refuses), to be copied by reading it."""
    if type(tar.fileobj) is not io.BufferedReader or m.issparse():
        return None
    src, done = tar.fileobj.fileno(), 0
    while done < m.size:
        steps.check()
        try:
            n = os.copy_file_range(src, out, min(KERNEL_COPY_CHUNK, m.size - done), m.offset_data + done)
        except OSError as e:
            if done == 0 and e.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                return None
            raise
        if n == 0:
            break
        done += n
    return done


def _read_json(path: Path, what: str) -> Any:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if st.st_size > MAX_METADATA_BYTES:
        raise errors.DataLoss(f"{what} is {st.st_size} bytes, over the {MAX_METADATA_BYTES} limit")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.DataLoss(f"{what} is not valid JSON ({e}): the archive is corrupt") from e


@dataclass
class ImportedCheckpoint:
    root: Path  # the extracted tree (the restore annotation points here)
    record: dict[str, Any]  # config.dump
    spec: dict[str, Any]  # spec.dump
    manifest: ContainerTarManifest | None  # podshim's manifest (None: written by another runtime)
    # page images extracted unhashed, by path below `root`: their sha256 in the manifest, which
    # podshim-runc checks while CRIU restores (PAGE_DIGESTS_ANNOTATION)
    pages_later: dict[str, str] = field(default_factory=dict)


def load_imported(
    root: Path,
    tar_path: Path,
    steps: Steps,
    held: DirHandle | None = None,
    written: dict[str, FileEntry] | None = None,
) -> ImportedCheckpoint:
    """Check an extracted container checkpoint: the required entries, and when it carries
    podshim's manifest, the exact file set with sizes and sha256 (DataLoss otherwise). `held`:
    `root` held open; it is then read and listed through that descriptor only. `written`: what
    extract_archive wrote into the new `root`, hashed as it was (else the tree is read again)."""
    where = root
    if held is not None:
        root = Path(held.proc)
    missing = [m for m in REQUIRED_MEMBERS if not (root / m).is_file()]
    if missing:
        raise errors.InvalidArgument(
            f"{tar_path} is not a container checkpoint: it has no {', '.join(missing)}"
        )
    record = _read_json(root / layout.CONFIG_DUMP_FILE, f"{tar_path}: {layout.CONFIG_DUMP_FILE}")
    spec = _read_json(root / layout.SPEC_DUMP_FILE, f"{tar_path}: {layout.SPEC_DUMP_FILE}")
    if not isinstance(record, dict) or not isinstance(spec, dict):
        raise errors.DataLoss(f"{tar_path}: config.dump and spec.dump must be JSON objects")
    doc = _read_json(root / MANIFEST_FILE, f"{tar_path}: {MANIFEST_FILE}")
    if doc is None and isinstance(record.get("podshim"), dict):
        raise errors.DataLoss(
            f"{tar_path} was written by podshim but has no {MANIFEST_FILE} (its last member): "
            "the archive is truncated; take a new checkpoint"
        )
    m = None
    later: dict[str, str] = {}
    if doc is not None:
        m = ContainerTarManifest.from_dict(doc, str(tar_path))
        m.check_format(str(tar_path))
        if written is not None:
            actual = {rel: fe for rel, fe in written.items() if rel != MANIFEST_FILE}
            for rel, fe in actual.items():  # unhashed: its size checked here, its sha256 later
                listed = m.files.get(rel)
                if not fe.sha256 and listed is not None and listed.size == fe.size:
                    actual[rel], later[rel] = listed, listed.sha256
        else:
            actual = container_tar_files(held if held is not None else root, steps.check)
        m.check_files(actual, str(tar_path))
    return ImportedCheckpoint(root=where, record=record, spec=spec, manifest=m, pages_later=later)


def _spec_defaults(spec: dict[str, Any]) -> cri.ContainerConfig:
    """command/env/working dir from an OCI spec (an archive without podshim's CRI record)."""
    proc = spec.get("process") or {}
    envs = []
    for e in proc.get("env") or []:
        k, _, v = str(e).partition("=")
        envs.append(cri.KeyValue(key=k, value=v.encode()))
    return cri.ContainerConfig(
        command=[str(a) for a in proc.get("args") or []], envs=envs, working_dir=str(proc.get("cwd") or "")
    )


def tar_image_refs(ck: ImportedCheckpoint) -> list[str]:
    """What a container tar records of its image, the surest first (docs/design/archive.md (Image
    identity)): podshim's manifest (its ID, the reference the upstream reported, its name, the
    user-specified name), else the checkpointctl keys of config.dump (another runtime's tar)."""
    if ck.manifest is not None:
        c = ck.manifest.container
        refs = [c.get(k) for k in ("image_id", "image_ref", "image", "user_specified_image")]
    else:
        r = ck.record
        refs = [r.get(k) for k in ("image_id", "rootfsImageRef", "rootfsImage", "rootfsImageName", "image")]
    return list(dict.fromkeys(str(ref) for ref in refs if ref and isinstance(ref, str)))


def _user_image(ck: ImportedCheckpoint, recorded: list[str]) -> str:
    """The name the restored container reports as its user-specified image: the checkpoint's."""
    c = ck.manifest.container if ck.manifest is not None else {}
    r = ck.record
    for named in (c.get("user_specified_image"), r.get("user_specified_image"), r.get("rootfsImageName")):
        if isinstance(named, str) and named:
            return named
    return next((ref for ref in recorded if not is_image_id(ref)), "")


def restore_config(
    req: cri.ContainerConfig, ck: ImportedCheckpoint, image: cri.ImageSpec
) -> cri.ContainerConfig:
    """The request's config (metadata, log path, mounts, labels, resources...) with the
    checkpoint's image, its command/args/env/working dir where the request leaves them empty,
    and podshim's restore annotations."""
    archived = archived_config(ck.record) if ck.record.get("config") else _spec_defaults(ck.spec)
    cc = cri.ContainerConfig()
    cc.CopyFrom(req)
    cc.image.CopyFrom(image)
    if not cc.command:
        cc.command.extend(archived.command)
    if not cc.args:
        cc.args.extend(archived.args)
    if not cc.envs:
        cc.envs.extend(archived.envs)
    if not cc.working_dir:
        cc.working_dir = archived.working_dir
    # CRI-O always dumps with file locks
    options = (ck.manifest.options if ck.manifest is not None else {}) or {contract.FILE_LOCKS: "true"}
    cc.annotations[RESTORE_ANNOTATION] = str(ck.root)
    cc.annotations[RESTORE_OPTIONS_ANNOTATION] = contract.to_record(options)
    if ck.pages_later:
        cc.annotations[contract.PAGE_DIGESTS_ANNOTATION] = contract.page_digests_record(ck.pages_later)
    return cc


def _remove_import(imports: DirHandle, name: str) -> None:
    """Remove the import dir `name` through <state_dir>/imports held open, then let go of it."""
    with contextlib.suppress(OSError):
        imports.remove(name)
    imports.close()


class ArchiveImporter:
    """CreateContainer from a container checkpoint tar, and removal of what it extracted."""

    def __init__(
        self,
        config: Config,
        upstream: Upstream,
        wiring: WiringChecker | None = None,
        restored: RestoredContainers | None = None,
        journal: Journal | None = None,
        page_checks: PageChecks | None = None,
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = journal  # records the volume fills (pod_volumes.journaled)
        # the page images' checks started at create, taken by podshim-runc at start (RestorePod's)
        self.page_checks = page_checks
        self.root = Path(config.state_dir) / IMPORTS_DIR
        # docs/design/runtime-wrapper.md (Wiring check): refuse a node wired wrong; remember what to confirm
        self.wiring = wiring
        self.restored = restored

    async def create(
        self, req: cri.CreateContainerRequest, remaining: float | None
    ) -> cri.CreateContainerResponse:
        tar_path = await asyncio.to_thread(
            check_archive_file, req.config.image.image, self.config.allowed_roots
        )
        if not req.pod_sandbox_id:
            raise errors.InvalidArgument(
                "pod_sandbox_id is empty: name the sandbox to create the container in"
            )
        budget = (remaining if remaining is not None else DEFAULT_DEADLINE) - CLEANUP_MARGIN
        if budget <= 0:
            raise errors.DeadlineExceeded("the deadline leaves no time to import the checkpoint")
        # the page images' checksums deferred to podshim-runc, as RestorePod's, only on a handler
        # known to pass podshim's annotations (dropped, the restore would run on unchecked memory)
        pages_later = False
        if self.wiring is not None:
            handler = await self._sandbox_handler(req.pod_sandbox_id)
            wired = await self.wiring.require(
                handler, f"restore from {tar_path} refused, nothing was created"
            )
            pages_later = self.page_checks is not None and wired.verdict is Verdict.OK
        await self.sweep()
        await asyncio.to_thread(fsutil.make_private_dir, self.root)
        import_dir = self.root / secrets.token_hex(8)
        # <state_dir>/imports held open: the import dir is made, filled, marked and removed only
        # through descriptors (dirfd.py), never through its path
        imports = DirHandle.open(os.path.realpath(self.root))
        steps = Steps()
        filled: list[pod_volumes.Filled] = []  # emptied again if the create fails after the fill
        checks_started = False
        ck: ImportedCheckpoint | None = None
        try:
            held = imports.adopt(imports.mkdir(import_dir.name))
            async with asyncio.timeout(budget):
                tree = import_dir / IMPORT_TREE
                tree_held = held.adopt(held.mkdir(IMPORT_TREE))
                written = await steps.run(extract_archive, tar_path, tree_held, steps, pages_later)
                ck = await steps.run(load_imported, tree, tar_path, steps, tree_held, written)
                # every bind mount of the checkpoint given a source (shim/checks/mounts.py)
                missing = mounts.missing_mounts(ck.spec, req.config)
                mounts.refuse_missing({req.config.metadata.name: missing}, str(tar_path))
                image = await self._image(ck, req.config, tar_path)
                cc = restore_config(req.config, ck, image)
                # the emptyDirs the container mounted, filled while still empty, before it exists
                await self._fill_volumes(tree_held, tar_path, req, steps, filled)
                if ck.pages_later and self.page_checks is not None:
                    self.page_checks.start(ck.root, ck.pages_later)
                    checks_started = True
                cid = await self.upstream.create_container(
                    cri.CreateContainerRequest(
                        pod_sandbox_id=req.pod_sandbox_id, config=cc, sandbox_config=req.sandbox_config
                    ),
                    doing=f"creating container {cc.metadata.name!r} from {tar_path}",
                    timeout=max(budget, 1.0),
                )
                resp = cri.CreateContainerResponse(container_id=cid)
                await asyncio.to_thread(held.write_file, IMPORT_MARKER, resp.container_id.encode())
                if self.restored is not None:  # StartContainer confirms its restore ran
                    await asyncio.to_thread(self.restored.add, resp.container_id)
        except TimeoutError:
            self._discard_checks(ck if checks_started else None)
            await run_to_end(pod_volumes.empty_again, filled)
            _remove_import(imports, import_dir.name)
            raise errors.DeadlineExceeded(
                f"import of {tar_path} did not finish within the deadline; nothing was created"
            ) from None
        except BaseException:
            self._discard_checks(ck if checks_started else None)
            await run_to_end(pod_volumes.empty_again, filled)
            _remove_import(imports, import_dir.name)
            raise
        imports.close()
        log.info("container created from checkpoint", archive=str(tar_path), container=resp.container_id)
        return resp

    def _discard_checks(self, ck: ImportedCheckpoint | None) -> None:
        if ck is not None and self.page_checks is not None:
            self.page_checks.discard(ck.root, ck.pages_later)

    async def _fill_volumes(
        self,
        tree: DirHandle,
        tar_path: Path,
        req: cri.CreateContainerRequest,
        steps: Steps,
        filled: list[pod_volumes.Filled],
    ) -> None:
        """The emptyDirs the checkpointed container mounted (sandbox/volumes.json of the tar), put
        into the new pod's emptyDirs of the same names that `req` mounts (refused when it mounts
        one not), each only while it is empty: another container of the pod restored from its own
        tar may have filled a shared one first. Journaled while it writes (pod_volumes.journaled)."""
        root = Path(tree.proc)
        rec = await steps.run(pod_volumes.recorded_in_tree, root, f"checkpoint archive {tar_path}")
        if rec is None or not rec.empty_dirs:
            return
        md = req.sandbox_config.metadata
        where = pod_volumes.Targets(volumes.targets(rec.empty_dirs, [req.config], md.uid), None)
        await steps.run(pod_volumes.check, root, volumes.Record(rec.empty_dirs, False), False, steps.cancel)
        journaled: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.journal is not None:
            journaled = pod_volumes.journaled(self.journal, f"{md.namespace}/{md.name}", where)
        with journaled:
            done = await steps.run(
                pod_volumes.fill,
                root,
                None,
                rec,
                where,
                None,
                self.config.state_dir,
                steps.cancel,
                only_empty=True,
            )
        filled += done
        log.info("restore volumes filled", archive=str(tar_path), bytes={f.name: f.bytes for f in done})

    async def _sandbox_handler(self, pod_id: str) -> str:
        """The runtime handler the sandbox's containers run with, as the upstream reports it."""
        return (await pod_status(self.upstream, pod_id)).status.runtime_handler

    async def _image(self, ck: ImportedCheckpoint, req: cri.ContainerConfig, tar_path: Path) -> cri.ImageSpec:
        """The checkpoint's image, by identity (docs/design/archive.md (Image identity)), as
        RestorePod checks it: what the tar records of its image must name one image (DATA_LOSS
        otherwise: the archive changed); an image the request names (`user_specified_image`, when
        it is not the tar) must be that image by its ID, a digest reference or a name
        (INVALID_ARGUMENT otherwise: a config mismatch); and this node must have it with the ID the
        checkpoint ran (FAILED_PRECONDITION otherwise). The container is created with that ID, as
        the kubelet creates containers, so a name moved to another image meanwhile cannot swap the
        image under the restored process."""
        images = Images(self.upstream)
        recorded = tar_image_refs(ck)
        if ck.manifest is not None:
            r = ck.record
            refs = {
                k: r.get(k) for k in ("image", "image_id", "rootfsImage", "rootfsImageRef", "rootfsImageName")
            }
            refs["config.image"] = archived_config(r).image.image if r.get("config") else ""
            found = await images.disagreeing(refs, recorded)
            if found is not None:
                where, ref, recorded_id = found
                raise errors.DataLoss(
                    f"checkpoint {tar_path} is inconsistent: its config.dump has {where} {ref!r}, "
                    f"{MANIFEST_FILE} says {recorded[0] if recorded else '?'} ({recorded_id}), another "
                    "image; the archive cannot be trusted, take a new checkpoint"
                )
        name = req.metadata.name
        want = req.image.user_specified_image
        if want and want != req.image.image:
            mismatch = await images.mismatch(want, recorded)
            if mismatch is not None:
                recorded_id, here = mismatch
                what = f"is {here} on this node" if here else "is not on this node"
                raise errors.InvalidArgument(
                    f"container {name!r}: image {want!r} differs from the image of checkpoint {tar_path} "
                    f"({recorded_id}): it {what}; nothing was created"
                )
        checkpoint_id = await images.first_id(recorded)
        if checkpoint_id is not None and (await self.upstream.image_status(checkpoint_id)).HasField("image"):
            named = want if want and want != req.image.image else _user_image(ck, recorded)
            return cri.ImageSpec(image=checkpoint_id, user_specified_image=named)
        elsewhere = [
            f"{ref} is {here} here"
            for ref in recorded
            if not is_image_id(ref) and (here := await images.id_of(ref)) and here != checkpoint_id
        ]
        recorded_as = checkpoint_id or ", ".join(recorded) or "unnamed"
        raise errors.FailedPrecondition(
            f"the image of checkpoint {tar_path} ({recorded_as}) is not on this node"
            f"{' (' + '; '.join(elsewhere) + ', another image)' if elsewhere else ''}: "
            "pull it first; nothing was created"
        )

    def _imports(self) -> list[tuple[Path, str | None]]:
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                continue
            try:
                owner: str | None = (Path(e.path) / IMPORT_MARKER).read_text().strip()
            except OSError:
                owner = None
            out.append((Path(e.path), owner))
        return out

    def _remove(self, d: Path, why: str) -> None:
        # through <state_dir>/imports opened with O_NOFOLLOW at every level, never by path
        with contextlib.suppress(OSError, errors.ShimError):
            _remove_import(DirHandle.open(os.path.realpath(d.parent)), d.name)
        log.info("checkpoint import removed", dir=str(d), reason=why)

    async def forget(self, container_id: str) -> None:
        """After RemoveContainer: drop the import of that container (an id or unique prefix)."""
        if not container_id:
            return
        imports = await asyncio.to_thread(self._imports)
        hits = [(d, o) for d, o in imports if o and o.startswith(container_id)]
        if len(hits) == 1:
            await asyncio.to_thread(self._remove, hits[0][0], f"container {hits[0][1]} removed")

    async def sweep(self) -> None:
        """Drop imports whose container is gone (removed with its sandbox, or never created
        because podshim stopped in the middle)."""
        now = time.time()
        for d, owner in await asyncio.to_thread(self._imports):
            if owner is None:
                try:
                    age = now - d.stat().st_mtime
                except OSError:
                    continue
                if age > STALE_IMPORT_SECONDS:
                    await asyncio.to_thread(self._remove, d, "interrupted import")
                continue
            try:
                await self.upstream.container_status(owner)
            except errors.ShimError as e:
                if is_not_found(e):
                    await asyncio.to_thread(self._remove, d, f"container {owner} no longer exists")
