"""shim.archive: path confinement, fsutil, manifest round trip and corruption, rootfs diffs.

The rootfs diff tests build a real overlay mount (root only) and compare the merged view
with the result of capture + apply onto a copy of the lower dir.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shim.archive import fsutil, layout
from shim.archive.dirfd import clear_dir_contents
from shim.archive.manifest import (
    FORMAT,
    ContainerEntry,
    HostInfo,
    Manifest,
    SandboxInfo,
    load_and_verify,
    read_manifest,
    write_manifest,
)
from shim.archive.paths import (
    check_component,
    check_member_path,
    validate_archive_dir,
    validate_output_dir,
)
from shim.archive.rootfs_diff import (
    OPAQUE_MARKER,
    apply_deleted_files,
    apply_rootfs_diff,
    capture_rootfs_diff,
)
from shim.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (overlay mounts, chown)")


# ---------------------------------------------------------------------------- paths


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "pod-checkpoints"
    r.mkdir()
    return r


def test_output_dir_ok_returns_resolved(root: Path) -> None:
    (root / "ck1").mkdir()
    assert validate_output_dir(str(root / "ck1"), [str(root)]) == (root / "ck1").resolve()
    # '.' components and double slashes are only spelling
    assert validate_output_dir(f"{root}//./ck1/", [str(root)]) == (root / "ck1").resolve()


def test_output_dir_symlink_inside_root_is_fine(root: Path) -> None:
    (root / "real").mkdir()
    (root / "alias").symlink_to("real")
    assert validate_output_dir(str(root / "alias"), [str(root)]) == (root / "real").resolve()


def test_allowed_root_behind_symlink(tmp_path: Path, root: Path) -> None:
    (tmp_path / "via").symlink_to(root)
    (root / "ck").mkdir()
    assert (
        validate_output_dir(str(tmp_path / "via" / "ck"), [str(tmp_path / "via")]) == (root / "ck").resolve()
    )


@pytest.mark.parametrize(
    "bad,rule",
    [
        ("relative/dir", "not absolute"),
        ("", "empty"),
        ("/x\x00y", "NUL"),
        ("/x\ny", "control"),
        ("/bad\udcff", "UTF-8"),
    ],
)
def test_output_dir_syntax(root: Path, bad: str, rule: str) -> None:
    with pytest.raises(InvalidArgument, match=rule):
        validate_output_dir(bad, [str(root)])


def test_output_dir_dotdot(root: Path) -> None:
    (root / "a").mkdir()
    (root / "b").mkdir()
    with pytest.raises(InvalidArgument, match=r"'\.\.'"):
        validate_output_dir(f"{root}/a/../b", [str(root)])


def test_output_dir_symlink_escape(tmp_path: Path, root: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "esc").symlink_to(outside)
    with pytest.raises(InvalidArgument, match="symlink") as ei:
        validate_output_dir(str(root / "esc"), [str(root)])
    assert str(root / "esc") in ei.value.message
    # a symlinked intermediate component too
    (outside / "sub").mkdir()
    with pytest.raises(InvalidArgument, match="outside"):
        validate_output_dir(str(root / "esc" / "sub"), [str(root)])


def test_output_dir_symlink_loop(root: Path) -> None:
    (root / "l1").symlink_to("l2")
    (root / "l2").symlink_to("l1")
    with pytest.raises(InvalidArgument, match="loop"):
        validate_output_dir(str(root / "l1"), [str(root)])


def test_output_dir_outside_roots(tmp_path: Path, root: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(InvalidArgument, match="outside the allowed"):
        validate_output_dir(str(tmp_path / "elsewhere"), [str(root)])
    # a missing path outside the roots is not reported as missing (no probing)
    with pytest.raises(InvalidArgument, match="outside the allowed"):
        validate_output_dir(str(tmp_path / "nope"), [str(root)])
    # a sibling sharing the root's name as prefix is outside
    sib = tmp_path / "pod-checkpoints-evil"
    sib.mkdir()
    with pytest.raises(InvalidArgument, match="outside"):
        validate_output_dir(str(sib), [str(root)])


def test_output_dir_not_empty(root: Path) -> None:
    d = root / "full"
    d.mkdir()
    (d / ".hidden").write_text("x")
    with pytest.raises(InvalidArgument, match="not empty"):
        validate_output_dir(str(d), [str(root)])


def test_output_dir_missing(root: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        validate_output_dir(str(root / "nope"), [str(root)])


def test_output_dir_is_a_file(root: Path) -> None:
    (root / "f").write_text("x")
    with pytest.raises(InvalidArgument, match="not a directory"):
        validate_output_dir(str(root / "f"), [str(root)])
    with pytest.raises(InvalidArgument, match="not a directory"):
        validate_output_dir(str(root / "f" / "sub"), [str(root)])


def test_output_dir_too_long(root: Path) -> None:
    with pytest.raises(InvalidArgument, match="PATH_MAX"):
        validate_output_dir(str(root) + "/a" * 3000, [str(root)])
    with pytest.raises(InvalidArgument, match="NAME_MAX"):
        validate_output_dir(str(root / ("n" * 300)), [str(root)])


def test_output_dir_root_itself(root: Path) -> None:
    with pytest.raises(InvalidArgument, match="root .* itself"):
        validate_output_dir(str(root), [str(root)])
    with pytest.raises(InvalidArgument, match="outside|itself"):
        validate_output_dir("/", [str(root)])


def test_no_roots_configured(root: Path) -> None:
    with pytest.raises(InvalidArgument, match="no allowed"):
        validate_output_dir(str(root / "x"), [])


def test_archive_dir(root: Path) -> None:
    d = root / "ck"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    assert validate_archive_dir(str(d), [str(root)]) == d.resolve()  # non-empty is fine
    with pytest.raises(NotFound):
        validate_archive_dir(str(root / "gone"), [str(root)])


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../x", "a/..", "", ".", "a\x00b"])
def test_check_member_path_rejects(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        check_member_path(bad)


def test_check_member_path_ok() -> None:
    assert str(check_member_path("a/./b//c")) == "a/b/c"


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "x" * 256])
def test_container_name_component(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        check_component(bad, "container name")


# ---------------------------------------------------------------------------- fsutil


def test_atomic_write_mode_and_no_temp(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        p = tmp_path / "state.json"
        fsutil.atomic_write(p, b"one")
        fsutil.atomic_write(p, b"two", mode=0o640)
    finally:
        os.umask(old)
    assert p.read_bytes() == b"two"
    assert stat.S_IMODE(p.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["state.json"]


def test_atomic_write_failure_keeps_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "f"
    fsutil.atomic_write(p, b"old")

    def boom(a: Any, b: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsutil.os, "rename", boom)
    with pytest.raises(ResourceExhausted, match="no space left on its filesystem"):
        fsutil.atomic_write(p, b"new")
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]  # the temp file is gone


def test_atomic_write_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        fsutil.atomic_write(tmp_path / "no" / "f", b"x")


def test_temp_names() -> None:
    t = fsutil.temp_name_for("abc.json")
    assert fsutil.is_temp_name(t) and not fsutil.is_temp_name("abc.json")


def test_clear_dir_contents_never_removes_dir_or_follows_links(tmp_path: Path) -> None:
    keep = tmp_path / "outside"
    keep.mkdir()
    (keep / "precious").write_text("x")
    d = tmp_path / "out"
    d.mkdir()
    (d / "f").write_text("x")
    (d / "sub" / "deep").mkdir(parents=True)
    (d / "sub" / "deep" / "g").write_text("y")
    (d / "link").symlink_to(keep)
    (d / "sub" / "link2").symlink_to(keep)
    clear_dir_contents(d)
    assert d.is_dir() and os.listdir(d) == []
    assert (keep / "precious").exists()
    with pytest.raises(NotFound):
        clear_dir_contents(tmp_path / "missing")


def test_sha256_and_fsync_tree(tmp_path: Path) -> None:
    data = os.urandom((3 << 20) + 17)  # crosses 1 MiB chunk boundaries
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "big").write_bytes(data)
    assert fsutil.hash_file(tmp_path / "a" / "big") == (len(data), hashlib.sha256(data).hexdigest())
    fsutil.fsync_tree(tmp_path, workers=4)
    fsutil.fsync_tree(tmp_path, files=False)


@pytest.mark.parametrize("workers", [1, 3])
def test_hash_and_flush_matches_hash_file(tmp_path: Path, workers: int) -> None:
    files = []
    for i, size in enumerate([0, 17, (2 << 20) + 3, 5000]):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(size))
        files.append(p)
    got = fsutil.hash_and_flush(files, workers=workers)
    assert got == [(p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in files]


def test_hash_threads_run_below_the_callers_priority() -> None:
    def nice_of_this_thread(_: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = nice_of_this_thread(0)
    got = fsutil.map_in_threads(nice_of_this_thread, [1, 2, 3], workers=2, nice=fsutil.BACKGROUND_NICE)
    assert got == [min(19, mine + fsutil.BACKGROUND_NICE)] * 3
    assert nice_of_this_thread(0) == mine  # the caller's own thread is left as it was


def test_hash_and_flush_stops_when_told(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(os.urandom(3 << 20))
    stop = threading.Event()
    stop.set()
    with pytest.raises(fsutil.Stopped):
        fsutil.hash_and_flush([tmp_path / "big"], workers=2, stop=stop)


# ---------------------------------------------------------------------------- manifest


def _sample_archive(root: Path, name: str = "ck") -> tuple[Path, Manifest]:
    d = root / name
    d.mkdir()
    lay = layout.ArchiveLayout(d).create()
    fsutil.write_private_file(lay.sandbox_config, b'{"metadata": {"name": "web"}}')
    c = lay.container("app").create()
    fsutil.write_private_file(c.config_dump, b"{}")
    fsutil.write_private_file(c.spec_dump, b'{"ociVersion": "1.0.2"}')
    (c.checkpoint_dir / "pages-1.img").write_bytes(os.urandom((2 << 20) + 5))
    (c.checkpoint_dir / "inventory.img").write_bytes(b"inv")
    (c.root / layout.DUMP_LOG_FILE).write_bytes(b"log\n")
    (c.root / "empty").write_bytes(b"")
    m = Manifest(
        sandbox=SandboxInfo(id="sb1", metadata={"name": "web", "uid": "u1"}, config={"a": 1}),
        containers=[
            ContainerEntry(
                name="app",
                id="c1",
                image="busybox",
                state="CONTAINER_RUNNING",
                restart_count=2,
                checkpointed=True,
                dir=c.rel,
            )
        ],
        host=HostInfo(podshim_version="0.1.0", criu_version="4.1.1", runtime_name="runc"),
        timings={"freeze_window": 0.25},
        criu_stats={"app": {"frozen_time": 1200}},
        options={},
    )
    write_manifest(d, m, workers=2)
    return d, m


def test_manifest_round_trip(root: Path) -> None:
    d, m = _sample_archive(root)
    assert set(m.files) == {
        "sandbox/config.json",
        "containers/app/config.dump",
        "containers/app/spec.dump",
        "containers/app/checkpoint/pages-1.img",
        "containers/app/checkpoint/inventory.img",
        "containers/app/dump.log",
        "containers/app/empty",
    }
    assert stat.S_IMODE((d / "manifest.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "containers" / "app").stat().st_mode) == 0o700
    got = load_and_verify(str(d), [str(root)])
    assert got.to_dict() == m.to_dict()
    assert got.format == FORMAT and got.container("app").restart_count == 2
    assert load_and_verify(str(d), [str(root)], workers=4).files == m.files
    with pytest.raises(NotFound):
        got.container("nope")


def test_manifest_flipped_byte(root: Path) -> None:
    d, _ = _sample_archive(root)
    p = d / "containers/app/checkpoint/pages-1.img"
    with open(p, "r+b") as f:
        f.seek(1 << 20)
        b = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(DataLoss, match="containers/app/checkpoint/pages-1.img"):
        load_and_verify(str(d), [str(root)])


def test_manifest_size_mismatch(root: Path) -> None:
    d, _ = _sample_archive(root)
    with open(d / "containers/app/dump.log", "ab") as f:
        f.write(b"x")
    with pytest.raises(DataLoss, match="dump.log is 5 bytes"):
        load_and_verify(str(d), [str(root)])


def test_manifest_truncated(root: Path) -> None:
    d, _ = _sample_archive(root)
    raw = (d / "manifest.json").read_bytes()
    (d / "manifest.json").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataLoss, match="truncated"):
        load_and_verify(str(d), [str(root)])


def test_manifest_missing_means_partial(root: Path) -> None:
    d, _ = _sample_archive(root)
    (d / "manifest.json").unlink()
    with pytest.raises(NotFound, match="not a complete"):
        load_and_verify(str(d), [str(root)])
    with pytest.raises(NotFound):
        load_and_verify(str(root / "nothing"), [str(root)])


def _edit_manifest(d: Path, fn: Any) -> None:
    doc = json.loads((d / "manifest.json").read_bytes())
    fn(doc)
    (d / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("fmt", ["podshim.checkpoint.v2", "containerd.checkpoint.v1"])
def test_manifest_unknown_format(root: Path, fmt: str) -> None:
    d, _ = _sample_archive(root)
    _edit_manifest(d, lambda doc: doc.update(format=fmt))
    with pytest.raises(FailedPrecondition, match="not"):
        load_and_verify(str(d), [str(root)])


def test_manifest_bad_shape(root: Path) -> None:
    d, _ = _sample_archive(root)
    _edit_manifest(d, lambda doc: doc.update(containers={"app": 1}))
    with pytest.raises(DataLoss, match="containers"):
        read_manifest(d)
    _edit_manifest(d, lambda doc: doc.update(containers=[], files=[]))
    with pytest.raises(DataLoss, match="files"):
        read_manifest(d)
    (d / "manifest.json").write_text("[1, 2]")
    with pytest.raises(DataLoss):
        read_manifest(d)


def test_manifest_extra_file(root: Path) -> None:
    d, _ = _sample_archive(root)
    (d / "containers/app/checkpoint/injected.img").write_bytes(b"evil")
    with pytest.raises(DataLoss, match="injected.img"):
        load_and_verify(str(d), [str(root)])


def test_manifest_missing_file(root: Path) -> None:
    d, _ = _sample_archive(root)
    (d / "containers/app/spec.dump").unlink()
    with pytest.raises(DataLoss, match="spec.dump"):
        load_and_verify(str(d), [str(root)])


@pytest.mark.parametrize("member", ["../../etc/passwd", "/etc/passwd", "a/../../b", "a//b"])
def test_manifest_escaping_member(root: Path, member: str) -> None:
    d, _ = _sample_archive(root)
    _edit_manifest(d, lambda doc: doc["files"].update({member: {"size": 1, "sha256": "0" * 64}}))
    with pytest.raises(InvalidArgument):
        load_and_verify(str(d), [str(root)])


def test_manifest_escaping_container_dir(root: Path) -> None:
    d, _ = _sample_archive(root)
    _edit_manifest(d, lambda doc: doc["containers"][0].update(dir="../../x"))
    with pytest.raises(InvalidArgument):
        load_and_verify(str(d), [str(root)])


def test_manifest_symlink_inside(tmp_path: Path, root: Path) -> None:
    d, _ = _sample_archive(root)
    (d / "containers/app/checkpoint/pages-1.img").unlink()
    (d / "containers/app/checkpoint/pages-1.img").symlink_to("/etc/passwd")
    with pytest.raises(InvalidArgument, match="symlink"):
        load_and_verify(str(d), [str(root)])


def test_manifest_symlinked_manifest(root: Path) -> None:
    d, _ = _sample_archive(root)
    (d / "manifest.json").rename(root / "elsewhere.json")
    (d / "manifest.json").symlink_to(root / "elsewhere.json")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        load_and_verify(str(d), [str(root)])


# ---------------------------------------------------------------------------- rootfs diff


def _snapshot(top: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[Any, ...]]:
    """Everything observable about a tree, keyed by relative path."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(top))
            if any(rel == s or rel.startswith(s + "/") for s in skip):
                continue
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                extra: Any = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                extra = st.st_rdev
            else:
                extra = None
            xattrs = {}
            if not stat.S_ISLNK(st.st_mode):
                for k in os.listxattr(p, follow_symlinks=False):
                    if k.startswith("user."):
                        xattrs[k] = os.getxattr(p, k, follow_symlinks=False)
            mtime = None if stat.S_ISLNK(st.st_mode) else st.st_mtime_ns // 1000
            out[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, extra, xattrs, mtime)
    return out


@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[dict[str, Path]]:
    if not IS_ROOT:
        pytest.skip("needs root to mount overlayfs")
    dirs = {k: tmp_path / k for k in ("lower", "upper", "work", "merged")}
    for d in dirs.values():
        d.mkdir()
    lower = dirs["lower"]
    (lower / "etc").mkdir()
    (lower / "etc" / "hostname").write_text("old-host\n")
    (lower / "etc" / "motd").write_text("deleted later\n")
    (lower / "etc" / "conf").write_text("a=1\n")
    (lower / "data" / "old").mkdir(parents=True)
    (lower / "data" / "old" / "x").write_text("old x")
    (lower / "data" / "y").write_text("old y")
    (lower / "keep").mkdir()
    (lower / "keep" / "file").write_text("to delete")
    (lower / "keep" / "stay").write_text("stays")
    (lower / "usr" / "lib").mkdir(parents=True)
    (lower / "usr" / "lib" / "libx.so").write_bytes(b"\x7fELF")
    (lower / "lib").symlink_to("usr/lib")
    (lower / "bin").mkdir()
    (lower / "bin" / "tool").write_bytes(b"#!/bin/sh\n")
    os.chmod(lower / "bin" / "tool", 0o755)
    (lower / "gone-dir" / "sub").mkdir(parents=True)
    (lower / "gone-dir" / "sub" / "f").write_text("f")
    os.setxattr(lower / "etc" / "conf", "user.origin", b"lower")
    opts = f"lowerdir={lower},upperdir={dirs['upper']},workdir={dirs['work']}"
    r = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", opts, str(dirs["merged"])],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount overlayfs here: {r.stderr.strip()}")
    try:
        yield dirs
    finally:
        subprocess.run(["umount", "-l", str(dirs["merged"])], check=False)


def _mutate(m: Path) -> None:
    (m / "etc" / "conf").write_text("a=2\n")  # modify (copy-up keeps user.origin)
    (m / "etc" / "motd").unlink()  # whiteout
    (m / "keep" / "file").unlink()  # whiteout in a copied-up dir
    shutil.rmtree(m / "data")  # opaque: delete a dir and recreate it
    (m / "data").mkdir(mode=0o750)
    (m / "data" / "fresh").write_text("fresh")
    shutil.rmtree(m / "gone-dir")  # whiteout of a whole directory
    new = m / "srv" / "new.txt"
    new.parent.mkdir()
    new.write_bytes(os.urandom(70_000))
    os.chown(new, 1234, 5678)
    os.chmod(new, 0o640)
    os.setxattr(new, "user.note", b"\x00\xffbinary")
    os.link(new, m / "srv" / "new-hard")  # hardlink between new files
    os.link(m / "etc" / "hostname", m / "etc" / "hostname.bak")  # hardlink after copy-up
    (m / "srv" / "abs-link").symlink_to("/etc/hostname")
    (m / "srv" / "rel-link").symlink_to("../etc/conf")
    os.lchown(m / "srv" / "rel-link", 42, 43)
    os.mkfifo(m / "srv" / "fifo", 0o620)
    os.mknod(m / "srv" / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.chmod(m / "bin" / "tool", 0o4750)  # setuid survives apply (chown before chmod)
    (m / "usr" / "lib" / "liby.so").write_bytes(b"y")  # written under a lower dir
    (m / "proc").mkdir()  # mount points: excluded
    (m / "run" / "secrets").mkdir(parents=True)
    (m / "run" / "secrets" / "token").write_text("secret")
    (m / "run" / "app.pid").write_text("1\n")
    (m / "mnt" / "bind").mkdir(parents=True)
    (m / "mnt" / "bind" / "x").write_text("bind content")


@pytest.mark.parametrize("compress", [False, True])
def test_rootfs_diff_round_trip(tmp_path: Path, overlay: dict[str, Path], compress: bool) -> None:
    merged = overlay["merged"]
    _mutate(merged)
    out = tmp_path / "rootfs-diff.tar"
    deleted_file = tmp_path / "deleted.files"
    summary = capture_rootfs_diff(
        overlay["upper"], out, exclude=["/mnt/bind"], compress=compress, deleted_files=deleted_file
    )
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert sorted(summary.deleted) == ["/etc/motd", "/gone-dir", "/keep/file"]
    assert json.loads(deleted_file.read_text()) == summary.deleted
    assert summary.opaque_dirs == ["/data"]
    assert {"/mnt/bind", "/proc", "/run/secrets"} <= set(summary.skipped)
    assert summary.hardlinks == 2 and summary.devices == 2
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert "etc/.wh.motd" in names and f"data/{OPAQUE_MARKER}" in names
    assert not any(n.startswith(("proc", "run/secrets", "mnt/bind")) for n in names)
    if compress:
        with gzip.open(out) as g:
            g.read(1)

    target = tmp_path / "target"
    subprocess.run(["cp", "-a", f"{overlay['lower']}/.", str(target)], check=True)
    applied = apply_rootfs_diff(out, target)
    assert applied.whiteouts == 3 and applied.opaque_dirs == ["/data"]

    skip = ("proc", "run/secrets", "mnt/bind")
    want, got = _snapshot(merged, skip), _snapshot(target, skip)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == want[k], k
    assert not (target / "data" / "old").exists() and not (target / "data" / "y").exists()
    st1, st2 = (target / "srv" / "new.txt").stat(), (target / "srv" / "new-hard").stat()
    assert st1.st_ino == st2.st_ino
    assert (target / "etc/hostname").stat().st_ino == (target / "etc/hostname.bak").stat().st_ino
    assert (target / "lib").is_symlink()  # the lower symlink was not replaced


def test_capture_refuses_existing_output_and_missing_upper(tmp_path: Path) -> None:
    up = tmp_path / "up"
    up.mkdir()
    (tmp_path / "exists.tar").write_bytes(b"")
    with pytest.raises(FailedPrecondition):
        capture_rootfs_diff(up, tmp_path / "exists.tar")
    with pytest.raises(NotFound):
        capture_rootfs_diff(tmp_path / "nope", tmp_path / "x.tar")
    assert not (tmp_path / "x.tar").exists()


def _tar(path: Path, members: list[tuple[str, bytes, str]]) -> Path:
    """members: (name, type, data-or-linkname)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for name, typ, data in members:
            ti = tarfile.TarInfo(name)
            ti.type = typ
            ti.mode = 0o644
            if typ in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                ti.linkname = data
                t.addfile(ti)
            elif typ == tarfile.DIRTYPE:
                ti.mode = 0o755
                t.addfile(ti)
            else:
                raw = data.encode()
                ti.size = len(raw)
                t.addfile(ti, io.BytesIO(raw))
    return path


@pytest.fixture
def hostile(tmp_path: Path) -> dict[str, Path]:
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("precious")
    (rootfs / "esc").symlink_to(outside)  # a pre-existing escaping symlink in the image
    return {"rootfs": rootfs, "outside": outside, "tmp": tmp_path}


@pytest.mark.parametrize(
    "members",
    [
        [("../evil", tarfile.REGTYPE, "x")],
        [("/abs-evil", tarfile.REGTYPE, "x")],
        [("a/../../evil", tarfile.REGTYPE, "x")],
        [("lnk", tarfile.SYMTYPE, "../outside"), ("lnk/evil", tarfile.REGTYPE, "x")],
        [("esc/evil", tarfile.REGTYPE, "x")],
        [("esc", tarfile.DIRTYPE, ""), ("esc/../../evil", tarfile.REGTYPE, "x")],
        [("h", tarfile.LNKTYPE, "../outside/victim")],
        [("h", tarfile.LNKTYPE, "/etc/passwd")],
    ],
)
def test_apply_rejects_escaping_members(hostile: dict[str, Path], members: list[Any]) -> None:
    tar = _tar(hostile["tmp"] / "evil.tar", members)
    with pytest.raises(InvalidArgument):
        apply_rootfs_diff(tar, hostile["rootfs"])
    assert sorted(os.listdir(hostile["outside"])) == ["victim"]
    assert (hostile["outside"] / "victim").read_text() == "precious"
    assert not (hostile["tmp"] / "evil").exists()


def test_apply_whiteouts_never_follow_symlinks(hostile: dict[str, Path]) -> None:
    tar = _tar(
        hostile["tmp"] / "wh.tar",
        [("esc/.wh.victim", tarfile.REGTYPE, ""), (f"esc/{OPAQUE_MARKER}", tarfile.REGTYPE, "")],
    )
    apply_rootfs_diff(tar, hostile["rootfs"])
    assert (hostile["outside"] / "victim").read_text() == "precious"
    assert (hostile["rootfs"] / "esc").is_symlink()
    assert apply_deleted_files(hostile["rootfs"], ["/esc/victim", "/nonexistent/x"]) == 0
    assert (hostile["outside"] / "victim").exists()
    with pytest.raises(InvalidArgument):
        apply_deleted_files(hostile["rootfs"], ["/../outside/victim"])


def test_apply_replaces_escaping_symlink_with_dir(hostile: dict[str, Path]) -> None:
    # a dir member replaces the symlink itself (never chmods through it)
    mode_before = stat.S_IMODE(hostile["outside"].stat().st_mode)
    tar = _tar(hostile["tmp"] / "d.tar", [("esc", tarfile.DIRTYPE, ""), ("esc/f", tarfile.REGTYPE, "in")])
    apply_rootfs_diff(tar, hostile["rootfs"])
    assert (hostile["rootfs"] / "esc").is_dir() and not (hostile["rootfs"] / "esc").is_symlink()
    assert (hostile["rootfs"] / "esc" / "f").read_text() == "in"
    assert stat.S_IMODE(hostile["outside"].stat().st_mode) == mode_before
    assert sorted(os.listdir(hostile["outside"])) == ["victim"]


def test_apply_corrupt_tar(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "bad.tar").write_bytes(os.urandom(4096))
    with pytest.raises(DataLoss):
        apply_rootfs_diff(tmp_path / "bad.tar", tmp_path / "r")
    with pytest.raises(NotFound):
        apply_rootfs_diff(tmp_path / "missing.tar", tmp_path / "r")


def test_apply_deleted_files(tmp_path: Path) -> None:
    r = tmp_path / "r"
    (r / "etc").mkdir(parents=True)
    (r / "etc" / "a").write_text("a")
    (r / "d" / "e").mkdir(parents=True)
    assert apply_deleted_files(r, ["/etc/a", "/d", "/missing"]) == 2
    assert sorted(os.listdir(r)) == ["etc"] and os.listdir(r / "etc") == []
