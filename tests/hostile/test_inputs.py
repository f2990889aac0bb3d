"""Inputs that got the wrong answer, end to end through podshim's socket:

* CRI strings containerd + CNI cannot undo (a NUL or ';' in the pod's name/namespace/uid: the
  upstream creates the sandbox, its CNI set-up fails, and RemovePodSandbox never removes it) in
  RestorePod and in the passed-through RunPodSandbox/CreateContainer: INVALID_ARGUMENT, nothing
  created;
* an archive of 1500 nested directories: INVALID_ARGUMENT with the limit, not INTERNAL;
* a runtime_handler podshim's config knows but containerd does not: INVALID_ARGUMENT;
* a plaintext archive whose rootfs-diff.tar and deleted.files were removed with their manifest
  entries: DATA_LOSS naming them (not a restore without the writable layer);
* a config.dump naming another image than manifest.json: DATA_LOSS at RestorePod;
* a manifest-consistent archive with a 64 GiB sparse member: DATA_LOSS at once.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from testbed import pods
from testbed.versions import real_runc

from .corpus import DATA_LOSS, INVALID, Case, Ctx, counter, edit_manifest, first_pages, rehash, rewrite
from .test_requests import check

pytestmark = pytest.mark.e2e


def _sandboxes(ctx: Ctx) -> set[str]:
    """Every sandbox containerd has (asked directly: podshim's answer is not the point)."""
    rt = pods.stubs(ctx.bed.containerd_socket)[0]
    return {p.id for p in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items}


def _restore_with(ctx: Ctx, **metadata: str) -> Callable[[], Any]:
    config = pods.pod_config(f"hostile-{secrets.token_hex(3)}", ctx.bed.pod_logs_dir)
    for k, v in metadata.items():
        setattr(config.metadata, k, v)
    req = cri.RestorePodRequest(
        checkpoint_path=str(ctx.archive), config=config, container_configs=[counter()]
    )
    return lambda: ctx.rt.RestorePod(req, timeout=60)


def _run_sandbox(ctx: Ctx, **metadata: str) -> Callable[[], Any]:
    config = pods.pod_config(f"hostile-{secrets.token_hex(3)}", ctx.bed.pod_logs_dir)
    for k, v in metadata.items():
        setattr(config.metadata, k, v)
    req = cri.RunPodSandboxRequest(config=config)
    return lambda: ctx.rt.RunPodSandbox(req, timeout=60)


def _create_container(ctx: Ctx, name: str) -> Callable[[], Any]:
    st = ctx.rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=ctx.victim.id), timeout=10)
    sandbox = cri.PodSandboxConfig(metadata=st.status.metadata, log_directory=str(ctx.bed.pod_logs_dir))
    req = cri.CreateContainerRequest(
        pod_sandbox_id=ctx.victim.id, config=counter(name), sandbox_config=sandbox
    )
    return lambda: ctx.rt.CreateContainer(req, timeout=30)


STRINGS = [
    Case("restore-name-nul", lambda c: _restore_with(c, name="a\x00b"), INVALID, ("metadata.name", "NUL")),
    Case("restore-namespace-semicolon", lambda c: _restore_with(c, namespace="a;b"), INVALID, ("CNI_ARGS",)),
    Case("restore-uid-equals", lambda c: _restore_with(c, uid="u=1"), INVALID, ("metadata.uid", "CNI_ARGS")),
    Case("run-sandbox-name-nul", lambda c: _run_sandbox(c, name="a\x00b"), INVALID, ("metadata.name", "NUL")),
    Case("run-sandbox-uid-nul", lambda c: _run_sandbox(c, uid="u\x00"), INVALID, ("metadata.uid", "NUL")),
    Case("run-sandbox-name-semicolon", lambda c: _run_sandbox(c, name="a;b"), INVALID, ("CNI_ARGS",)),
    Case("run-sandbox-namespace-equals", lambda c: _run_sandbox(c, namespace="a=b"), INVALID, ("CNI_ARGS",)),
    Case("run-sandbox-name-200k", lambda c: _run_sandbox(c, name="n" * 200_000), INVALID, ("bytes long",)),
    Case("create-container-name-nul", lambda c: _create_container(c, "a\x00b"), INVALID, ("NUL",)),
]


@pytest.mark.parametrize("case", STRINGS, ids=lambda c: c.id)
def test_strings_the_upstream_cannot_undo(ctx: Ctx, case: Case) -> None:
    """Refused before anything is created: without the check, containerd makes a sandbox whose
    CNI set-up fails and that RemovePodSandbox cannot remove (or, for the container, one that
    never starts)."""
    before = _sandboxes(ctx)
    containers = {c.id for c in ctx.rt.ListContainers(cri.ListContainersRequest()).containers}
    check(ctx, case)
    assert _sandboxes(ctx) == before, "a sandbox was created"
    assert {c.id for c in ctx.rt.ListContainers(cri.ListContainersRequest()).containers} == containers


# ---------------------------------------------------------------------------- archives


def _nested(depth: int) -> Callable[[Path], object]:
    def fn(root: Path) -> None:
        fd = os.open(root / "containers/counter", os.O_RDONLY | os.O_DIRECTORY)
        try:
            for _ in range(depth):
                os.mkdir("d" * 8, dir_fd=fd)
                nfd = os.open("d" * 8, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nfd
        finally:
            os.close(fd)

    return fn


def _without_rootfs_diff(root: Path) -> None:
    """rootfs-diff.tar and deleted.files gone, with their files entries and members (a plaintext
    manifest is anyone's to edit: the members podshim always writes are required anyway)."""
    for name in ("rootfs-diff.tar", "deleted.files"):
        (root / "containers/counter" / name).unlink()

    def drop(m: dict[str, Any]) -> None:
        for name in ("rootfs-diff.tar", "deleted.files"):
            del m["files"][f"containers/counter/{name}"]
            c = m["containers"][0]
            if name in c.get("members", []):
                c["members"].remove(name)

    edit_manifest(root, drop)


def _config_dump_image(root: Path) -> None:
    p = root / "containers/counter/config.dump"
    doc = json.loads(p.read_text())
    assert doc["image"] == pods.COUNTER_IMAGE, doc["image"]
    doc["image"] = pods.BUSYBOX_IMAGE
    rewrite(p, json.dumps(doc).encode())
    rehash(root, "containers/counter/config.dump")


def _sparse_pages(root: Path) -> None:
    rel = first_pages(root)
    (root / rel).unlink()
    with open(root / rel, "wb") as f:
        f.truncate(64 << 30)
    os.chmod(root / rel, 0o600)
    edit_manifest(root, lambda m: m["files"][rel].update(size=64 << 30))


def _mutated(fn: Callable[[Path], object]) -> Callable[[Ctx], Callable[[], Any]]:
    def build(ctx: Ctx) -> Callable[[], Any]:
        root = ctx.copy()
        fn(root)
        return ctx.restore(path=root, containers=[counter()])

    return build


ARCHIVES = [
    Case(
        "rootfs-diff-removed-with-its-entries",
        _mutated(_without_rootfs_diff),
        DATA_LOSS,
        ("'counter'", "rootfs-diff.tar", "deleted.files"),
    ),
    Case("config-dump-other-image", _mutated(_config_dump_image), DATA_LOSS, ("config.dump", "busybox")),
    Case("sparse-64gib-member", _mutated(_sparse_pages), DATA_LOSS, ("sparse", "pages-")),
]


@pytest.mark.parametrize("case", ARCHIVES, ids=lambda c: c.id)
def test_inconsistent_archive_is_refused_at_restore_pod(ctx: Ctx, case: Case) -> None:
    before = _sandboxes(ctx)
    check(ctx, case)
    assert _sandboxes(ctx) == before, "a sandbox was created"


def test_1500_nested_directories(ctx: Ctx) -> None:
    """INVALID_ARGUMENT naming the limit (was: INTERNAL, an uncaught 'File name too long')."""
    root = ctx.copy("nested")
    try:
        _nested(1500)(root)
        before = _sandboxes(ctx)
        check(ctx, Case("nested", lambda c: c.restore(path=root), INVALID, ("nest deeper than 16",)))
        assert _sandboxes(ctx) == before
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)  # deeper than rmtree likes


def test_handler_podshim_knows_but_containerd_does_not(ctx: Ctx, tmp_path: Path) -> None:
    """A podshim configured with [runtimes.ghost], in front of the bed's containerd (which has no
    such handler): INVALID_ARGUMENT naming it, before any sandbox exists (was: INTERNAL "no
    runtime for ghost")."""
    ghost = {"binary": str(real_runc()), "root": str(tmp_path / "ghost-root")}
    with ctx.bed.extra_podshim(tmp_path, runtimes={"ghost": ghost}) as (socket, _log):
        rt = pods.stubs(socket)[0]
        config = pods.pod_config(f"hostile-{secrets.token_hex(3)}", ctx.bed.pod_logs_dir)
        req = cri.RestorePodRequest(
            checkpoint_path=str(ctx.archive),
            config=config,
            container_configs=[counter()],
            runtime_handler="ghost",
        )
        before = _sandboxes(ctx)
        with pytest.raises(grpc.RpcError) as err:
            rt.RestorePod(req, timeout=60)
        assert err.value.code() == INVALID, err.value.details()
        assert "'ghost'" in (err.value.details() or "") and "not in the upstream" in (
            err.value.details() or ""
        )
        assert _sandboxes(ctx) == before
