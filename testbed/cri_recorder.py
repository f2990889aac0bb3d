"""A recording CRI relay for the tests: what a real client (the kubelet) sends, call by call.

    with CriRecorder(listen=path, upstream=podshim_socket) as rec:
        ...  # point the client at `path`
        rec.calls["CreateContainer"][0]   # the first request, as protobuf JSON (a dict)
        rec.counts                        # calls per method, with the codes they got

Every call is forwarded as raw bytes (unary and server-streaming, metadata and deadline kept)
and answered with the upstream's bytes or status; the first ``keep`` requests of each method are
decoded with the CRI stubs and kept. It runs in the test process (a thread pool gRPC server).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from api.runtime.v1 import api_pb2 as cri
from testbed._cri import target


def _request_classes() -> dict[str, tuple[type[Message], bool]]:
    """'/runtime.v1.RuntimeService/Version' -> (VersionRequest, server_streaming)."""
    out = {}
    for service in cri.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            out[f"/{service.full_name}/{m.name}"] = (getattr(cri, m.input_type.name), m.server_streaming)
    return out


class CriRecorder(grpc.GenericRpcHandler):
    __test__ = False

    def __init__(
        self, listen: str | os.PathLike[str], upstream: str | os.PathLike[str], keep: int = 3
    ) -> None:
        self.listen = Path(listen)
        self.upstream = grpc.insecure_channel(target(upstream))
        self.keep = keep
        self.calls: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self._classes = _request_classes()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        self._server.add_generic_rpc_handlers((self,))

    def __enter__(self) -> CriRecorder:
        self.listen.unlink(missing_ok=True)
        self._server.add_insecure_port(target(self.listen))
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=1).wait(5)
        self.upstream.close()
        self.listen.unlink(missing_ok=True)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        cls, streaming = self._classes.get(method, (None, False))
        short = method.rsplit("/", 1)[-1]

        def record(request: bytes) -> None:
            with self._lock:
                if cls is not None and len(self.calls[short]) < self.keep:
                    try:
                        msg = cls.FromString(request)
                        self.calls[short].append(json_format.MessageToDict(msg))
                    except Exception as e:  # noqa: BLE001 - record what could not be decoded
                        self.calls[short].append({"undecodable": str(e)})

        def count(code: grpc.StatusCode) -> None:
            with self._lock:
                self.counts[(short, code.name)] += 1

        def metadata(context: grpc.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
            return tuple((k, v) for k, v in context.invocation_metadata() if not k.startswith(":"))

        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            record(request)
            call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.upstream.unary_unary(method)
            try:
                resp: bytes = call(request, timeout=context.time_remaining(), metadata=metadata(context))
            except grpc.RpcError as e:
                count(e.code())
                context.abort(e.code(), e.details() or "")
            count(grpc.StatusCode.OK)
            return resp

        def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            record(request)
            call: grpc.UnaryStreamMultiCallable[bytes, bytes] = self.upstream.unary_stream(method)
            try:
                yield from call(request, timeout=context.time_remaining(), metadata=metadata(context))
            except grpc.RpcError as e:
                count(e.code())
                context.abort(e.code(), e.details() or "")
            count(grpc.StatusCode.OK)

        if streaming:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)
