"""Failpoints for the fault-injection suite (tests/faults).

Inactive unless PODSHIM_FAILPOINTS is set, e.g.
`PODSHIM_FAILPOINTS=checkpoint.after-freeze=kill,restore.after-sandbox=error`.
Actions: `kill` (SIGKILL this process: a crash), `error` (raise Internal), `sleep:<seconds>`,
`wait:<path>` (until `path` exists: a test's step done at that instant, whatever the machine's
speed); `<action>@<n>` acts on the n-th hit only (e.g. `write-file.manifest.json=kill@2`: during the
second write of a manifest). A failpoint on the event loop is `await hit_async(name)`: its sleep
leaves the loop and the deadlines running (a caller's deadline cancels it), as a slow step would.
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
    (shim/ops/restore_broker.py)."""

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
        pause = self._act(name)
        if isinstance(pause, str):
            while not os.path.exists(pause):
                time.sleep(0.01)
        elif pause:
            time.sleep(pause)

    async def hit_async(self, name: str) -> None:
        """hit() on the event loop: a `sleep` or `wait` awaits, so it can be cancelled."""
        pause = self._act(name)
        if pause:
            import asyncio  # here: podshim-runc's hook imports this module and no asyncio

            if isinstance(pause, str):
                while not os.path.exists(pause):
                    await asyncio.sleep(0.01)
            else:
                await asyncio.sleep(pause)

    def _act(self, name: str) -> float | str:
        """Kill or raise if `name` is armed so; the seconds it is to sleep (0: none), or the path
        whose creation it is to wait for."""
        if not self.points:
            return 0.0
        action = self.points.get(name)
        if action is None:
            return 0.0
        action, at, nth = action.partition("@")
        if at:
            self.hits[name] = self.hits.get(name, 0) + 1
            if self.hits[name] != int(nth):
                return 0.0
        if action == "kill":
            self.kill(name)
        elif action == "error":
            raise self.error(name)
        elif action.startswith("sleep:"):
            return float(action.split(":", 1)[1])
        elif action.startswith("wait:"):
            return action.split(":", 1)[1]
        return 0.0


_PROCESS = Failpoints(os.environ.get(ENV, ""))  # this process's, from its environment


def hit(name: str) -> None:
    """Act on this process's failpoint `name` if it is armed (a dict lookup otherwise)."""
    _PROCESS.hit(name)


async def hit_async(name: str) -> None:
    """hit() for code on the event loop (a `sleep` awaits: the loop and deadlines keep running)."""
    await _PROCESS.hit_async(name)
