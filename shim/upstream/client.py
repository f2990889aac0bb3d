"""One gRPC channel to the upstream runtime, shared by the byte-level proxy and podshim's own calls."""

from __future__ import annotations

import grpc

from api.runtime.v1 import api_pb2_grpc
from shim import errors

MAX_MESSAGE = 16 * 1024 * 1024  # the kubelet's own CRI limit

# Reconnect quickly after the upstream restarts: gRPC's default backoff grows to 120 s, during
# which every call would fail with UNAVAILABLE although the upstream is back.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]

# Markers of a transport failure (the upstream is not there), as opposed to an UNAVAILABLE
# status that the upstream itself returned.
_TRANSPORT_MARKERS = (
    "failed to connect",
    "connection refused",
    "no such file",
    "socket closed",
    "connect failed",
    "broken pipe",
    "connection reset",
)


def is_transport_failure(err: grpc.aio.AioRpcError) -> bool:
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    text = f"{err.details()} {err.debug_error_string()}".lower()
    return any(m in text for m in _TRANSPORT_MARKERS)


def unavailable_message(endpoint: str, err: grpc.aio.AioRpcError) -> str:
    return (
        f"podshim: upstream runtime at {endpoint} is unavailable ({err.details()}); "
        "check that it is running — podshim reconnects by itself when it is back"
    )


class Upstream:
    """The upstream endpoint: raw multicallables for the proxy and typed stubs for the engine."""

    def __init__(self, endpoint: str, timeout: float = 120.0) -> None:
        self.endpoint = endpoint
        # `[upstream] timeout_seconds`: the limit of each call podshim makes on its own (passed-
        # through calls carry their caller's deadline instead)
        self.timeout = timeout
        self.channel = grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        self.runtime = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.image = api_pb2_grpc.ImageServiceStub(self.channel)
        self._unary: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._stream: dict[str, grpc.aio.UnaryStreamMultiCallable] = {}

    def raw_unary(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        """A bytes-in, bytes-out callable for `method` (no re-encoding)."""
        mc = self._unary.get(method)
        if mc is None:
            mc = self._unary[method] = self.channel.unary_unary(method)
        return mc

    def raw_stream(self, method: str) -> grpc.aio.UnaryStreamMultiCallable:
        mc = self._stream.get(method)
        if mc is None:
            mc = self._stream[method] = self.channel.unary_stream(method)
        return mc

    async def close(self) -> None:
        await self.channel.close()


def upstream_error(endpoint: str, err: grpc.aio.AioRpcError, doing: str) -> errors.ShimError:
    """Turn an upstream failure met during podshim's own work into a typed error that says so."""
    if is_transport_failure(err):
        return errors.Unavailable(unavailable_message(endpoint, err))
    cls = {
        grpc.StatusCode.NOT_FOUND: errors.NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
        grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
        grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
        grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
        grpc.StatusCode.ABORTED: errors.Aborted,
    }.get(err.code(), errors.Internal)
    return cls(f"{doing}: upstream runtime answered {err.code().name}: {err.details()}")
