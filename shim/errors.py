"""Typed errors of podshim's own operations, each carrying its gRPC status code
(docs/design/errors.md (Errors)).

Plain modules raise these; the gRPC layer turns them into a status with the same message.
"""

from __future__ import annotations

import errno
import os
from contextvars import ContextVar


class ShimError(Exception):
    """An error with the gRPC code the caller must see. The message says what failed and what to do."""

    # The code by name: this module knows no gRPC (podshim-runc raises these errors on every
    # restore and never imports grpc); shim/server turns the name into the status.
    code_name: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        # set when the error is the upstream's answer (shim/upstream/errors.py): its code by name,
        # its message, and whether the upstream could not be reached at all
        self.upstream_code: str | None = None
        self.upstream_details = ""
        self.transport = False


def is_not_found(e: ShimError) -> bool:
    """The upstream itself answered NOT_FOUND (not a NotFound of podshim's own)."""
    return e.upstream_code == "NOT_FOUND"


class NotFound(ShimError):
    code_name = "NOT_FOUND"


class FailedPrecondition(ShimError):
    code_name = "FAILED_PRECONDITION"


class InvalidArgument(ShimError):
    code_name = "INVALID_ARGUMENT"


class Aborted(ShimError):
    code_name = "ABORTED"


class DeadlineExceeded(ShimError):
    code_name = "DEADLINE_EXCEEDED"


class DataLoss(ShimError):
    code_name = "DATA_LOSS"


class Internal(ShimError):
    code_name = "INTERNAL"


class Unavailable(ShimError):
    code_name = "UNAVAILABLE"


class ResourceExhausted(ShimError):
    code_name = "RESOURCE_EXHAUSTED"


class Unimplemented(ShimError):
    code_name = "UNIMPLEMENTED"


OUT_OF_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def room_left(where: str | os.PathLike[str]) -> str:
    """What the filesystem of `where` has left, in words ("" when it cannot be read)."""
    try:
        st = os.statvfs(where)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    inodes = f", {st.f_favail} free inodes" if st.f_files else ""
    return f"{free / 2**20:.1f} MiB free{inodes}"


def out_of_space(where: str | os.PathLike[str], what: str, needs: str) -> ResourceExhausted:
    """RESOURCE_EXHAUSTED for a step that ran out of room: `what` names the step and its path,
    `where` is a path on its filesystem (for what it has left), `needs` what the step needed.
    Every out-of-space case says the same, bytes or inodes."""
    left = room_left(where)
    return ResourceExhausted(
        f"{what}: no space left on its filesystem"
        + (f" ({left})" if left else "")
        + f"; it needs {needs}: free space (or inodes) there and retry"
    )


def storage_error(e: OSError, message: str, where: str | os.PathLike[str], needs: str = "") -> ShimError:
    """An OSError of a write as podshim's error: RESOURCE_EXHAUSTED when the filesystem is out of
    space or inodes (ENOSPC, EDQUOT), INTERNAL otherwise."""
    if e.errno in OUT_OF_SPACE:
        return out_of_space(where, message, needs or "room to write")
    return Internal(f"{message}: {e}")


class Stopped(Exception):
    """A long blocking step was told to stop (its operation was cancelled): the one stop signal of
    every thread podshim runs (fsutil, crypto, the container tar). Not a ShimError: the cancelled
    operation ends with its own status. Here, in a module that imports nothing, so the blocking
    modules (shim/archive) need not import asyncio (shim/aio.py re-exports it)."""


# What the caller of the current call should be told even when it succeeds (e.g. tasks a
# checkpoint left stopped and podshim resumed): the server collects them per call and sends them
# as the `podshim-notice` trailing metadata, or appended to the error's message.
_caller_notes: ContextVar[list[str] | None] = ContextVar("podshim_caller_notes", default=None)


def collect_caller_notes() -> list[str]:
    """Start collecting the notes of the current call (the server, once per call)."""
    notes: list[str] = []
    _caller_notes.set(notes)
    return notes


def tell_caller(note: str) -> None:
    """Add a note to the current call's answer (nothing when no call collects them)."""
    notes = _caller_notes.get()
    if notes is not None:
        notes.append(note)
