"""How a failed call reads: the client's message, which the doctor shows, names no flag of the
CLI's; the CLI's own adds what its flags do about it."""

from __future__ import annotations

import grpc

from shim import rpc_client
from shim.cli import transport


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


EP = "unix:///run/podshim/podshim.sock"


def test_an_unreachable_runtime() -> None:
    err = Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    assert rpc_client.rpc_error_message(err, EP) == (
        f"UNAVAILABLE: cannot reach the runtime at {EP}: failed to connect to all addresses"
    )
    assert transport.rpc_error_message(err, EP) == (
        f"UNAVAILABLE: cannot reach the runtime at {EP} (is podshim running? see -r): "
        "failed to connect to all addresses"
    )


def test_a_deadline_and_a_call_not_implemented() -> None:
    late = Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert rpc_client.rpc_error_message(late, EP) == "DEADLINE_EXCEEDED: Deadline Exceeded"
    assert transport.rpc_error_message(late, EP) == (
        "DEADLINE_EXCEEDED: Deadline Exceeded (raise --timeout for long operations)"
    )
    missing = Failed(grpc.StatusCode.UNIMPLEMENTED, "unknown service")
    want = f"UNIMPLEMENTED: the runtime at {EP} does not implement this call (unknown service)"
    assert rpc_client.rpc_error_message(missing, EP) == transport.rpc_error_message(missing, EP) == want
