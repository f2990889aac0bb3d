"""`python -m shim.migration.guard CGROUP...`: the destination's watchdog during a migration
(docs/design/migration.md (Live migration)).

The migrated containers run on memory that still arrives from the source, and the source thaws
its own copy once the destination's lease has run out. podshim enforces the lease; if podshim
itself dies, nothing would, so podshim starts this process (in a session of its own) with a pipe
as its stdin whose other end only podshim holds. When the migration is complete podshim writes
`done`; when the pipe ends without it (podshim died), every process in the containers' cgroups is
killed at once: frozen first, so that none forks away, then SIGKILLed, then thawed so they die.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from shim.cgroups import cgroup_procs, default_freezer
from shim.deadlines import MIGRATION_KILL_WAIT


def kill_cgroups(cgroups: list[str]) -> None:
    """Every process in `cgroups` killed: frozen first (so that none forks away meanwhile; a task
    blocked on a missing page may not freeze, SIGKILL ends it anyway), SIGKILLed, thawed so that the
    kills land, then SIGKILL again until the cgroups are empty (at most MIGRATION_KILL_WAIT)."""
    freezer = default_freezer()
    for cg in cgroups:
        with contextlib.suppress(Exception):
            freezer.freeze(cg, timeout=0.5)
    _kill_all(cgroups)
    for cg in cgroups:
        with contextlib.suppress(Exception):
            freezer.thaw(cg, timeout=1.0, missing_ok=True)
    end = time.monotonic() + MIGRATION_KILL_WAIT
    while _kill_all(cgroups) and time.monotonic() < end:
        time.sleep(0.01)


def _kill_all(cgroups: list[str]) -> bool:
    """SIGKILL every process listed in `cgroups`; whether any was."""
    found = False
    for cg in cgroups:
        for pid in cgroup_procs(cg):
            found = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return found


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the pipe decides
    data = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(0, 4096):
            data += chunk
    if b"done" in data:
        return 0
    kill_cgroups(argv)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
