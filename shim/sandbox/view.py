"""Builds the pod as podshim needs it from the upstream's CRI status (verbose info).

containerd's verbose info carries, per sandbox and container: pid, the CRI config as JSON, the
OCI runtime spec, and the runtime options (runc binary and root). podshim relies on nothing else
from the upstream, so the same view can be built from CRI-O's equivalent info.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from api.runtime.v1 import api_pb2 as cri
from shim import cni, errors
from shim.errors import is_not_found


class PodSource(Protocol):
    """The upstream's status calls the view is built from, raising podshim's typed errors (the
    upstream's own answer in `upstream_code`): shim/upstream's client satisfies it, so the view
    knows neither the client nor gRPC, and a unit test passes a fake."""

    timeout: float  # each call's default limit (`[upstream] timeout_seconds`)

    async def pod_status(
        self, pod_id: str, verbose: bool = False, *, doing: str = ..., timeout: float | None = None
    ) -> cri.PodSandboxStatusResponse: ...

    async def container_status(
        self, container_id: str, verbose: bool = False, *, doing: str = ..., timeout: float | None = None
    ) -> cri.ContainerStatusResponse: ...

    async def list_containers(
        self, filter: cri.ContainerFilter, *, doing: str = ..., timeout: float | None = None
    ) -> list[cri.Container]: ...


CRI_NAMESPACE = "k8s.io"  # containerd's namespace for CRI objects: the runc root's last element


@dataclass
class ContainerView:
    id: str
    name: str
    state: int  # cri.ContainerState
    status: cri.ContainerStatus
    config: dict[str, Any]  # the CRI ContainerConfig it was created with (JSON form)
    spec: dict[str, Any]  # the OCI runtime spec
    pid: int
    runtime_root: str  # the OCI runtime's --root holding this container's state
    runtime_binary: str  # the binary the upstream calls (podshim-runc in front of runc/crun)
    # the image's ID (docs/design/archive.md (Image identity)); set by resolve_container_images
    image_id: str = ""

    @property
    def running(self) -> bool:
        return self.state == cri.CONTAINER_RUNNING

    @property
    def cgroups_path(self) -> str:
        return str(self.spec.get("linux", {}).get("cgroupsPath", ""))

    @property
    def restart_count(self) -> int:
        return int(self.status.metadata.attempt)

    @property
    def image(self) -> str:
        """The image by name when the upstream reports one (containerd: its first tag)."""
        return self.status.image.image or self.configured_image

    @property
    def configured_image(self) -> str:
        """The image reference the container was created with (the kubelet sends the image ID)."""
        return str(self.config.get("image", {}).get("image", ""))

    @property
    def user_specified_image(self) -> str:
        """The image as the pod spec names it (the kubelet's ImageSpec.user_specified_image, which
        containerd 1.x does not keep: then the name the upstream reports)."""
        spec = self.config.get("image", {})
        named = spec.get("user_specified_image") or spec.get("userSpecifiedImage")
        return str(named or self.status.image.user_specified_image or self.image)

    @property
    def mount_destinations(self) -> list[str]:
        """Where the runtime mounts things into the rootfs (never part of the writable layer)."""
        return [str(m.get("destination", "")) for m in self.spec.get("mounts", [])]

    def upperdir(self) -> Path | None:
        """The overlayfs upper dir of the container's rootfs, i.e. its writable layer."""
        if self.pid <= 0:
            return None
        try:
            with open(f"/proc/{self.pid}/mountinfo") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        for line in lines:
            pre, _, post = line.partition(" - ")
            fields_ = pre.split()
            if len(fields_) < 5 or fields_[4] != "/":
                continue
            fstype, _source, super_opts = (post.split(" ", 2) + ["", ""])[:3]
            if fstype != "overlay":
                continue
            for opt in super_opts.split(","):
                if opt.startswith("upperdir="):
                    return Path(opt.removeprefix("upperdir="))
        return None

    def status_dump(self) -> dict[str, Any]:
        """status.dump: the CRI ContainerStatus as containerd writes it there (Go's encoding/json
        of the CRI type: the proto field names, enums and 64-bit integers as numbers), which
        containerd's own restore of a container tar decodes (a proto3 JSON "CONTAINER_RUNNING"
        or "1733…" string fails it)."""
        return go_json(self.status)

    def to_record(self) -> dict[str, Any]:
        """What the archive keeps of this container (config.dump content)."""
        return {
            "id": self.id,
            "name": self.name,
            "state": cri.ContainerState.Name(self.state),
            "image": self.image,
            "image_ref": self.status.image_ref,
            "image_id": self.image_id,
            "user_specified_image": self.user_specified_image,
            "restart_count": self.restart_count,
            "created_at": self.status.created_at,
            "started_at": self.status.started_at,
            "finished_at": self.status.finished_at,
            "exit_code": self.status.exit_code,
            "log_path": self.status.log_path,
            "labels": dict(self.status.labels),
            "annotations": dict(self.status.annotations),
            "config": self.config,
            "status": json_format.MessageToDict(self.status),
        }


@dataclass
class PodView:
    id: str
    status: cri.PodSandboxStatus
    config: dict[str, Any]  # the PodSandboxConfig it was created with (JSON form)
    spec: dict[str, Any]  # the sandbox (pause) container's OCI spec
    pid: int
    runtime_handler: str
    network: dict[str, Any]  # the CNI result the upstream recorded
    containers: list[ContainerView] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.status.state == cri.SANDBOX_READY

    @property
    def netns(self) -> str | None:
        """The pod's network namespace (a path), None when the upstream does not say."""
        return cni.netns_path(self.spec, self.pid)

    @property
    def name(self) -> str:
        md = self.status.metadata
        return f"{md.namespace}/{md.name}"

    @property
    def cgroup_parent(self) -> str:
        """The pod-level cgroup: parent of the sandbox's own cgroup (cgroupfs or systemd form)."""
        path = str(self.spec.get("linux", {}).get("cgroupsPath", ""))
        if ":" in path and not path.startswith("/"):  # systemd "slice:prefix:name": the slice
            return path.split(":", 1)[0]
        return os.path.dirname(path.rstrip("/")) or "/"

    def by_id(self, container_id: str) -> ContainerView | None:
        return next((c for c in self.containers if c.id == container_id), None)

    def to_record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "metadata": json_format.MessageToDict(self.status.metadata),
            "runtime_handler": self.runtime_handler,
            "cgroup_parent": self.cgroup_parent,
            "config": self.config,
            "status": json_format.MessageToDict(self.status),
        }


def _info(info: Any) -> dict[str, Any]:
    raw = info.get("info") if info else None
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return {}


def _runtime_root(info: dict[str, Any]) -> str:
    root = str(info.get("runtimeOptions", {}).get("root", "") or "")
    return os.path.join(root, CRI_NAMESPACE) if root else ""


async def pod_status(
    upstream: PodSource, pod_id: str, verbose: bool = False, timeout: float | None = None
) -> cri.PodSandboxStatusResponse:
    """The pod's status; an id the upstream does not know is NotFound saying how to find it."""
    try:
        return await upstream.pod_status(pod_id, verbose=verbose, timeout=timeout)
    except errors.ShimError as e:
        if is_not_found(e):
            raise errors.NotFound(
                f"pod sandbox {pod_id!r} not found: check the id with `podshim pods`"
            ) from None
        raise


async def build_pod_view(upstream: PodSource, pod_id: str, timeout: float | None = None) -> PodView:
    """The pod and all its containers (running and exited), ordered by creation; each upstream
    call limited to `timeout` (default: the upstream's `[upstream] timeout_seconds`)."""
    timeout = timeout if timeout is not None else upstream.timeout
    if not pod_id:
        raise errors.InvalidArgument("pod_sandbox_id is empty: name the pod to checkpoint")
    sresp = await pod_status(upstream, pod_id, verbose=True, timeout=timeout)
    sinfo = _info(sresp.info)
    pod = PodView(
        id=sresp.status.id,
        status=sresp.status,
        config=sinfo.get("config") or {},
        spec=sinfo.get("runtimeSpec") or {},
        pid=int(sinfo.get("pid") or 0),
        # containerd 2.x drops "runtimeHandler" from the verbose info; the status field has it
        runtime_handler=sresp.status.runtime_handler or str(sinfo.get("runtimeHandler") or ""),
        network=sinfo.get("cniResult") or {},
    )
    listed = await upstream.list_containers(
        cri.ContainerFilter(pod_sandbox_id=pod.id),
        doing=f"listing containers of pod {pod_id}",
        timeout=timeout,
    )
    for c in sorted(listed, key=lambda c: c.created_at):
        try:
            cresp = await upstream.container_status(c.id, verbose=True, timeout=timeout)
        except errors.ShimError as e:
            if is_not_found(e):
                continue  # removed meanwhile
            raise
        cinfo = _info(cresp.info)
        pod.containers.append(
            ContainerView(
                id=c.id,
                name=cresp.status.metadata.name,
                state=cresp.status.state,
                status=cresp.status,
                config=cinfo.get("config") or {},
                spec=cinfo.get("runtimeSpec") or {},
                pid=int(cinfo.get("pid") or 0),
                runtime_root=_runtime_root(cinfo),
                runtime_binary=str(cinfo.get("runtimeOptions", {}).get("binary_name", "") or ""),
            )
        )
    return pod


def go_json(msg: Message) -> dict[str, Any]:
    """`msg` as Go's encoding/json renders the Go type protoc generates for it (the set fields by
    their proto names; numbers as numbers, bytes as base64), not as proto3 JSON."""
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            vfd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: _go_value(vfd, v) for k, v in value.items()}
        elif fd.is_repeated:
            out[fd.name] = [_go_value(fd, v) for v in value]
        else:
            out[fd.name] = _go_value(fd, value)
    return out


def _go_value(fd: FieldDescriptor, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return go_json(value)
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value
