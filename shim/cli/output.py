"""Rendering for the crictl-style commands: tables, JSON and YAML, and the progress line.

JSON and YAML of CRI messages use the protobuf JSON mapping (camelCase names, enum names),
as crictl prints them, so `podshim pods -o json` parses like `crictl pods -o json`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from google.protobuf.message import Message

FORMATS = ("json", "yaml", "table")
TRUNC_ID = 13  # crictl's short id length


def message_dict(msg: Message) -> dict[str, Any]:
    """A CRI message as crictl prints it: protobuf JSON mapping with default values included
    (SANDBOX_READY and CONTAINER_CREATED are enum value 0 and would vanish otherwise)."""
    from google.protobuf import json_format  # only with a message in hand: the CLI starts without protobuf

    return json_format.MessageToDict(msg, always_print_fields_with_no_presence=True)


def timestamp(ns: int | str) -> str:
    """A CRI timestamp (unix nanoseconds) as RFC 3339 UTC; '' for 0."""
    try:
        value = int(ns)
    except (TypeError, ValueError):
        return str(ns)
    if value <= 0:
        return ""
    from datetime import UTC, datetime

    t = datetime.fromtimestamp(value / 1e9, UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_json(data: Any) -> str:
    import json

    return json.dumps(data, indent=2, ensure_ascii=False)


def to_yaml(data: Any) -> str:
    import yaml  # only when asked for: keeps the start-up of the other commands light

    return yaml.safe_dump(data, default_flow_style=False, sort_keys=False, allow_unicode=True).rstrip("\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], padding: int = 3) -> str:
    """Left-aligned columns separated by at least `padding` spaces (crictl's tabwriter look)."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.ljust(w + padding) for c, w in zip(r[:-1], widths[:-1], strict=True)]
        lines.append(("".join(parts) + r[-1]).rstrip())
    return "\n".join(lines)


def render(
    data: Any,
    fmt: str,
    as_table: Callable[[Any], str] | None = None,
    out: IO[str] | None = None,
) -> None:
    """Print `data` as JSON, YAML or (with `as_table`) a table; table without one means JSON."""
    out = out or sys.stdout
    if fmt == "yaml":
        text = to_yaml(data)
    elif fmt == "table" and as_table is not None:
        text = as_table(data)
    else:
        text = to_json(data)
    if text:
        print(text, file=out)


def short_id(value: str) -> str:
    return value[:TRUNC_ID]


def ago(created_ns: int, now: float | None = None) -> str:
    """`created_at` (unix nanoseconds) as crictl's CREATED column: '2 minutes ago'."""
    if created_ns <= 0:
        return "Unknown"
    seconds = max(0.0, (time.time() if now is None else now) - created_ns / 1e9)
    return f"{human_duration(seconds)} ago"


def human_duration(seconds: float) -> str:
    """Docker/crictl's HumanDuration wording."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = s // 60
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = round(s / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{hours // 24 // 365} years"


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("not reached")


def tree_bytes(path: Path) -> int | None:
    """Bytes in the regular files under `path` (a file or a directory); None if unreadable."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not os.path.isdir(path):
        return st.st_size
    total = 0
    seen = False
    for dirpath, _dirs, files in os.walk(path, onerror=lambda _e: None):
        seen = True
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total if seen else None


class Progress:
    """A one-line progress display on stderr while a long call runs: elapsed time and bytes
    under `watch` (when given and readable). Silent when stderr is not a terminal."""

    INTERVAL = 0.25  # seconds: about 4 refreshes a second

    def __init__(self, label: str, watch: Path | None = None, stream: IO[str] | None = None) -> None:
        self.label = label
        self.watch = watch
        self.stream = stream or sys.stderr
        self.enabled = _isatty(self.stream)
        self.start = time.monotonic()
        self._width = 0

    def update(self) -> None:
        if not self.enabled:
            return
        line = f"{self.label}: {self.elapsed():.1f}s"
        if self.watch is not None:
            size = tree_bytes(self.watch)
            if size is not None:
                line += f", {human_bytes(size)} written"
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def clear(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
