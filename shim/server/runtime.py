"""The CRI methods podshim answers itself; everything else goes through the passthrough.

This layer only decodes, delegates and maps errors: the logic lives in plain modules.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from api.runtime.v1 import api_pb2 as cri
from shim import __version__, contract, errors, logs
from shim.checks import cri_strings
from shim.kube.restore import restore_from
from shim.server.proxy import Passthrough

if TYPE_CHECKING:
    from shim.kube.service import ClusterApi

log = logs.get("shim.server")
SERVICE = "/runtime.v1.RuntimeService/"
RESERVED_ANNOTATION_PREFIX = "podshim."


class Engine(Protocol):
    """The checkpoint/restore orchestrations (shim/ops/). `deadline`: the caller's time remaining
    in seconds (None: no deadline set)."""

    async def checkpoint_pod(
        self, req: cri.CheckpointPodRequest, deadline: float | None
    ) -> cri.CheckpointPodResponse: ...

    async def restore_pod(
        self, req: cri.RestorePodRequest, deadline: float | None
    ) -> cri.RestorePodResponse: ...

    async def checkpoint_container(
        self, req: cri.CheckpointContainerRequest, deadline: float | None
    ) -> cri.CheckpointContainerResponse: ...

    @property
    def container_checkpoint_mode(self) -> str: ...  # "fallback" (upstream first) or "always"

    async def create_container_from_archive(
        self, req: cri.CreateContainerRequest, deadline: float | None
    ) -> cri.CreateContainerResponse: ...

    async def forget_container(self, container_id: str) -> None: ...

    async def recover(self) -> None: ...

    async def drain(self, timeout: float) -> None: ...  # graceful stop: refuse new, let running finish

    async def stop(self, timeout: float) -> None: ...  # graceful stop: let cancelled operations undo

    async def startup(self) -> None: ...

    @property
    def restores_pending(self) -> bool: ...  # some container created for a restore is not started yet

    @property
    def checkpointing(self) -> dict[str, Any]: ...  # sandbox id -> its checkpoint's end (an asyncio.Event)

    async def wait_checkpointed(self, container_id: str, limit: float | None) -> None: ...

    def restored_id(self, container_id: str) -> str | None: ...  # created for a restore, not started

    async def confirm_restored(self, container_id: str) -> None: ...  # raises if it was not restored


M = TypeVar("M", bound=Message)
Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]


MAX_MESSAGE_CHARS = 2048  # a status message travels in metadata (clients cap it near 8-16 KiB)


def fit_message(message: str) -> str:
    """Keep a status message deliverable: a huge echoed value must not turn the error into the
    client's RESOURCE_EXHAUSTED."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 16] + " … (truncated)"


NOTICE_KEY = "podshim-notice"  # trailing metadata: what the caller should know of a call that succeeded


def ascii_notice(notes: list[str]) -> str:
    """The notes as one metadata value (ASCII only, deliverable like a status message)."""
    return fit_message("; ".join(notes)).encode("ascii", "replace").decode()


def restored_start_code(err: grpc.aio.AioRpcError) -> grpc.StatusCode | None:
    """StartContainer of a restored container that podshim-runc failed for a page image whose
    sha256 differs from the manifest (docs/design/restore-pod.md (RestorePod) step 4): DATA_LOSS, as
    RestorePod answers any other corrupt member, instead of the upstream's UNKNOWN."""
    return grpc.StatusCode.DATA_LOSS if contract.is_page_mismatch(err.details() or "") else None


async def decode(req_cls: type[M], raw: bytes, context: grpc.aio.ServicerContext) -> M:
    """Parse a request; a malformed one (e.g. invalid UTF-8 in a string) is INVALID_ARGUMENT."""
    try:
        return req_cls.FromString(raw)
    except DecodeError as e:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"malformed {req_cls.__name__}: {e} (strings must be UTF-8)"
        )
        raise AssertionError("not reached") from None


def typed_call(name: str, fn: Handler, req_cls: type[Message]) -> Handler:
    """`fn` with the request as bytes (from the wire) or decoded (another handler delegating), and
    podshim's typed errors turned into their gRPC status, never a traceback: typed_handler's behaviour."""

    async def handle(raw: bytes | Message, context: grpc.aio.ServicerContext) -> Message:
        # bytes from the wire; a decoded request when another handler delegates (CreateContainer)
        request = await decode(req_cls, raw, context) if isinstance(raw, bytes) else raw
        notes = errors.collect_caller_notes()
        try:
            response = await fn(request, context)
            if notes:
                context.set_trailing_metadata(((NOTICE_KEY, ascii_notice(notes)),))
            return response
        except errors.ShimError as e:
            message = "; ".join([e.message, *(n for n in notes if n not in e.message)])
            await context.abort(grpc.StatusCode[e.code_name], fit_message(message))
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # a bug: say so without leaking a traceback to the caller
            log.exception("unexpected error", method=name)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"podshim: unexpected error in {name}: {type(e).__name__}: {e}"
            )
        raise AssertionError("not reached")

    return handle


def typed_handler(
    name: str, fn: Handler, req_cls: type[Message], resp_cls: type[Message]
) -> grpc.RpcMethodHandler:
    """A unary handler that turns podshim's typed errors into their gRPC status, never a traceback."""
    return grpc.unary_unary_rpc_method_handler(
        typed_call(name, fn, req_cls), response_serializer=resp_cls.SerializeToString
    )


def version_answer(up: cri.VersionResponse, runtime_name: str) -> cri.VersionResponse:
    """Version through podshim (docs/design/proxy.md (The proxy)). "upstream": the upstream's
    runtime_name (the kubelet reports container ids as `<runtime_name>://<id>`, which node agents
    key on) and its runtime_version with podshim added as build metadata
    (`1.6.20~ds1+podshim.0.1.0`); "podshim": runtime_name podshim, the upstream in the build
    metadata of podshim's version (`0.1.0+containerd-1.6.20-ds1`)."""
    if runtime_name == "podshim":
        upstream = re.sub(r"[^0-9A-Za-z.-]", "-", f"{up.runtime_name}-{up.runtime_version}")
        name, version = "podshim", f"{__version__}+{upstream}"
    else:
        # one "+" only: build metadata the upstream's version already has goes on after a "."
        sep = "." if "+" in up.runtime_version else "+"
        name, version = up.runtime_name, f"{up.runtime_version}{sep}podshim.{__version__}"
    return cri.VersionResponse(
        version=up.version or "0.1.0",
        runtime_name=name,
        runtime_version=version,
        runtime_api_version=up.runtime_api_version or "v1",
    )


class RuntimeHandlers:
    """Builds the handlers of the RuntimeService methods podshim owns or corrects."""

    def __init__(
        self,
        passthrough: Passthrough,
        engine: Engine | None,
        runtime_name: str = "upstream",
        cluster: ClusterApi | None = None,
    ) -> None:
        self.passthrough = passthrough
        self.engine = engine
        self.runtime_name = runtime_name  # [server] runtime_name: "upstream" or "podshim"
        self.cluster = cluster  # [kubernetes]: Pods that name a checkpoint (shim/kube/restore.py)

    async def version(
        self, req: cri.VersionRequest, context: grpc.aio.ServicerContext
    ) -> cri.VersionResponse:
        try:
            raw = await self.passthrough.call_unary(SERVICE + "Version", req.SerializeToString(), context)
        except grpc.aio.AioRpcError as err:
            await self.passthrough.abort_with(context, err)
            raise
        return version_answer(cri.VersionResponse.FromString(raw), self.runtime_name)

    def idempotent_stop(self, method: str) -> grpc.RpcMethodHandler:
        """StopPodSandbox/StopContainer: the CRI makes them idempotent, containerd 1.6 answers
        NOT_FOUND for an id that is already gone. podshim answers OK (an empty response)."""

        def gone_is_stopped(err: grpc.aio.AioRpcError) -> bytes | None:
            return b"" if err.code() == grpc.StatusCode.NOT_FOUND else None

        return grpc.unary_unary_rpc_method_handler(self.passthrough.unary(SERVICE + method, gone_is_stopped))

    def guarded_create(self) -> grpc.RpcMethodHandler:
        """CreateContainer: podshim's restore annotations are reserved — only RestorePod sets them,
        so a client cannot make podshim-runc restore an arbitrary directory. The request is
        decoded to check, and forwarded as the original bytes. An image that is an absolute path
        is a container checkpoint archive (CRI-O's convention; no image reference starts with
        '/'): podshim creates the container from it."""
        forward = self.passthrough.unary(SERVICE + "CreateContainer")
        from_archive = typed_call(
            "CreateContainer", self._engine_call("CreateContainerFromArchive"), cri.CreateContainerRequest
        )

        async def create(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            req = await decode(cri.CreateContainerRequest, request, context)
            reserved = [k for k in req.config.annotations if k.startswith(RESERVED_ANNOTATION_PREFIX)]
            if reserved:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"annotation {reserved[0]!r} is reserved for podshim's RestorePod: remove it",
                )
            try:
                cri_strings.check_container_config(req.config)
            except errors.InvalidArgument as e:
                await context.abort(grpc.StatusCode[e.code_name], fit_message(e.message))
            if req.config.image.image.startswith("/"):
                resp = await from_archive(req, context)
                return resp.SerializeToString()
            if self.cluster is not None and restore_from(req.sandbox_config.annotations):
                try:
                    cid = await self.cluster.restores.create_container(req, context.time_remaining())
                except errors.ShimError as e:
                    await context.abort(grpc.StatusCode[e.code_name], fit_message(e.message))
                if cid is not None:
                    return cri.CreateContainerResponse(container_id=cid).SerializeToString()
            return await forward(request, context)

        return grpc.unary_unary_rpc_method_handler(create)

    def guarded_run_sandbox(self) -> grpc.RpcMethodHandler:
        """RunPodSandbox: decoded only to refuse a config the upstream would turn into a sandbox
        nobody can remove (a NUL, ';' or '=' in the name: shim/checks/cri_strings.py), INVALID_ARGUMENT
        before anything is created; forwarded as the original bytes."""
        forward = self.passthrough.unary(SERVICE + "RunPodSandbox")

        async def run(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            req = await decode(cri.RunPodSandboxRequest, request, context)
            try:
                cri_strings.check_sandbox_config(req.config)
                if self.cluster is not None and restore_from(req.config.annotations):
                    await self.cluster.restores.run_sandbox(req)
            except errors.ShimError as e:
                await context.abort(grpc.StatusCode[e.code_name], fit_message(e.message))
            return await forward(request, context)

        return grpc.unary_unary_rpc_method_handler(run)

    def start_container(self) -> grpc.RpcMethodHandler:
        """StartContainer: forwarded as bytes. Only for a container podshim created for a restore
        (looked up in memory: any other container costs no decoding and no added upstream call)
        does podshim confirm afterwards that its process really came from the checkpoint; if not,
        the container is stopped and removed and the call fails FAILED_PRECONDITION
        (docs/design/runtime-wrapper.md (Wiring check))."""
        forward = self.passthrough.unary(SERVICE + "StartContainer")
        forward_restored = self.passthrough.unary(SERVICE + "StartContainer", code_for=restored_start_code)

        async def start(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            engine = self.engine
            if engine is None or not engine.restores_pending:
                return await forward(request, context)
            try:
                cid = engine.restored_id(cri.StartContainerRequest.FromString(request).container_id)
            except DecodeError:
                cid = None  # the upstream answers a malformed request itself
            if cid is None:
                return await forward(request, context)
            response = await forward_restored(request, context)
            try:
                await engine.confirm_restored(cid)
                if self.cluster is not None:
                    self.cluster.restores.started(cid)
            except errors.ShimError as e:
                await context.abort(grpc.StatusCode[e.code_name], fit_message(e.message))
            except Exception as e:  # a bug: say so without a traceback
                log.exception("unexpected error", method="StartContainer")
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    f"podshim: unexpected error confirming the restore of {cid}: {type(e).__name__}: {e}",
                )
            return response

        return grpc.unary_unary_rpc_method_handler(start)

    def exec_sync(self) -> grpc.RpcMethodHandler:
        """ExecSync: forwarded as bytes; into a pod podshim is checkpointing, only once the
        checkpoint has ended (Engine.wait_checkpointed): a probe survives the freeze."""
        forward = self.passthrough.unary(SERVICE + "ExecSync")

        async def exec_sync(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            engine = self.engine
            if engine is not None and engine.checkpointing:
                try:
                    cid = cri.ExecSyncRequest.FromString(request).container_id
                except DecodeError:
                    cid = ""  # the upstream answers a malformed request itself
                if cid:
                    await engine.wait_checkpointed(cid, context.time_remaining())
            return await forward(request, context)

        return grpc.unary_unary_rpc_method_handler(exec_sync)

    def checkpoint_container(self) -> grpc.RpcMethodHandler:
        """CheckpointContainer: the upstream's when it has one (forwarded first, as bytes);
        podshim's own when it answers UNIMPLEMENTED (containerd 1.6), or always by config."""
        method = SERVICE + "CheckpointContainer"
        own = self._engine_call("CheckpointContainer")

        async def call(
            req: cri.CheckpointContainerRequest, context: grpc.aio.ServicerContext
        ) -> cri.CheckpointContainerResponse:
            if self.engine is None or self.engine.container_checkpoint_mode != "always":
                try:
                    raw = await self.passthrough.call_unary(method, req.SerializeToString(), context)
                    return cri.CheckpointContainerResponse.FromString(raw)
                except grpc.aio.AioRpcError as err:
                    if self.engine is None or err.code() != grpc.StatusCode.UNIMPLEMENTED:
                        await self.passthrough.abort_with(context, err)
                        raise
            return await own(req, context)  # type: ignore[return-value]

        return typed_handler(
            "CheckpointContainer", call, cri.CheckpointContainerRequest, cri.CheckpointContainerResponse
        )

    def cleanup_after(self, method: str, container_id: Callable[[bytes], str]) -> grpc.RpcMethodHandler:
        """RemoveContainer/RemovePodSandbox: forwarded; once the upstream removed it, podshim drops
        the checkpoint imports nobody uses any more (a failure there is logged, never returned)."""
        forward = self.passthrough.unary(SERVICE + method)

        async def remove(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            response = await forward(request, context)
            if self.cluster is not None and method == "RemovePodSandbox":
                self.cluster.restores.forget(cri.RemovePodSandboxRequest.FromString(request).pod_sandbox_id)
            if self.engine is not None:
                try:
                    await self.engine.forget_container(container_id(request))
                except Exception:  # noqa: BLE001 - the removal succeeded; the leftover is swept later
                    log.exception("removing checkpoint imports failed", method=method)
            return response

        return grpc.unary_unary_rpc_method_handler(remove)

    def _engine_call(self, name: str) -> Handler:
        async def call(request: Message, context: grpc.aio.ServicerContext) -> Message:
            if self.engine is None:
                raise errors.Unimplemented(f"podshim: {name} is not implemented yet")
            fn = getattr(self.engine, _snake(name))
            # the engine sees the caller's deadline (seconds left, None: none set), never gRPC
            return await fn(request, context.time_remaining())

        return call

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        own = {
            SERVICE + "Version": typed_handler(
                "Version", self.version, cri.VersionRequest, cri.VersionResponse
            ),
            SERVICE + "StopPodSandbox": self.idempotent_stop("StopPodSandbox"),
            SERVICE + "StopContainer": self.idempotent_stop("StopContainer"),
            SERVICE + "CreateContainer": self.guarded_create(),
            SERVICE + "RunPodSandbox": self.guarded_run_sandbox(),
            SERVICE + "StartContainer": self.start_container(),
            SERVICE + "ExecSync": self.exec_sync(),
            SERVICE + "CheckpointContainer": self.checkpoint_container(),
            SERVICE + "RemoveContainer": self.cleanup_after(
                "RemoveContainer", lambda raw: cri.RemoveContainerRequest.FromString(raw).container_id
            ),
            SERVICE + "RemovePodSandbox": self.cleanup_after("RemovePodSandbox", lambda _raw: ""),
        }
        for name in ("CheckpointPod", "RestorePod"):
            req_cls = getattr(cri, f"{name}Request")
            resp_cls = getattr(cri, f"{name}Response")
            own[SERVICE + name] = typed_handler(name, self._engine_call(name), req_cls, resp_cls)
        return own


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
