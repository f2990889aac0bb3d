"""What the two nodes of a migration say to each other: JSON control messages with a type `t`
(offer, accept, refuse, file, archived, created, ready, go, running, done, ack, abort, ping), the
BYTES frames of the archive's files, and the channel that carries them
(docs/design/migration.md (Live migration))."""

from __future__ import annotations

import dataclasses
from typing import Any

from shim import errors
from shim.archive import compat
from shim.archive.manifest import HostInfo

VERSION = 1
OFFER, ACCEPT, REFUSE = "offer", "accept", "refuse"
FILE, ARCHIVED = "file", "archived"
CREATED, READY, GO, RUNNING = "created", "ready", "go", "running"
DONE, ACK, ABORT, PING = "done", "ack", "abort", "ping"
CONTROL, PAGES = "control", "pages"  # the greeting of a connection


def offer(
    migration: str, pod: dict[str, Any], containers: list[dict[str, Any]], host: HostInfo
) -> dict[str, Any]:
    """`containers`: [{name, image, image_ref, checkpointed}] in checkpoint order."""
    return {
        "t": OFFER,
        "version": VERSION,
        "migration": migration,
        "pod": pod,
        "containers": containers,
        "host": dataclasses.asdict(host),
    }


def host_of(msg: dict[str, Any]) -> HostInfo:
    """The source's host facts in an offer (unknown keys ignored, missing ones not compared)."""
    known = {f.name for f in dataclasses.fields(HostInfo)}
    raw = msg.get("host") or {}
    return HostInfo(**{k: str(v) for k, v in raw.items() if k in known and isinstance(v, str | int)})


def refusal(problems: list[str]) -> str:
    """One line for every mismatch, as compat.refuse words them."""
    try:
        compat.refuse(problems)
    except errors.FailedPrecondition as e:
        return e.message
    return ""
