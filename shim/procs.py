"""A process named across pid reuse: its pid and its start time (clock ticks since boot), as the
journal, the lazy-pages daemons' records, the front's record and `--keep`'s markers store it."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> int:
    """The start time of `pid`, 0 if it is gone (a zombie still has one)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else 0


def running_start_time(pid: int) -> int:
    """The start time of `pid` while it runs: 0 if it is gone or a zombie (it has exited)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and fields[0] not in ("Z", "X") else 0
