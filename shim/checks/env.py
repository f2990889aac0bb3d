"""Environment values as the upstream stores them, for RestorePod's env check (docs/design/restore-pod.md
(RestorePod) step 1).

The released CRI API types KeyValue.value `bytes`: a value need not be UTF-8 (`BIN=\\xff`). containerd
1.6 keeps a container's config as JSON text, where Go's encoding/json turns every byte that is not
part of a valid UTF-8 sequence into U+FFFD, one each; config.dump records that text. A request
compared byte for byte with it would never match its own checkpoint, so both sides are compared in
that stored form: what the upstream cannot tell apart is the same environment, anything else still
differs.
"""

from __future__ import annotations

from collections.abc import Iterable

from api.runtime.v1 import api_pb2 as cri

REPLACEMENT = "\ufffd"


def as_stored(value: bytes) -> bytes:
    """`value` with each byte outside a valid UTF-8 sequence replaced by U+FFFD, as Go's
    encoding/json writes it (utf8.DecodeRune's width-1 errors: a truncated sequence is one U+FFFD
    per byte, not one for the whole as Python's "replace" gives)."""
    out: list[str] = []
    rest = value
    while rest:
        try:
            out.append(rest.decode("utf-8"))
            break
        except UnicodeDecodeError as e:
            out.append(rest[: e.start].decode("utf-8"))
            out.append(REPLACEMENT)
            rest = rest[e.start + 1 :]  # one byte, then decoding resumes as Go's does
    return "".join(out).encode("utf-8")


def stored_envs(envs: Iterable[cri.KeyValue]) -> list[tuple[str, bytes]]:
    """A config's environment as (key, value as stored), in order."""
    return [(e.key, as_stored(e.value)) for e in envs]


def by_key(envs: Iterable[tuple[str, bytes]]) -> dict[str, list[bytes]]:
    """Each key's values in order: the environment compared without the order of its keys."""
    out: dict[str, list[bytes]] = {}
    for key, value in envs:
        out.setdefault(key, []).append(value)
    return out
