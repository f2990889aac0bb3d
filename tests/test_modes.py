"""Modes of what podshim and podshim-runc keep on the node: server.state_dir is
0700 whatever the unit or the umask, and the restore CRIU logs podshim-runc keeps there are 0600
in a 0700 directory although podshim-runc runs with containerd's umask (022)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.server import app
from shim.wrapper import restore as restore_hook
from testbed.bed import TestBed


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)  # containerd's, and so podshim-runc's
    try:
        yield
    finally:
        os.umask(old)


def test_kept_restore_log_is_private(tmp_path: Path, umask_022: None) -> None:
    log = tmp_path / "bundle" / "restore.log"
    log.parent.mkdir()
    log.write_text("(00.000001) Error (criu/cr-restore.c:1): something\n")
    state = tmp_path / "state"
    kept = Path(restore_hook._keep_log(log, str(state), "c1"))
    assert kept == state / "logs" / "restore-c1.log"
    assert kept.read_text() == log.read_text()
    assert _mode(kept) == 0o600 and _mode(kept.parent) == 0o700
    # a second failure of the same container overwrites it, still private
    (state / "logs").chmod(0o755)
    kept.chmod(0o644)
    log.write_text("again\n")
    assert restore_hook._keep_log(log, str(state), "c1") == str(kept)
    assert kept.read_text() == "again\n"
    assert _mode(kept) == 0o600 and _mode(kept.parent) == 0o700


def test_state_dir_created_private(tmp_path: Path, umask_022: None) -> None:
    d = tmp_path / "var" / "lib" / "podshim"
    app.prepare_state_dir(str(d))
    assert _mode(d) == 0o700


def test_open_state_dir_is_narrowed(tmp_path: Path, umask_022: None) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    (d / "keep").write_text("x")
    app.prepare_state_dir(str(d))
    assert _mode(d) == 0o700 and (d / "keep").read_text() == "x"


def test_scratch_dir_is_emptied_at_start(tmp_path: Path, umask_022: None) -> None:
    """What a podshim killed mid-dump left in its scratch dir (a CRIU config file, a gate) goes
    at the next start; the dir is 0700."""
    scratch = tmp_path / "scratch"
    (scratch / "podshim-gate-x").mkdir(parents=True)
    (scratch / "podshim-gate-x" / "go").write_text("")
    (scratch / "podshim-criu-y.conf").write_text("tcp-established\n")
    app.reset_scratch_dir(str(scratch))
    assert list(scratch.iterdir()) == [] and _mode(scratch) == 0o700
    app.reset_scratch_dir(str(tmp_path / "new" / "scratch"))
    assert _mode(tmp_path / "new" / "scratch") == 0o700


def test_unusable_state_dir_is_a_startup_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(app.StartupError, match="server.state_dir"):
        app.prepare_state_dir(str(tmp_path / "file" / "state"))


@pytest.mark.e2e
def test_running_podshim_state_dir_is_private(bed: TestBed) -> None:
    """The test bed creates the state dir with its own umask (0755); podshim narrows it."""
    assert bed.podshim_running
    assert _mode(Path(bed.podshim_state_dir)) == 0o700
    assert _mode(Path(bed.podshim_state_dir) / "scratch") == 0o700
