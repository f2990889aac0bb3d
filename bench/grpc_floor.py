"""The smallest Python gRPC passthrough: the floor any Python CRI proxy stands on (bench/proxy).

`python -m bench.grpc_floor LISTEN UPSTREAM` serves every unary method on the unix socket LISTEN
by forwarding the request bytes to UPSTREAM and returning the response bytes: no routing, no
metadata or deadline handling, no metrics, no logs. bench/proxy measures it beside podshim, in
the same run, so podshim's own overhead is told apart from the cost of grpcio on this machine.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, upstream: grpc.aio.Channel) -> None:
        self.upstream = upstream

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self.upstream.unary_unary(details.method)

        async def forward(request: bytes, context: Any) -> bytes:
            return await call(request)

        return grpc.unary_unary_rpc_method_handler(forward)


async def serve(listen: str, upstream: str) -> None:
    channel = grpc.aio.insecure_channel(f"unix://{upstream}")
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_Forward(channel),))
    server.add_insecure_port(f"unix://{listen}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))
