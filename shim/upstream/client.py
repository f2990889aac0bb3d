"""One gRPC channel to the upstream runtime, shared by the byte-level proxy and podshim's own calls."""

from __future__ import annotations

import grpc

from api.runtime.v1 import api_pb2_grpc
from shim.upstream.calls import CriCalls
from shim.upstream.errors import is_transport_failure as is_transport_failure
from shim.upstream.errors import unavailable_message as unavailable_message
from shim.upstream.errors import upstream_error as upstream_error

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


class Upstream(CriCalls):
    """The upstream endpoint: raw multicallables for the proxy, the typed calls (CriCalls) for
    podshim's own work."""

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
