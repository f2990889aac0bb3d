"""shim/archive/volumes.py: a pod's emptyDirs found from its containers' mounts, tarred with
their holes, owners and links, refused over the node's limit, and applied without following a
symlink (unit tests on a real file system)."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import errors
from shim.archive import volumes

UID = "0c9f3a8e-5b1d-4c7e-9f2a-1d3e5f7a9b0c"
KUBELET = "/var/lib/kubelet"


def empty_dir(name: str, uid: str = UID) -> str:
    return f"{KUBELET}/pods/{uid}/volumes/kubernetes.io~empty-dir/{name}"


def bind(source: str, dest: str) -> dict[str, object]:
    return {"destination": dest, "type": "bind", "source": source, "options": ["rbind", "rw"]}


def test_finds_the_pods_empty_dirs_only() -> None:
    """A bind mount from the pod's own kubernetes.io~empty-dir/<name> is an emptyDir; another
    pod's, a configMap's or a plain host path is not; two containers of one volume are one."""
    specs: list[tuple[str, dict[str, Any]]] = [
        ("init", {"mounts": [bind(empty_dir("work"), "/work")]}),
        (
            "app",
            {
                "mounts": [
                    bind(empty_dir("work"), "/data"),
                    bind(empty_dir("cache") + "/", "/cache"),
                    bind(empty_dir("other", uid="another-pod"), "/other"),
                    bind(f"{KUBELET}/pods/{UID}/volumes/kubernetes.io~configmap/cfg", "/cfg"),
                    bind("/srv/data", "/srv"),
                    {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
                ]
            },
        ),
    ]
    found = volumes.find_empty_dirs(specs, UID)
    assert [(d.name, d.host_path, d.mounts) for d in found] == [
        ("cache", empty_dir("cache"), (("app", "/cache"),)),
        ("work", empty_dir("work"), (("init", "/work"), ("app", "/data"))),
    ]


def make_tree(root: Path) -> None:
    (root / "sub").mkdir()
    (root / "msg").write_text("rendered config\n")
    os.chown(root / "msg", 1000, 2000)
    os.chmod(root / "msg", 0o640)
    os.symlink("msg", root / "link")
    os.link(root / "msg", root / "sub" / "hard")
    with open(root / "sparse", "wb") as f:  # 64 MiB with 2 small data segments
        f.truncate(64 << 20)
        f.seek(20 << 20)
        f.write(b"middle")
        f.seek((64 << 20) - 3)
        f.write(b"end")
    os.mkfifo(root / "fifo")
    os.chmod(root, 0o1777)


def test_capture_and_apply_keep_content_owners_links_and_holes(tmp_path: Path) -> None:
    src, dst, tar = tmp_path / "src", tmp_path / "dst", tmp_path / "work.tar"
    src.mkdir()
    dst.mkdir()
    make_tree(src)
    got = volumes.capture(src, tar)
    assert (got.files, got.symlinks, got.hardlinks, got.fifos, got.sparse_files) == (2, 1, 1, 1, 1)
    # the holes are not stored: the tar is far smaller than the 64 MiB file
    assert tar.stat().st_size < 1 << 20
    volumes.check_tar(tar)
    volumes.apply(tar, dst)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o1777
    st = (dst / "msg").stat()
    assert ((dst / "msg").read_text(), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (
        "rendered config\n",
        1000,
        2000,
        0o640,
    )
    assert os.readlink(dst / "link") == "msg"
    assert (dst / "sub" / "hard").stat().st_ino == st.st_ino
    assert stat.S_ISFIFO((dst / "fifo").lstat().st_mode)
    restored = dst / "sparse"
    assert restored.read_bytes() == (src / "sparse").read_bytes()
    assert restored.stat().st_blocks * 512 < 1 << 20, "the holes were written out"
    # GNU tar reads the sparse member too
    with tarfile.open(tar) as t:
        names = {m.name for m in t.getmembers()}
    assert {"msg", "sparse", "link", "sub/hard"} <= names


def test_apply_refuses_a_filled_target(tmp_path: Path) -> None:
    src, dst, tar = tmp_path / "src", tmp_path / "dst", tmp_path / "t.tar"
    src.mkdir()
    dst.mkdir()
    (src / "a").write_text("x")
    volumes.capture(src, tar)
    (dst / "leftover").write_text("y")
    with pytest.raises(errors.FailedPrecondition, match="not empty"):
        volumes.apply(tar, dst)


def hostile_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))


def info(name: str, typ: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = typ, linkname, 0o644
    return ti


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([(info("../escape"), b"x")], "'..'"),
        ([(info("/etc/passwd"), b"x")], "absolute"),
        ([(info("out", tarfile.SYMTYPE, "/etc"), b""), (info("out/passwd"), b"x")], "symlink"),
        ([(info("dev", tarfile.CHRTYPE), b"")], "unsupported type"),
    ],
)
def test_a_hostile_tar_is_refused_before_anything_is_written(
    tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]], why: str
) -> None:
    tar, dst = tmp_path / "bad.tar", tmp_path / "dst"
    dst.mkdir()
    hostile_tar(tar, members)
    with pytest.raises(errors.InvalidArgument, match=why):
        volumes.check_tar(tar)
    with pytest.raises(errors.InvalidArgument, match=why):
        volumes.apply(tar, dst)
    assert list(dst.iterdir()) == []


def test_a_pod_over_the_limit_is_refused_with_its_size_and_the_key(tmp_path: Path) -> None:
    """The sum of the emptyDirs counts; the message names the total, the largest and the key."""
    d = tmp_path / "big"
    d.mkdir()
    (d / "data").write_bytes(b"\1" * (3 << 20))
    with open(d / "holes", "wb") as f:  # 1 GiB of holes counts nothing
        f.truncate(1 << 30)
    sizes = {"big": volumes.tree_bytes(d), "small": 4096}
    assert 3 << 20 < sizes["big"] < 4 << 20
    volumes.check_limit(sizes, 8 << 20, "checkpoint.empty_dir_limit")
    with pytest.raises(errors.FailedPrecondition) as e:
        volumes.check_limit(sizes, 2 << 20, "checkpoint.empty_dir_limit")
    msg = e.value.message
    assert "'big'" in msg and "3.0 MiB" in msg and "checkpoint.empty_dir_limit" in msg, msg
    assert "nothing was frozen" in msg, msg


def test_targets_are_the_new_pods_paths_of_the_same_names() -> None:
    new = "1e2d3c4b-0000-4000-8000-000000000000"
    cc = cri.ContainerConfig(
        mounts=[
            cri.Mount(host_path=empty_dir("work", uid=new), container_path="/data"),
            cri.Mount(host_path="/srv", container_path="/srv"),
        ]
    )
    assert volumes.targets(["work"], [cc], new) == {"work": empty_dir("work", uid=new)}
    with pytest.raises(errors.FailedPrecondition, match="'cache'"):
        volumes.targets(["work", "cache"], [cc], new)
    dirs = [
        volumes.EmptyDir("work", empty_dir("work"), (("app", "/data"),)),
        volumes.EmptyDir("idle", empty_dir("idle"), (("app", "/idle"),)),
    ]
    rec = volumes.record_bytes(dirs, {"work": volumes.Summary()})  # "idle" was empty: not captured
    assert volumes.parse_record(rec, "volumes.json") == volumes.Record(("work",), False)
    shm = ("/run/sandboxes/x/shm", volumes.Summary(files=2))
    rec = volumes.record_bytes(dirs, {}, shm)
    assert volumes.parse_record(rec, "volumes.json") == volumes.Record((), True)
    with pytest.raises(errors.DataLoss):
        volumes.parse_record(b"{}", "volumes.json")
    bad = json.dumps({"version": 1, "empty_dirs": [{"name": "../x"}], "dev_shm": None}).encode()
    with pytest.raises(errors.InvalidArgument):
        volumes.parse_record(bad, "volumes.json")


def test_dev_shm_is_the_pods_own_mount_only() -> None:
    """The pod's /dev/shm is the bind mount the runtime gives it; a host-IPC pod's is the node's."""
    own = {"mounts": [{"destination": "/dev/shm", "type": "bind", "source": "/run/c/sandboxes/x/shm"}]}
    host = {"mounts": [{"destination": "/dev/shm", "type": "bind", "source": "/dev/shm"}]}
    tmpfs = {"mounts": [{"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}]}
    assert volumes.dev_shm_source(own) == "/run/c/sandboxes/x/shm"
    assert volumes.dev_shm_source(host) is None
    assert volumes.dev_shm_source(tmpfs) is None
    assert volumes.dev_shm_source({}) is None


def test_pod_volumes_capture_what_holds_anything_and_fill_only_empty_targets(tmp_path: Path) -> None:
    """shim/ops/pod_volumes.py on a real file system: an empty emptyDir is not recorded, a filled one
    and the pod's /dev/shm are; fill puts them back, and a kubelet's restore (only_empty) leaves a
    volume an earlier container filled as it is."""
    from types import SimpleNamespace

    from shim.archive.dirfd import DirHandle
    from shim.ops import pod_volumes

    work, idle, shm = (tmp_path / "src" / n for n in ("work", "idle", "shm"))
    for d in (work, idle, shm):
        d.mkdir(parents=True)
    (work / "msg").write_text("hello")
    (shm / "PostgreSQL.1234").write_bytes(b"\1" * 4096)
    archive = tmp_path / "archive"
    (archive / "sandbox").mkdir(parents=True)
    found = pod_volumes.PodVolumes(
        (
            volumes.EmptyDir("idle", str(idle), (("app", "/idle"),)),
            volumes.EmptyDir("work", str(work), (("app", "/work"),)),
        ),
        str(shm),
    )
    with DirHandle.open(archive) as held:
        written = pod_volumes.capture(found, held)
    assert written == {"work": 5, "/dev/shm": 4096}
    rec = volumes.parse_record((archive / "sandbox" / "volumes.json").read_bytes(), "volumes.json")
    assert rec == volumes.Record(("work",), True)
    assert sorted(pod_volumes.tar_rels(rec)) == ["sandbox/dev-shm.tar", "sandbox/empty-dirs/work.tar"]
    pod_volumes.check(archive, rec, encrypted=False)

    new_work, new_shm = tmp_path / "new" / "work", tmp_path / "new" / "shm"
    new_work.mkdir(parents=True)
    new_shm.mkdir()
    m = SimpleNamespace(encryption=None, files={})
    where = pod_volumes.Targets({"work": str(new_work)}, str(new_shm))
    got = pod_volumes.fill(archive, m, rec, where, None, str(tmp_path))
    assert {f.name: f.bytes for f in got} == {"work": 5, "/dev/shm": 4096}
    assert (new_work / "msg").read_text() == "hello"
    assert (new_shm / "PostgreSQL.1234").read_bytes() == b"\1" * 4096
    # filled already (an earlier container of the pod): left alone, not refused
    assert pod_volumes.fill(archive, m, rec, where, None, str(tmp_path), only_empty=True) == []
    with pytest.raises(errors.FailedPrecondition, match="not empty"):
        pod_volumes.fill(archive, m, rec, where, None, str(tmp_path))
    assert (new_work / "msg").read_text() == "hello", "a refused fill touched a volume it did not fill"

    # the undo of a restore that failed after the fill: both volumes as the caller made them
    pod_volumes.empty_again(got)
    assert list(new_work.iterdir()) == [] and list(new_shm.iterdir()) == []
    # a fill that fails at its second volume (the new sandbox's /dev/shm is gone) empties the first
    new_shm.rmdir()
    with pytest.raises(errors.FailedPrecondition, match="cannot be opened"):
        pod_volumes.fill(archive, m, rec, where, None, str(tmp_path))
    assert list(new_work.iterdir()) == []


def test_a_container_tar_tree_carries_the_empty_dirs_that_hold_anything(tmp_path: Path) -> None:
    """CheckpointContainer's tree has no sandbox/ of its own: capture makes it only when a
    volume holds anything; the restore reads the record from the extracted tree (its members
    checked against the tar's manifest as it was loaded) and fills without a pod manifest."""
    from shim.archive.dirfd import DirHandle
    from shim.ops import pod_volumes

    work, idle, tree = tmp_path / "work", tmp_path / "idle", tmp_path / "tree"
    for d in (work, idle, tree):
        d.mkdir()
    dirs = (
        volumes.EmptyDir("idle", str(idle), (("app", "/idle"),)),
        volumes.EmptyDir("work", str(work), (("app", "/work"),)),
    )
    with DirHandle.open(tree) as held:
        assert pod_volumes.capture(pod_volumes.PodVolumes(dirs), held) == {}
    assert list(tree.iterdir()) == [] and pod_volumes.recorded_in_tree(tree, "t.tar") is None
    (work / "msg").write_text("hi")
    with DirHandle.open(tree) as held:
        assert pod_volumes.capture(pod_volumes.PodVolumes(dirs), held) == {"work": 2}
    rec = pod_volumes.recorded_in_tree(tree, "t.tar")
    assert rec == volumes.Record(("work",), False)
    new = tmp_path / "new"
    new.mkdir()
    where = pod_volumes.Targets({"work": str(new)}, None)
    got = pod_volumes.fill(tree, None, rec, where, None, str(tmp_path), only_empty=True)
    assert [f.name for f in got] == ["work"] and (new / "msg").read_text() == "hi"
    (tree / "sandbox" / "empty-dirs" / "work.tar").unlink()
    with pytest.raises(errors.DataLoss, match="does not hold"):
        pod_volumes.recorded_in_tree(tree, "t.tar")


def test_a_fill_that_fails_midway_leaves_the_volume_as_it_was(tmp_path: Path) -> None:
    """An apply that fails after some members were written (its last member, a hard link, names
    a file the tar does not hold): the target is emptied again and has its own mode, owner and
    mtime back, so a retry is not refused as 'not empty' and nothing half-filled passes for a
    filled volume."""
    dst, tar = tmp_path / "dst", tmp_path / "t.tar"
    dst.mkdir()
    root = info(".", tarfile.DIRTYPE)
    root.mode = 0o700
    hostile_tar(
        tar,
        [
            (root, b""),
            (info("sub", tarfile.DIRTYPE), b""),
            (info("sub/a"), b"written first"),
            (info("b"), b"and this"),
            (info("c", tarfile.LNKTYPE, "missing"), b""),
        ],
    )
    os.chmod(dst, 0o777)
    os.chown(dst, 1234, 5678)
    os.utime(dst, ns=(1_000_000_000, 2_000_000_000))
    with pytest.raises(errors.InvalidArgument, match="target is missing"):
        volumes.apply(tar, dst)
    st = dst.stat()
    assert list(dst.iterdir()) == []
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (
        0o777,
        1234,
        5678,
        2_000_000_000,
    )


def test_clear_never_follows_a_symlink_out_of_the_volume(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the volume's")
    vol = tmp_path / "vol"
    vol.mkdir()
    prior = volumes.Prior.of(os.stat(vol))
    (vol / "d").mkdir()
    (vol / "d" / "f").write_text("x")
    os.symlink(outside, vol / "link")
    os.symlink(outside, vol / "d" / "link")
    volumes.clear(vol, prior)
    assert list(vol.iterdir()) == []
    assert (outside / "keep").read_text() == "not the volume's"
