"""The unix sockets podshim listens on: taken over and removed only when nobody serves them
(docs/design/proxy.md (The proxy)).

A socket file left by a run that died is removed before the path is bound again; one that a live
process still serves is not: a second `podshim serve` on the same path would otherwise steal the
kubelet's endpoint from the first (which runs on, unreachable). At the stop, the file is removed
only when nobody serves it: a podshim started after this one may have bound the path anew.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from shim.deadlines import SOCKET_PROBE_TIMEOUT


class SocketInUse(Exception):
    """Another process serves the path."""


def remove_stale(path: str) -> None:
    """Make `path` free to bind: its directory made, a dead socket removed; SocketInUse when a
    process accepts connections on it, OSError when something else (a file, a directory) is there."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, "exists and is not a socket", path)
    if serving(path):
        raise SocketInUse(f"{path}: another process serves this socket (is podshim running already?)")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def serving(path: str) -> bool:
    """A process accepts connections on the unix socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(SOCKET_PROBE_TIMEOUT)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError as e:
            # a full backlog (EAGAIN) or a timeout is a live server too busy to accept
            return e.errno in (errno.EAGAIN, errno.ETIMEDOUT) or isinstance(e, TimeoutError)
        return True


def remove_unserved(path: str) -> None:
    """At the stop, once this run no longer listens on `path`: remove the file unless a process
    serves it (a podshim started after this one may have bound the path anew; a socket nobody
    serves is dead, whoever bound it)."""
    try:
        if serving(path):
            return
        os.unlink(path)
    except FileNotFoundError:
        pass
