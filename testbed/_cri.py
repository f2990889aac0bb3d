"""CRI plumbing for the test bed: socket targets, a short-lived client, and a raw encoder.

`CriClient` is what the bed uses to wait for a runtime and tear pods down (a fresh channel per
use, so a runtime that is still starting never leaves it in reconnect backoff). `field_bytes` /
`field_str` encode a request by hand for the tests that must send what the generated stubs
refuse to build (strings that are not valid UTF-8).
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc


def target(socket: str | os.PathLike[str]) -> str:
    """The gRPC target of a unix socket path (or pass ``unix://...`` through)."""
    s = os.fspath(socket)
    return s if s.startswith("unix:") else "unix://" + str(Path(s).resolve())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_bytes(number: int, data: bytes) -> bytes:
    """A length-delimited field (string, bytes or embedded message), encoded by hand."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def field_str(number: int, value: str) -> bytes:
    return field_bytes(number, value.encode())


class CriClient:
    """Typed CRI calls on a channel of its own; use as a context manager."""

    def __init__(self, socket: str | os.PathLike[str]) -> None:
        self.channel = grpc.insecure_channel(target(socket))
        self.runtime = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.image = api_pb2_grpc.ImageServiceStub(self.channel)

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def image_present(self, image: str, timeout: float = 10.0) -> bool:
        resp = self.image.ImageStatus(
            cri.ImageStatusRequest(image=cri.ImageSpec(image=image)), timeout=timeout
        )
        return resp.HasField("image")
