"""Hostile rootfs diffs: tar members and deleted.files entries that try to leave the container's
rootfs when podshim-runc applies them, as root, on the host (absolute names, '..', symlinks
planted by the tar or already in the rootfs, hardlinks out, bad whiteouts, lying sizes).

Fast table (no bed): apply_rootfs_diff / apply_deleted_files on a scratch rootfs next to a
canary directory: the documented error (or, where the entry is harmless, success) and the canary
untouched; the up-front check RestorePod runs agrees with it. End to end: such a diff inside an
otherwise consistent archive (checksums recomputed): RestorePod fails naming the member, creates
no sandbox, and the canary stays untouched.
"""

from __future__ import annotations

import io
import json
import secrets
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import __version__
from shim.archive import rootfs_diff
from shim.errors import DataLoss, InvalidArgument, ShimError
from testbed import pods

from .corpus import Ctx, rehash, rewrite

Member = tuple[str, str, Any]  # (kind, name, payload): file bytes, link target, ...


def make_tar(members: list[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for kind, name, payload in members:
            ti = tarfile.TarInfo(name)
            ti.mode = 0o644
            if kind == "file":
                ti.size = len(payload)
                tar.addfile(ti, io.BytesIO(payload))
                continue
            if kind == "dir":
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            elif kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, payload
            elif kind == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, payload
            elif kind == "type":
                ti.type = payload
            tar.addfile(ti)
    return buf.getvalue()


def lying_size_tar() -> bytes:
    """One member declaring 8 GiB, followed by 512 bytes of data: a truncated stream."""
    ti = tarfile.TarInfo("big")
    ti.size = 8 << 30
    return ti.tobuf(tarfile.GNU_FORMAT) + b"\0" * 512


@dataclass
class Scene:
    rootfs: Path
    canary: Path  # a directory next to the rootfs, with `secret` and `sub/file`

    def fingerprint(self) -> dict[str, tuple[int, int, int]]:
        out = {}
        for p in [self.canary, *sorted(self.canary.rglob("*"))]:
            st = p.lstat()
            out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns)
        return out


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    canary = tmp_path / "canary"
    (canary / "sub").mkdir(parents=True)
    (canary / "secret").write_text("host secret\n")
    (canary / "sub" / "file").write_text("x\n")
    rootfs = tmp_path / "bundle" / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "bin" / "app").write_text("app\n")
    (rootfs / "hostlink").symlink_to(canary)  # a symlink already in the image
    return Scene(rootfs, canary)


@dataclass(frozen=True)
class DiffCase:
    id: str
    tar: Callable[[Scene], bytes]
    deleted: Callable[[Scene], list[Any]] | None = None
    error: type[ShimError] | None = InvalidArgument  # None: applies, harmlessly
    needle: str = ""


CASES = [
    DiffCase("absolute-member", lambda s: make_tar([("file", "/etc/cron.d/x", b"pwn")]), needle="absolute"),
    DiffCase("dotdot-member", lambda s: make_tar([("file", "../../pwned", b"pwn")]), needle="escapes"),
    DiffCase(
        "inner-dotdot-member", lambda s: make_tar([("file", "bin/../../pwned", b"x")]), needle="escapes"
    ),
    DiffCase("dot-dotdot-member", lambda s: make_tar([("file", "./../pwned", b"x")]), needle="escapes"),
    DiffCase(
        "symlink-then-write-through",
        lambda s: make_tar([("symlink", "l", str(s.canary)), ("file", "l/pwned", b"x")]),
        needle="refusing to write through",
    ),
    DiffCase(
        "relative-symlink-then-write-through",
        lambda s: make_tar([("symlink", "l", "../../canary"), ("file", "l/pwned", b"x")]),
        needle="refusing to write through",
    ),
    DiffCase(
        "write-through-image-symlink",
        lambda s: make_tar([("file", "hostlink/pwned", b"x")]),
        needle="refusing to write through",
    ),
    DiffCase(
        "dir-through-image-symlink",
        lambda s: make_tar([("dir", "hostlink/newdir", None)]),
        needle="refusing to write through",
    ),
    DiffCase(
        "file-then-child",
        lambda s: make_tar([("file", "f", b"x"), ("file", "f/child", b"y")]),
        needle="refusing to write through",
    ),
    DiffCase(
        "hardlink-absolute", lambda s: make_tar([("hardlink", "h", f"{s.canary}/secret")]), needle="absolute"
    ),
    DiffCase(
        "hardlink-dotdot", lambda s: make_tar([("hardlink", "h", "../../canary/secret")]), needle="escapes"
    ),
    DiffCase(
        "hardlink-through-symlink",
        lambda s: make_tar([("hardlink", "h", "hostlink/secret")]),
        needle="target is missing",
    ),
    DiffCase("bad-whiteout", lambda s: make_tar([("file", "bin/.wh..", b"")]), needle="bad whiteout"),
    DiffCase("opaque-rootfs", lambda s: make_tar([("file", ".wh..wh..opq", b"")]), needle="opaque"),
    DiffCase(
        "whiteout-through-symlink",
        lambda s: make_tar([("file", "hostlink/.wh.secret", b"")]),
        error=None,  # the parent is a symlink: nothing of it to delete
    ),
    DiffCase(
        "opaque-through-symlink",
        lambda s: make_tar([("file", "hostlink/.wh..wh..opq", b"")]),
        error=None,
    ),
    DiffCase(
        "absolute-symlink-target",
        lambda s: make_tar([("symlink", "etc-shadow", "/etc/shadow")]),
        error=None,  # stored as is: it resolves inside the container, nothing follows it here
    ),
    DiffCase("unsupported-type", lambda s: make_tar([("type", "weird", b"Z")]), needle="unsupported type"),
    DiffCase("not-a-tar", lambda s: secrets.token_bytes(4096), error=DataLoss, needle="not a readable tar"),
    DiffCase(
        "truncated-tar",
        lambda s: make_tar([("file", "a", b"x" * 100_000)])[:20_000],
        error=DataLoss,
        needle="truncated",
    ),
    DiffCase("lying-size", lambda s: lying_size_tar(), error=DataLoss, needle="truncated"),
    DiffCase(
        "deleted-dotdot",
        lambda s: make_tar([]),
        deleted=lambda s: ["/../../canary/secret"],
        needle="escapes",
    ),
    DiffCase(
        "deleted-through-symlink",
        lambda s: make_tar([]),
        deleted=lambda s: ["/hostlink/secret", "/hostlink/sub"],
        error=None,
    ),
    DiffCase(
        "deleted-host-absolute",
        lambda s: make_tar([]),
        deleted=lambda s: [str(s.canary / "secret")],  # container-absolute: not the host's
        error=None,
    ),
    DiffCase("deleted-not-a-string", lambda s: make_tar([]), deleted=lambda s: [42], needle="not a string"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_apply_hostile_diff(scene: Scene, case: DiffCase, tmp_path: Path) -> None:
    tar = tmp_path / "rootfs-diff.tar"
    tar.write_bytes(case.tar(scene))
    before = scene.fingerprint()
    outside_before = sorted(p.name for p in tmp_path.iterdir())
    deleted = case.deleted(scene) if case.deleted else None
    if case.error is None:
        rootfs_diff.apply_rootfs_diff(tar, scene.rootfs, deleted)
    else:
        with pytest.raises(case.error) as err:
            rootfs_diff.apply_rootfs_diff(tar, scene.rootfs, deleted)
        assert case.needle in err.value.message, err.value.message
    assert scene.fingerprint() == before, "the canary next to the rootfs changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == outside_before
    assert not (tmp_path / "bundle" / "pwned").exists() and not (tmp_path / "pwned").exists()
    assert (scene.rootfs / "bin" / "app").read_text() == "app\n"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_check_agrees_with_apply(scene: Scene, case: DiffCase, tmp_path: Path) -> None:
    """RestorePod's up-front check (no rootfs needed) never refuses a diff that applies, and what
    it refuses it refuses as applying would. It cannot see the target image, so a diff that is
    hostile only through a symlink already in the rootfs passes it (and fails when applied)."""
    tar = tmp_path / "rootfs-diff.tar"
    tar.write_bytes(case.tar(scene))
    deleted = case.deleted(scene) if case.deleted else None
    before = scene.fingerprint()
    if case.error is None:
        rootfs_diff.check_rootfs_diff(tar, deleted)
        return
    try:
        rootfs_diff.check_rootfs_diff(tar, deleted)
    except ShimError as e:
        assert isinstance(e, case.error), e
        assert case.needle in e.message or "refusing to write through" in e.message, e.message
    assert scene.fingerprint() == before


def test_check_refuses_writes_through_a_symlink_of_the_same_diff(tmp_path: Path) -> None:
    tar = tmp_path / "rootfs-diff.tar"
    tar.write_bytes(make_tar([("file", "l/x", b"x"), ("symlink", "l", "/etc")]))  # order does not matter
    with pytest.raises(InvalidArgument, match="refusing to write through"):
        rootfs_diff.check_rootfs_diff(tar)


# ---------------------------------------------------------------------------- end to end


def _diff_archive(ctx: Ctx, tar: bytes | None = None, deleted: list[str] | None = None) -> Path:
    root = ctx.copy("diff")
    c = "containers/counter"
    if tar is not None:
        rewrite(root / c / "rootfs-diff.tar", tar)
        rehash(root, f"{c}/rootfs-diff.tar")
    if deleted is not None:
        rewrite(root / c / "deleted.files", json.dumps(deleted).encode())
        rehash(root, f"{c}/deleted.files")
    return root


E2E = [
    (
        "symlink-to-host-then-write",
        lambda c: _diff_archive(
            c, make_tar([("symlink", "l", str(c.canary.dir)), ("file", "l/pwned", b"x")])
        ),
        "refusing to write through",
        "RestorePod",
    ),
    (
        "dotdot-member",
        lambda c: _diff_archive(c, make_tar([("file", "../../../../pwned", b"x")])),
        "escapes",
        "RestorePod",
    ),
    (
        "deleted-dotdot",
        lambda c: _diff_archive(c, deleted=[f"/../../../..{c.canary.secret}"]),
        "escapes",
        "RestorePod",
    ),
    # /counter is a file of the image: only podshim-runc, applying the diff onto the new rootfs,
    # can see that "counter/x" would be written through it
    (
        "write-under-an-image-file",
        lambda c: _diff_archive(c, make_tar([("file", "counter/x", b"x")])),
        "refusing to write through",
        "StartContainer",
    ),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("name", "build", "needle", "refused_by"), E2E, ids=[e[0] for e in E2E])
def test_restore_with_hostile_diff(ctx: Ctx, name: str, build: Any, needle: str, refused_by: str) -> None:
    """A consistent archive (checksums recomputed: they are no signature) with a hostile diff.
    What the diff alone betrays, RestorePod refuses up front (INVALID_ARGUMENT naming the member)
    and creates nothing. What only the target image shows, podshim-runc refuses when it applies
    the diff at StartContainer: the start fails naming the member, nothing runs, the pod removes
    cleanly. Either way the canary is untouched."""
    archive = build(ctx)
    before = ctx.canary.fingerprint()
    config = pods.pod_config(f"hostile-{secrets.token_hex(3)}", ctx.bed.pod_logs_dir)
    req = cri.RestorePodRequest(
        checkpoint_path=str(archive),
        config=config,
        container_configs=[pods.container_config("counter", args=["--mem-mib", "8", "--interval-ms", "100"])],
    )
    sid = ""
    try:
        try:
            resp = ctx.rt.RestorePod(req, timeout=60)
        except grpc.RpcError as e:
            assert refused_by == "RestorePod", f"RestorePod refused what only the start sees: {e.details()}"
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in (e.details() or ""), e.details()
            print(f"{name}: RestorePod {e.code()}: {e.details()}")
            listed = ctx.rt.ListPodSandbox(cri.ListPodSandboxRequest()).items
            assert config.metadata.name not in {sb.metadata.name for sb in listed}, "a sandbox was created"
        else:
            sid = resp.pod_sandbox_id
            assert refused_by == "StartContainer", f"RestorePod accepted a diff it should refuse ({needle})"
            cid = resp.restored_containers[0].container_id
            with pytest.raises(grpc.RpcError) as err:
                ctx.rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
            details = err.value.details() or ""
            print(f"{name}: RestorePod OK, StartContainer {err.value.code()}: {details[-300:]}")
            assert needle in details, details
            st = ctx.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
            assert st.state != cri.CONTAINER_RUNNING
        assert ctx.canary.fingerprint() == before, "the hostile diff reached outside the rootfs"
        assert not (ctx.canary.dir / "pwned").exists() and ctx.canary.secret.exists()
        assert ctx.rt.Version(cri.VersionRequest()).runtime_version.endswith(f"+podshim.{__version__}")
    finally:
        if sid:
            pods.remove_pod(ctx.rt, sid)  # and the pod-level cgroup
