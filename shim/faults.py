"""Failpoints for the fault-injection suite (tests/faults).

Inactive unless PODSHIM_FAILPOINTS is set, e.g.
`PODSHIM_FAILPOINTS=checkpoint.after-freeze=kill,restore.after-sandbox=error`.
Actions: `kill` (SIGKILL this process: a crash), `error` (raise Internal), `sleep:<seconds>`;
`<action>@<n>` acts on the n-th hit only (e.g. `write-file.manifest.json=kill@2`: during the
second write of a manifest).
"""

from __future__ import annotations

import os
import signal
import time

ENV = "PODSHIM_FAILPOINTS"


def parse(spec: str) -> dict[str, str]:
    """`name=action,...` -> {name: action}."""
    points = {}
    for item in spec.split(","):
        name, sep, action = item.strip().partition("=")
        if name and sep:
            points[name] = action
    return points


_POINTS = parse(os.environ.get(ENV, ""))
_HITS: dict[str, int] = {}


def hit(name: str) -> None:
    """Act on failpoint `name` if it is armed (a dict lookup otherwise)."""
    if not _POINTS:
        return
    action = _POINTS.get(name)
    if action is None:
        return
    action, at, nth = action.partition("@")
    if at:
        _HITS[name] = _HITS.get(name, 0) + 1
        if _HITS[name] != int(nth):
            return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "error":
        from shim.errors import Internal

        raise Internal(f"failpoint {name} triggered (PODSHIM_FAILPOINTS)")
    elif action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
