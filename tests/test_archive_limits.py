"""Unit tests (no bed) of the archive limits: an archive podshim must refuse before reading it
(sparse members, members larger than their file system, directories nested past the limit, a
container missing a member its checkpoint has), verification that stops when told, the lanes
that keep restores off the threads checkpoints use, and CRI strings the upstream cannot undo."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import aio
from shim.archive import fsutil, layout
from shim.archive.manifest import (
    ContainerEntry,
    HostInfo,
    Manifest,
    SandboxInfo,
    check_container_members,
    load_and_verify,
    read_manifest,
    verify_files,
    write_manifest,
)
from shim.archive.tree_check import MAX_TREE_DEPTH
from shim.checks import cri_strings
from shim.errors import DataLoss, InvalidArgument, ResourceExhausted


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "pod-checkpoints"
    r.mkdir()
    return r


def archive(root: Path, diff: bool = True) -> tuple[Path, Manifest]:
    """A small archive with every member a podshim checkpoint has (rootfs diff optional)."""
    d = root / "ck"
    d.mkdir()
    lay = layout.ArchiveLayout(d).create()
    fsutil.write_private_file(lay.sandbox_config, b"{}")
    c = lay.container("app").create()
    fsutil.write_private_file(c.config_dump, json.dumps({"image": "busybox"}).encode())
    fsutil.write_private_file(c.spec_dump, b"{}")
    (c.checkpoint_dir / "inventory.img").write_bytes(b"inv")
    (c.checkpoint_dir / "pages-1.img").write_bytes(os.urandom(1 << 20))
    if diff:
        (c.root / layout.ROOTFS_DIFF_TAR).write_bytes(b"\0" * 10240)
        (c.root / layout.DELETED_FILES_FILE).write_bytes(b"[]")
    m = Manifest(
        sandbox=SandboxInfo(id="sb", metadata={"name": "web"}, config={}),
        containers=[
            ContainerEntry(
                name="app",
                id="c1",
                image="busybox",
                state="CONTAINER_RUNNING",
                restart_count=0,
                checkpointed=True,
                dir=c.rel,
            )
        ],
        host=HostInfo(),
    )
    return d, write_manifest(d, m)


def edit(d: Path, fn: object) -> None:
    doc = json.loads((d / "manifest.json").read_text())
    fn(doc)  # type: ignore[operator]
    (d / "manifest.json").write_text(json.dumps(doc))


# ---------------------------------------------------------------------------- sparse members


def test_hole_bytes(tmp_path: Path) -> None:
    dense = tmp_path / "dense"
    dense.write_bytes(os.urandom(1 << 20))
    assert fsutil.hole_bytes(dense, 0) == 0
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.write(b"x" * 4096)
        f.truncate(1 << 30)
    assert fsutil.hole_bytes(sparse, 1 << 40) >= (1 << 30) - (1 << 20)


def test_sparse_member_is_refused_before_it_is_read(root: Path) -> None:
    """A 64 GiB sparse pages image whose size the manifest agrees with: DATA_LOSS at once (read in
    full it would take minutes), naming the file."""
    d, _m = archive(root)
    rel = "containers/app/checkpoint/pages-1.img"
    (d / rel).unlink()
    with open(d / rel, "wb") as f:
        f.truncate(64 << 30)
    edit(d, lambda doc: doc["files"][rel].update(size=64 << 30))
    start = time.monotonic()
    with pytest.raises(DataLoss, match="sparse") as err:
        load_and_verify(d, [str(root)])
    assert rel in err.value.message
    assert time.monotonic() - start < 5, "the sparse member was read"


def test_member_larger_than_its_file_system_is_refused(root: Path) -> None:
    d, _m = archive(root)
    rel = "containers/app/checkpoint/pages-1.img"
    vfs = os.statvfs(d)
    size = vfs.f_blocks * vfs.f_frsize + (1 << 30)
    with open(d / rel, "r+b") as f:
        f.truncate(size)
    edit(d, lambda doc: doc["files"][rel].update(size=size))
    with pytest.raises(DataLoss, match="more than its file system holds"):
        load_and_verify(d, [str(root)])


def test_verification_stops_when_told(root: Path) -> None:
    d, m = archive(root)
    stop = threading.Event()
    stop.set()
    with pytest.raises(fsutil.Stopped):
        verify_files(d, read_manifest(d), stop=stop)
    verify_files(d, m)  # and without: fine


# ---------------------------------------------------------------------------- nesting


def test_deeply_nested_directories_are_refused_with_a_message(root: Path) -> None:
    """1500 nested directories: INVALID_ARGUMENT naming the limit, not an uncaught
    "File name too long" from stat."""
    d, _m = archive(root)
    fd = os.open(d / "containers/app", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):
            os.mkdir("dddddddd", dir_fd=fd)
            nfd = os.open("dddddddd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    with pytest.raises(InvalidArgument, match=f"deeper than {MAX_TREE_DEPTH}"):
        load_and_verify(d, [str(root)])
    subprocess.run(["rm", "-rf", str(d)], check=True)  # rmtree may trip over the depth itself


# ---------------------------------------------------------------------------- members


def test_manifest_records_each_containers_members(root: Path) -> None:
    d, m = archive(root)
    assert read_manifest(d).container("app").members == [
        "checkpoint/inventory.img",
        "checkpoint/pages-1.img",
        "config.dump",
        "deleted.files",
        "rootfs-diff.tar",
        "spec.dump",
    ]
    check_container_members(d, m, m.container("app"))


@pytest.mark.parametrize("with_members", [True, False], ids=["members", "older-manifest"])
def test_rootfs_diff_removed_with_its_entries_is_data_loss(root: Path, with_members: bool) -> None:
    """rootfs-diff.tar and deleted.files removed together with their manifest entries (and from the
    members list, or from a manifest older than it): the archive verifies, RestorePod's member
    check refuses it."""
    d, _m = archive(root)

    def drop(doc: dict) -> None:
        c = doc["containers"][0]
        for name in ("rootfs-diff.tar", "deleted.files"):
            del doc["files"][f"containers/app/{name}"]
            (d / "containers/app" / name).unlink()
            if with_members:
                c["members"].remove(name)
        if not with_members:
            del c["members"]

    edit(d, drop)
    m = load_and_verify(d, [str(root)])  # consistent: files and manifest agree
    assert (m.container("app").members is None) is not with_members
    with pytest.raises(DataLoss, match="rootfs-diff.tar") as err:
        check_container_members(d, m, m.container("app"))
    assert "'app'" in err.value.message


def test_member_missing_from_the_members_list(root: Path) -> None:
    d, _m = archive(root)
    edit(d, lambda doc: doc["containers"][0]["members"].append("checkpoint/pages-2.img"))
    m = load_and_verify(d, [str(root)])
    with pytest.raises(DataLoss, match="pages-2.img"):
        check_container_members(d, m, m.container("app"))
    edit(d, lambda doc: doc["containers"][0]["members"].remove("checkpoint/pages-1.img"))
    edit(d, lambda doc: doc["containers"][0]["members"].remove("checkpoint/pages-2.img"))
    m = load_and_verify(d, [str(root)])
    with pytest.raises(DataLoss, match="does not list"):
        check_container_members(d, m, m.container("app"))


def test_members_must_be_strings(root: Path) -> None:
    d, _m = archive(root)
    edit(d, lambda doc: doc["containers"][0].update(members=[1]))
    with pytest.raises(DataLoss, match="members"):
        read_manifest(d)


# ---------------------------------------------------------------------------- lanes


def test_lane_runs_on_its_own_threads_and_is_bounded() -> None:
    lane = aio.Lane("test", workers=1, max_operations=2)

    async def main() -> None:
        outside = await aio.run_to_end(lambda: threading.current_thread().name)
        assert not outside.startswith("podshim-test")
        with lane.enter():
            inside = await aio.run_to_end(lambda: threading.current_thread().name)
            assert inside.startswith("podshim-test")
            with lane.enter(), pytest.raises(ResourceExhausted, match="at most 2"), lane.enter():
                pass
        assert lane.active == 0

    asyncio.run(main())


def test_cancelled_call_queued_in_a_lane_never_runs() -> None:
    lane = aio.Lane("test", workers=1, max_operations=8)
    ran: list[str] = []
    release = threading.Event()

    async def main() -> None:
        with lane.enter():
            busy = asyncio.ensure_future(aio.run_to_end(release.wait))
            queued = asyncio.ensure_future(aio.run_to_end(ran.append, "queued"))
            await asyncio.sleep(0.05)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            release.set()
            await busy
        lane.pool.shutdown(wait=True)

    asyncio.run(main())
    assert ran == []


# ---------------------------------------------------------------------------- CRI strings


def _sandbox(**md: str) -> cri.PodSandboxConfig:
    fields = {"name": "web", "namespace": "default", "uid": "u1", **md}
    return cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(**fields), hostname="web")


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (_sandbox(name="a\x00b"), "metadata.name"),
        (_sandbox(namespace="a\x00b"), "metadata.namespace"),
        (_sandbox(uid="u\x00"), "metadata.uid"),
        (_sandbox(name="a;b"), "CNI_ARGS"),
        (_sandbox(namespace="a=b"), "CNI_ARGS"),
        (_sandbox(name="n" * 200_000), "bytes long"),
        (cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="x"), hostname="h" * 65), "HOST_NAME_MAX"),
        (cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="x"), hostname="h\x00"), "hostname"),
        (cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="x"), log_directory="/l\x00"), "log_dir"),
    ],
)
def test_sandbox_configs_the_upstream_cannot_undo(config: cri.PodSandboxConfig, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        cri_strings.check_sandbox_config(config)


def test_ordinary_configs_pass() -> None:
    cri_strings.check_sandbox_config(_sandbox(name="web-0.x", uid="6f1c2d3e-aaaa-bbbb-cccc-0123456789ab"))
    cri_strings.check_sandbox_config(_sandbox(name="a/b c_d"))  # containerd takes these
    cri_strings.check_container_config(cri.ContainerConfig(metadata=cri.ContainerMetadata(name="a;b=c")))
    with pytest.raises(InvalidArgument, match="NUL"):
        cri_strings.check_container_config(cri.ContainerConfig(metadata=cri.ContainerMetadata(name="a\x00")))


# ---------------------------------------------------------------------------- runtime handlers


def test_handler_the_upstream_lacks() -> None:
    from shim.ops.restore_checks import upstream_handlers
    from shim.ops.restore_pod import unknown_handler

    cfg = {"containerd": {"runtimes": {"runc": {}, "crun": {}}}}
    assert upstream_handlers({"config": json.dumps(cfg)}) == {"runc", "crun"}
    assert upstream_handlers({}) is None and upstream_handlers({"config": "[]"}) is None
    # containerd 1.6's RunPodSandbox answer, the fallback when Status does not say
    e = unknown_handler('failed to get sandbox runtime: no runtime for "ghost" is configured', "ghost")
    assert isinstance(e, InvalidArgument) and "'ghost'" in e.message
    assert unknown_handler("something else", "ghost") is None


def test_rootfs_diff_check_stops_when_told(tmp_path: Path) -> None:
    import tarfile

    from shim.archive import rootfs_diff

    tar = tmp_path / "rootfs-diff.tar"
    with tarfile.open(tar, "w") as t:
        for i in range(3):
            t.addfile(tarfile.TarInfo(f"f{i}"))
    rootfs_diff.check_rootfs_diff(tar, [], threading.Event())
    stop = threading.Event()
    stop.set()
    with pytest.raises(fsutil.Stopped):
        rootfs_diff.check_rootfs_diff(tar, [], stop)


@pytest.mark.parametrize("name", ["/".join(["d"] * 1500) + "/f", "n" * 300], ids=["1500-deep", "long-name"])
def test_container_tar_with_unusable_member_names(tmp_path: Path, name: str) -> None:
    """CreateContainer from a container checkpoint tar: INVALID_ARGUMENT, not an uncaught
    'File name too long' from mkdir/open (INTERNAL)."""
    import io
    import tarfile

    from shim.aio import Steps
    from shim.ops import restore_container as rc

    tar = tmp_path / "ck.tar"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo(name)
        ti.size = 1
        t.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(InvalidArgument, match="nests deeper than"):
        rc.extract_archive(tar, tmp_path / "import", Steps())


def test_rootfs_diff_names_no_file_system_takes(tmp_path: Path) -> None:
    """Refused by the up-front check (INVALID_ARGUMENT), not as ENAMETOOLONG when podshim-runc
    applies the diff; a whiteout of a 255-byte name ('.wh.' + 255) and 1500-deep paths are fine."""
    import io
    import tarfile

    from shim.archive import rootfs_diff

    def tar_of(*members: tarfile.TarInfo) -> Path:
        p = tmp_path / f"{len(list(tmp_path.iterdir()))}.tar"
        with tarfile.open(p, "w", format=tarfile.PAX_FORMAT) as t:
            for ti in members:
                t.addfile(ti, io.BytesIO(b""))
        return p

    ok = [tarfile.TarInfo(".wh." + "w" * 255), tarfile.TarInfo("/".join(["d"] * 1500) + "/f")]
    rootfs_diff.check_rootfs_diff(tar_of(*ok), [])
    with pytest.raises(InvalidArgument, match="over 255 bytes"):
        rootfs_diff.check_rootfs_diff(tar_of(tarfile.TarInfo("d/" + "n" * 256)), [])
    link = tarfile.TarInfo("l")
    link.type, link.linkname = tarfile.SYMTYPE, "x" * 5000
    with pytest.raises(InvalidArgument, match="symlink target over 4096"):
        rootfs_diff.check_rootfs_diff(tar_of(link), [])


def test_long_names_below_the_depth_limit(tmp_path: Path) -> None:
    """Directories of 255-byte names under a long archive path: past PATH_MAX before the depth
    limit; INVALID_ARGUMENT, not an uncaught ENAMETOOLONG (or INTERNAL)."""
    base = tmp_path
    for i in range(4):
        base = base / (str(i) * 250)
    base.mkdir(parents=True)
    d, _m = archive(base)
    fd = os.open(d / "containers/app", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(MAX_TREE_DEPTH - 4):
            os.mkdir(chr(ord("a") + i) * 255, dir_fd=fd)
            nfd = os.open(chr(ord("a") + i) * 255, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    with pytest.raises(InvalidArgument, match="too long"):
        load_and_verify(d, [str(base)])
    subprocess.run(["rm", "-rf", str(tmp_path / ("0" * 250))], check=True)
