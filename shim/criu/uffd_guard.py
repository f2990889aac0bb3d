"""`python -m shim.criu.uffd_guard`: holds the userfaultfds of one lazy restore so that they
outlive podshim (docs/design/restore-pod.md (Lazy restore)).

When the last holder of a userfaultfd closes it, the kernel unregisters its ranges: a fault on a
page the `criu lazy-pages` daemon has not delivered then reads a zero page and the process runs on
with missing memory. podshim holds a duplicate of each, but a podshim killed with its daemon
(SIGKILL, the OOM killer) closes them all. So podshim starts this process per daemon, in a session
of its own, with one end of a SOCK_SEQPACKET socket pair as its stdin, and sends it each duplicate
(SCM_RIGHTS) as it takes it. podshim ends it with `release` once the container no longer needs the
pages (every page delivered, or the container killed). When the socket ends without `release`
(podshim died) it keeps holding what it has, so that the faults stay blocked (killable), until
podshim's next start has killed the container and then kills this process (shim/ops/lazy_pages.py
recover); holding nothing, it exits. Standard library only: it starts on every lazy restore.
"""

from __future__ import annotations

import signal
import socket
import sys

RELEASE = b"release"
FD = b"fd"  # a message carrying one userfaultfd
MAX_FDS = 16


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only podshim's message or SIGKILL ends it
    sock = socket.socket(fileno=0)
    held: list[int] = []
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 64, MAX_FDS)
        except OSError:
            break
        held.extend(fds)
        if msg == RELEASE:
            return 0
        if not msg and not fds:
            break  # podshim is gone
    if not held:
        return 0
    while True:  # until podshim's recovery has killed the container, then this process
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
