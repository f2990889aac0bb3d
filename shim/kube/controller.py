"""PodCheckpoint objects, acted on for the pods of this node as KEP-5823's kubelet does
(docs/cluster.md): claim the object, pin the source pod's UID, capture its sanitised template,
CheckpointPod into the node's checkpoint root, and write the result into the status, with events.

Nothing here is on a CRI call's path: the watch runs in its own task, an API server that is down
or slow only delays the objects, and every missed object is found again by the next list.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lightkube import ALL_NS, ApiError
from lightkube.core.exceptions import NotReadyError

from api.runtime.v1 import api_pb2 as cri
from shim import errors, logs
from shim.deadlines import KUBE_CHECKPOINT_DEFAULT_TIMEOUT, KUBE_RESYNC, KUBE_RESYNC_IDLE
from shim.kube import api
from shim.kube.client import Kube
from shim.kube.template import sanitise_template
from shim.upstream import Upstream

log = logs.get("shim.kube.controller")

POD_UID_LABEL = "io.kubernetes.pod.uid"
WATCH_RETRY = (0.5, 10.0)  # back-off of a failed list or watch: first, at most


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(status: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": api.READY,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": _now(),
    }


class PodGuards:
    """The per-pod in-flight guard: one checkpoint or restore per pod at a time, the next waits
    its turn (shared by the checkpoints here and the restores, restore.py)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> Any:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            yield
        if not lock.locked() and self._locks.get(key) is lock:
            del self._locks[key]


@dataclass
class InFlight:
    """A marker per checkpoint being taken (`<state_dir>/kubernetes/in-flight/<object uid>.json`),
    written before the archive directory is made: a podshim restarted mid-checkpoint finds it,
    removes the directory and marks the object CheckpointFailed."""

    dir: Path
    names: dict[str, str] = field(default_factory=dict)

    def path(self, uid: str) -> Path:
        return self.dir / f"{uid}.json"

    def begin(self, uid: str, namespace: str, name: str, archive: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path(uid).with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"namespace": namespace, "name": name, "archive": archive}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(uid))
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def end(self, uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(uid))

    def left(self) -> Iterator[tuple[str, dict[str, str]]]:
        if not self.dir.is_dir():
            return
        for p in sorted(self.dir.glob("*.json")):
            try:
                doc = json.loads(p.read_text())
            except (OSError, ValueError):
                doc = {}
            yield p.stem, {k: str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}


def owned_archive(path: str, pod: str, namespace: str) -> Path | None:
    """`path` as an archive directory podshim made for this pod (right under the checkpoint root,
    named checkpoint-<pod>_<namespace>-<time>, a directory and not a link), None otherwise: only
    such a directory is ever removed."""
    if not path:
        return None
    p = Path(path)
    if p.parent != Path(api.CHECKPOINT_ROOT) or not p.name.startswith(
        api.archive_dir_name(pod, namespace, "")
    ):
        return None
    if p.is_symlink() or not p.is_dir():
        return None
    return p


class CheckpointController:
    def __init__(self, kube: Kube, node: str, engine: Any, upstream: Upstream, state_dir: str) -> None:
        self.kube = kube
        self.node = node
        self.engine = engine
        self.upstream = upstream
        self.guards = PodGuards()
        self.in_flight = InFlight(Path(state_dir) / "kubernetes" / "in-flight")
        self._active: dict[str, asyncio.Task[None]] = {}  # object uid -> its task
        self._recovered = False
        # the cluster serves PodCheckpoint as a type not podshim's: the kubelet acts on its objects
        self.standing_aside = False
        self._aside_seen: set[str] = set()  # object uids logged as left to the kubelet
        # object uids waiting on their source pod (not yet scheduled, or not ready): while any
        # waits, the objects are listed again every KUBE_RESYNC, else every KUBE_RESYNC_IDLE
        self._waiting: set[str] = set()

    async def cancel(self) -> None:
        """End what is still in flight (the engine has undone its checkpoints by now)."""
        tasks = list(self._active.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the loop: list, then watch from the list's version; on any error back off and list again
    async def run(self) -> None:
        delay = WATCH_RETRY[0]
        while True:
            try:
                await self._check_served_by()
                if not self._recovered and not self.standing_aside:
                    await self._recover()
                    self._recovered = True
                version = await self._resync()
                delay = WATCH_RETRY[0]
                await self._watch(version)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the API server is down, slow or refuses: retry
                log.warning("PodCheckpoint watch interrupted; listing again", error=why(e), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, WATCH_RETRY[1])

    async def _check_served_by(self) -> None:
        """Stand aside while the cluster serves PodCheckpoint as a type that is not podshim's CRD
        (the built-in type: the kubelet acts on those objects, and one object is never acted on
        twice); checked before each list, so a change is followed within a resync."""
        aside = await self.kube.api_served_by() == api.SERVED_BUILT_IN
        if aside != self.standing_aside:
            self.standing_aside = aside
            self._aside_seen.clear()
            if aside:
                log.warning(
                    "the cluster serves PodCheckpoint as its own type, not podshim's CRD: the kubelet "
                    "acts on those objects; podshim stands aside and serves the kubelet's "
                    "CheckpointPod and RestorePod"
                )
            else:
                log.info("PodCheckpoint is served by podshim's CRD: podshim acts on its objects")

    async def _resync(self) -> str:
        self._waiting.clear()  # who still waits says so again when looked at
        objs = self.kube.client.list(api.PodCheckpoint, namespace=ALL_NS)
        async for obj in objs:
            self._consider(obj.to_dict())
        try:
            return str(objs.resourceVersion or "")
        except NotReadyError:  # an empty list may carry none: the watch starts from now
            return ""

    async def _watch(self, version: str) -> None:
        """Watch events until the next list is due: soon while an object waits on its pod, else
        after KUBE_RESYNC_IDLE. The watch is re-opened from the last version seen every
        KUBE_RESYNC, so a waiting object is noticed that soon."""
        loop = asyncio.get_running_loop()
        relist_at = loop.time() + KUBE_RESYNC_IDLE
        while True:
            watch = self.kube.client.watch(
                api.PodCheckpoint, namespace=ALL_NS, resource_version=version or None
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KUBE_RESYNC):
                    async for kind, obj in watch:
                        version = str(obj.metadata.resourceVersion or version) if obj.metadata else version
                        if kind in ("ADDED", "MODIFIED"):
                            self._consider(obj.to_dict())
            if self._waiting or loop.time() >= relist_at:
                return

    def _consider(self, obj: dict[str, Any]) -> None:
        md = obj.get("metadata") or {}
        uid = str(md.get("uid") or "")
        if not uid or uid in self._active:
            return
        if self.standing_aside:
            if uid not in self._aside_seen:
                self._aside_seen.add(uid)
                log.info(
                    "PodCheckpoint left to the kubelet: the cluster serves the type itself",
                    checkpoint=f"{md.get('namespace')}/{md.get('name')}",
                )
            return
        status = obj.get("status") or {}
        mine = status.get("nodeName") == self.node
        if md.get("deletionTimestamp"):
            if mine and api.FINALIZER in (md.get("finalizers") or []):
                self._spawn(uid, self._finalize(obj))
            return
        if api.is_terminal(obj) or (status.get("nodeName") and not mine):
            return
        self._spawn(uid, self._take(obj))

    def _spawn(self, uid: str, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._active[uid] = task
        task.add_done_callback(lambda _t: self._active.pop(uid, None))

    # -- one object
    async def _take(self, obj: dict[str, Any]) -> None:
        md = obj["metadata"]
        ns, name = md["namespace"], md["name"]
        pod_name = api.source_pod_name(obj)
        try:
            pod = await self.kube.pod(ns, pod_name) if pod_name else None
            claimed = (obj.get("status") or {}).get("nodeName") == self.node
            if pod is not None and not (pod.get("spec") or {}).get("nodeName"):
                self._waiting.add(md["uid"])  # not scheduled yet: it may come here
                return
            if pod is None or (pod.get("spec") or {}).get("nodeName") != self.node:
                if claimed:  # ours, and the pod is gone from this node
                    await self._fail(obj, api.SOURCE_POD_REPLACED, f"source pod {ns}/{pod_name} is gone")
                return
            async with self.guards.hold(f"{ns}/{pod_name}"):
                fresh = await self.kube.get_checkpoint(ns, name)
                if (
                    fresh is None
                    or api.is_terminal(fresh)
                    or (fresh.get("metadata") or {}).get("deletionTimestamp")
                ):
                    return
                await self._checkpoint(fresh, pod)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the API server refused or is down: the next resync retries
            log.warning("PodCheckpoint not handled; retried later", checkpoint=f"{ns}/{name}", error=why(e))

    async def _checkpoint(self, obj: dict[str, Any], pod: dict[str, Any]) -> None:
        md = obj["metadata"]
        ns, name, uid = md["namespace"], md["name"], md["uid"]
        pod_md = pod["metadata"]
        pod_uid = str(pod_md.get("uid") or "")
        status = obj.get("status") or {}
        pinned = api.source_pod_uid(obj) or str(status.get("sourcePodUID") or "")
        if not status.get("nodeName"):
            await self.kube.patch_status(
                ns,
                name,
                {
                    "nodeName": self.node,
                    "sourcePodUID": pinned or pod_uid,
                    "conditions": [condition(False, api.PENDING, f"node {self.node} runs the source pod")],
                },
            )
        if pinned and pinned != pod_uid:
            await self._fail(
                obj,
                api.SOURCE_POD_REPLACED,
                f"source pod {ns}/{pod_md['name']} has UID {pod_uid}, not {pinned}: it was replaced",
                source_uid=pod_uid,
            )
            return
        await self.kube.add_finalizer(ns, name)
        if not _ready(pod):
            self._waiting.add(uid)
            await self.kube.patch_status(
                ns,
                name,
                {"conditions": [condition(False, api.PENDING, "waiting for the source pod to be ready")]},
            )
            return
        template = sanitise_template(pod)
        spec = pod.get("spec") or {}
        await self.kube.patch_status(
            ns,
            name,
            {
                "conditions": [condition(False, api.IN_PROGRESS, "checkpointing the pod")],
                "checkpointedPodTemplate": template,
                "checkpointedContainers": _named(spec.get("containers")),
                "checkpointedInitContainers": _named(spec.get("initContainers")),
            },
        )
        await self.kube.event(obj, api.EVENT_STARTED, f"checkpointing pod {pod_md['name']} on {self.node}")
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        archive = Path(api.CHECKPOINT_ROOT) / api.archive_dir_name(pod_md["name"], ns, stamp)
        started = time.monotonic()
        try:
            sandbox, containers = await self._sandbox_of(pod_uid)
            await asyncio.to_thread(self.in_flight.begin, uid, ns, name, str(archive))
            try:
                await asyncio.to_thread(_make_archive_dir, archive)
                deadline = float(api.timeout_seconds(obj) or KUBE_CHECKPOINT_DEFAULT_TIMEOUT)
                await self.engine.checkpoint_pod(
                    cri.CheckpointPodRequest(
                        pod_sandbox_id=sandbox, output_path=str(archive), container_ids=containers
                    ),
                    deadline,
                )
            except BaseException:
                await asyncio.to_thread(_remove_dir, archive)  # emptied by CheckpointPod's own undo
                await asyncio.to_thread(self.in_flight.end, uid)
                raise
        except errors.ShimError as e:
            await self._fail(obj, api.FAILED, f"{e.code_name}: {e.message}")
            return
        await self._outcome(
            ns,
            name,
            {
                "conditions": [condition(True, api.COMPLETED, f"checkpoint written on {self.node}")],
                "checkpointLocation": {"type": api.LOCATION_NODE_LOCAL, "nodeLocal": {"path": archive.name}},
                "completionTime": _now(),
            },
        )
        await asyncio.to_thread(self.in_flight.end, uid)
        seconds = round(time.monotonic() - started, 3)
        await self.kube.event(
            obj, api.EVENT_SUCCEEDED, f"checkpoint of {pod_md['name']} written in {seconds} s"
        )
        log.info("PodCheckpoint completed", checkpoint=f"{ns}/{name}", archive=str(archive), seconds=seconds)

    async def _fail(self, obj: dict[str, Any], reason: str, message: str, source_uid: str = "") -> None:
        md = obj["metadata"]
        status: dict[str, Any] = {"conditions": [condition(False, reason, message)]}
        if not (obj.get("status") or {}).get("nodeName"):
            status["nodeName"] = self.node
        if source_uid:
            status["sourcePodUID"] = source_uid
        await self._outcome(md["namespace"], md["name"], status)
        await self.kube.event(obj, api.EVENT_FAILED, message, warning=True)
        log.warning(
            "PodCheckpoint failed", checkpoint=f"{md['namespace']}/{md['name']}", reason=reason, error=message
        )

    async def _outcome(self, ns: str, name: str, status: dict[str, Any]) -> None:
        """A checkpoint's result written into the status, retried while the API server is down or
        slow (the archive is made: the object must say so, not be taken again); given up only
        when the object is gone."""
        delay = WATCH_RETRY[0]
        while True:
            try:
                await self.kube.patch_status(ns, name, status)
                return
            except ApiError as e:
                if e.status.code == 404:
                    return
                error = why(e)
            except Exception as e:  # noqa: BLE001 - unreachable, a timeout: retried
                error = why(e)
            log.warning(
                "cannot write a PodCheckpoint's result; retrying", checkpoint=f"{ns}/{name}", error=error
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, WATCH_RETRY[1])

    async def _sandbox_of(self, pod_uid: str) -> tuple[str, list[str]]:
        """The ready sandbox of the pod with this UID, and its running containers."""
        sandboxes = [
            s
            for s in await self.upstream.list_pod_sandboxes(doing="finding the source pod's sandbox")
            if s.labels.get(POD_UID_LABEL) == pod_uid and s.state == cri.SANDBOX_READY
        ]
        if not sandboxes:
            raise errors.FailedPrecondition(f"no ready sandbox of pod UID {pod_uid} on this node")
        sandbox = max(sandboxes, key=lambda s: s.created_at)
        running = await self.upstream.list_containers(
            cri.ContainerFilter(
                pod_sandbox_id=sandbox.id, state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING)
            ),
            doing="listing the source pod's containers",
        )
        if not running:
            raise errors.FailedPrecondition(f"pod UID {pod_uid} has no running container")
        return sandbox.id, [c.id for c in running]

    # -- deletion and restart
    async def _finalize(self, obj: dict[str, Any]) -> None:
        """The object is being deleted: remove its archive (only a directory podshim made for its
        pod), then the finalizer."""
        md = obj["metadata"]
        try:
            async with self.guards.hold(f"{md['namespace']}/{api.source_pod_name(obj)}"):
                archive = owned_archive(api.archive_path(obj), api.source_pod_name(obj), md["namespace"])
                if archive is not None:
                    await asyncio.to_thread(shutil.rmtree, archive)
                    log.info("PodCheckpoint deleted: archive removed", archive=str(archive))
                await self.kube.remove_finalizer(md["namespace"], md["name"])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - retried at the next resync
            log.warning("PodCheckpoint finalizer not done; retried later", error=why(e))

    async def _recover(self) -> None:
        """Checkpoints a previous podshim left in flight: the archive directory goes (the engine's
        recovery has already thawed the pod and cleared what the dump wrote) and the object is
        marked CheckpointFailed, so it never hangs in CheckpointInProgress."""
        for uid, rec in list(self.in_flight.left()):
            ns, name, archive = rec.get("namespace", ""), rec.get("name", ""), rec.get("archive", "")
            obj = await self.kube.get_checkpoint(ns, name) if ns and name else None
            pod = api.source_pod_name(obj) if obj else ""
            owned = owned_archive(archive, pod, ns) if obj else None
            if owned is not None:
                await asyncio.to_thread(shutil.rmtree, owned)
            if obj is not None and (obj.get("metadata") or {}).get("uid") == uid and not api.is_terminal(obj):
                await self._fail(
                    obj, api.FAILED, "podshim restarted during the checkpoint; create a new PodCheckpoint"
                )
            await asyncio.to_thread(self.in_flight.end, uid)


def _make_archive_dir(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.mkdir(mode=0o700)


def _remove_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _named(containers: Any) -> list[dict[str, str]]:
    return [{"name": str(c.get("name")), "image": str(c.get("image"))} for c in containers or []]


def why(e: BaseException) -> str:
    if isinstance(e, ApiError):
        return f"{e.status.code} {e.status.reason}: {e.status.message}"
    return f"{type(e).__name__}: {e}"
