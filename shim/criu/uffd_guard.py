"""`python -m shim.criu.uffd_guard`: holds the userfaultfds of one lazy restore (sent over its
stdin, SCM_RIGHTS) so that they outlive podshim and faults stay blocked instead of reading zero
pages, until `release` or until podshim's next start has killed the container and then this
process (docs/design/restore-pod.md (Lazy restore)). Standard library only: it starts on every
lazy restore."""

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
