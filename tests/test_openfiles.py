"""shim/checks/openfiles.py against real processes (no bed): the deleted files a process holds open or
mapped (CRIU's ghost files) and the files it watches with inotify, found in /proc before the freeze,
and the CRIU options fitted to them (docs/design/checkpoint-pod.md (What the kubelet sends))."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim import errors
from shim.checks import openfiles
from shim.criu.options import CriuOptions

MIB = 1 << 20

# a process that holds a deleted 3 MiB file open, maps a deleted 2 MiB one, and watches DIR/sub/f
HOLDER = r"""
import ctypes, mmap, os, sys, time
d = sys.argv[1]
fd = os.open(f"{d}/held", os.O_RDWR | os.O_CREAT)
os.write(fd, b"x" * (3 << 20))
os.unlink(f"{d}/held")
m = os.open(f"{d}/mapped", os.O_RDWR | os.O_CREAT)
os.write(m, b"y" * (2 << 20))
mapping = mmap.mmap(m, 2 << 20)
os.close(m)
os.unlink(f"{d}/mapped")
os.makedirs(f"{d}/sub", exist_ok=True)
open(f"{d}/sub/f", "w").close()
libc = ctypes.CDLL(None, use_errno=True)
ino = libc.inotify_init1(0)
assert libc.inotify_add_watch(ino, f"{d}/sub/f".encode(), 2) >= 0
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid, tmp_path
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="/proc/<pid>/map_files needs CAP_SYS_ADMIN")
def test_deleted_files_open_and_mapped(holder: tuple[int, Path]) -> None:
    pid, d = holder
    # (libffi maps a deleted, empty temporary file of its own: size 0)
    found = {f.path: f.size for f in openfiles.deleted_files("app", [pid, pid]) if f.size}
    assert found == {str(d / "held"): 3 * MIB, str(d / "mapped"): 2 * MIB}, found


def test_watched_file_is_found_in_its_mount(holder: tuple[int, Path]) -> None:
    pid, d = holder
    marks = openfiles.watches(pid)
    st = os.stat(d / "sub" / "f")
    assert marks == {(st.st_dev, st.st_ino)}, marks
    assert openfiles.find_path(pid, st.st_dev, st.st_ino) == str(d / "sub" / "f")
    assert openfiles.find_path(pid, st.st_dev, st.st_ino, limit=0) is None  # the walk is bounded
    assert openfiles.watched_dirs("app", [pid]) == [str(d / "sub")]


def test_ghost_limit_is_sized_and_capped() -> None:
    def f(size: int) -> openfiles.DeletedFile:
        return openfiles.DeletedFile("app", 7, f"/tmp/f{size}", size)

    assert openfiles.ghost_limit([], 64 * MIB) == 0
    assert openfiles.ghost_limit([f(MIB), f(10)], 64 * MIB) == 0  # CRIU's 1 MiB takes them
    assert openfiles.ghost_limit([f(2 * MIB), f(MIB + 1)], 64 * MIB) == 3 * MIB  # a quarter more, whole MiB
    assert openfiles.ghost_limit([f(60 * MIB)], 64 * MIB) == 64 * MIB  # never above the cap
    with pytest.raises(errors.FailedPrecondition) as err:
        openfiles.ghost_limit([f(2 * MIB), f(65 * MIB)], 64 * MIB)
    assert "/tmp/f68157440" in err.value.message and "ghost_limit_max" in err.value.message
    assert "/tmp/f2097152" not in err.value.message and "ghost-limit=68157440" in err.value.message


def test_fdinfo_and_mountinfo_forms() -> None:
    text = (
        "pos:\t0\nflags:\t02000000\nmnt_id:\t17\nino:\t1038\n"
        "inotify wd:1 ino:a06898 sdev:5b mask:a ignored_mask:0 fhandle-bytes:20 fhandle-type:f8 f_handle:00\n"
        "inotify wd:2 ino:10 sdev:800001 mask:a ignored_mask:0\n"
        "fanotify ino:2a sdev:fd00002 mflags:0 mask:1 ignored_mask:0 fhandle-bytes:8 f_handle:0\n"
        "fanotify mnt_id:22 mflags:0 mask:1 ignored_mask:0\n"
    )
    got = {
        (os.major(openfiles._kernel_dev(int(d, 16))), int(i, 16)) for i, d in openfiles.WATCH_RE.findall(text)
    }
    assert got == {(0, 0xA06898), (8, 0x10), (253, 0x2A)}
    assert openfiles._kernel_dev(0x800001) == os.makedev(8, 1)
    assert openfiles._unescape(r"/var/lib/my\040dir") == "/var/lib/my dir"


def test_fitted_leaves_a_plain_pod_alone(holder: tuple[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod with neither ghost files nor watches gets the very options it asked for (so its dump
    and freeze window are unchanged); one with them gets ghost-limit and irmap-scan-path."""
    pid, d = holder

    class C:
        name = "app"
        cgroups_path = "/x"

    plain = subprocess.Popen(["sleep", "60"])
    try:
        monkeypatch.setattr(openfiles, "cgroup_procs", lambda _path: [plain.pid])
        asked = CriuOptions(irmap_scan_paths=("/etc/app",))
        assert openfiles.fitted(asked, [C()], 64 * MIB) == asked  # type: ignore[list-item]
        monkeypatch.setattr(openfiles, "cgroup_procs", lambda _path: [plain.pid, pid])
        got = openfiles.fitted(asked, [C()], 64 * MIB)  # type: ignore[list-item]
        assert got.ghost_limit == 4 * MIB and got.irmap_scan_paths == ("/etc/app", str(d / "sub"))
        # ghost-limit given (not auto): only the watches are fitted
        given = openfiles.fitted(CriuOptions(ghost_limit=MIB), [C()], 0)  # type: ignore[list-item]
        assert given.ghost_limit == MIB and given.irmap_scan_paths == (str(d / "sub"),)
    finally:
        plain.kill()
        plain.wait()
