"""What an archive's tree on disk may hold, checked without its manifest: directories and regular
files only, nested at most MAX_TREE_DEPTH deep, no member mostly holes (a pod checkpoint's tree,
shim/archive/manifest.py; a pulled one, shim/distribution/pull.py; a container checkpoint tar's,
shim/ops/restore_container.py)."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from shim.archive.fsutil import hole_bytes
from shim.archive.layout import MANIFEST_FILE
from shim.errors import DataLoss, Internal, ShimError

# Directory nesting of an archive tree: podshim's is 4 deep (containers/<name>/checkpoint/<file>).
MAX_TREE_DEPTH = 16
# Holes a member may have (bytes, and at most half of its size) before it counts as a sparse
# file: podshim, CRIU and tar never write one, and hashing gigabytes of holes is work for nothing.
MAX_HOLE_BYTES = 64 << 20


def scan_tree(root: Path, err: Callable[[str], ShimError]) -> dict[str, int]:
    """Regular files under `root` (relative posix path -> size), manifest.json excluded.

    Anything but directories and regular files (symlinks, fifos, devices, sockets), and
    directories nested deeper than MAX_TREE_DEPTH, raise `err(message)`: an archive tree is plain
    data, and a symlink could point reads outside it.
    """
    out: dict[str, int] = {}
    stack: list[tuple[Path, str, int]] = [(root, "", 0)]
    while stack:
        d, prefix, depth = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:  # a tree of long names below the depth limit
                raise err(f"{root}: {prefix[:120]!r}... is too long a path to read") from None
            raise Internal(f"cannot list {d}: {e}") from e
        for entry in entries:
            rel = f"{prefix}{entry.name}"
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as ex:
                raise err(f"{root}: cannot stat {rel[:200]!r}: {ex.strerror}") from None
            if stat.S_ISDIR(st.st_mode):
                if depth + 1 >= MAX_TREE_DEPTH:
                    raise err(
                        f"{root}: directories nest deeper than {MAX_TREE_DEPTH} levels "
                        f"({rel[:120]!r}...); a checkpoint is at most {MAX_TREE_DEPTH} deep"
                    )
                stack.append((Path(entry.path), rel + "/", depth + 1))
            elif stat.S_ISREG(st.st_mode):
                if rel != MANIFEST_FILE:
                    out[rel] = st.st_size
            elif stat.S_ISLNK(st.st_mode):
                raise err(f"{root}: {rel} is a symlink; a checkpoint holds no symlinks")
            else:
                raise err(f"{root}: {rel} is not a regular file or directory")
    return out


def check_allocated(root: Path, sizes: dict[str, int], stop: threading.Event | None = None) -> None:
    """Refuse (DataLoss), before reading a byte, a member larger than the file system holding it
    or mostly holes (over MAX_HOLE_BYTES and over half its size): a sparse file reads back as
    gigabytes of zeros that podshim never wrote, and hashing them would only burn the caller's
    deadline (docs/design/restore-pod.md (RestorePod))."""
    try:
        vfs = os.statvfs(root)
        capacity = vfs.f_blocks * vfs.f_frsize
        for rel, size in sizes.items():
            if capacity and size > capacity:
                raise DataLoss(
                    f"checkpoint {root} is corrupt: {rel} is {size} bytes, more than its file system "
                    f"holds ({capacity} bytes): a sparse file podshim never wrote; take a new checkpoint"
                )
            limit = max(MAX_HOLE_BYTES, size // 2)
            holes = hole_bytes(root / rel, limit, stop)
            if holes > limit:
                raise DataLoss(
                    f"checkpoint {root} is corrupt: {rel} is {size} bytes of which over {holes} are "
                    "holes (a sparse file): podshim never writes one, refused before reading it; if the "
                    "archive was copied with holes (rsync -S, cp --sparse=always) copy it again without"
                )
    except OSError as e:
        raise Internal(f"cannot read checkpoint {root}: {e}") from e
