"""What a CRIU log tells a person: its last error lines, and the CheckpointPod option that would
get past the failure it records."""

from __future__ import annotations

import re
from pathlib import Path

CRIU_LOG_TAIL = 6
# Error lines CRIU prints on every run of this kind of host without failing because of them
# (no CAP_SYS_RESOURCE to raise its own RLIMIT_NOFILE): kept out of error messages.
_HARMLESS = ("Can't setup RLIMIT_NOFILE for self",)
_CRIU_ERROR = re.compile(r"\bError \(")

# CRIU log lines that an option of podshim's would fix -> the hint for the refusal message
_HINTS = (
    (
        re.compile(r"Can't dump ghost file (\S+) of (\d+) size"),
        lambda m: (
            f"; a deleted but open file ({m.group(1)}, {m.group(2)} bytes) is bigger than CRIU's "
            f"ghost-file limit: retry with the CheckpointPod option ghost-limit={m.group(2)} (bytes, or more)"
        ),
    ),
    (
        re.compile(r"Can't dump that handle"),
        lambda m: (
            "; CRIU cannot find the path of a file watched with inotify/fanotify (in the container's "
            "rootfs): retry with the CheckpointPod option irmap-scan-paths=<the watched file's directory, "
            "as the container sees it>[,<another>]"
        ),
    ),
)


def option_hint(log_path: Path) -> str:
    """Which CheckpointPod option would get past this CRIU failure ("" when none would)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    for pattern, hint in _HINTS:
        m = pattern.search(text)
        if m:
            return hint(m)
    return ""


def criu_error_lines(log_path: Path, limit: int = CRIU_LOG_TAIL) -> list[str]:
    """The last error lines of a CRIU log (what a person needs to see first)."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    # CRIU's pr_err lines only ("Error (file:line): ..."): a debug line can hold "error" too, e.g.
    # "Handling VMA" naming /usr/lib/.../libgpg-error.so.0
    errs = [
        line.strip() for line in lines if _CRIU_ERROR.search(line) and not any(n in line for n in _HARMLESS)
    ]
    return (errs or [line.strip() for line in lines])[-limit:]
