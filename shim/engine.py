"""The checkpoint/restore engine behind the gRPC layer: one lock per pod, the journal,
metrics and logs around each operation, and crash recovery at start (DESIGN §8)."""

from __future__ import annotations

import contextlib
import functools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from api.runtime.v1 import api_pb2 as cri
from shim import errors, logs, metrics
from shim.archive import fsutil, layout
from shim.cgroups import thaw_paths
from shim.checkpoint import PodCheckpointer
from shim.config import Config
from shim.container_checkpoint import ArchiveImporter, ContainerCheckpointer
from shim.restore import PodRestorer
from shim.state import Journal
from shim.upstream import Upstream

log = logs.get("shim.engine")


class OperationLocks:
    """At most one operation per pod (and per archive path): a second one gets ABORTED."""

    def __init__(self) -> None:
        self._held: dict[str, str] = {}

    @contextlib.contextmanager
    def hold(self, operation: str, keys: list[str]) -> Iterator[None]:
        busy = [k for k in keys if k in self._held]
        if busy:
            k = busy[0]
            raise errors.Aborted(
                f"{operation}: another operation ({self._held[k]}) is in progress on {k}; retry when it ends"
            )
        for k in keys:
            self._held[k] = operation
        try:
            yield
        finally:
            for k in keys:
                self._held.pop(k, None)


class Engine:
    def __init__(self, config: Config, upstream: Upstream) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = Journal(Path(config.state_dir))
        self.locks = OperationLocks()
        self.checkpointer = PodCheckpointer(config, upstream, self.journal)
        self.restorer = PodRestorer(config, upstream, self.journal)

    @contextlib.contextmanager
    def _operation(self, name: str, keys: list[str], **fields: str) -> Iterator[None]:
        start = time.monotonic()
        result = "OK"
        log.info(f"{name} started", **fields)
        try:
            with self.locks.hold(name, keys):
                yield
        except errors.ShimError as e:
            result = e.code.name
            log.warning(f"{name} failed", code=result, error=e.message, **fields)
            raise
        except BaseException as e:
            result = "INTERNAL"
            log.error(f"{name} failed", error=repr(e), **fields)
            raise
        finally:
            elapsed = time.monotonic() - start
            metrics.operations.labels(name, result).inc()
            metrics.operation_duration.labels(name).observe(elapsed)
            if result == "OK":
                log.info(f"{name} done", seconds=round(elapsed, 4), **fields)

    async def checkpoint_pod(
        self, req: cri.CheckpointPodRequest, context: grpc.aio.ServicerContext
    ) -> cri.CheckpointPodResponse:
        keys = [f"pod {req.pod_sandbox_id}", f"path {req.output_path}"]
        with self._operation("checkpoint_pod", keys, pod=req.pod_sandbox_id, path=req.output_path):
            m = await self.checkpointer.checkpoint(req, context.time_remaining())
        metrics.freeze_window.observe(m.timings.get("freeze_window", 0.0))
        metrics.archive_size.labels("checkpoint_pod").observe(sum(f.size for f in m.files.values()))
        return cri.CheckpointPodResponse()

    async def restore_pod(
        self, req: cri.RestorePodRequest, context: grpc.aio.ServicerContext
    ) -> cri.RestorePodResponse:
        md = req.config.metadata
        keys = [f"pod {md.namespace}/{md.name}", f"path {req.checkpoint_path}"]
        with self._operation("restore_pod", keys, pod=f"{md.namespace}/{md.name}", path=req.checkpoint_path):
            return await self.restorer.restore(req, context.time_remaining())

    @property
    def container_checkpoint_mode(self) -> str:
        """`[checkpoint] container_checkpoint`: "fallback" (ask the upstream first) or "always"."""
        return self.config.container_checkpoint

    @functools.cached_property
    def container_checkpointer(self) -> ContainerCheckpointer:
        return ContainerCheckpointer(self.config, self.upstream, self.journal, self.checkpointer)

    @functools.cached_property
    def archive_importer(self) -> ArchiveImporter:
        return ArchiveImporter(self.config, self.upstream)

    async def checkpoint_container(
        self, req: cri.CheckpointContainerRequest, context: grpc.aio.ServicerContext
    ) -> cri.CheckpointContainerResponse:
        """KEP-2008 in podshim: one tar at `location`, the container left running (DESIGN §5)."""
        hold = functools.partial(self.locks.hold, "checkpoint_container")
        # the pod and path locks are taken inside, once the container's pod is known
        with self._operation("checkpoint_container", [], container=req.container_id, path=req.location):
            result = await self.container_checkpointer.checkpoint(req, context.time_remaining(), hold)
        metrics.freeze_window.observe(result.freeze_window)
        metrics.archive_size.labels("checkpoint_container").observe(result.size)
        return cri.CheckpointContainerResponse()

    async def create_container_from_archive(
        self, req: cri.CreateContainerRequest, context: grpc.aio.ServicerContext
    ) -> cri.CreateContainerResponse:
        """CreateContainer whose image is a container checkpoint tar (CRI-O's convention)."""
        path = req.config.image.image
        with self._operation("restore_container", [], pod=req.pod_sandbox_id, path=path):
            return await self.archive_importer.create(req, context.time_remaining())

    async def forget_container(self, container_id: str) -> None:
        """After RemoveContainer (its id) or RemovePodSandbox (""): remove the checkpoint imports
        (CreateContainer from a tar) whose container is gone."""
        if container_id:
            await self.archive_importer.forget(container_id)
        else:
            await self.archive_importer.sweep()

    async def recover(self) -> None:
        """Undo what a crashed podshim left: thaw pods, remove partial archives (DESIGN §8)."""
        for rec in self.journal.pending():
            data = rec.data
            log.warning("recovering interrupted operation", kind=rec.kind, pod=rec.pod_key, phase=rec.phase)
            if rec.kind in ("checkpoint", "checkpoint-container"):
                thaw_paths(list(data.get("cgroups", [])))
                out = data.get("output_path")
                if rec.kind == "checkpoint-container" and out and fsutil.is_temp_name(Path(out).name):
                    shutil.rmtree(out, ignore_errors=True)  # podshim's staging dir next to the tar
                elif out and not (Path(out) / layout.MANIFEST_FILE).exists():
                    with contextlib.suppress(OSError):
                        fsutil.clear_dir_contents(Path(out))
            elif rec.kind == "restore" and data.get("sandbox_id"):
                await self.restorer.rollback_sandbox(str(data["sandbox_id"]))
            self.journal.finish(rec)
            metrics.operations.labels(rec.kind.replace("-", "_"), "RECOVERED").inc()
