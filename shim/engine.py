"""The checkpoint/restore engine behind the gRPC layer: one lock per pod, the journal,
metrics and logs around each operation, and crash recovery at start (docs/design/crash-safety.md
(Crash safety))."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import psutil

from api.runtime.v1 import api_pb2 as cri
from shim import aio, errors, logs, metrics
from shim.checks.wiring import RestoredContainers, WiringChecker, confirm_restored
from shim.config import Config
from shim.deadlines import KILL_WAIT, RECOVERY_WAIT, RETRY_FIRST, RETRY_MAX
from shim.migration import destination as migration_in
from shim.migration import source as migration_out
from shim.migration import source_recovery
from shim.ops import checkpoint_container, checkpoint_pod_recovery, pod_volumes
from shim.ops.checkpoint_container import ContainerCheckpointer
from shim.ops.checkpoint_pod import PodCheckpointer
from shim.ops.restore_broker import RestoreBroker
from shim.ops.restore_container import ArchiveImporter
from shim.ops.restore_pod import PodRestorer
from shim.state import Journal, OpRecord
from shim.upstream import Upstream, is_not_found

log = logs.get("shim.engine")

_CHECKPOINT_KINDS = ("checkpoint", "checkpoint-container")
# Worker threads and operations (running or waiting for a thread) of the lanes RestorePod and
# CreateContainer-from-a-tar run in: their archives, the caller's data, may take long to verify
# or extract, and must not take the threads checkpoints need (docs/design/crash-safety.md (Cancellation)).
LANE_WORKERS = 2
LANE_MAX_OPERATIONS = 32


class OperationLocks:
    """At most one operation per pod (and per archive path): a second one gets ABORTED. A key
    may also be taken shared (RestorePod only reads its archive): any number of shared holders
    at once, none while an exclusive one holds it (a checkpoint into that path, a recovery's
    clean-up), and no exclusive holder while shared ones do."""

    _SHARED = "shared "  # prefix of a shared key in what `acquire` returns (keys never start so)

    def __init__(self) -> None:
        self._held: dict[str, str] = {}
        self._shared: dict[str, list[str]] = {}  # key -> the operations holding it shared

    def acquire(self, operation: str, keys: list[str], shared: list[str] | None = None) -> list[str]:
        """Take every key (`shared` ones shared) or none (ABORTED naming the holder); returns the
        keys as held, which is what `release` takes. A "path P" key is held by P's resolved form,
        so that aliases of one directory ("D/.", "D//", a symlink to D) exclude each other too."""
        keys = [_canonical(k) for k in keys]
        shared_keys = [_canonical(k) for k in shared or []]
        for k in [*keys, *shared_keys]:
            holder = self._held.get(k)
            if holder is None and k in keys and self._shared.get(k):
                holder = self._shared[k][0]
            if holder is not None:
                raise errors.Aborted(
                    f"{operation}: another operation ({holder}) is in progress on {k}; retry when it ends"
                )
        for k in keys:
            self._held[k] = operation
        for k in shared_keys:
            self._shared.setdefault(k, []).append(operation)
        return [*keys, *(self._SHARED + k for k in shared_keys)]

    def release(self, held: list[str]) -> None:
        for k in held:
            if k.startswith(self._SHARED):
                k = k.removeprefix(self._SHARED)
                holders = self._shared.get(k, [])
                if holders:
                    holders.pop()
                if not holders:
                    self._shared.pop(k, None)
            else:
                self._held.pop(k, None)

    @contextlib.contextmanager
    def hold(self, operation: str, keys: list[str], shared: list[str] | None = None) -> Iterator[None]:
        held = self.acquire(operation, keys, shared)
        try:
            yield
        finally:
            self.release(held)


def _canonical(key: str) -> str:
    kind, _, value = key.partition(" ")
    if kind == "path" and value.startswith("/"):
        try:
            return f"path {os.path.realpath(value)}"
        except (OSError, ValueError):  # NUL byte and the like: the request is refused anyway
            pass
    return key


class Engine:
    def __init__(self, config: Config, upstream: Upstream) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = Journal(Path(config.state_dir))
        self.locks = OperationLocks()
        self.checkpointer = PodCheckpointer(config, upstream, self.journal)
        # the wiring check and the containers created for a restore (docs/design/runtime-wrapper.md
        # (Wiring check))
        self.wiring = WiringChecker(upstream)
        self.restored = RestoredContainers(config.state_dir)
        self.restorer = PodRestorer(config, upstream, self.journal, self.wiring, self.restored)
        self.broker = RestoreBroker(config, self.restorer.page_checks)
        # live migration (docs/design/migration.md (Live migration)): CheckpointPod and RestorePod
        # with their migration options
        self.migration_out = migration_out.MigrationSource(config, upstream, self.journal)
        self.migration_in = migration_in.MigrationDestination(config, upstream, self.journal, self.restorer)
        self._recovering: set[asyncio.Task[None]] = set()  # background recoveries (see recover)
        self._inflight: set[asyncio.Task[object]] = set()  # tasks of the operations running now (stop)
        self._retrying: set[str] = set()  # op ids of records whose recovery is retried (retry_later)
        self._stopping = False  # drain(): no new operations
        self._checkpointing_pods: dict[str, asyncio.Event] = {}  # sandbox id -> set when its checkpoint ends
        self.restorer.on_kept = self.retry_later  # a restore whose rollback failed: retried
        self.restore_lane = aio.Lane("restore", LANE_WORKERS, LANE_MAX_OPERATIONS)
        self.import_lane = aio.Lane("import", LANE_WORKERS, LANE_MAX_OPERATIONS)

    @contextlib.contextmanager
    def _operation(
        self, name: str, keys: list[str], shared: list[str] | None = None, **fields: str
    ) -> Iterator[None]:
        if self._stopping:
            raise errors.Unavailable(f"{name}: podshim is stopping; retry once it has restarted")
        start = time.monotonic()
        result = "OK"
        log.info(f"{name} started", **fields)
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            with self.locks.hold(name, keys, shared):
                yield
        except errors.ShimError as e:
            result = e.code_name
            log.warning(f"{name} failed", code=result, error=e.message, **fields)
            raise
        except asyncio.CancelledError:
            result = "CANCELLED"  # the caller went away or its deadline passed first
            log.warning(f"{name} cancelled by the caller", **fields)
            raise
        except BaseException as e:
            result = "INTERNAL"
            log.error(f"{name} failed", error=repr(e), **fields)
            raise
        finally:
            if task is not None:
                self._inflight.discard(task)
            elapsed = time.monotonic() - start
            metrics.operations.labels(name, result).inc()
            metrics.operation_duration.labels(name).observe(elapsed)
            if result == "OK":
                log.info(f"{name} done", seconds=round(elapsed, 4), **fields)

    async def checkpoint_pod(
        self, req: cri.CheckpointPodRequest, deadline: float | None
    ) -> cri.CheckpointPodResponse:
        # The upstream accepts a unique prefix of an id: lock the full id, so a prefix and the
        # full id (or CheckpointContainer, which locks the full id) exclude each other.
        keys = [f"pod {await self._full_pod_id(req.pod_sandbox_id)}", f"path {req.output_path}"]
        if migration_out.OPTION in req.options:
            to = req.options[migration_out.OPTION]
            with self._operation("migrate_pod", keys, pod=req.pod_sandbox_id, path=req.output_path, to=to):
                m = await self.migration_out.checkpoint(req, deadline)
            return cri.CheckpointPodResponse()
        with self._operation("checkpoint_pod", keys, pod=req.pod_sandbox_id, path=req.output_path):
            with self._checkpointing(keys[0].removeprefix("pod ")):
                m = await self.checkpointer.checkpoint(req, deadline)
        metrics.freeze_window.observe(m.timings.get("freeze_window", 0.0))
        metrics.archive_size.labels("checkpoint_pod").observe(sum(f.size for f in m.files.values()))
        return cri.CheckpointPodResponse()

    @contextlib.contextmanager
    def _checkpointing(self, sandbox_id: str) -> Iterator[None]:
        """Marks the pod as being checkpointed, for the ExecSyncs that wait it out."""
        done = asyncio.Event()
        self._checkpointing_pods[sandbox_id] = done
        try:
            yield
        finally:
            done.set()
            if self._checkpointing_pods.get(sandbox_id) is done:
                del self._checkpointing_pods[sandbox_id]

    @property
    def checkpointing(self) -> dict[str, asyncio.Event]:
        """The pods being checkpointed now (sandbox id -> set when the checkpoint ends)."""
        return self._checkpointing_pods

    async def wait_checkpointed(self, container_id: str, limit: float | None) -> None:
        """An ExecSync into a container of a pod being checkpointed waits until the checkpoint
        ends (its processes are stopped for the dump, so a probe asking the app would time out and
        the kubelet kill the pod), then runs with its full timeout; at most `limit` seconds (the
        caller's deadline; the kubelet's is the probe's timeout plus two minutes)."""
        try:
            found = await self.upstream.list_containers(
                cri.ContainerFilter(id=container_id), doing="finding the exec's pod", timeout=2.0
            )
        except errors.ShimError:
            return  # the upstream answers the ExecSync itself
        for c in found:
            done = self._checkpointing_pods.get(c.pod_sandbox_id)
            if done is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), None if limit is None else max(0.0, limit - 1.0))
                return

    async def _full_pod_id(self, pod_id: str) -> str:
        """The sandbox's full id as the upstream resolves `pod_id`; `pod_id` itself when the
        upstream cannot say (the operation then reports that error with its own code)."""
        if not pod_id:
            return pod_id
        try:
            resp = await self.upstream.pod_status(pod_id)
        except errors.ShimError:
            return pod_id
        return resp.status.id or pod_id

    async def restore_pod(self, req: cri.RestorePodRequest, deadline: float | None) -> cri.RestorePodResponse:
        md = req.config.metadata
        # restores only read their archive: many at once (N replicas from one checkpoint); a
        # checkpoint into that path or a recovery's clean-up of it excludes them
        keys, shared = [f"pod {md.namespace}/{md.name}"], [f"path {req.checkpoint_path}"]
        pod = f"{md.namespace}/{md.name}"
        if migration_in.OPTION in req.options:
            # the archive arrives into checkpoint_path: held exclusively
            source = req.options[migration_in.OPTION]
            keys.append(f"path {req.checkpoint_path}")
            with self._operation("migrate_pod_in", keys, pod=pod, path=req.checkpoint_path, source=source):
                with self.restore_lane.enter():
                    return await self.migration_in.restore(req, deadline)
        with self._operation("restore_pod", keys, shared, pod=pod, path=req.checkpoint_path):
            with self.restore_lane.enter():
                return await self.restorer.restore(req, deadline)

    async def restore_container_into(
        self,
        req: cri.CreateContainerRequest,
        checkpoint_path: str,
        deadline: float | None,
    ) -> str:
        """A kubelet's CreateContainer of a container of a Pod that names a checkpoint
        (shim/kube/restore.py): that container restored from `checkpoint_path` into the sandbox."""
        md = req.sandbox_config.metadata
        pod = f"{md.namespace}/{md.name}"
        with self._operation(
            "restore_container_into",
            [],
            [f"path {checkpoint_path}"],
            pod=pod,
            container=req.config.metadata.name,
        ):
            with self.restore_lane.enter():
                return await self.restorer.restore_into(
                    req.pod_sandbox_id, req.sandbox_config, checkpoint_path, req.config, deadline
                )

    @property
    def container_checkpoint_mode(self) -> str:
        """`[checkpoint] container_checkpoint`: "fallback" (ask the upstream first) or "always"."""
        return self.config.container_checkpoint

    @functools.cached_property
    def container_checkpointer(self) -> ContainerCheckpointer:
        return ContainerCheckpointer(self.config, self.upstream, self.journal, self.checkpointer)

    @functools.cached_property
    def archive_importer(self) -> ArchiveImporter:
        return ArchiveImporter(
            self.config, self.upstream, self.wiring, self.restored, self.journal, self.restorer.page_checks
        )

    async def checkpoint_container(
        self, req: cri.CheckpointContainerRequest, deadline: float | None
    ) -> cri.CheckpointContainerResponse:
        """KEP-2008 in podshim: one tar at `location`, the container left running
        (docs/design/checkpoint-container.md (CheckpointContainer))."""
        hold = functools.partial(self.locks.hold, "checkpoint_container")
        # the pod and path locks are taken inside, once the container's pod is known
        with self._operation("checkpoint_container", [], container=req.container_id, path=req.location):
            result = await self.container_checkpointer.checkpoint(req, deadline, hold)
        metrics.freeze_window.observe(result.freeze_window)
        metrics.archive_size.labels("checkpoint_container").observe(result.size)
        return cri.CheckpointContainerResponse()

    async def create_container_from_archive(
        self, req: cri.CreateContainerRequest, deadline: float | None
    ) -> cri.CreateContainerResponse:
        """CreateContainer whose image is a container checkpoint tar (CRI-O's convention)."""
        path = req.config.image.image
        with self._operation("restore_container", [], pod=req.pod_sandbox_id, path=path):
            with self.import_lane.enter():
                return await self.archive_importer.create(req, deadline)

    async def forget_container(self, container_id: str) -> None:
        """After RemoveContainer (its id) or RemovePodSandbox (""): remove the checkpoint imports
        (CreateContainer from a tar) whose container is gone, and forget the restored containers
        that were removed without being started."""
        if container_id:
            rid = self.restored.lookup(container_id)
            if rid is not None:
                self.restored.discard(rid)
            await self.archive_importer.forget(container_id)
        else:
            await self._sweep_restored()
            await self.archive_importer.sweep()

    async def startup(self) -> None:
        """After recovery, before serving: reload the restored containers not started yet and
        check the wiring of every runtime handler podshim restores with, in the background (a log
        line and the podshim_wiring_ok gauge for each; the upstream may not be up yet)."""
        self.restored.load()
        # podshim-runc's restores, prepared and settled here (docs/design/runtime-wrapper.md (The
        # runtime wrapper))
        self.broker.start()
        handlers = ["", *self.config.runtimes]

        async def check() -> None:
            await self.wiring.at_startup(handlers)
            await self._sweep_restored()

        task = asyncio.create_task(check())
        self._recovering.add(task)
        task.add_done_callback(self._recovering.discard)

    async def _sweep_restored(self) -> None:
        """Forget restored containers the upstream no longer has (removed with their sandbox)."""
        for cid in list(self.restored.ids):
            try:
                await self.upstream.container_status(cid)
            except errors.ShimError as e:
                if is_not_found(e):
                    self.restored.discard(cid)

    @property
    def restores_pending(self) -> bool:
        return bool(self.restored.ids)

    def restored_id(self, container_id: str) -> str | None:
        """The id of a container podshim created for a restore and that was not started yet, as
        `container_id` (full or a unique prefix) names it; None for any other container. No
        upstream call: StartContainer of other containers stays a plain passthrough."""
        return self.restored.lookup(container_id)

    async def confirm_restored(self, container_id: str) -> None:
        """After StartContainer of a restored container answered OK: its process must come from
        the checkpoint (podshim-runc's marker); else it is stopped and removed, FAILED_PRECONDITION."""
        try:
            await confirm_restored(self.upstream, self.config, container_id)
        finally:
            self.restored.discard(container_id)

    async def drain(self, timeout: float) -> None:
        """First step of a graceful stop: new operations are refused (UNAVAILABLE) and those in
        flight get up to `timeout` seconds to finish (passed-through calls are served meanwhile)."""
        self._stopping = True
        pending = {t for t in self._inflight if not t.done()}
        if pending:
            log.info("stopping: letting operations finish", operations=len(pending), timeout=timeout)
            await asyncio.wait(pending, timeout=timeout)

    async def stop(self, timeout: float) -> None:
        """Graceful stop, after the server stopped taking calls and cancelled those left
        (docs/design/crash-safety.md (Crash safety)): wait up to `timeout` for the operations still
        undoing their work (thaw, clear output_path, remove a restore's sandbox, close the
        journal record), then stop the background recoveries (their records stay for the next
        start)."""
        following = self.migration_in.following  # migrations in whose pages still arrive: they end
        for t in following:
            t.cancel()
        pending = {t for t in self._inflight | following if not t.done()}
        if pending:
            log.info("stopping: waiting for operations to end", operations=len(pending), timeout=timeout)
            _done, left = await asyncio.wait(pending, timeout=timeout)
            if left:
                log.error("stopping: operations still running; journal records kept", operations=len(left))
        for t in list(self._recovering):
            t.cancel()
        self.broker.stop()  # a restore it serves now ends with podshim: podshim-runc undoes it

    async def recover(self) -> None:
        """Undo what a crashed podshim left (docs/design/crash-safety.md (Crash safety)): thaw pods, remove
        partial archives, remove half-restored sandboxes, and log each recovery.

        A record that cannot be recovered now is logged and kept for the next start: it never
        keeps podshim from serving. A checkpoint whose runc/CRIU outlived the crash (they run in
        their own session) is recovered in the background once they have ended, holding the pod
        and path locks meanwhile (ABORTED for new requests): CRIU re-freezes the cgroups it found
        frozen when it finishes and writes into output_path until then, so a thaw and a clean-up
        done before that would not last.
        """
        for rec in self.journal.pending():
            log.warning("recovering interrupted operation", kind=rec.kind, pod=rec.pod_key, phase=rec.phase)
            out = rec.data.output_path if rec.kind in _CHECKPOINT_KINDS else ""
            leftovers = _processes_under(str(out)) if out else []
            if not leftovers:
                await self._recover_record(rec)
                continue
            keys = self.locks.acquire(
                "recovery of an interrupted checkpoint", [f"pod {rec.pod_key}", f"path {out}"]
            )
            log.warning(
                "interrupted checkpoint: its runtime/CRIU processes still run; recovering when they end",
                pod=rec.pod_key,
                pids=[p.pid for p in leftovers],
            )
            task = asyncio.create_task(self._recover_after(rec, leftovers, keys))
            self._recovering.add(task)
            task.add_done_callback(self._recovering.discard)

    async def _recover_after(self, rec: OpRecord, procs: list[psutil.Process], keys: list[str]) -> None:
        try:
            _gone, alive = await asyncio.to_thread(psutil.wait_procs, procs, RECOVERY_WAIT)
            if alive:
                log.error(
                    f"interrupted checkpoint: runtime/CRIU alive after {RECOVERY_WAIT:.0f}s; killing them",
                    pod=rec.pod_key,
                    pids=[p.pid for p in alive],
                )
                for p in alive:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                await asyncio.to_thread(psutil.wait_procs, alive, KILL_WAIT)
            await self._recover_record(rec)
        finally:
            self.locks.release(keys)

    async def _recover_record(self, rec: OpRecord, retry: bool = True) -> bool:
        # each operation undoes its own record (shim/ops/); the engine only dispatches
        recoverers: dict[str, Callable[[OpRecord], Awaitable[None]]] = {
            "checkpoint": checkpoint_pod_recovery.recover,
            "checkpoint-container": checkpoint_container.recover,
            "restore": self.restorer.recover,
            "volume-fill": pod_volumes.recover,  # a kubelet's restore, a container tar's
            "lazy-pages": self.restorer.lazy.recover,  # docs/design/restore-pod.md (Lazy restore)
            # docs/design/migration.md (Live migration)
            "migration-source": functools.partial(source_recovery.recover, upstream=self.upstream),
            "migration-destination": functools.partial(migration_in.recover, restorer=self.restorer),
        }
        recover = recoverers[rec.kind]
        try:
            await recover(rec)
        except Exception as e:  # noqa: BLE001 - logged; the record stays, retried in the background
            log.error(
                "recovery of interrupted operation failed; kept and retried",
                kind=rec.kind,
                pod=rec.pod_key,
                record=str(rec.path),
                error=getattr(e, "message", None) or repr(e),
            )
            metrics.operations.labels(OPERATION_OF_KIND[rec.kind], "RECOVERY_FAILED").inc()
            if retry:
                self.retry_later(rec)
            return False
        self.journal.finish(rec)
        log.info("recovered interrupted operation", kind=rec.kind, pod=rec.pod_key, phase=rec.phase)
        metrics.operations.labels(OPERATION_OF_KIND[rec.kind], "RECOVERED").inc()
        return True

    def retry_later(self, rec: OpRecord) -> None:
        """Retry the recovery of `rec` in the background while podshim runs (a sandbox containerd
        would not remove yet, containerd down...), with a bounded backoff, until it succeeds."""
        if rec.op_id in self._retrying:
            return
        self._retrying.add(rec.op_id)
        task = asyncio.create_task(self._retry(rec))
        self._recovering.add(task)
        task.add_done_callback(self._recovering.discard)

    async def _retry(self, rec: OpRecord) -> None:
        """Holds the record's pod (and path) locks from the first attempt on: a new operation on
        that pod is ABORTED until the recovery is done (a restore's sandbox is found by its
        metadata, which a new restore of the same pod would share)."""
        want = [f"pod {rec.pod_key}"]
        if rec.kind in _CHECKPOINT_KINDS and rec.data.output_path:  # a CheckpointRecord
            want.append(f"path {rec.data.output_path}")
        held: list[str] | None = None
        delay = RETRY_FIRST
        attempt = 0
        try:
            while True:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                if held is None:
                    try:
                        held = self.locks.acquire("recovery of an interrupted operation", want)
                    except errors.Aborted:
                        continue  # the failed operation still ends; next time
                if not rec.path.exists():
                    return  # finished meanwhile (a start-up recovery of the same record)
                attempt += 1
                log.warning(
                    "retrying the recovery of an interrupted operation",
                    kind=rec.kind,
                    pod=rec.pod_key,
                    attempt=attempt,
                )
                if await self._recover_record(rec, retry=False):
                    return
                log.warning("recovery retry failed", kind=rec.kind, pod=rec.pod_key, next_in=delay)
        finally:
            self._retrying.discard(rec.op_id)
            if held is not None:
                self.locks.release(held)


# journal kind -> the `operation` label of podshim_operations_total (the gRPC method's name)
OPERATION_OF_KIND = {
    "checkpoint": "checkpoint_pod",
    "restore": "restore_pod",
    "volume-fill": "restore_container_into",
    "checkpoint-container": "checkpoint_container",
    "lazy-pages": "lazy_restore",
    "migration-source": "migrate_pod",
    "migration-destination": "migrate_pod_in",
}


def _holds(pid: int, path: str, prefix: str) -> bool:
    """Whether process `pid` has a descriptor open on `path` or below it."""
    try:
        with os.scandir(f"/proc/{pid}/fd") as it:
            for fd in it:
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target == path or target.startswith(prefix):
                        return True
    except OSError:
        pass
    return False


def _processes_under(path: str) -> list[psutil.Process]:
    """Live processes whose argv names `path` or a path below it (CRIU's `criu: dump ... -D
    <path>/...`), or that were given a directory of it as `/proc/self/fd/N` and hold it (the
    runc/crun `checkpoint --image-path /proc/self/fd/N` of a crashed podshim: docs/design/archive.md
    (Path confinement)), with their descendants."""
    prefix = path.rstrip("/") + "/"
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info.get("cmdline") or []
        if p.pid == os.getpid():
            continue
        named = any(a == path or prefix in a for a in argv)
        if named or (any(a.startswith("/proc/self/fd/") for a in argv) and _holds(p.pid, path, prefix)):
            found[p.pid] = p
            with contextlib.suppress(psutil.Error):
                found.update((c.pid, c) for c in p.children(recursive=True))
    return list(found.values())
