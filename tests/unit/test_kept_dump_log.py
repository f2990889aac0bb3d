"""A failed dump's error names a copy of its CRIU log that outlives the removed archive, never
podshim's own /proc/self/fd/N path."""

from __future__ import annotations

from pathlib import Path

from shim import errors
from shim.archive.dirfd import DirHandle
from shim.ops.checkpoint_pod import with_kept_log


def test_the_error_names_the_kept_copy(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "dump.log").write_text("(00.1) Error (criu/cr-dump.c:1): boom\n")
    with DirHandle.open(work) as d:
        shown = f"{d.proc}/dump.log"
        e = with_kept_log(
            errors.Internal(f"runc exited 1: boom (CRIU log: {shown})"), d, str(tmp_path / "st"), "c1"
        )
    kept = tmp_path / "st" / "logs" / "checkpoint-c1.log"
    assert isinstance(e, errors.Internal)
    assert e.message == f"runc exited 1: boom (CRIU log: {kept})"
    assert "boom" in kept.read_text() and kept.stat().st_mode & 0o077 == 0


def test_without_a_log_the_descriptor_path_is_dropped(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    with DirHandle.open(work) as d:
        shown = f"{d.proc}/dump.log"
        e = with_kept_log(
            errors.ResourceExhausted(f"no space (CRIU log: {shown})"), d, str(tmp_path / "st"), "c1"
        )
    assert isinstance(e, errors.ResourceExhausted) and e.message == "no space"
