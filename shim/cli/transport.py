"""The CLI's one seam to gRPC beyond the client's (shim/rpc_client.py: channel, stub, call
errors): a call's error in the CLI's words, and a unary call with a progress line. No other module
of the CLI imports grpc (tests/test_contract.py).

grpc, protobuf and the generated CRI modules load inside the functions that make a call, never at
import: `podshim --help` and the parser stay free of them (tests/test_cli_startup.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shim import rpc_client
from shim.cli import output
from shim.rpc_client import grpc_target as grpc_target  # re-exported: the CLI's commands use them here
from shim.rpc_client import is_rpc_error as is_rpc_error
from shim.rpc_client import runtime_stub as runtime_stub

if TYPE_CHECKING:
    import grpc
    from google.protobuf.message import Message

    from shim.rpc_client import RpcError as RpcError
    from shim.rpc_client import RuntimeStub as RuntimeStub
else:

    def __getattr__(name: str) -> Any:
        # rpc_client's, grpc loaded when read: after a call
        if name == "RpcError":
            return rpc_client.RpcError
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def rpc_error_message(err: grpc.RpcError, ep: str) -> str:
    """rpc_client.rpc_error_message with what the CLI's flags do about it."""
    return rpc_client.rpc_error_message(
        err, ep, unreachable="is podshim running? see -r", deadline="raise --timeout for long operations"
    )


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
