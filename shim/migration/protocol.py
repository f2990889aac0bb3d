"""What the two nodes of a migration say to each other (docs/design/migration.md (Live migration)).

Control messages are JSON objects with a type `t`, source → destination (S→D) or back (D→S):

  S→D offer       the pod, its containers (name, image, image_ref) and the source's host facts
  D→S accept      the destination can restore it (the compatibility pre-check passed)
  D→S refuse      it cannot: `reason` (the source answers FAILED_PRECONDITION, nothing was frozen)
  S→D file        an archive member follows: `rel`, `size`, then BYTES frames with its content
  S→D archived    every member was sent (manifest.json last); the page connections follow
  D→S created     the new sandbox and containers exist (the pages are not needed yet)
  D→S ready       asks leave to start the containers
  S→D go          granted: from here on the source never thaws without first fencing the destination
  D→S running     the containers were started
  D→S done        every page arrived: the source may stop and remove its pod
  S→D ack         the source's pod is stopped: the migration is complete
  both  abort     the sender gives up: `reason`
  both  ping      a heartbeat (not delivered: it refreshes the channel's last_received)
"""

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
