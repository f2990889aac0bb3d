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
from collections.abc import Callable

ENV = "PODSHIM_FAILPOINTS"


def parse(spec: str) -> dict[str, str]:
    """`name=action,...` -> {name: action}."""
    points = {}
    for item in spec.split(","):
        name, sep, action = item.strip().partition("=")
        if name and sep:
            points[name] = action
    return points


def _kill_self(name: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _internal(name: str) -> Exception:
    from shim.errors import Internal

    return Internal(f"failpoint {name} triggered (PODSHIM_FAILPOINTS)")


class Failpoints:
    """The failpoints armed by one `spec`, their hits counted. `kill(name)` and `error(name)` (the
    exception to raise) act for `kill` and `error`: by default this process is SIGKILLed, Internal
    is raised. podshim's restore broker arms podshim-runc's own with a kill of podshim-runc
    (shim/wrapper/broker.py)."""

    def __init__(
        self,
        spec: str,
        kill: Callable[[str], None] = _kill_self,
        error: Callable[[str], Exception] = _internal,
    ) -> None:
        self.points = parse(spec)
        self.hits: dict[str, int] = {}
        self.kill = kill
        self.error = error

    def hit(self, name: str) -> None:
        """Act on failpoint `name` if it is armed (a dict lookup otherwise)."""
        if not self.points:
            return
        action = self.points.get(name)
        if action is None:
            return
        action, at, nth = action.partition("@")
        if at:
            self.hits[name] = self.hits.get(name, 0) + 1
            if self.hits[name] != int(nth):
                return
        if action == "kill":
            self.kill(name)
        elif action == "error":
            raise self.error(name)
        elif action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))


_PROCESS = Failpoints(os.environ.get(ENV, ""))  # this process's, from its environment


def hit(name: str) -> None:
    """Act on this process's failpoint `name` if it is armed (a dict lookup otherwise)."""
    _PROCESS.hit(name)
