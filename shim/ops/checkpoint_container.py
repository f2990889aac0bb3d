"""CheckpointContainer (KEP-2008) done by podshim: the container's own cgroup frozen, dumped with
`--leave-running` beside its rootfs diff, thawed, and one tar with the checkpointctl member names
staged next to the target and linked into place; any failure leaves no file
(docs/design/checkpoint-container.md (CheckpointContainer)).

Restore of such a tar: shim/ops/restore_container.py."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import os
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, TypeVar

from api.runtime.v1 import api_pb2 as cri
from shim import __version__, errors, faults, logs
from shim.aio import Steps, run_to_end
from shim.archive import fsutil, layout, manifest, paths, rootfs_diff
from shim.archive.container_tar import (
    FORMAT,
    LEADING_MEMBERS,
    MANIFEST_FILE,
    ContainerTarManifest,
)
from shim.archive.dirfd import DirHandle, HeldTree, open_checked
from shim.cgroups import PodCut, thaw_paths
from shim.checks import space, taskstate
from shim.checks.sharing import check_shared_state
from shim.checks.taskstate import TaskStates
from shim.config import Config, parse_size
from shim.criu.netns_lock import NetnsLock
from shim.criu.options import CriuOptions
from shim.criu.runtime import binary_version, read_dump_stats
from shim.deadlines import CLEANUP_MARGIN, DEFAULT_DEADLINE, FREEZE_TIMEOUT
from shim.ops import checkpoint_pod_recovery, pod_volumes
from shim.ops.checkpoint_checks import CheckpointOptions, check_dumpable
from shim.ops.checkpoint_pod import (
    PodCheckpointer,
    confirm_thawed,
    options_record,
    self_frozen,
    with_kept_log,
)
from shim.sandbox import ContainerView, PodView, build_pod_view
from shim.sandbox.images import resolve_container_images
from shim.state import Journal, OpRecord
from shim.state.records import ContainerCheckpointRecord
from shim.upstream import Upstream, is_not_found

log = logs.get("shim.ops.checkpoint_container")

KIND = "checkpoint-container"  # journal kind: recover() thaws `cgroups`, removes `output_path`
STAGING_PREFIX = "podshim-checkpoint"  # the staging dir: .podshim-checkpoint.tmp-<hex> beside the tar
STAGING_TREE = "tree"  # inside the staging dir: the files that go into the tar
STAGING_TAR = "archive.tar"  # inside the staging dir: the tar until it is linked to its name


T = TypeVar("T")


# ---------------------------------------------------------------------------- location


@dataclass(frozen=True)
class Location:
    """Where the tar goes: `directory` (resolved, inside or equal to an allowed root) and the file
    `name` the caller gave; None means the kubelet's name is chosen once the container is known."""

    directory: Path
    name: str | None
    asked: str = ""  # the caller's spelling of `directory` (it may pass through a symlink)

    def target(self, default_name: str) -> Path:
        return self.directory / (self.name or default_name)


def _inside_roots(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or paths.is_inside(path, r) for r in roots)


def check_location(location: str, allowed_roots: Sequence[str]) -> Location:
    """Validate CheckpointContainer's `location` before anything is touched.

    An existing directory (the allowed root itself or one inside it) receives a kubelet-named
    tar; anything else is the tar's own path: its parent must exist (NotFound) inside an
    allowed root and the file must not (InvalidArgument). Empty: the first allowed root.
    """
    roots = paths.resolved_roots(allowed_roots)
    roots_text = ", ".join(str(r) for r in roots)
    if not location:
        if not roots[0].is_dir():
            raise errors.NotFound(f"location is empty and the checkpoint root {roots[0]} does not exist")
        return Location(roots[0], None, str(roots[0]))
    norm = paths.check_syntax(location, "location")
    if os.path.isdir(norm):
        real = Path(os.path.realpath(norm))
        if not _inside_roots(real, roots):
            via = "" if str(real) == norm else f" (resolves to {real})"
            raise errors.InvalidArgument(
                f"location {location}{via} is outside the allowed checkpoint roots ({roots_text})"
            )
        return Location(real, None, norm)
    parent, name = os.path.split(norm)
    real_parent = Path(os.path.realpath(parent))
    if not _inside_roots(real_parent, roots):
        raise errors.InvalidArgument(
            f"location {location} is outside the allowed checkpoint roots ({roots_text})"
        )
    if os.path.lexists(norm):
        raise errors.InvalidArgument(
            f"location {location} already exists: pass a new file name or a directory; "
            "podshim never replaces a file"
        )
    paths.check_component(name, "location file name")
    if not real_parent.is_dir():
        raise errors.NotFound(f"the directory of location {location} does not exist: create {parent} first")
    return Location(real_parent, name, parent)


def rfc3339(ns: int | None = None, seconds_only: bool = False) -> str:
    """RFC 3339 in UTC: from unix nanoseconds (None: now); Go's RFC3339 when seconds_only."""
    if ns is None:
        dt = datetime.now(UTC)
    else:
        dt = datetime.fromtimestamp(ns / 1e9, UTC)
    if seconds_only:
        return dt.strftime("%Y-%m-%dT%H:%M:%SZ")
    return dt.isoformat(timespec="microseconds").replace("+00:00", "Z")


def kubelet_name(pod: PodView, container: str, when: str) -> str:
    """The kubelet's name: checkpoint-<podName>_<podNamespace>-<containerName>-<RFC3339>.tar."""
    md = pod.status.metadata
    return f"checkpoint-{md.name}_{md.namespace}-{container}-{when}.tar"


# ---------------------------------------------------------------------------- threads


class _Reader:
    """A file object for tarfile to copy from: hashes what it reads (one pass over the images)
    and stops when the operation is cancelled."""

    def __init__(self, f: IO[bytes], steps: Steps) -> None:
        self.f = f
        self.steps = steps
        self.sha256 = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        self.steps.check()
        data = self.f.read(n)
        self.sha256.update(data)
        self.size += len(data)
        return data


# ---------------------------------------------------------------------------- archive files


class _FdRef:
    """What tarfile.gettarinfo needs of a file object to stat an open descriptor."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd, self.name = fd, name

    def fileno(self) -> int:
        return self.fd


def _member_order(tree: HeldTree) -> list[str]:
    """Every entry of `tree` (dirs too), metadata first, then the rest in sorted order."""
    rest = [rel for rel in [*tree.dirs, *tree.files] if rel and rel not in LEADING_MEMBERS]
    lead = [m for m in LEADING_MEMBERS if m in tree.files]
    return lead + sorted(rest)


def write_tar(
    tree_dir: DirHandle,
    staging: DirHandle,
    steps: Steps,
    manifest_for: Callable[[dict[str, manifest.FileEntry]], bytes],
) -> int:
    """Tar `tree_dir` into the new file STAGING_TAR of `staging` (0600, uncompressed, PAX,
    fsynced); returns its size. Both are read and written through their descriptors only.

    Member names are relative ("spec.dump", "checkpoint/inventory.img"), as containerd and
    CRI-O write them. Each file is hashed as it is copied; `manifest_for(files)` then gives the
    manifest, added as the last member. A partial tar is removed.
    """
    files: dict[str, manifest.FileEntry] = {}
    fd = staging.create(STAGING_TAR)
    try:
        with (
            tree_dir.tree(
                lambda msg: errors.Internal(f"unexpected entry in a container checkpoint: {msg}")
            ) as tree,
            os.fdopen(fd, "wb") as raw,
        ):
            with tarfile.open(  # type: ignore[call-overload]  # copybufsize: a TarFile argument typeshed's open() lacks
                fileobj=raw, mode="w", format=tarfile.PAX_FORMAT, copybufsize=fsutil.CHUNK_SIZE
            ) as tar:
                for rel in _member_order(tree):
                    steps.check()
                    if rel in tree.dirs:
                        tar.addfile(tar.gettarinfo(arcname=rel, fileobj=_FdRef(tree.dirs[rel].fd, rel)))
                        continue
                    parent, _, name = rel.rpartition("/")
                    ffd = os.open(
                        name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tree.dirs[parent].fd
                    )
                    with os.fdopen(ffd, "rb") as f:
                        ti = tar.gettarinfo(arcname=rel, fileobj=_FdRef(ffd, rel))
                        if not ti.isreg():
                            raise errors.Internal(f"unexpected entry {rel} in a container checkpoint")
                        reader = _Reader(f, steps)
                        tar.addfile(ti, reader)
                    if reader.size != ti.size:
                        raise errors.Internal(f"{rel} changed size while it was archived")
                    files[rel] = manifest.FileEntry(size=reader.size, sha256=reader.sha256.hexdigest())
                data = manifest_for(files)
                ti = tarfile.TarInfo(MANIFEST_FILE)
                ti.size, ti.mode, ti.mtime = len(data), fsutil.FILE_MODE, int(time.time())
                tar.addfile(ti, io.BytesIO(data))
            raw.flush()
            os.fsync(raw.fileno())
            size = os.fstat(raw.fileno()).st_size
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(STAGING_TAR, dir_fd=staging.fd)
        raise
    return size


def publish(staging: DirHandle, where: DirHandle, name: str) -> Path:
    """Give the finished tar (STAGING_TAR in `staging`) its name in `where` without ever
    replacing a file (link(2) fails if the name exists), then make the new entry durable. Both
    directories are reached through their held descriptors."""
    target = where.path / name
    try:
        os.link(STAGING_TAR, name, src_dir_fd=staging.fd, dst_dir_fd=where.fd, follow_symlinks=False)
    except FileExistsError:
        raise errors.InvalidArgument(
            f"{target} appeared while the checkpoint was written; it was left alone: pass a new file name"
        ) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV):
            raise errors.storage_error(e, f"cannot create {target}", Path(target).parent, "one inode") from e
        # a file system without hard links: a rename, after checking the name is free
        if _exists(where, name):
            raise errors.InvalidArgument(f"{target} appeared meanwhile; left alone") from None
        os.rename(STAGING_TAR, name, src_dir_fd=staging.fd, dst_dir_fd=where.fd)
    where.fsync()
    return target


def _exists(d: DirHandle, name: str) -> bool:
    try:
        os.stat(name, dir_fd=d.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


# ---------------------------------------------------------------------------- checkpoint


@dataclass
class Result:
    path: Path
    size: int
    freeze_window: float
    timings: dict[str, float]


class ContainerCheckpointer:
    """CheckpointContainer in podshim; the dump, runtime choice and diff capture are the pod
    checkpoint's (PodCheckpointer), applied to one container."""

    def __init__(self, config: Config, upstream: Upstream, journal: Journal, pods: PodCheckpointer) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = journal
        self.pods = pods

    @staticmethod
    def budget(timeout: int, remaining: float | None) -> float:
        """Seconds the operation may take: the request's `timeout` (0: none) and the caller's
        gRPC deadline, whichever ends first, minus the margin kept to thaw and clean up."""
        limits = [float(timeout)] if timeout > 0 else []
        if remaining is not None:
            limits.append(remaining)
        return (min(limits) if limits else DEFAULT_DEADLINE) - CLEANUP_MARGIN

    async def locate(self, container_id: str) -> tuple[PodView, ContainerView]:
        """The container and its pod, from the upstream (an id prefix works as in crictl)."""
        if not container_id:
            raise errors.InvalidArgument("container_id is empty: name the container to checkpoint")
        doing = f"reading container {container_id}"
        try:
            st = await self.upstream.container_status(container_id, doing=doing)
            listed = await self.upstream.list_containers(cri.ContainerFilter(id=st.status.id), doing=doing)
        except errors.ShimError as e:
            if is_not_found(e):
                raise errors.NotFound(
                    f"container {container_id!r} not found: check the id with `crictl ps -a`"
                ) from None
            raise
        if not listed:
            raise errors.NotFound(f"container {container_id!r} not found (removed meanwhile)")
        pod = await build_pod_view(self.upstream, listed[0].pod_sandbox_id)
        c = pod.by_id(st.status.id)
        if c is None:
            raise errors.NotFound(f"container {container_id!r} not found in its pod (removed meanwhile)")
        return pod, c

    async def checkpoint(
        self,
        req: cri.CheckpointContainerRequest,
        remaining: float | None,
        hold: Callable[[list[str]], contextlib.AbstractContextManager[None]],
    ) -> Result:
        """Run CheckpointContainer. `remaining`: the caller's gRPC deadline (None: none set);
        `hold(keys)`: the engine's operation lock (ABORTED while another operation holds one)."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        budget = self.budget(req.timeout, remaining)
        if budget <= 0:
            raise errors.DeadlineExceeded(
                "the timeout leaves no time to checkpoint the container: pass a longer timeout"
            )
        deadline = loop.time() + budget
        loc = await asyncio.to_thread(check_location, req.location, self.config.allowed_roots)
        pod, c = await self.locate(req.container_id)
        if not c.running:
            raise errors.FailedPrecondition(
                f"container {c.name!r} ({c.id[:13]}) is {cri.ContainerState.Name(c.state)}, not running: "
                "only a running container can be checkpointed"
            )
        when = rfc3339(seconds_only=True)
        target = loc.target(kubelet_name(pod, c.name, when))
        with hold([f"pod {pod.id}", f"path {target}"]):
            await run_to_end(check_dumpable, c)
            await run_to_end(self.pods.check_criu_config, c)
            # a file of the pod's /dev/shm in use: the restore could not open it
            await run_to_end(check_shared_state, [c])
            # the kubelet's checkpoint API sends no options: the node's defaults, with ghost-limit and
            # irmap-scan-path fitted to what the container holds, as CheckpointPod's
            # (docs/design/checkpoint-container.md (CheckpointContainer)); its image ID, recorded in the tar
            # (docs/design/archive.md (Image identity))
            opts = await self.pods.fit_options(self.pods.parse_options({}), [c])
            await resolve_container_images(self.upstream, [c])
            # the directory of the tar, held open: from here on it is reached only through that
            # descriptor (dirfd.py), so replacing it cannot make podshim write elsewhere
            where = open_checked(loc.directory, loc.asked or str(loc.directory), "location directory")
            try:
                stop = threading.Event()  # set when the deadline cancels a walk below: it ends
                # the emptyDirs it mounts travel in the tar (not the pod's /dev/shm: the pod's own,
                # refused above when in use), sized against the node's limit before the freeze
                limit = parse_size(self.config.volume_limit)
                vols = await run_to_end(pod_volumes.find, pod, [c], limit, stop, False, stop=stop)
                what = f"location directory {loc.directory}"
                await run_to_end(space.check_fits, where, [c], what, stop, vols.bytes, stop=stop)
                if _exists(where, target.name):
                    if loc.name is not None:
                        raise errors.InvalidArgument(
                            f"location {target} already exists: pass a new file name"
                        )
                    # a second checkpoint within the same second: a finer (still RFC 3339) time
                    target = loc.target(kubelet_name(pod, c.name, rfc3339()))
                # a hidden sibling of the tar, named so that leftovers read as temporary files
                staging = target.parent / fsutil.temp_name_for(STAGING_PREFIX)
                # what recovery thaws after a crash: not a container someone else had paused
                ours = [] if await run_to_end(self_frozen, [c.cgroups_path]) else [c.cgroups_path]
                rec = await run_to_end(  # fsync: never on the loop
                    self.journal.begin,
                    KIND,
                    pod.id,
                    ContainerCheckpointRecord(
                        output_path=str(staging), cgroups=ours, container_id=c.id, target=str(target)
                    ),
                )
            except BaseException:
                where.close()
                raise
            steps = Steps()
            try:
                held = where.adopt(where.mkdir(staging.name))  # closed with `where`
                async with asyncio.timeout_at(deadline):
                    size, timings = await self._run(
                        pod, c, opts, held, target, rec, steps, started, where, vols
                    )
                # The commit point, past the deadline's reach as before (it ran between two awaits):
                # from here on the checkpoint exists; only the staging dir is left to go.
                path = await run_to_end(self._publish, held, where, target.name)
                timings["total"] = time.monotonic() - started
                log.info(
                    "container checkpoint complete",
                    container=c.id,
                    path=str(path),
                    bytes=size,
                    **{k: round(v, 4) for k, v in timings.items()},
                )
                result = Result(path=path, size=size, freeze_window=timings["freeze_window"], timings=timings)
            except TimeoutError:
                self._abandon(where, staging, rec)
                total = budget + CLEANUP_MARGIN
                raise errors.DeadlineExceeded(
                    f"checkpoint of container {c.name!r} ({c.id[:13]}) did not finish within the deadline "
                    f"({total:.1f}s); the container was thawed and partial files removed: "
                    "retry with a longer timeout"
                ) from None
            except BaseException:
                self._abandon(where, staging, rec)
                raise
            self.journal.finish(rec)
            where.close()
        return result

    def _abandon(self, where: DirHandle, staging: Path, rec: Any) -> None:
        """Remove the staging dir through the location's held descriptor (never by path)."""
        try:
            with contextlib.suppress(OSError):
                where.remove(staging.name)
                where.fsync()
        finally:
            self.journal.finish(rec)
            where.close()

    async def _run(
        self,
        pod: PodView,
        c: ContainerView,
        opts: CheckpointOptions,
        staging: DirHandle,
        target: Path,
        rec: Any,
        steps: Steps,
        started: float,
        where: DirHandle,
        vols: pod_volumes.PodVolumes,
    ) -> tuple[int, dict[str, float]]:
        timings: dict[str, float] = {}
        tree = staging.adopt(staging.sub(STAGING_TREE, create=True))
        images = tree.adopt(tree.sub(layout.CHECKPOINT_DIR, create=True))
        # Paths through the held tree's descriptor (the rootfs diff and the stats reader take
        # paths): /proc/self/fd/N/<name>, inside podshim's own 0700 staging dir whatever happens to
        # `location` meanwhile.
        cl = layout.ContainerLayout(root=Path(tree.proc), rel="")
        upper = c.upperdir()
        if upper is None:
            raise errors.FailedPrecondition(
                f"container {c.name!r}: cannot find its writable layer (overlayfs upperdir); "
                "only the overlayfs snapshotter is supported"
            )
        await steps.run(tree.write_file, layout.SPEC_DUMP_FILE, layout.json_bytes(c.spec))
        await steps.run(tree.write_file, layout.STATUS_DUMP_FILE, layout.json_bytes(c.status_dump()))
        runtime = self.pods.runtime_for(c)
        timings["prepare"] = time.monotonic() - started

        # Freeze, dump (leaving it running) with the rootfs diff alongside, thaw: the pod's cut
        # (PodCut) of this one container's own cgroup, no parent (the rest of the pod is never
        # touched); someone else's earlier pause is left as found.
        cgroup = c.cgroups_path
        cut = PodCut(None, [cgroup], timeout=FREEZE_TIMEOUT)
        # its tasks' states, read before the freeze and checked after the thaw (docs/design/checkpoint-pod.md
        # (Task states after a checkpoint))
        states = await steps.run(TaskStates, [cgroup])
        # established TCP connections (a node default): the pod's netns locked around the dump as
        # CheckpointPod locks it, journaled first so that recovery unlocks it after a crash
        netlock = NetnsLock(pod.netns) if opts.criu.tcp_established and pod.netns else None
        netns = netlock.netns if netlock is not None else None
        await steps.run(self.journal.update, rec, "frozen", netns=netns)  # fsync: never on the loop
        checkpointed = rfc3339()
        try:
            await steps.run(cut.freeze)
            checkpointed = rfc3339()
            faults.hit("checkpoint-container.after-freeze")
            log.info("container frozen", container=c.id, name=c.name)
            try:
                if netlock is not None:
                    await run_to_end(netlock.lock)
                tasks = [
                    asyncio.ensure_future(self._dump(runtime, c, opts.criu, timings, tree, images)),
                    asyncio.ensure_future(self._diff(steps, c, upper, cl, timings)),
                    asyncio.ensure_future(self._volumes(steps, vols, tree, timings)),
                ]
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for t in tasks:
                        t.cancel()
                    await asyncio.wait(tasks)
                    for t in tasks:  # the first failure propagated; the others are retrieved
                        if not t.cancelled():
                            t.exception()
            finally:
                if netlock is not None:
                    netlock.unlock()  # synchronous on purpose, as the thaw: runs while cancelled
            await faults.hit_async("checkpoint-container.before-thaw")
        finally:
            cut.thaw_all()  # synchronous on purpose: runs even while the task is being cancelled
            if cut.timings.started_monotonic is not None and not cut.preexisting:
                confirm_thawed([cgroup], c.id)  # read back: no dump left to freeze it again
                taskstate.settle(states, "checkpoint_container", f"container {c.name!r}", container=c.id)
        timings["freeze_window"] = cut.window_seconds
        timings.update(cut.timings.wall_clock())
        # runc/CRIU wrote through the held descriptors: if the location's directory was replaced
        # meanwhile, fail rather than publish a tar where the caller's path no longer leads
        where.check_in_place("location directory", "the checkpoint")
        log.info("container thawed", container=c.id, freeze_window=round(timings["freeze_window"], 4))

        # After the thaw: config.dump, stats, manifest, the tar.
        await steps.run(self.journal.update, rec, "archiving")
        await steps.run(
            tree.write_file,
            layout.CONFIG_DUMP_FILE,
            layout.json_bytes(self._config_dump(pod, c, runtime, checkpointed)),
        )
        await steps.run(tree.make_private)
        stats = await steps.run(read_dump_stats, cl.stats_dump)
        host = await steps.run(self._host, runtime)
        tar_start = time.monotonic()

        def manifest_for(files: dict[str, manifest.FileEntry]) -> bytes:
            timings["archive"] = time.monotonic() - tar_start
            timings["total"] = time.monotonic() - started
            return self._manifest(pod, c, host, stats, opts, timings, files).to_json()

        size = await steps.run(write_tar, tree, staging, steps, manifest_for)
        tree.close()
        faults.hit("checkpoint-container.before-publish")
        where.check_in_place("location directory", "the checkpoint")  # the last moment to refuse
        return size, timings

    @staticmethod
    def _publish(staging: DirHandle, where: DirHandle, name: str) -> Path:
        """The commit point (in a worker thread: link, fsync, rmtree): the tar gets its name, then
        the staging dir goes."""
        path = publish(staging, where, name)
        staging.close()
        with contextlib.suppress(OSError):
            where.remove(staging.path.name)
        return path

    async def _dump(
        self,
        runtime: Any,
        c: ContainerView,
        opts: CriuOptions,
        timings: dict,
        tree: DirHandle,
        images: DirHandle,
    ) -> None:
        # runc/crun inherit the held directories and name them /proc/self/fd/N (dirfd.py)
        try:
            timings["dump"] = await runtime.checkpoint(
                c.name,
                c.id,
                Path(images.proc),
                Path(tree.proc),
                opts,
                leave_running=True,
                pass_fds=(images.fd, tree.fd),
            )
        except (errors.Internal, errors.ResourceExhausted) as e:  # the staging dir goes with the failure
            raise with_kept_log(e, tree, self.config.state_dir, c.id) from None
        log.info("container dumped", container=c.id, seconds=round(timings["dump"], 4))

    async def _diff(
        self, steps: Steps, c: ContainerView, upper: Path, cl: layout.ContainerLayout, timings: dict
    ) -> None:
        start = time.monotonic()
        await steps.run(
            rootfs_diff.capture_rootfs_diff,
            upper,
            cl.rootfs_diff_tar,
            exclude=c.mount_destinations,
            deleted_files=cl.deleted_files,
        )
        timings["rootfs_diff"] = time.monotonic() - start

    @staticmethod
    async def _volumes(
        steps: Steps, vols: pod_volumes.PodVolumes, tree: DirHandle, timings: dict[str, float]
    ) -> None:
        """The emptyDirs the container mounts, tarred inside the freeze beside the dump, as a pod
        checkpoint holds them (sandbox/volumes.json, sandbox/empty-dirs/<name>.tar)."""
        if not vols.empty_dirs:
            return
        start = time.monotonic()
        await steps.run(pod_volumes.capture, vols, tree, steps.cancel)
        timings["volumes"] = time.monotonic() - start

    def _config_dump(self, pod: PodView, c: ContainerView, runtime: Any, checkpointed: str) -> dict[str, Any]:
        """checkpointctl's ContainerConfig keys, plus podshim's record of the container (the same
        keys as in a pod checkpoint) and its pod."""
        md = pod.status.metadata
        return {
            **c.to_record(),
            "rootfsImage": str(c.config.get("image", {}).get("image", "")) or c.image,
            "rootfsImageRef": c.status.image_ref,
            "rootfsImageName": c.image,
            "runtime": os.path.basename(runtime.binary),
            "createdTime": rfc3339(c.status.created_at) if c.status.created_at else "",
            "checkpointedTime": checkpointed,
            "restored": False,
            # written first in the tar: says a podshim manifest must follow (truncation check)
            "podshim": {"format": FORMAT, "manifest": MANIFEST_FILE, "version": __version__},
            "pod": {
                "id": pod.id,
                "name": md.name,
                "namespace": md.namespace,
                "uid": md.uid,
                "runtime_handler": pod.runtime_handler,
            },
        }

    def _host(self, runtime: Any) -> dict[str, str]:
        return vars(
            manifest.HostInfo(
                podshim_version=__version__,
                criu_version=binary_version(runtime.criu or self.config.runtime.criu),
                runtime_name=os.path.basename(runtime.binary),
                runtime_version=binary_version(runtime.binary),
            )
        )

    def _manifest(
        self,
        pod: PodView,
        c: ContainerView,
        host: dict[str, str],
        stats: dict[str, int],
        opts: CheckpointOptions,
        timings: dict[str, float],
        files: dict[str, manifest.FileEntry],
    ) -> ContainerTarManifest:
        """podshim-manifest.json: format, host, container, pod, timings, CRIU stats, options and
        size + sha256 of every other file of the tar."""
        md = pod.status.metadata
        return ContainerTarManifest(
            host=host,
            container={
                "id": c.id,
                "name": c.name,
                "image": c.image,
                "image_ref": c.status.image_ref,
                "image_id": c.image_id,
                "user_specified_image": c.user_specified_image,
                "restart_count": c.restart_count,
                "state": cri.ContainerState.Name(c.state),
            },
            pod={"id": pod.id, "name": md.name, "namespace": md.namespace, "uid": md.uid},
            timings={k: round(v, 6) for k, v in timings.items()},
            criu_stats=stats,
            options=dict(sorted(options_record(opts).items())),
            files=files,
        )


# ---------------------------------------------------------------------------- recovery


async def recover(rec: OpRecord) -> None:
    """Undo a CheckpointContainer a crash interrupted: thaw the container's cgroup (unless someone
    else had paused it) and remove podshim's staging dir next to the tar, through its parent
    opened with O_NOFOLLOW (a parent replaced by a symlink since is left alone). A record without
    a staging dir is recovered like a pod checkpoint's."""
    data: ContainerCheckpointRecord = rec.data
    out = data.output_path
    if not (out and fsutil.is_temp_name(Path(out).name)):
        await checkpoint_pod_recovery.recover(rec)
        return
    if data.netns:
        # a crash between the netns lock and its unlock left the pod's network dropped
        NetnsLock.unlock_leftover(data.netns)
    thaw_paths(list(data.cgroups))
    staging = Path(out)
    with contextlib.suppress(OSError, errors.ShimError), DirHandle.open(staging.parent) as d:
        d.remove(staging.name)
