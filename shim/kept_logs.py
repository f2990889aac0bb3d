"""Copies of the logs of failed runtime, CRIU and lazy-pages runs, kept for the operator in
`<state_dir>/logs/` (a 0700 directory, 0600 files: CRIU logs name the workload's files and
sockets), because the directory each was written in goes with the failure. Standard library
only: the restore hook imports it (docs/design/runtime-wrapper.md (The runtime wrapper))."""

from __future__ import annotations

import os
from pathlib import Path


def keep(data: bytes, state_dir: str | Path, name: str) -> Path:
    """Write `data` as `<state_dir>/logs/<name>` (replaced if there, never through a symlink);
    OSError when it cannot."""
    dest_dir = Path(state_dir) / "logs"
    dest_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(dest_dir, 0o700)  # private whatever the umask or an older directory's mode
    dest = dest_dir / name
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return dest
