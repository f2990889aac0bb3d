"""podshim-runc's watchdog detaches the mounts CRIU left below the bundle's work dir although the
upstream renamed the bundle meanwhile: it holds the directory by an O_PATH
descriptor and detaches through /proc/self/fd, shortest mount first, until none is left."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from shim import contract
from shim.wrapper import cleanup

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts)")


def _mounts_below(d: Path) -> list[str]:
    prefix = str(d) + "/"
    with open("/proc/self/mountinfo") as f:
        return [m for m in (cleanup._unescape(line.split()[4]) for line in f) if m.startswith(prefix)]


def test_mounts_detached_after_the_bundle_was_renamed(tmp_path: Path) -> None:
    bundle = tmp_path / "abc"
    work = bundle / contract.WORK_DIR
    yard = work / "yard dir"  # a space: mountinfo escapes it
    yard.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "yard", str(yard)], check=True)
    for i in range(13):  # CRIU's mounts in its yard
        (yard / f"m{i}").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", f"m{i}", str(yard / f"m{i}")], check=True)
    renamed = tmp_path / ".abc"
    try:
        held = cleanup.hold_dirs([work, tmp_path / "missing"])
        assert list(held) == [work]
        bundle.rename(renamed)  # what containerd does while it deletes the bundle
        assert len(_mounts_below(renamed)) == 14
        cleanup.detach_mounts_below([work, tmp_path / "state"], held)
        assert _mounts_below(renamed) == []
        for fd in held.values():
            os.close(fd)
    finally:
        for d in (bundle, renamed):
            for m in sorted(_mounts_below(d), key=len, reverse=True):
                subprocess.run(["umount", "-l", m], check=False)
