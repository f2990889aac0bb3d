"""The CLI's one seam to gRPC: the channel to the runtime's CRI socket, its stub, the error a
failed call raises and how it reads, and a unary call with a progress line. No other module of the
CLI imports grpc (tests/test_contract.py).

grpc, protobuf and the generated CRI modules load inside the functions that make a call, never at
import: `podshim --help` and the parser stay free of them (tests/test_cli_startup.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

from shim.cli import output

if TYPE_CHECKING:
    import grpc
    from google.protobuf.message import Message

    from api.runtime.v1.api_pb2_grpc import RuntimeServiceStub as RuntimeStub

MAX_MESSAGE = 16 << 20

if TYPE_CHECKING:
    RpcError = grpc.RpcError  # what a failed call raises (base.guarded turns it into exit code 1)
else:

    def __getattr__(name: str) -> Any:
        # read when an exception reaches `except transport.RpcError`, after a call: grpc is loaded then
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


def rpc_error_message(err: grpc.RpcError, ep: str) -> str:
    import grpc

    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if name == "UNAVAILABLE" and "failed to connect" in details:
        details = f"cannot reach the runtime at {ep} (is podshim running? see -r): {details}"
    elif name == "DEADLINE_EXCEEDED" and "Deadline Exceeded" in details:
        details = f"{details} (raise --timeout for long operations)"
    elif name == "UNIMPLEMENTED" and details in ("", "Method not found!", "unknown service"):
        details = f"the runtime at {ep} does not implement this call ({details or 'no details'})"
    return f"{name}: {details}"


def long_call(method: Any, request: Message, timeout: float, progress: output.Progress) -> Any:
    """Run a unary call, refreshing `progress` about 4 times a second until it ends.
    Ctrl-C cancels the call (the runtime then cleans up, as on a deadline)."""
    import grpc

    future = method.future(request, timeout=timeout)
    try:
        while True:
            try:
                return future.result(timeout=output.Progress.INTERVAL)
            except grpc.FutureTimeoutError:
                progress.update()
    except KeyboardInterrupt:
        future.cancel()
        raise
    finally:
        progress.clear()
