"""A CRI client's seam to gRPC, for the commands that call a runtime (the CLI, `podshim doctor`):
the channel to a runtime's CRI socket, its stub, the error a failed call raises and how it reads.
The daemon's own client of the upstream is shim/upstream/ (asyncio).

grpc and the generated CRI modules load inside the functions that make a call, never at import:
a command's `--help` and its parser stay free of them (tests/test_cli_startup.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    import grpc

    from api.runtime.v1.api_pb2_grpc import RuntimeServiceStub as RuntimeStub

MAX_MESSAGE = 16 << 20

if TYPE_CHECKING:
    RpcError = grpc.RpcError  # what a failed call raises
else:

    def __getattr__(name: str) -> Any:
        # read when an exception reaches `except rpc_client.RpcError`, after a call: grpc is loaded
        if name == "RpcError":
            import grpc

            return grpc.RpcError
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_rpc_error(err: BaseException) -> TypeGuard[grpc.RpcError]:
    """Whether `err` is a RpcError, without loading grpc to find out."""
    if "grpc" not in sys.modules:
        return False  # grpc never loaded: no call was made, so no call failed
    import grpc

    return isinstance(err, grpc.RpcError)


def grpc_target(ep: str) -> str:
    """crictl accepts unix:///path, unix:/path, a bare /path and tcp://host:port."""
    if ep.startswith("unix:"):
        return ep
    if ep.startswith("/"):
        return f"unix://{ep}"
    if ep.startswith("tcp://"):
        return ep.removeprefix("tcp://")
    return ep


def preload() -> None:
    """Load grpc and the CRI modules now, making no channel (the CLI's warm helper, before it
    forks the children that call)."""
    import grpc  # noqa: F401

    from api.runtime.v1 import api_pb2_grpc  # noqa: F401


def runtime_stub(ep: str) -> RuntimeStub:
    """A RuntimeService stub on a channel to endpoint `ep` (crictl's forms, see grpc_target)."""
    import grpc

    from api.runtime.v1 import api_pb2_grpc

    channel = grpc.insecure_channel(
        grpc_target(ep),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ],
    )
    return api_pb2_grpc.RuntimeServiceStub(channel)


def rpc_error_message(err: grpc.RpcError, ep: str, unreachable: str = "", deadline: str = "") -> str:
    """`CODE: details` of a failed call, the common cases said plainly. `unreachable` and
    `deadline`: what the caller's user can do about a runtime not reached or a deadline run out
    (the CLI names its flags; the doctor says what to start after the message)."""
    import grpc

    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if name == "UNAVAILABLE" and "failed to connect" in details:
        hint = f" ({unreachable})" if unreachable else ""
        details = f"cannot reach the runtime at {ep}{hint}: {details}"
    elif name == "DEADLINE_EXCEEDED" and "Deadline Exceeded" in details and deadline:
        details = f"{details} ({deadline})"
    elif name == "UNIMPLEMENTED" and details in ("", "Method not found!", "unknown service"):
        details = f"the runtime at {ep} does not implement this call ({details or 'no details'})"
    return f"{name}: {details}"
