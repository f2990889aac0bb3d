"""Which lines of a CRIU log an error message quotes: CRIU's own error lines, never its debug lines."""

from __future__ import annotations

from pathlib import Path

from shim.criu.log import criu_error_lines

LOG = """\
(00.029721) Error (criu/util.c:1561): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.031000) Handling VMA with the following smaps entry: 7f00-7f01 r--p /usr/lib/libgpg-error.so.0
(00.031001) Handling VMA with the following smaps entry: 7f01-7f02 r-xp /usr/lib/libgpg-error.so.0
(00.040023) Error (criu/cr-dump.c:371): Can't get rlimit 0: Operation not permitted
(00.040024) Error (criu/cr-dump.c:1720): Dump core (pid: 3272) failed with -1
(00.050000)      1: Error (criu/cr-restore.c:2111): Restoring FAILED.
"""


def test_only_criu_error_lines_are_quoted(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(LOG)
    got = criu_error_lines(log)
    assert got == [
        "(00.040023) Error (criu/cr-dump.c:371): Can't get rlimit 0: Operation not permitted",
        "(00.040024) Error (criu/cr-dump.c:1720): Dump core (pid: 3272) failed with -1",
        "(00.050000)      1: Error (criu/cr-restore.c:2111): Restoring FAILED.",
    ]


def test_a_missing_log_quotes_nothing(tmp_path: Path) -> None:
    assert criu_error_lines(tmp_path / "gone.log") == []
