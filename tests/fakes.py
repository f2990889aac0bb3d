"""A fake upstream for unit tests of the orchestrations through the typed seam
(shim/upstream/calls.py): every call is recorded; a test makes any call fail with a given
upstream answer (mapped by the real seam, so the error is the one production sees), or hang.
The end-to-end tests use the real containerd instead."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from shim.upstream.calls import CriCalls

ENDPOINT = "unix:///nonexistent/fake-upstream.sock"


def rpc_error(code: str, details: str = "") -> grpc.aio.AioRpcError:
    """The upstream's answer `code` (a gRPC code name), as the channel raises it."""
    md = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(grpc.StatusCode[code], md, md, details=details)


def unreachable() -> grpc.aio.AioRpcError:
    """What the channel raises when the upstream is not running (a transport failure)."""
    return rpc_error("UNAVAILABLE", "failed to connect to all addresses; connection refused")


class FakeUpstream(CriCalls):
    """Sandboxes and containers in memory, answering the raw CRI calls (`runtime` and `image` are
    the fake itself), so that the real typed seam (CriCalls) maps every error and names every
    step as in production. `fail[Method]`: the gRPC error the next calls of that CRI method raise
    (a list: one per call, None letting that call through); `hang`: methods that never answer
    (a caller's deadline ends them); `held[Method]`: an event the calls of that method wait for
    before they answer. `calls`: (method, id or name) in order."""

    endpoint = ENDPOINT
    timeout = 30.0

    def __init__(self) -> None:
        self.runtime = self.image = self
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[str, grpc.aio.AioRpcError | list[grpc.aio.AioRpcError | None]] = {}
        self.hang: set[str] = set()
        self.held: dict[str, asyncio.Event] = {}
        self.sandboxes: dict[str, cri.PodSandboxStatus] = {}
        self.containers: dict[str, cri.ContainerStatus] = {}
        self.images: dict[str, cri.Image] = {}
        self.runtime_info: dict[str, str] = {}
        self._next = 0

    async def _step(self, name: str, arg: str = "") -> None:
        self.calls.append((name, arg))
        if name in self.hang:
            await asyncio.Event().wait()
        if name in self.held:
            await self.held[name].wait()
        f = self.fail.get(name)
        if isinstance(f, list):
            f = f.pop(0) if f else None
        if f is not None:
            raise f

    def _id(self, prefix: str) -> str:
        self._next += 1
        return f"{prefix}{self._next:04d}"

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    # ------------------------------------------------------------------ the raw CRI calls

    async def PodSandboxStatus(self, req: cri.PodSandboxStatusRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("PodSandboxStatus", req.pod_sandbox_id)
        if req.pod_sandbox_id not in self.sandboxes:
            raise rpc_error("NOT_FOUND", f"sandbox {req.pod_sandbox_id} not found")
        return cri.PodSandboxStatusResponse(status=self.sandboxes[req.pod_sandbox_id])

    async def ContainerStatus(self, req: cri.ContainerStatusRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("ContainerStatus", req.container_id)
        if req.container_id not in self.containers:
            raise rpc_error("NOT_FOUND", f"container {req.container_id} not found")
        return cri.ContainerStatusResponse(status=self.containers[req.container_id])

    async def ListContainers(self, req: cri.ListContainersRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("ListContainers", req.filter.pod_sandbox_id or req.filter.id)
        return cri.ListContainersResponse()

    async def ListPodSandbox(self, req: cri.ListPodSandboxRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("ListPodSandbox")
        items = [
            cri.PodSandbox(id=s.id, metadata=s.metadata, created_at=s.created_at)
            for s in self.sandboxes.values()
        ]
        return cri.ListPodSandboxResponse(items=items)

    async def RunPodSandbox(self, req: cri.RunPodSandboxRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("RunPodSandbox", req.config.metadata.name)
        sid = self._id("sb")
        self.sandboxes[sid] = cri.PodSandboxStatus(
            id=sid, metadata=req.config.metadata, state=cri.SANDBOX_READY
        )
        return cri.RunPodSandboxResponse(pod_sandbox_id=sid)

    async def CreateContainer(self, req: cri.CreateContainerRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("CreateContainer", req.config.metadata.name)
        cid = self._id("c")
        self.containers[cid] = cri.ContainerStatus(id=cid, metadata=req.config.metadata)
        return cri.CreateContainerResponse(container_id=cid)

    async def StartContainer(self, req: cri.StartContainerRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("StartContainer", req.container_id)
        return cri.StartContainerResponse()

    async def StopContainer(self, req: cri.StopContainerRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("StopContainer", req.container_id)
        return cri.StopContainerResponse()

    async def RemoveContainer(self, req: cri.RemoveContainerRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("RemoveContainer", req.container_id)
        self.containers.pop(req.container_id, None)
        return cri.RemoveContainerResponse()

    async def StopPodSandbox(self, req: cri.StopPodSandboxRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("StopPodSandbox", req.pod_sandbox_id)
        return cri.StopPodSandboxResponse()

    async def RemovePodSandbox(self, req: cri.RemovePodSandboxRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("RemovePodSandbox", req.pod_sandbox_id)
        self.sandboxes.pop(req.pod_sandbox_id, None)
        return cri.RemovePodSandboxResponse()

    async def Status(self, req: cri.StatusRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("Status")
        return cri.StatusResponse(info=self.runtime_info)

    async def Version(self, req: cri.VersionRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("Version")
        return cri.VersionResponse(runtime_name="fake", runtime_version="v2.1.0")

    async def ImageStatus(self, req: cri.ImageStatusRequest, timeout: float) -> Any:  # noqa: N802
        await self._step("ImageStatus", req.image.image)
        img = self.images.get(req.image.image)
        return cri.ImageStatusResponse(image=img) if img is not None else cri.ImageStatusResponse()
