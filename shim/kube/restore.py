"""Pods that name a checkpoint (api.RESTORE_FROM_ANNOTATION, KEP-5823's `spec.restoreFrom`),
restored through the stock kubelet's own RunPodSandbox, CreateContainer and StartContainer
(docs/design/index.md (The cluster API); docs/cluster.md). Each call re-reads what it needs from
its request: nothing is kept between the kubelet's calls that a restarted podshim would miss."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from api.runtime.v1 import api_pb2 as cri
from shim import errors, logs
from shim.archive import layout
from shim.kube import api
from shim.kube.client import Kube
from shim.kube.controller import PodGuards, owned_archive, why
from shim.kube.template import spec_mismatch

log = logs.get("shim.kube.restore")
T = TypeVar("T")

# the pause image's "print the version and exit 0" (registry.k8s.io/pause and the test images)
DONE_COMMAND = ["/pause"]
DONE_ARGS = ["-v"]


def restore_from(annotations: Any) -> str:
    return str(annotations.get(api.RESTORE_FROM_ANNOTATION, "")) if annotations is not None else ""


class Refused(errors.FailedPrecondition):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class RestoreGate:
    def __init__(self, kube: Kube, engine: Any, upstream: Any, guards: PodGuards) -> None:
        self.kube = kube
        self.engine = engine
        self.upstream = upstream
        self.guards = guards
        # pod UID -> its checkpoint's archive and the Pod's init container names (a cache only)
        self._checked: dict[str, tuple[str, set[str]]] = {}
        self._sandbox_pods: dict[str, str] = {}  # sandbox id -> its pod's UID (for forget)
        # restored container id -> its sandbox and pod, until its StartContainer
        self._made: dict[str, tuple[str, cri.PodSandboxMetadata]] = {}
        self._events: set[asyncio.Task[None]] = set()

    async def _refuse(self, pod: dict[str, Any] | None, md: Any, reason: str, detail: str) -> Refused:
        target = pod or {"metadata": {"name": md.name, "namespace": md.namespace, "uid": md.uid}}
        await self.kube.event(target, reason, detail, warning=True, kind="Pod", api_version="v1")
        log.warning("restore refused", pod=f"{md.namespace}/{md.name}", reason=reason, error=detail)
        return Refused(reason, detail)

    async def check(self, config: cri.PodSandboxConfig) -> tuple[str, set[str]]:
        """The archive the Pod of this sandbox config restores from, and the names of the Pod's
        init containers; raises Refused."""
        md = config.metadata
        name = restore_from(config.annotations)
        # the reads at once: a restore waits for the slowest, not for their sum
        pod, missing_policy, obj, served_by = await asyncio.gather(
            self.kube.pod(md.namespace, md.name),
            self.kube.restore_policy_enforcing(),
            self.kube.get_checkpoint(md.namespace, name),
            self.kube.api_served_by(),
        )
        if pod is not None and (pod.get("metadata") or {}).get("uid") != md.uid:
            pod = None  # another Pod of the same name: not the one being started
        if served_by == api.SERVED_BUILT_IN:
            # the kubelet restores from the built-in type's objects (spec.restoreFrom, RestorePod);
            # a Pod naming one by podshim's annotation is refused rather than started afresh
            raise await self._refuse(
                pod,
                md,
                api.BUILT_IN_API,
                f"the cluster serves {api.KIND} as its own type: name the checkpoint in the Pod's "
                f"spec.restoreFrom, not the {api.RESTORE_FROM_ANNOTATION} annotation",
            )
        if missing_policy:
            raise await self._refuse(pod, md, api.POLICY_MISSING, missing_policy)
        if obj is None:
            raise await self._refuse(
                pod, md, api.NOT_READY, f"PodCheckpoint {md.namespace}/{name} does not exist"
            )
        if not api.is_ready(obj):
            c = api.ready_condition(obj) or {}
            state = f"{c.get('reason')}: {c.get('message')}" if c else "no Ready condition yet"
            raise await self._refuse(
                pod, md, api.NOT_READY, f"PodCheckpoint {md.namespace}/{name} is not Ready ({state})"
            )
        status = obj.get("status") or {}
        if status.get("nodeName") != self.kube.node:
            raise await self._refuse(
                pod,
                md,
                api.WRONG_NODE,
                f"PodCheckpoint {md.namespace}/{name} was taken on node {status.get('nodeName')!r}, "
                f"this is {self.kube.node!r}: create the Pod with spec.nodeName {status.get('nodeName')!r}",
            )
        archive = owned_archive(api.archive_path(obj), api.source_pod_name(obj), md.namespace)
        if archive is None or not (archive / layout.MANIFEST_FILE).is_file():
            raise await self._refuse(
                pod,
                md,
                api.DATA_MISSING,
                f"the archive of PodCheckpoint {md.namespace}/{name} "
                f"({api.archive_path(obj) or 'no location'}) is missing on this node",
            )
        if pod is None:
            raise await self._refuse(pod, md, api.NOT_READY, f"cannot read Pod {md.namespace}/{md.name}")
        template = (status.get("checkpointedPodTemplate") or {}).get("spec") or {}
        differs = spec_mismatch(pod.get("spec") or {}, template)
        if differs:
            raise await self._refuse(
                pod,
                md,
                api.SPEC_MISMATCH,
                f"the Pod's {differs} differs from PodCheckpoint {md.namespace}/{name}'s "
                "checkpointed template",
            )
        inits = {str(c.get("name")) for c in (pod.get("spec") or {}).get("initContainers") or []}
        return str(archive), inits

    async def run_sandbox(self, req: cri.RunPodSandboxRequest) -> None:
        """Before the kubelet's RunPodSandbox of a Pod that names a checkpoint; what it found
        serves the CreateContainers that follow (by the Pod's UID: the sandbox id is not known
        yet)."""
        self._checked[req.config.metadata.uid] = await _api_errors(self.check(req.config))

    async def create_container(self, req: cri.CreateContainerRequest, deadline: float | None) -> str | None:
        """The kubelet's CreateContainer in a restoring Pod's sandbox: the container id made here,
        None when the call goes to the upstream unchanged (a later attempt: a restart is a new
        container, as for any pod)."""
        if req.config.metadata.attempt != 0:
            return None
        md = req.sandbox_config.metadata
        uid = md.uid
        checked = self._checked.get(uid)
        if checked is None:  # a podshim restarted since the RunPodSandbox: checked again
            checked = await _api_errors(self.check(req.sandbox_config))
            self._checked[uid] = checked
        self._sandbox_pods[req.pod_sandbox_id] = uid
        archive, inits = checked
        name = req.config.metadata.name
        if name in inits:  # it ran to completion in the source pod
            return await self._done(req)
        dumped = [
            str(c.get("name"))
            for c in _manifest(Path(archive)).get("containers") or []
            if isinstance(c, dict) and c.get("checkpointed", True)
        ]
        if name not in dumped:
            raise await self._refuse(
                None,
                md,
                api.SPEC_MISMATCH,
                f"container {name!r} is not in the checkpoint ({', '.join(dumped)})",
            )
        async with self.guards.hold(f"{md.namespace}/{md.name}"):
            cid = str(await self.engine.restore_container_into(req, archive, deadline))
        self._made[cid] = (req.pod_sandbox_id, md)
        return cid

    def started(self, container_id: str) -> None:
        """After the StartContainer that resumed a container restored here: the event
        RestoreSucceeded on its Pod, written beside the answer (never delaying it)."""
        made = self._made.pop(container_id, None)
        if made is None:
            return
        md = made[1]
        pod = {"metadata": {"name": md.name, "namespace": md.namespace, "uid": md.uid}}
        what = f"container {container_id[:13]} resumed from its checkpoint"
        task = asyncio.ensure_future(
            self.kube.event(pod, api.RESTORE_SUCCEEDED, what, kind="Pod", api_version="v1")
        )
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    async def _done(self, req: cri.CreateContainerRequest) -> str:
        """An init container that completed in the source pod: the sandbox's own image (the
        pause image) printing its version, exit 0."""
        image = await self._sandbox_image(req.pod_sandbox_id)
        cc = cri.ContainerConfig()
        cc.CopyFrom(req.config)
        cc.image.CopyFrom(cri.ImageSpec(image=image))
        del cc.command[:]
        del cc.args[:]
        cc.command.extend(DONE_COMMAND)
        cc.args.extend(DONE_ARGS)
        del cc.mounts[:]
        cid = await self.upstream.create_container(
            cri.CreateContainerRequest(
                pod_sandbox_id=req.pod_sandbox_id, config=cc, sandbox_config=req.sandbox_config
            ),
            doing=f"creating completed init container {req.config.metadata.name!r}",
        )
        log.info(
            "restore: init container completed in the checkpoint", container=req.config.metadata.name, id=cid
        )
        return cid

    async def _sandbox_image(self, sandbox_id: str) -> str:
        resp = await self.upstream.pod_status(sandbox_id, verbose=True, doing="reading the sandbox's image")
        try:
            image = str(json.loads(resp.info.get("info", "{}")).get("image") or "")
        except ValueError:
            image = ""
        if not image:
            raise errors.FailedPrecondition(
                f"the upstream does not say which image sandbox {sandbox_id} runs"
            )
        return image

    def forget(self, sandbox_id: str) -> None:
        """After RemovePodSandbox: its containers never started are not coming back, and its
        Pod's check is made again by a next sandbox."""
        self._checked.pop(self._sandbox_pods.pop(sandbox_id, ""), None)
        for cid in [cid for cid, (sid, _md) in self._made.items() if sid == sandbox_id]:
            del self._made[cid]


async def _api_errors(checking: Coroutine[Any, Any, T]) -> T:
    """An API server that is down, slow or refuses: UNAVAILABLE (the kubelet retries), never a
    traceback."""
    try:
        return await checking
    except errors.ShimError:
        raise
    except Exception as e:  # noqa: BLE001 - lightkube's and httpx's errors alike
        raise errors.Unavailable(f"cannot read the Pod's checkpoint from the API server: {why(e)}") from None


def _manifest(root: Path) -> dict[str, Any]:
    try:
        with open(root / layout.MANIFEST_FILE, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        cause = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
        raise errors.FailedPrecondition(
            f"{api.DATA_MISSING}: {root}/{layout.MANIFEST_FILE}: {cause}"
        ) from None
    return doc if isinstance(doc, dict) else {}
