"""The typed seam to the upstream runtime: the CRI calls podshim makes on its own, as methods that
take plain arguments, return the upstream's response messages and raise podshim's typed errors
(shim/errors.py), the gRPC error mapped once here (upstream_error). Modules above this one never
see gRPC. A unit test replaces the upstream by a subclass overriding these methods, or by stubs
(`runtime`, `image`) answering the raw calls (tests/fakes.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from api.runtime.v1 import api_pb2 as cri
from shim.upstream.errors import upstream_error

R = TypeVar("R")


class CriCalls:
    """The calls; a concrete upstream provides `endpoint`, `timeout` (each call's default limit,
    `[upstream] timeout_seconds`) and the `runtime` and `image` stubs."""

    endpoint: str
    timeout: float
    runtime: Any
    image: Any

    async def _call(
        self, rpc: Callable[..., Awaitable[R]], request: object, doing: str, timeout: float | None
    ) -> R:
        try:
            return await rpc(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.aio.AioRpcError as e:
            raise upstream_error(self.endpoint, e, doing) from None

    async def pod_status(
        self, pod_id: str, verbose: bool = False, *, doing: str = "", timeout: float | None = None
    ) -> cri.PodSandboxStatusResponse:
        req = cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=verbose)
        return await self._call(self.runtime.PodSandboxStatus, req, doing or f"reading pod {pod_id}", timeout)

    async def container_status(
        self, container_id: str, verbose: bool = False, *, doing: str = "", timeout: float | None = None
    ) -> cri.ContainerStatusResponse:
        req = cri.ContainerStatusRequest(container_id=container_id, verbose=verbose)
        doing = doing or f"reading container {container_id}"
        return await self._call(self.runtime.ContainerStatus, req, doing, timeout)

    async def list_containers(
        self, filter: cri.ContainerFilter, *, doing: str = "listing containers", timeout: float | None = None
    ) -> list[cri.Container]:
        req = cri.ListContainersRequest(filter=filter)
        return list((await self._call(self.runtime.ListContainers, req, doing, timeout)).containers)

    async def list_pod_sandboxes(
        self, *, doing: str = "listing sandboxes", timeout: float | None = None
    ) -> list[cri.PodSandbox]:
        resp = await self._call(self.runtime.ListPodSandbox, cri.ListPodSandboxRequest(), doing, timeout)
        return list(resp.items)

    async def run_pod_sandbox(
        self,
        req: cri.RunPodSandboxRequest,
        *,
        doing: str = "creating a sandbox",
        timeout: float | None = None,
    ) -> str:
        return (await self._call(self.runtime.RunPodSandbox, req, doing, timeout)).pod_sandbox_id

    async def create_container(
        self,
        req: cri.CreateContainerRequest,
        *,
        doing: str = "creating a container",
        timeout: float | None = None,
    ) -> str:
        return (await self._call(self.runtime.CreateContainer, req, doing, timeout)).container_id

    async def start_container(
        self, container_id: str, *, doing: str = "", timeout: float | None = None
    ) -> None:
        req = cri.StartContainerRequest(container_id=container_id)
        doing = doing or f"starting container {container_id}"
        await self._call(self.runtime.StartContainer, req, doing, timeout)

    async def stop_container(
        self, container_id: str, grace: int = 0, *, doing: str = "", timeout: float | None = None
    ) -> None:
        req = cri.StopContainerRequest(container_id=container_id, timeout=grace)
        await self._call(
            self.runtime.StopContainer, req, doing or f"stopping container {container_id}", timeout
        )

    async def remove_container(
        self, container_id: str, *, doing: str = "", timeout: float | None = None
    ) -> None:
        req = cri.RemoveContainerRequest(container_id=container_id)
        doing = doing or f"removing container {container_id}"
        await self._call(self.runtime.RemoveContainer, req, doing, timeout)

    async def stop_pod_sandbox(self, pod_id: str, *, doing: str = "", timeout: float | None = None) -> None:
        req = cri.StopPodSandboxRequest(pod_sandbox_id=pod_id)
        await self._call(self.runtime.StopPodSandbox, req, doing or f"stopping sandbox {pod_id}", timeout)

    async def remove_pod_sandbox(self, pod_id: str, *, doing: str = "", timeout: float | None = None) -> None:
        req = cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id)
        await self._call(self.runtime.RemovePodSandbox, req, doing or f"removing sandbox {pod_id}", timeout)

    async def status(
        self,
        verbose: bool = False,
        *,
        doing: str = "reading the runtime status",
        timeout: float | None = None,
    ) -> cri.StatusResponse:
        return await self._call(self.runtime.Status, cri.StatusRequest(verbose=verbose), doing, timeout)

    async def version(
        self, *, doing: str = "reading the runtime version", timeout: float | None = None
    ) -> cri.VersionResponse:
        return await self._call(self.runtime.Version, cri.VersionRequest(), doing, timeout)

    async def image_status(
        self, image: str, *, doing: str = "", timeout: float | None = None
    ) -> cri.ImageStatusResponse:
        req = cri.ImageStatusRequest(image=cri.ImageSpec(image=image))
        return await self._call(self.image.ImageStatus, req, doing or f"looking up image {image}", timeout)
