"""The CRI methods podshim answers itself; everything else goes through the passthrough.

This layer only decodes, delegates and maps errors: the logic lives in plain modules.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from api.runtime.v1 import api_pb2 as cri
from shim import __version__, errors, logs
from shim.server.proxy import Passthrough

log = logs.get("shim.server")
SERVICE = "/runtime.v1.RuntimeService/"
RESERVED_ANNOTATION_PREFIX = "podshim."


class Engine(Protocol):
    """The checkpoint/restore orchestrations (shim/checkpoint.py, shim/restore.py)."""

    async def checkpoint_pod(
        self, req: cri.CheckpointPodRequest, context: grpc.aio.ServicerContext
    ) -> cri.CheckpointPodResponse: ...

    async def restore_pod(
        self, req: cri.RestorePodRequest, context: grpc.aio.ServicerContext
    ) -> cri.RestorePodResponse: ...

    async def checkpoint_container(
        self, req: cri.CheckpointContainerRequest, context: grpc.aio.ServicerContext
    ) -> cri.CheckpointContainerResponse: ...

    async def recover(self) -> None: ...


Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]


def typed_handler(
    name: str, fn: Handler, req_cls: type[Message], resp_cls: type[Message]
) -> grpc.RpcMethodHandler:
    """A unary handler that turns podshim's typed errors into their gRPC status, never a traceback."""

    async def handle(request: Message, context: grpc.aio.ServicerContext) -> Message:
        try:
            return await fn(request, context)
        except errors.ShimError as e:
            await context.abort(e.code, e.message)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # a bug: say so without leaking a traceback to the caller
            log.exception("unexpected error", method=name)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"podshim: unexpected error in {name}: {type(e).__name__}: {e}"
            )
        raise AssertionError("not reached")

    return grpc.unary_unary_rpc_method_handler(
        handle, request_deserializer=req_cls.FromString, response_serializer=resp_cls.SerializeToString
    )


class RuntimeHandlers:
    """Builds the handlers of the RuntimeService methods podshim owns or corrects."""

    def __init__(self, passthrough: Passthrough, engine: Engine | None) -> None:
        self.passthrough = passthrough
        self.engine = engine

    async def version(
        self, req: cri.VersionRequest, context: grpc.aio.ServicerContext
    ) -> cri.VersionResponse:
        try:
            raw = await self.passthrough.call_unary(SERVICE + "Version", req.SerializeToString(), context)
        except grpc.aio.AioRpcError as err:
            await self.passthrough.abort_with(context, err)
            raise
        up = cri.VersionResponse.FromString(raw)
        # Semver build metadata names the upstream without breaking version parsers.
        upstream = re.sub(r"[^0-9A-Za-z.-]", "-", f"{up.runtime_name}-{up.runtime_version}")
        return cri.VersionResponse(
            version=up.version or "0.1.0",
            runtime_name="podshim",
            runtime_version=f"{__version__}+{upstream}",
            runtime_api_version=up.runtime_api_version or "v1",
        )

    def idempotent_stop(self, method: str) -> grpc.RpcMethodHandler:
        """StopPodSandbox/StopContainer: the CRI makes them idempotent, containerd 1.6 answers
        NOT_FOUND for an id that is already gone. podshim answers OK (an empty response)."""

        def gone_is_stopped(err: grpc.aio.AioRpcError) -> bytes | None:
            return b"" if err.code() == grpc.StatusCode.NOT_FOUND else None

        return grpc.unary_unary_rpc_method_handler(self.passthrough.unary(SERVICE + method, gone_is_stopped))

    def guarded_create(self) -> grpc.RpcMethodHandler:
        """CreateContainer: podshim's restore annotations are reserved — only RestorePod sets them,
        so a client cannot make podshim-runc restore an arbitrary directory. The request is
        decoded to check, and forwarded as the original bytes."""
        forward = self.passthrough.unary(SERVICE + "CreateContainer")

        async def create(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            req = cri.CreateContainerRequest.FromString(request)
            reserved = [k for k in req.config.annotations if k.startswith(RESERVED_ANNOTATION_PREFIX)]
            if reserved:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"annotation {reserved[0]!r} is reserved for podshim's RestorePod: remove it",
                )
            return await forward(request, context)

        return grpc.unary_unary_rpc_method_handler(create)

    def _engine_call(self, name: str) -> Handler:
        async def call(request: Message, context: grpc.aio.ServicerContext) -> Message:
            if self.engine is None:
                raise errors.Unimplemented(f"podshim: {name} is not implemented yet")
            fn: Handler = getattr(self.engine, _snake(name))
            return await fn(request, context)

        return call

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        own = {
            SERVICE + "Version": typed_handler(
                "Version", self.version, cri.VersionRequest, cri.VersionResponse
            ),
            SERVICE + "StopPodSandbox": self.idempotent_stop("StopPodSandbox"),
            SERVICE + "StopContainer": self.idempotent_stop("StopContainer"),
            SERVICE + "CreateContainer": self.guarded_create(),
        }
        for name in ("CheckpointPod", "RestorePod"):
            req_cls = getattr(cri, f"{name}Request")
            resp_cls = getattr(cri, f"{name}Response")
            own[SERVICE + name] = typed_handler(name, self._engine_call(name), req_cls, resp_cls)
        return own


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
