"""The few CRI calls the test bed itself needs, encoded by hand.

The bed must be able to wait for a runtime and tear pods down even when the generated stubs
(``api.runtime.v1``) are missing or broken, so it speaks the protobuf wire format directly for
these messages.  Only string, bool and nested-message fields are handled.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGES = "/runtime.v1.ImageService/"


def target(socket: str | os.PathLike[str]) -> str:
    """The gRPC target of a unix socket path (or pass ``unix://...`` through)."""
    s = os.fspath(socket)
    return s if s.startswith("unix:") else "unix://" + str(Path(s).resolve())


# ---------------------------------------------------------------------------- wire format


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
    """A length-delimited field (string, bytes or embedded message)."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def field_str(number: int, value: str) -> bytes:
    return field_bytes(number, value.encode())


def field_bool(number: int, value: bool) -> bytes:
    return _varint(number << 3) + _varint(int(value)) if value else b""


def parse(data: bytes) -> list[tuple[int, int | bytes]]:
    """Decode one message level into (field number, value) pairs (varints as int)."""
    out: list[tuple[int, int | bytes]] = []
    i = 0

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            b = data[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 2:
            n = varint()
            out.append((number, data[i : i + n]))
            i += n
        elif wire == 1:
            out.append((number, data[i : i + 8]))
            i += 8
        elif wire == 5:
            out.append((number, data[i : i + 4]))
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def strings(data: bytes, number: int) -> list[str]:
    return [v.decode() for n, v in parse(data) if n == number and isinstance(v, bytes)]


def messages(data: bytes, number: int) -> list[bytes]:
    return [v for n, v in parse(data) if n == number and isinstance(v, bytes)]


# ---------------------------------------------------------------------------- calls


class RawCRI:
    """Raw unary CRI calls over one channel."""

    def __init__(self, socket: str | os.PathLike[str]) -> None:
        self.channel = grpc.insecure_channel(target(socket))

    def close(self) -> None:
        self.channel.close()

    def call(self, method: str, request: bytes, timeout: float = 10.0) -> bytes:
        fn = self.channel.unary_unary(method)  # no (de)serializers: bytes in, bytes out
        return fn(request, timeout=timeout)

    def version(self, timeout: float = 2.0) -> dict[str, str]:
        """VersionResponse as a dict (version, runtime_name, runtime_version, runtime_api_version)."""
        resp = self.call(RUNTIME + "Version", b"", timeout)
        names = {1: "version", 2: "runtime_name", 3: "runtime_version", 4: "runtime_api_version"}
        return {names[n]: v.decode() for n, v in parse(resp) if n in names and isinstance(v, bytes)}

    def list_pod_ids(self, timeout: float = 10.0) -> list[str]:
        resp = self.call(RUNTIME + "ListPodSandbox", b"", timeout)
        return [s for item in messages(resp, 1) for s in strings(item, 1)[:1]]

    def stop_pod(self, pod_id: str, timeout: float = 60.0) -> None:
        self.call(RUNTIME + "StopPodSandbox", field_str(1, pod_id), timeout)

    def remove_pod(self, pod_id: str, timeout: float = 60.0) -> None:
        self.call(RUNTIME + "RemovePodSandbox", field_str(1, pod_id), timeout)

    def image_present(self, image: str, timeout: float = 10.0) -> bool:
        req = field_bytes(1, field_str(1, image))
        resp = self.call(IMAGES + "ImageStatus", req, timeout)
        return bool(messages(resp, 1))
