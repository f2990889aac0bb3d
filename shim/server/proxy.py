"""Byte-level passthrough of CRI calls to the upstream runtime.

Requests and responses are forwarded as raw bytes (never decoded and re-encoded), with the
caller's metadata and deadline (less a margin, `forwarded_timeout`); the upstream's status code,
message and metadata come back unchanged. Only a transport failure (upstream not running) gets
podshim's own message.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from shim import metrics
from shim.deadlines import PASSTHROUGH_DEADLINE_MARGIN
from shim.upstream.client import Upstream, is_transport_failure, unavailable_message

CRI_SERVICES = ("/runtime.v1.RuntimeService/", "/runtime.v1.ImageService/")
# Metadata that belongs to the hop, not to the call.
_HOP_KEYS = ("user-agent",)

UnaryBehaviour = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


def forwarded_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str | bytes], ...] | None:
    md = context.invocation_metadata()
    if not md:
        return None
    kept = tuple((k, v) for k, v in md if k not in _HOP_KEYS and not k.startswith((":", "grpc-")))
    return kept or None


def forwarded_timeout(context: grpc.aio.ServicerContext) -> float | None:
    """The caller's remaining time less PASSTHROUGH_DEADLINE_MARGIN: the upstream's
    DEADLINE_EXCEEDED then reaches the caller before this server's own deadline resets the stream."""
    remaining = context.time_remaining()
    return None if remaining is None else max(remaining - PASSTHROUGH_DEADLINE_MARGIN, 0.0)


def short_name(method: str) -> str:
    return method.rsplit("/", 1)[-1]


class Passthrough:
    """Forwards one CRI method to the upstream."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def call_unary(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Forward and return the upstream's response; raises AioRpcError (not aborted) on failure."""
        call = self.upstream.raw_unary(method)(
            request, timeout=forwarded_timeout(context), metadata=forwarded_metadata(context)
        )
        response = await call
        trailing = await call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(tuple(trailing))
        return response

    async def abort_with(
        self,
        context: grpc.aio.ServicerContext,
        err: grpc.aio.AioRpcError,
        code: grpc.StatusCode | None = None,
    ) -> None:
        details = err.details() or ""
        if is_transport_failure(err):
            details = unavailable_message(self.upstream.endpoint, err)
        await context.abort(code or err.code(), details, tuple(err.trailing_metadata() or ()))

    def unary(
        self,
        method: str,
        recover: Callable[[grpc.aio.AioRpcError], bytes | None] | None = None,
        code_for: Callable[[grpc.aio.AioRpcError], grpc.StatusCode | None] | None = None,
    ) -> UnaryBehaviour:
        """The forwarding behaviour of `method`. `recover` may turn an upstream error into a
        response (used to correct a known upstream deviation from the CRI); `code_for` may give
        an upstream error podshim's documented code instead of the upstream's (same message)."""
        name = short_name(method)
        requests = metrics.proxy_requests
        latency = metrics.proxy_latency.labels(name)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            start = time.perf_counter()
            code = "OK"
            try:
                return await self.call_unary(method, request, context)
            except grpc.aio.AioRpcError as err:
                recovered = recover(err) if recover else None
                if recovered is not None:
                    return recovered
                own = code_for(err) if code_for else None
                code = (own or err.code()).name
                await self.abort_with(context, err, own)
                raise  # not reached: abort raises
            finally:
                latency.observe(time.perf_counter() - start)
                requests.labels(name, code).inc()

        return forward

    def stream(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        name = short_name(method)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = self.upstream.raw_stream(method)(
                request, timeout=forwarded_timeout(context), metadata=forwarded_metadata(context)
            )
            code = "OK"
            try:
                async for message in call:
                    yield message
            except grpc.aio.AioRpcError as err:
                code = err.code().name
                await self.abort_with(context, err)
            finally:
                call.cancel()  # the caller went away: stop the upstream stream too
                metrics.proxy_requests.labels(name, code).inc()

        return forward


class CriHandler(grpc.GenericRpcHandler):
    """Routes every CRI method: podshim's own handlers first, the passthrough for the rest.

    Methods unknown to podshim's proto are still forwarded (as unary), so a newer client keeps
    working against a newer upstream.
    """

    def __init__(
        self,
        passthrough: Passthrough,
        own: dict[str, grpc.RpcMethodHandler],
        streaming: frozenset[str],
    ) -> None:
        self._passthrough = passthrough
        self._own = own
        self._streaming = streaming
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        handler = self._cache.get(method)
        if handler is not None:
            return handler
        if method in self._own:
            handler = self._own[method]
        elif not method.startswith(CRI_SERVICES):
            return None
        elif method in self._streaming:
            handler = grpc.unary_stream_rpc_method_handler(self._passthrough.stream(method))
        else:
            handler = grpc.unary_unary_rpc_method_handler(self._passthrough.unary(method))
        self._cache[method] = handler
        return handler
