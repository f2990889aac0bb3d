"""Directories held open (shim/archive/dirfd.py): once podshim holds a directory, replacing its
path by a symlink to somewhere else changes nothing about where podshim writes, chmods, lists or
removes. The end-to-end proof with CRIU is tests/faults/test_path_swap.py."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from shim import errors
from shim.aio import Steps
from shim.archive import crypto, dirfd, manifest
from shim.archive.container_tar import container_tar_files
from shim.archive.dirfd import DirHandle, open_checked
from shim.ops.restore_container import extract_archive


def fingerprint(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [".", *dirnames, *filenames]:
            p = Path(dirpath) / n
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "secret").write_text("keep\n")
    (d / "secret").chmod(0o644)
    (d / "sub").chmod(0o755)
    return d


def swap(path: Path, to: Path) -> Path:
    """Move `path` away and put a symlink to `to` in its place; returns where it went."""
    moved = path.with_name(path.name + ".moved")
    os.rename(path, moved)
    os.symlink(to, path)
    return moved


def test_writes_follow_the_held_directory_not_the_path(tmp_path: Path, outside: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    before = fingerprint(outside)
    with open_checked(out, str(out), "output path", empty=True) as h:
        moved = swap(out, outside)
        with h.sub("containers/app", create=True) as c:
            c.write_file("config.dump", b"{}")
            fd = c.create("big")
            os.write(fd, b"x" * 10)
            os.close(fd)
        (moved / "containers" / "app" / "loose").write_bytes(b"y")
        (moved / "containers" / "app" / "loose").chmod(0o644)
        os.symlink(outside / "secret", moved / "link")
        h.make_private()
        assert stat.S_IMODE((moved / "containers" / "app" / "loose").stat().st_mode) == 0o600
        assert stat.S_IMODE((moved / "containers").stat().st_mode) == 0o700
        with pytest.raises(errors.FailedPrecondition, match="replaced during the checkpoint"):
            h.check_in_place("output path", "the checkpoint")
        (moved / "link").unlink()
        h.clear()
        assert list(moved.iterdir()) == []
    assert fingerprint(outside) == before


def test_make_private_and_clear_leave_symlink_targets_alone(tmp_path: Path, outside: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    os.symlink(outside / "secret", d / "file-link")
    os.symlink(outside / "sub", d / "dir-link")
    before = fingerprint(outside)
    with DirHandle.open(d) as h:
        h.make_private()
        h.chmod("file-link", 0o600)
        h.clear()
    assert list(d.iterdir()) == []
    assert fingerprint(outside) == before


def test_open_follows_no_symlink(tmp_path: Path, outside: Path) -> None:
    os.symlink(outside, tmp_path / "link")
    with pytest.raises(errors.InvalidArgument, match="symlink"):
        DirHandle.open(tmp_path / "link")
    with pytest.raises(errors.InvalidArgument, match="symlink"):
        DirHandle.open(tmp_path / "link" / "sub")
    d = tmp_path / "real"
    d.mkdir()
    os.symlink(outside, d / "inner")
    with DirHandle.open(d) as h, pytest.raises(OSError):
        h.sub("inner/sub")
    with pytest.raises(errors.InvalidArgument, match="not a directory"):
        dirfd.clear_dir_contents(tmp_path / "link")
    assert (outside / "secret").exists()


def test_open_checked_refuses_a_changed_or_filled_directory(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "x").write_text("caller's")
    with pytest.raises(errors.InvalidArgument, match="not empty"):
        open_checked(d, str(d), "output path", empty=True)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(errors.InvalidArgument, match="changed while it was checked"):
        open_checked(d, str(other), "output path")


def test_write_manifest_and_encrypt_through_the_held_dir(tmp_path: Path, outside: Path) -> None:
    out = tmp_path / "out"
    (out / "containers" / "app").mkdir(parents=True)
    (out / "containers" / "app" / "pages.img").write_bytes(b"p" * 5000)
    before = fingerprint(outside)
    key = crypto.NodeKey(b"k" * 32)
    with DirHandle.open(out) as h:
        moved = swap(out, outside)
        crypto.encrypt_tree(h, key)
        m = manifest.Manifest(sandbox=manifest.SandboxInfo(id="s", metadata={}, config={}))
        manifest.write_manifest(h, m, key=key)
    assert fingerprint(outside) == before
    assert (moved / "manifest.json").is_file()
    assert set(json.loads((moved / "manifest.json").read_text())["files"]) == {"containers/app/pages.img"}
    assert crypto.is_encrypted_bytes((moved / "containers" / "app" / "pages.img").read_bytes())


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def test_import_extracts_into_the_held_dir(tmp_path: Path, outside: Path) -> None:
    tar = tmp_path / "c.tar"
    tar.write_bytes(_tar({"spec.dump": b"{}", "checkpoint/inventory.img": b"i"}))
    dest = tmp_path / "import"
    dest.mkdir()
    before = fingerprint(outside)
    with DirHandle.open(dest) as h:
        moved = swap(dest, outside)
        written = extract_archive(tar, h, Steps())
        assert list(written) == ["spec.dump", "checkpoint/inventory.img"]
        # hashed as written: what reading the tree again gives
        assert written == container_tar_files(h, Steps().check)
    assert fingerprint(outside) == before
    assert (moved / "checkpoint" / "inventory.img").read_bytes() == b"i"
    assert stat.S_IMODE((moved / "checkpoint").stat().st_mode) == 0o700
    assert stat.S_IMODE((moved / "spec.dump").stat().st_mode) == 0o600


def test_import_refuses_deep_nesting(tmp_path: Path) -> None:
    tar = tmp_path / "deep.tar"
    tar.write_bytes(_tar({"/".join(["d"] * 40) + "/f": b"x"}))
    with pytest.raises(errors.InvalidArgument, match="nests deeper"):
        extract_archive(tar, tmp_path / "import", Steps())


def test_held_tree_depth_is_bounded(tmp_path: Path) -> None:
    deep = tmp_path.joinpath(*(["d"] * (dirfd.MAX_DEPTH + 2)))
    deep.mkdir(parents=True)
    with DirHandle.open(tmp_path) as h, pytest.raises(errors.Internal, match="nest deeper"):
        h.tree()


def test_decrypted_copy_goes_into_the_held_dir(tmp_path: Path, outside: Path) -> None:
    key = crypto.NodeKey(b"k" * 32)
    archive = tmp_path / "a"
    (archive / "containers" / "app" / "checkpoint").mkdir(parents=True)
    (archive / "containers" / "app" / "checkpoint" / "pages.img").write_bytes(b"z" * 3000)
    crypto.encrypt_tree(archive, key)
    state = tmp_path / "state"
    d = crypto.new_decrypted_dir(state, archive, "app")
    before = fingerprint(outside)
    with DirHandle.open(d) as h:
        moved = swap(d, outside)
        crypto.decrypt_members(archive, ["containers/app/checkpoint/pages.img"], "containers/app", h, key)
    assert fingerprint(outside) == before
    assert (moved / "checkpoint" / "pages.img").read_bytes() == b"z" * 3000
    crypto.remove_decrypted(d)  # d is the symlink now: its target is left alone
    assert fingerprint(outside) == before
    crypto.remove_decrypted(moved)
    assert not moved.exists()
