"""CheckpointPod (KEP-5823): a consistent pod-wide checkpoint with the shortest freeze window.

Order of work (docs/design/checkpoint-pod.md (CheckpointPod)): validate (the options and the containers:
shim/ops/checkpoint_checks.py) -> pod view -> journal -> write what needs no frozen state -> freeze
in one cut -> dump every container in parallel + capture rootfs diffs -> thaw (or kill for STOPPED)
-> stats, encryption (with a node key: shim/archive/crypto.py), checksums, manifest (the completion
marker). Any failure or the deadline thaws the pod, removes what was written inside output_path and
returns a typed error.
"""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from api.runtime.v1 import api_pb2 as cri
from shim import __version__, cni, errors, faults, kept_logs, logs
from shim.aio import run_to_end, wait_out
from shim.archive import compat, crypto, fsutil, layout, manifest, paths, rootfs_diff, writeback
from shim.archive.dirfd import DirHandle, open_checked
from shim.cgroups import PodCut, cgroup_procs, default_freezer, thaw_paths
from shim.checks import openfiles, rlimits, space, taskstate
from shim.checks.sharing import check_shared_state
from shim.checks.taskstate import TaskStates
from shim.config import Config, parse_size
from shim.criu import rpc_config
from shim.criu.netns_lock import NetnsLock
from shim.criu.options import DumpGate
from shim.criu.runtime import OciRuntime, binary_version, read_dump_stats
from shim.deadlines import CHECK_MARGIN, CLEANUP_MARGIN, DEFAULT_DEADLINE, DUMPS_READY_WAIT, FREEZE_TIMEOUT
from shim.ops import pod_volumes
from shim.ops.checkpoint_checks import (
    CheckpointOptions,
    check_dumpable,
    recorded_containers,
    select_containers,
)
from shim.sandbox import ContainerView, PodView, build_pod_view
from shim.sandbox.images import resolve_container_images
from shim.state import Journal
from shim.state.records import CheckpointRecord
from shim.upstream import Upstream

log = logs.get("shim.ops.checkpoint_pod")

# Hash threads of the archive phase: one per core. The images were written back during the dumps
# (shim/archive/writeback.py), so the phase is bound by sha256 (about 1 GiB/s per thread here),
# not by the flush beside it; the threads run at a lower priority (fsutil.BACKGROUND_NICE), so
# the pod that was just thawed and the node's other work come first. With fewer dumps than these
# cores, the page images are hashed during the dumps instead (PodCheckpointer._images_ahead).
HASH_WORKERS = max(1, os.cpu_count() or 1)


def network_record(pod: PodView) -> dict[str, Any]:
    """sandbox/network.json: the CNI result the upstream recorded and the pod's namespace as
    pyroute2 reads it (interfaces, addresses, routes), which RestorePod checks against."""
    netns = pod.netns
    return {"cni_result": pod.network, "netns": cni.read_facts(netns) if netns else {}}


def self_frozen(cgroups: list[str]) -> list[str]:
    """The cgroups of `cgroups` that are frozen by themselves (paused by someone else)."""
    f = default_freezer()
    return [cg for cg in cgroups if f.self_frozen(cg)]


def _children_cpu() -> float:
    """User + system CPU seconds of podshim's child processes reaped so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def _gates_ready(gates: list[DumpGate], dumps: Sequence[asyncio.Future[None]]) -> float:
    """Wait, before the cut, until every dump's CRIU is at its gate (or its dump ended: a failure
    before the gate), at most DUMPS_READY_WAIT: past it the cut goes on and a late dump passes
    its gate when it gets there. Returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < DUMPS_READY_WAIT:
        if all(g.ready() or d.done() for g, d in zip(gates, dumps, strict=True)):
            break
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def confirm_thawed(cgroups: list[str], pod_id: str) -> None:
    """Read the freezer state back after the thaw and thaw again what is frozen: the dumps have
    ended and no CRIU of theirs is left (OciRuntime.checkpoint), so nothing should have frozen
    it again; if something did, the pod must still not stay frozen."""
    again = thaw_paths(cgroups)
    if again:
        log.warning("cgroups frozen again after the thaw; thawed them again", pod=pod_id, cgroups=again)


@dataclass
class _Work:
    """One container being captured."""

    view: ContainerView
    layout: layout.ContainerLayout
    runtime: OciRuntime
    dir: DirHandle  # containers/<name>, held open: everything of the container goes through it
    images: DirHandle  # containers/<name>/checkpoint, held open (CRIU's --image-path)
    dump_seconds: float = 0.0
    diff_seconds: float = 0.0
    memory: int = 0  # resident bytes before the freeze: the largest dump is started first

    def close(self) -> None:
        self.images.close()
        self.dir.close()


class PodCheckpointer:
    def __init__(self, config: Config, upstream: Upstream, journal: Journal) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = journal

    def node_key(self) -> crypto.NodeKey | None:
        """The node key archives are encrypted with (`[checkpoint] encryption_key_file`), or None."""
        path = self.config.encryption_key_file
        return crypto.load_key(path) if path else None

    def runtime_for(self, c: ContainerView) -> OciRuntime:
        rt = self.config.runtime_for_root(c.runtime_root) if c.runtime_root else self.config.runtime
        return OciRuntime(rt.binary, c.runtime_root or rt.root, rt.criu, self.config.scratch_dir)

    def parse_options(self, options: dict[str, str]) -> CheckpointOptions:
        """A checkpoint's options: the request's over the node's defaults (`[checkpoint]`; the
        kubelet sends none, docs/design/checkpoint-pod.md (What the kubelet sends))."""
        cap = parse_size(self.config.ghost_limit_max)
        return CheckpointOptions.parse(options, self.config.option_defaults(), cap)

    async def fit_options(
        self, opts: CheckpointOptions, containers: list[ContainerView]
    ) -> CheckpointOptions:
        """`opts` with CRIU's ghost-limit and irmap-scan-path fitted to the files `containers` hold,
        read before anything is frozen (shim/checks/openfiles.py): what the kubelet sends is enough."""
        criu = await run_to_end(openfiles.fitted, opts.criu, containers, opts.ghost_auto_max)
        return replace(opts, criu=criu)

    def check_criu_config(self, c: ContainerView) -> None:
        """What this container's dump needs of CRIU, checked before the freeze: that it can read
        the limits of a non-root task on this node (shim/checks/rlimits.py), and the CRIU config
        file runc would hand it: a restore's leftover is removed, a file overriding podshim's dump
        options refused (shim/criu/rpc_config.py)."""
        rt = self.runtime_for(c)
        rlimits.check(c.name, c.pid, rt.criu or "criu")
        removed = rpc_config.check_before_dump(rt.root, rt.is_runc, c.id, c.name)
        if removed:
            log.warning(
                "removed a restore's CRIU config named for the container's dumps",
                container=c.id,
                path=removed,
            )

    async def checkpoint(self, req: cri.CheckpointPodRequest, deadline: float | None) -> manifest.Manifest:
        """Run CheckpointPod; `deadline` is the caller's remaining seconds (None: none set),
        counted from here: the checks before the freeze are bounded by it too."""
        loop = asyncio.get_running_loop()
        caller_end = loop.time() + (deadline if deadline is not None else DEFAULT_DEADLINE)
        try:
            async with asyncio.timeout_at(caller_end - CHECK_MARGIN):
                opts, out, pod, selected, held, vols = await self._check(req)
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"the caller's deadline passed while checking the request for pod {req.pod_sandbox_id}; "
                "nothing was frozen or written: retry with a longer deadline"
            ) from None
        archive = layout.ArchiveLayout(out, held)
        try:
            post = req.post_checkpoint_state
            end = caller_end - CLEANUP_MARGIN
            if end <= loop.time():
                raise errors.DeadlineExceeded(f"the deadline leaves no time to checkpoint pod {pod.name}")
            # What recovery thaws after a crash: the cgroups this checkpoint may freeze. A container
            # someone else paused before (the cut leaves it so) is not ours to thaw.
            paused = set(await run_to_end(self_frozen, [c.cgroups_path for c in selected]))
            ours = [c.cgroups_path for c in selected if c.cgroups_path not in paused]
            rec = await run_to_end(  # fsync: never on the loop
                self.journal.begin,
                "checkpoint",
                pod.id,
                CheckpointRecord(output_path=str(out), cgroups=[pod.cgroup_parent, *ours]),
            )
        except BaseException:
            held.close()
            raise
        started = time.monotonic()
        try:
            async with asyncio.timeout_at(end):
                result = await self._run(pod, selected, archive, opts, post, rec, started, vols)
        except TimeoutError:
            self._abandon(archive, rec)
            raise errors.DeadlineExceeded(
                f"checkpoint of pod {pod.name} did not finish within the caller's deadline "
                f"({deadline if deadline is not None else DEFAULT_DEADLINE:.1f}s); the pod was thawed and "
                "partial files removed: "
                "retry with a longer deadline"
            ) from None
        except BaseException:
            self._abandon(archive, rec)
            raise
        self.journal.finish(rec)
        held.close()
        return result

    async def _check(
        self, req: cri.CheckpointPodRequest, carry_volumes: bool = True
    ) -> tuple[CheckpointOptions, Path, PodView, list[ContainerView], DirHandle, pod_volumes.PodVolumes]:
        """Everything checked before anything is frozen or written: options, output path, node
        key, pod (ready), the containers to capture (running, dumpable), the pod's volumes (under
        the node's limit), and that the checkpoint fits on output_path's file system. Returns
        output_path held open (dirfd.py): from here on nothing inside it is reached through its
        path."""
        opts = self.parse_options(dict(req.options))
        post = req.post_checkpoint_state
        if post not in (cri.POST_CHECKPOINT_STATE_RUNNING, cri.POST_CHECKPOINT_STATE_STOPPED):
            raise errors.InvalidArgument(f"post_checkpoint_state {post} is not RUNNING (0) or STOPPED (1)")
        out = await run_to_end(paths.validate_output_dir, req.output_path, self.config.allowed_roots)
        await run_to_end(self.node_key)  # an unusable node key fails before anything is frozen
        pod = await build_pod_view(self.upstream, req.pod_sandbox_id)
        if not pod.ready:
            raise errors.FailedPrecondition(
                f"pod {pod.name} ({pod.id[:13]}) is {cri.PodSandboxState.Name(pod.status.state)}, not ready"
            )
        selected = select_containers(pod, list(req.container_ids))
        await resolve_container_images(self.upstream, recorded_containers(pod, selected))
        for c in selected:
            await run_to_end(check_dumpable, c)
            await run_to_end(self.check_criu_config, c)
        stop = threading.Event()  # set when the deadline cancels a walk below: it ends
        limit = parse_size(self.config.volume_limit)
        vols = pod_volumes.PodVolumes()
        if carry_volumes:  # what the checkpointed containers mount: nothing else runs again
            vols = await run_to_end(pod_volumes.find, pod, selected, limit, stop, stop=stop)
        # what the containers share (shim/checks/sharing.py); the pod's own /dev/shm travels with it
        await run_to_end(check_shared_state, selected, vols.dev_shm is not None)
        opts = await self.fit_options(opts, selected)
        held = open_checked(out, req.output_path, "output path", empty=True)
        try:
            where = f"output path {req.output_path}"
            await run_to_end(space.check_fits, held, selected, where, stop, vols.bytes, stop=stop)
        except BaseException:
            held.close()
            raise
        return opts, out, pod, selected, held, vols

    def _abandon(self, archive: layout.ArchiveLayout, rec: Any) -> None:
        """Remove what this operation wrote inside output_path (never the dir itself), through
        the descriptor held: if the path was replaced meanwhile, nothing else is touched."""
        assert archive.dir is not None
        try:
            archive.dir.clear()
        except OSError as e:
            raise errors.Internal(
                f"cannot remove the partial checkpoint in {archive.root}: {e}; remove it by hand"
            ) from e
        finally:
            self.journal.finish(rec)
            archive.dir.close()

    async def _run(
        self,
        pod: PodView,
        selected: list[ContainerView],
        archive: layout.ArchiveLayout,
        opts: CheckpointOptions,
        post: int,
        rec: Any,
        started: float,
        vols: pod_volumes.PodVolumes,
    ) -> manifest.Manifest:
        assert archive.dir is not None  # output_path held open (_check)
        timings: dict[str, float] = {}
        stopped = post == cri.POST_CHECKPOINT_STATE_STOPPED
        # 1. Everything that needs no frozen state is written before the freeze.
        faults.hit("checkpoint.before-prepare")
        work = await run_to_end(self._prepare, pod, selected, archive)
        timings["prepare"] = time.monotonic() - started
        log.info("checkpoint prepared", pod=pod.id, containers=[w.view.name for w in work])

        # 2. Freeze in one cut, dump all in parallel with the rootfs diffs, thaw.
        cut = PodCut(pod.cgroup_parent, [w.view.cgroups_path for w in work], timeout=FREEZE_TIMEOUT)
        # established TCP connections: the pod's netns locked once for all the dumps (each
        # CRIU is told to skip its own lock; docs/design/checkpoint-pod.md (The freeze window)),
        # journaled first so that recovery unlocks it after a crash
        netlock = NetnsLock(pod.netns) if opts.criu.tcp_established and pod.netns else None
        netns = netlock.netns if netlock is not None else None
        # every task's scheduling state, read before the freeze and checked after the thaw, both
        # outside the freeze window (docs/design/checkpoint-pod.md (Task states after a checkpoint))
        states_start = time.monotonic()
        states = await run_to_end(TaskStates, [w.view.cgroups_path for w in work])
        timings["task_states"] = time.monotonic() - states_start
        await run_to_end(self.journal.update, rec, "frozen", netns=netns)  # fsync: never on the loop
        ahead: writeback.ImagesWriteback | None = None
        vstop = threading.Event()  # set when the capture must end: the volumes' tars stop
        # the dumps start before the cut and wait at their gates with runc's and CRIU's start-up
        # done (DumpGate; docs/design/checkpoint-pod.md (The freeze window)); the largest first: the
        # slowest dump bounds the window, so it gets the head start
        order = sorted(work, key=lambda w: w.memory, reverse=True)
        gates = [DumpGate(self.config.scratch_dir) for _ in order]
        children_before = _children_cpu()
        dumps = [asyncio.ensure_future(self._dump(w, opts, g)) for w, g in zip(order, gates, strict=True)]
        try:
            try:
                timings["dumps_ready"] = await _gates_ready(gates, dumps)
                for d in dumps:
                    if d.done():
                        d.result()  # failed before its gate: raised before anything is frozen
                await run_to_end(cut.freeze)
                faults.hit("checkpoint.after-freeze")
                log.info("pod frozen", pod=pod.id, cut_seconds=round(cut.cut_seconds, 4))
                dump_start = time.monotonic()
                ahead = self._images_ahead(work)
                try:
                    if netlock is not None:
                        await run_to_end(netlock.lock)
                    diffs = [asyncio.ensure_future(self._diff(w, opts)) for w in work]
                    diffs.append(asyncio.ensure_future(self._volumes(vols, archive.dir, timings, vstop)))
                    try:
                        for g in gates:
                            g.open()
                        await asyncio.gather(*dumps, *diffs)
                    except BaseException:
                        # gather leaves the others running: a dump still going after the thaw below
                        # would freeze its container again (CRIU restores the FROZEN state it found)
                        # and write into the cleared output_path. Stop them and wait before thawing.
                        vstop.set()
                        for t in dumps:
                            t.cancel()
                        await asyncio.gather(*dumps, *diffs, return_exceptions=True)
                        raise
                finally:
                    if netlock is not None:
                        netlock.unlock()  # synchronous on purpose, as the thaw: runs while cancelled
                    if ahead is not None:
                        # its last look may wait for the disk's queue (0.8 s measured): never
                        # waited for while frozen, joined after the thaw (below)
                        ahead.stop_soon()
                timings["dump"] = time.monotonic() - dump_start
                # CPU seconds of the runc/CRIU processes reaped meanwhile (the dumps, whatever else
                # podshim ran then): the bench compares it with plain runc's (bench/checkpoint.py)
                timings["dump_cpu"] = _children_cpu() - children_before
                await faults.hit_async("checkpoint.before-thaw")
                # runc/CRIU wrote through the directory podshim holds (/proc/self/fd/N), never
                # through output_path: if someone replaced output_path meanwhile, fail instead of
                # answering OK for a checkpoint the caller's path does not hold
                archive.dir.check_in_place("output path", "the checkpoint")
                if stopped:
                    # STOPPED: the pod stays frozen until its archive is complete and is then killed,
                    # still frozen, so no instruction runs past the checkpoint. A failure before that
                    # thaws it (below) and it keeps running: the pod is never lost without a checkpoint.
                    m = await self._archive(pod, work, archive, opts, post, timings, rec, ahead)
                    await run_to_end(self._kill_frozen, work)
            finally:
                cut.thaw_all()  # synchronous on purpose: runs even while the task is being cancelled
                confirm_thawed(
                    [pod.cgroup_parent, *(c for c in cut.containers if c not in cut.preexisting)], pod.id
                )
                check_start = time.monotonic()
                taskstate.settle(states, "checkpoint_pod", f"pod {pod.name}", pod=pod.id)
                timings["task_check"] = time.monotonic() - check_start
            timings["freeze_window"] = cut.window_seconds
            timings["freeze_cut"] = cut.cut_seconds
            timings.update(cut.timings.wall_clock())
            log.info("pod thawed", pod=pod.id, freeze_window=round(cut.window_seconds, 4))
            if stopped:
                await self._stop_upstream(work)
            else:
                # 3. After the thaw: stats, checksums, manifest (completion marker).
                m = await self._archive(pod, work, archive, opts, post, timings, rec, ahead)
        finally:
            # a dump still at its gate (a failure before the cut) fails there, nothing seized
            for g in gates:
                g.close()
            # ended before anything in output_path is removed, whatever cancellations arrive
            late_cancel = await wait_out(asyncio.gather(*dumps, return_exceptions=True))
            if ahead is not None:
                # its last look may still wait for the disk's queue: it runs beside the archive's
                # sha256 pass; ended before the handles are closed or anything in output_path
                # is removed
                await run_to_end(ahead.stop)  # waits for its thread even when cancelled
                hashed_mib = sum(d.size for d in ahead.hashed.values()) >> 20
                mib = ahead.started_bytes >> 20
                log.info("images written back during the dumps", pod=pod.id, mib=mib, hashed_mib=hashed_mib)
            if late_cancel is not None:
                raise late_cancel
        m.timings["total"] = time.monotonic() - started
        # Rewrite the timings into the final manifest (files are unchanged, so checksums stand).
        archive.dir.write_file(layout.MANIFEST_FILE, m.to_json())
        for w in work:
            w.close()
        log.info(
            "checkpoint complete",
            pod=pod.id,
            path=str(archive.root),
            **{k: round(v, 4) for k, v in m.timings.items()},
        )
        return m

    async def _archive(
        self,
        pod: PodView,
        work: list[_Work],
        archive: layout.ArchiveLayout,
        opts: CheckpointOptions,
        post: int,
        timings: dict[str, float],
        rec: Any,
        ahead: writeback.ImagesWriteback | None,
    ) -> manifest.Manifest:
        """Stats, checksums, fsync, manifest.json (the completion marker); `ahead`: the images'
        follower, whose page-image digests the checksums take."""
        await run_to_end(self.journal.update, rec, "archiving")  # fsync: never on the loop
        faults.hit("checkpoint.archive")
        archive_start = time.monotonic()
        stop = threading.Event()
        hashed_ahead = ahead.digests if ahead is not None else None
        m = await run_to_end(
            self._finish_archive,
            pod,
            work,
            archive,
            opts,
            post,
            timings,
            stop,
            hashed_ahead=hashed_ahead,
            stop=stop,
        )
        m.timings["archive"] = time.monotonic() - archive_start
        return m

    def _prepare(
        self, pod: PodView, selected: list[ContainerView], archive: layout.ArchiveLayout
    ) -> list[_Work]:
        """Write what needs no frozen state, every level through the held output_path. Each
        directory is podshim's own new one (an exclusive mkdir): anything planted in output_path
        since it was checked empty is FAILED_PRECONDITION (docs/design/archive.md (Path
        confinement)), whatever it is."""
        try:
            return self._prepare_dirs(pod, selected, archive)
        except (FileExistsError, NotADirectoryError, IsADirectoryError, errors.InvalidArgument) as e:
            raise _written_meanwhile(archive, str(e)) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTEMPTY):  # a symlink or a filled dir in the way
                raise _written_meanwhile(archive, str(e)) from None
            raise

    def _prepare_dirs(
        self, pod: PodView, selected: list[ContainerView], archive: layout.ArchiveLayout
    ) -> list[_Work]:
        assert archive.dir is not None
        with archive.dir.mkdir(layout.SANDBOX_DIR) as sb:
            sb.write_file(layout.SANDBOX_CONFIG_FILE, layout.json_bytes(pod.config))
            sb.write_file(layout.SANDBOX_STATUS_FILE, layout.json_bytes(pod.to_record()))
            sb.write_file(layout.SANDBOX_NETWORK_FILE, layout.json_bytes(network_record(pod)))
        work: list[_Work] = []
        with archive.dir.mkdir(layout.CONTAINERS_DIR) as containers:
            for c in recorded_containers(pod, selected):
                cl = archive.container(c.name)  # checks the name is one path component
                cd = archive.dir.adopt(containers.mkdir(c.name))  # closed with output_path
                images = cd.adopt(cd.mkdir(layout.CHECKPOINT_DIR)) if c in selected else None
                cd.write_file(layout.CONFIG_DUMP_FILE, layout.json_bytes(c.to_record()))
                cd.write_file(layout.SPEC_DUMP_FILE, layout.json_bytes(c.spec))
                cd.write_file(layout.STATUS_DUMP_FILE, layout.json_bytes(c.status_dump()))
                if images is not None:
                    work.append(_Work(c, cl, self.runtime_for(c), cd, images, memory=space.memory_bytes(c)))
        return work

    def _images_ahead(self, work: list[_Work]) -> writeback.ImagesWriteback | None:
        """A thread beside the dumps that follows the images CRIU writes (docs/design/checkpoint-pod.md
        (The freeze window)):

        * writeback: when the pod's memory would take the node's dirty pages past the point where
          the kernel throttles writers, the page images are written back from their first MiB, so
          the disk starts with the dumps instead of at the kernel's background threshold and
          fewer of their pages count against the throttle point. Below it they stay in the page
          cache until the thaw. `[checkpoint] writeback_ahead` = "always" / "never" decides
          without looking.
        * sha256: with fewer dumps than cores, a core the dumps leave idle hashes the page images
          as they are written, and the archive phase after the thaw does not read them again (a
          1 GiB image took one thread 0.7 s there). Not for encrypted archives: their digests are
          the ciphertext's, taken after the thaw."""
        mode = self.config.writeback_ahead
        memory = sum(w.memory for w in work)
        write_back = mode == "always" or (
            mode == "auto" and writeback.would_be_throttled(memory, writeback.dirty_state())
        )
        hash_pages = len(work) < HASH_WORKERS and not self.config.encryption_key_file
        if not (write_back or hash_pages):
            return None
        images = [w.images for w in work]
        return writeback.ImagesWriteback(images, writeback=write_back, hash_pages=hash_pages).start()

    async def _dump(self, w: _Work, opts: CheckpointOptions, gate: DumpGate) -> None:
        try:
            # runc/crun get paths through the descriptors podshim holds: whatever happens to
            # output_path meanwhile, CRIU writes into the directory that was validated
            w.dump_seconds = await w.runtime.checkpoint(
                w.view.name,
                w.view.id,
                Path(w.images.proc),
                Path(w.dir.proc),
                opts.criu,
                leave_running=True,
                pass_fds=(w.images.fd, w.dir.fd),  # /proc/self/fd/N names them in runc/crun too
                gate=gate,
            )
        except (errors.Internal, errors.ResourceExhausted) as e:
            raise with_kept_log(e, w.dir, self.config.state_dir, w.view.id) from None
        log.info("container dumped", container=w.view.name, seconds=round(w.dump_seconds, 4))

    async def _diff(self, w: _Work, opts: CheckpointOptions) -> None:
        upper = w.view.upperdir()
        if upper is None:
            raise errors.FailedPrecondition(
                f"container {w.view.name!r}: cannot find its writable layer (overlayfs upperdir); "
                "only the overlayfs snapshotter is supported"
            )
        start = time.monotonic()
        await run_to_end(
            rootfs_diff.capture_rootfs_diff,
            upper,
            w.dir.at(layout.ROOTFS_DIFF_TAR),
            exclude=w.view.mount_destinations,
            compress=opts.compress,
            deleted_files=w.dir.at(layout.DELETED_FILES_FILE),
        )
        w.diff_seconds = time.monotonic() - start

    async def _volumes(
        self, vols: pod_volumes.PodVolumes, out: DirHandle, timings: dict[str, float], stop: threading.Event
    ) -> None:
        """The pod's emptyDirs and /dev/shm, tarred inside the freeze beside the dumps."""
        if not (vols.empty_dirs or vols.dev_shm):
            return
        start = time.monotonic()
        await run_to_end(pod_volumes.capture, vols, out, stop)
        timings["volumes"] = time.monotonic() - start

    def _kill_frozen(self, work: list[_Work]) -> None:
        for w in work:
            for pid in cgroup_procs(w.view.cgroups_path):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    async def _stop_upstream(self, work: list[_Work]) -> None:
        """Let the upstream record the exits (the processes are already dead)."""
        for w in work:
            try:
                await self.upstream.stop_container(w.view.id)
            except errors.ShimError as e:
                log.warning("stop after checkpoint failed", container=w.view.name, error=e.upstream_details)

    def _finish_archive(
        self,
        pod: PodView,
        work: list[_Work],
        archive: layout.ArchiveLayout,
        opts: CheckpointOptions,
        post: int,
        timings: dict[str, float],
        stop: threading.Event,
        extra_options: dict[str, str] | None = None,
        hashed_ahead: fsutil.HashedAhead | None = None,
    ) -> manifest.Manifest:
        """The archive's manifest, written last; `extra_options` joins the recorded options (a
        live migration's mark, manifest.PAGES_OPTION); `hashed_ahead`: digests taken during the
        dumps (ImagesWriteback.digests)."""
        assert archive.dir is not None
        archive.dir.make_private()
        rt = work[0].runtime
        dumped = {w.view.id: w for w in work}
        stats: dict[str, Any] = {}
        for w in work:
            s: dict[str, float] = dict(read_dump_stats(w.dir.at(layout.STATS_DUMP_FILE)))
            s["dump_seconds"] = round(w.dump_seconds, 6)
            s["rootfs_diff_seconds"] = round(w.diff_seconds, 6)
            stats[w.view.name] = s
        timings["dump_slowest"] = max(w.dump_seconds for w in work)
        timings["rootfs_diff"] = max(w.diff_seconds for w in work)  # slowest; inside the freeze
        m = manifest.Manifest(
            sandbox=manifest.SandboxInfo(
                id=pod.id, metadata=json_format.MessageToDict(pod.status.metadata), config=pod.config
            ),
            containers=[
                manifest.ContainerEntry(
                    name=c.name,
                    id=c.id,
                    image=c.image,
                    image_id=c.image_id,
                    user_specified_image=c.user_specified_image,
                    state=cri.ContainerState.Name(c.state),
                    restart_count=c.restart_count,
                    checkpointed=c.id in dumped,
                    dir=archive.container(c.name).rel,
                )
                for c in recorded_containers(pod, [w.view for w in work])
            ],
            host=manifest.HostInfo(
                podshim_version=__version__,
                criu_version=binary_version(self.config.runtime.criu),
                runtime_name=os.path.basename(rt.binary),
                runtime_version=binary_version(rt.binary),
                # what RestorePod on another node compares (shim/archive/compat.py)
                cgroup_version=compat.cgroup_version(),
                cpuinfo=compat.cpuinfo(self.config.runtime.criu),
            ),
            timings=timings,
            criu_stats=stats,
            options=dict(sorted({**options_record(opts), **(extra_options or {})}.items())),
            post_checkpoint_state="STOPPED" if post == cri.POST_CHECKPOINT_STATE_STOPPED else "RUNNING",
        )
        key = self.node_key()
        if key is not None:  # after the thaw, never inside the freeze window
            encrypt_start = time.monotonic()
            crypto.encrypt_tree(archive.dir, key, workers=2, stop=stop)
            timings["encrypt"] = time.monotonic() - encrypt_start  # m.timings: the same dict
        archive.dir.check_in_place("output path", "the checkpoint")  # the last moment to refuse
        _check_only_ours(archive, [c.name for c in m.containers])
        return manifest.write_manifest(
            archive.dir, m, workers=HASH_WORKERS, key=key, stop=stop, hashed_ahead=hashed_ahead
        )


def with_kept_log(
    e: errors.ShimError, work: DirHandle, state_dir: str, container_id: str
) -> errors.ShimError:
    """A failed dump's error, naming a copy of its CRIU log kept in `<state_dir>/logs/` (as the
    restore hook does): the failure removes the directory CRIU wrote it in, and its name there,
    /proc/self/fd/N/dump.log, is a descriptor of podshim's own. Same code; the error itself when
    no copy could be made."""
    shown = str(Path(work.proc) / layout.DUMP_LOG_FILE)
    try:
        dest = kept_logs.keep(
            work.read_bytes(layout.DUMP_LOG_FILE), state_dir, f"checkpoint-{container_id}.log"
        )
    except (OSError, errors.ShimError):
        return type(e)(e.message.replace(f" (CRIU log: {shown})", "")) if shown in e.message else e
    if shown in e.message:
        return type(e)(e.message.replace(shown, str(dest)))
    return type(e)(f"{e.message} (CRIU log: {dest})")


def _written_meanwhile(archive: layout.ArchiveLayout, what: str) -> errors.FailedPrecondition:
    return errors.FailedPrecondition(
        f"output path {archive.root} was written to by someone else during the checkpoint ({what}): "
        "nothing was written outside it, the pod was thawed and the partial files removed; "
        "retry with an empty directory nobody else writes to"
    )


def _check_only_ours(archive: layout.ArchiveLayout, containers: list[str]) -> None:
    """Before the manifest: output_path holds only podshim's entries (sandbox/, containers/ and one
    directory per recorded container), so nothing planted meanwhile becomes part of the archive."""
    assert archive.dir is not None
    top = set(archive.dir.names()) - {layout.SANDBOX_DIR, layout.CONTAINERS_DIR}
    with archive.dir.sub(layout.CONTAINERS_DIR) as d:
        extra = sorted(top) + [f"{layout.CONTAINERS_DIR}/{n}" for n in d.names() if n not in containers]
    if extra:
        raise _written_meanwhile(archive, f"{extra[0]!r} is not podshim's")


def options_record(opts: CheckpointOptions) -> dict[str, str]:
    """The options a checkpoint was taken with, as its manifest records them."""
    c = opts.criu
    return {
        **c.switches_record(),
        "rootfs-compression": "gzip" if opts.compress else "none",
        "ghost-limit": str(c.ghost_limit or ""),
        "irmap-scan-paths": ",".join(c.irmap_scan_paths),
    }
