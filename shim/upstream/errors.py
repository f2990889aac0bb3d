"""gRPC errors of the upstream turned into podshim's typed errors, in one place."""

from __future__ import annotations

import grpc

from shim import errors

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


def upstream_error(endpoint: str, err: grpc.aio.AioRpcError, doing: str) -> errors.ShimError:
    """Turn an upstream failure met during podshim's own work into a typed error that says so."""
    if is_transport_failure(err):
        e: errors.ShimError = errors.Unavailable(unavailable_message(endpoint, err))
        e.transport = True
    else:
        cls = {
            grpc.StatusCode.NOT_FOUND: errors.NotFound,
            grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
            grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
            grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
            grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
            grpc.StatusCode.ABORTED: errors.Aborted,
        }.get(err.code(), errors.Internal)
        e = cls(f"{doing}: upstream runtime answered {err.code().name}: {err.details()}")
    e.upstream_code, e.upstream_details = err.code().name, err.details() or ""
    return e
