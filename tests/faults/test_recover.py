"""Journal replay.

Unit level (real freezer cgroups and files, a fake upstream; root, no containerd): what
Engine.recover() does with each kind of record a crashed podshim can leave, and that no record
keeps podshim from starting. End to end: a restart of podshim (SIGKILL or SIGTERM) changes no
pod's or container's status.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from api.runtime.v1 import api_pb2 as cri
from shim import engine as engine_mod
from shim import errors
from shim.config import Config
from shim.engine import Engine
from shim.ops import checkpoint_pod_recovery
from shim.state import Journal
from shim.upstream.calls import CriCalls
from testbed import _sys, pods
from testbed.bed import TestBed
from testbed.checks import FREEZER, container_cgroup, freezer_state, set_freezer

from .helpers import Rt, wait_serving

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (freezer cgroups)")


# ---------------------------------------------------------------------------- unit level


def _rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeRuntime:
    """The three upstream calls recovery makes; `gone` sandboxes answer NOT_FOUND."""

    def __init__(self, fail: grpc.StatusCode | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.gone: set[str] = set()
        self.fail = fail

    async def StopPodSandbox(self, req: Any, timeout: float = 0) -> cri.StopPodSandboxResponse:  # noqa: N802
        self.calls.append(("stop", req.pod_sandbox_id))
        if self.fail:
            raise _rpc_error(self.fail, "upstream down")
        return cri.StopPodSandboxResponse()

    async def RemovePodSandbox(self, req: Any, timeout: float = 0) -> cri.RemovePodSandboxResponse:  # noqa: N802
        self.calls.append(("remove", req.pod_sandbox_id))
        if self.fail:
            raise _rpc_error(self.fail, "upstream down")
        self.gone.add(req.pod_sandbox_id)
        return cri.RemovePodSandboxResponse()

    async def PodSandboxStatus(self, req: Any, timeout: float = 0) -> cri.PodSandboxStatusResponse:  # noqa: N802
        if self.fail:
            raise _rpc_error(self.fail, "upstream down")
        if req.pod_sandbox_id in self.gone:
            raise _rpc_error(grpc.StatusCode.NOT_FOUND, "not found")
        return cri.PodSandboxStatusResponse()


class FakeUpstream(CriCalls):
    """The typed calls (shim/upstream/calls.py) over FakeRuntime's raw ones."""

    endpoint = "unix:///nonexistent/fake.sock"
    timeout = 30.0

    def __init__(self, fail: grpc.StatusCode | None = None) -> None:
        self.runtime = FakeRuntime(fail)
        self.image = None


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "roots").mkdir()
    return tmp_path


def make_engine(root: Path, upstream: FakeUpstream | None = None) -> Engine:
    cfg = Config(state_dir=str(root / "state"), allowed_roots=(str(root / "roots"),))
    return Engine(cfg, upstream or FakeUpstream())  # type: ignore[arg-type]


@pytest.fixture
def cgroups() -> Iterator[list[str]]:
    """Fresh freezer cgroups (relative paths) named by the test; removed after, thawed first."""
    made: list[str] = []
    yield made
    for rel in reversed(made):
        d = FREEZER / rel.lstrip("/")
        if d.is_dir():
            set_freezer(rel, "THAWED")
            for sub in sorted(d.rglob("*"), reverse=True):
                if sub.is_dir():
                    sub.rmdir()
            d.rmdir()


def frozen_pod(cgroups: list[str]) -> list[str]:
    """A pod cgroup with one container cgroup below, the container frozen (as after the cut)."""
    pod = f"/podshim-recover-{secrets.token_hex(4)}"
    ctr = f"{pod}/ctr"
    (FREEZER / ctr.lstrip("/")).mkdir(parents=True)
    cgroups.append(pod)
    set_freezer(ctr, "FROZEN")
    assert freezer_state(ctr) == "FROZEN"
    return [pod, ctr]


def partial_archive(root: Path) -> Path:
    out = root / "roots" / f"out-{secrets.token_hex(3)}"
    (out / "containers" / "app" / "checkpoint").mkdir(parents=True)
    (out / "containers" / "app" / "checkpoint" / "pages-1.img").write_bytes(b"\0" * 4096)
    (out / "sandbox").mkdir()
    (out / "sandbox" / "config.json").write_text("{}")
    return out


@needs_root
async def test_checkpoint_record_thaws_and_clears(root: Path, cgroups: list[str]) -> None:
    cg = frozen_pod(cgroups)
    out = partial_archive(root)
    j = Journal(root / "state")
    rec = j.begin("checkpoint", "pod-a", {"output_path": str(out), "cgroups": cg})
    j.update(rec, "frozen")
    labels = {"operation": "checkpoint_pod", "result": "RECOVERED"}
    recovered_before = REGISTRY.get_sample_value("podshim_operations_total", labels) or 0.0
    await make_engine(root).recover()
    assert [freezer_state(c) for c in cg] == ["THAWED", "THAWED"]
    assert out.is_dir() and list(out.iterdir()) == []  # emptied, never removed
    assert j.scan().records == []
    # counted under the gRPC method's name, like the operation it undid
    assert REGISTRY.get_sample_value("podshim_operations_total", labels) == recovered_before + 1


@needs_root
async def test_complete_archive_is_kept(root: Path, cgroups: list[str]) -> None:
    """Died after manifest.json but before the record's removal: the archive is complete."""
    cg = frozen_pod(cgroups)
    out = partial_archive(root)
    (out / "manifest.json").write_text("{}")
    j = Journal(root / "state")
    j.begin("checkpoint", "pod-b", {"output_path": str(out), "cgroups": cg})
    await make_engine(root).recover()
    assert freezer_state(cg[1]) == "THAWED"
    assert (out / "manifest.json").is_file() and (out / "sandbox" / "config.json").is_file()
    assert j.scan().records == []


async def test_output_dir_removed_since(root: Path) -> None:
    """The caller removed output_path before podshim came back: nothing to clear, no crash
    (clear_dir_contents raises NotFound, which used to stop podshim from starting)."""
    j = Journal(root / "state")
    j.begin("checkpoint", "pod-c", {"output_path": str(root / "roots" / "gone"), "cgroups": []})
    await make_engine(root).recover()
    assert j.scan().records == []


async def test_failing_record_is_kept_and_others_recovered(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_a, out_b = partial_archive(root), partial_archive(root)
    j = Journal(root / "state")
    bad = j.begin("checkpoint", "pod-bad", {"output_path": str(out_a), "cgroups": ["/cannot-thaw"]})
    j.begin("checkpoint", "pod-ok", {"output_path": str(out_b), "cgroups": []})

    def thaw(paths: list[str], *a: Any, **k: Any) -> list[str]:
        if "/cannot-thaw" in paths:
            raise errors.Internal("could not thaw: /cannot-thaw; thaw by hand")
        return []

    monkeypatch.setattr(checkpoint_pod_recovery, "thaw_paths", thaw)  # the checkpoint's own recovery
    await make_engine(root).recover()  # must not raise: podshim has to start
    assert [r.op_id for r in j.scan().records] == [bad.op_id]  # kept for the next start
    assert list(out_b.iterdir()) == []
    monkeypatch.undo()
    await make_engine(root).recover()  # next start: now it works
    assert j.scan().records == []


async def test_corrupt_record_set_aside(root: Path) -> None:
    j = Journal(root / "state")
    out = partial_archive(root)
    j.begin("checkpoint", "pod-d", {"output_path": str(out), "cgroups": []})
    (j.ops_dir / "20990101T000000-checkpoint-deadbeef.json").write_text('{"version": 1, "op_')
    await make_engine(root).recover()
    assert j.scan().records == [] and list(out.iterdir()) == []
    assert [p.name for p in j.ops_dir.iterdir()] == ["20990101T000000-checkpoint-deadbeef.json.corrupt"]


async def test_restore_record_removes_sandbox(root: Path) -> None:
    up = FakeUpstream()
    j = Journal(root / "state")
    begun = j.begin("restore", "default/web", {"checkpoint_path": "/x"})  # before RunPodSandbox
    rec = j.begin("restore", "default/api", {"checkpoint_path": "/x"})
    j.update(rec, "sandbox", sandbox_id="sb-1")
    await make_engine(root, up).recover()
    assert up.runtime.calls == [("stop", "sb-1"), ("remove", "sb-1")]
    assert j.scan().records == [] and not begun.path.exists()


async def test_restore_record_kept_while_upstream_down(root: Path) -> None:
    """rollback_sandbox only logs an upstream failure: the record must stay until the sandbox is
    confirmed gone, or the half-restored pod would be forgotten for good."""
    up = FakeUpstream(fail=grpc.StatusCode.UNAVAILABLE)
    j = Journal(root / "state")
    rec = j.begin("restore", "default/api", {"checkpoint_path": "/x"})
    j.update(rec, "sandbox", sandbox_id="sb-2")
    await make_engine(root, up).recover()
    assert [r.op_id for r in j.scan().records] == [rec.op_id]
    up.runtime.fail = None
    await make_engine(root, up).recover()
    assert j.scan().records == [] and "sb-2" in up.runtime.gone


@needs_root
async def test_waits_for_leftover_dump_processes(root: Path, cgroups: list[str]) -> None:
    """runc/CRIU of the crashed run still write into output_path: recovery must not block the
    start, must hold the pod and the path (ABORTED), and thaw and clear only after they end."""
    cg = frozen_pod(cgroups)
    out = partial_archive(root)
    # stands for `runc checkpoint --image-path <out>/containers/app/checkpoint ...`
    orphan = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "--image-path",
            f"{out}/containers/app/checkpoint",
        ]
    )
    try:
        j = Journal(root / "state")
        j.begin("checkpoint", "pod-e", {"output_path": str(out), "cgroups": cg})
        eng = make_engine(root)
        start = time.monotonic()
        await eng.recover()
        assert time.monotonic() - start < 5, "recovery blocked podshim's start"
        assert j.scan().records and freezer_state(cg[1]) == "FROZEN" and any(out.iterdir())
        for key in ("pod pod-e", f"path {out}"):
            with pytest.raises(errors.Aborted, match="recovery"):
                eng.locks.acquire("checkpoint_pod", [key])
        orphan.kill()
        orphan.wait()
        for _ in range(100):
            if not j.scan().records:
                break
            await asyncio.sleep(0.1)
        assert j.scan().records == []
        assert freezer_state(cg[1]) == "THAWED" and list(out.iterdir()) == []
        eng.locks.acquire("checkpoint_pod", ["pod pod-e", f"path {out}"])  # released
    finally:
        orphan.kill()
        orphan.wait()


def test_path_lock_holds_the_resolved_path(tmp_path: Path) -> None:
    """Aliases of one directory exclude each other; the keys as held are what release takes."""
    d = tmp_path / "archive"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    locks = engine_mod.OperationLocks()
    held = locks.acquire("checkpoint_pod", ["pod p1", f"path {d}"])
    for alias in (f"{d}/.", f"{d}//", str(tmp_path / "link"), f"{tmp_path}/x/../archive"):
        with pytest.raises(errors.Aborted, match="in progress"):
            locks.acquire("restore_pod", ["pod default/x", f"path {alias}"])
    locks.acquire("restore_pod", ["pod default/x", f"path {tmp_path}/other\x00"])  # not resolvable
    (tmp_path / "link").unlink()  # the alias changing meanwhile does not strand the lock
    locks.release(held)
    locks.acquire("checkpoint_pod", ["pod p1", f"path {d}"])


# ---------------------------------------------------------------------------- end to end


def _snapshot(rt: Rt) -> dict[str, Any]:
    """Everything the kubelet sees of every pod and container (non-verbose), plus their pids."""
    snap: dict[str, Any] = {"version": rt.Version(cri.VersionRequest())}
    for p in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items:
        snap[f"pod {p.id}"] = p
        snap[f"pod-status {p.id}"] = rt.PodSandboxStatus(
            cri.PodSandboxStatusRequest(pod_sandbox_id=p.id)
        ).status
    for c in rt.ListContainers(cri.ListContainersRequest()).containers:
        snap[f"container {c.id}"] = c
        snap[f"container-status {c.id}"] = rt.ContainerStatus(
            cri.ContainerStatusRequest(container_id=c.id)
        ).status
        info = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=c.id, verbose=True)).info
        snap[f"container-pid {c.id}"] = json.loads(info["info"]).get("pid")
    return snap


@pytest.mark.e2e
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_podshim_restart_changes_no_status(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], sig: str
) -> None:
    two = {n: pods.container_config(n) for n in ("a", "b")}
    p1 = pods.run_pod(rt, f"restart-{secrets.token_hex(3)}", log_root, two)
    pod_cleanup.append(p1.id)
    p2 = pods.run_pod(rt, f"restart-{secrets.token_hex(3)}", log_root)
    pod_cleanup.append(p2.id)
    pods.wait_count(p1.log_path("b"), 2)
    pods.wait_count(p2.log_path("counter"), 2)
    before = _snapshot(rt)
    bed.kill_podshim(getattr(signal, sig))
    assert not bed.podshim_running
    bed.start_podshim_again()
    wait_serving(rt)
    after = _snapshot(rt)
    assert after.keys() == before.keys()
    changed = [k for k in before if before[k] != after[k]]
    assert changed == [], f"a podshim restart changed {changed}"
    for pod, names in ((p1, ("a", "b")), (p2, ("counter",))):
        for n in names:
            assert freezer_state(container_cgroup(rt, pod.containers[n])) == "THAWED"
            last = pods.counts(pod.log_path(n))[-1]
            pods.wait_count(pod.log_path(n), last + 2)
    assert not _sys.mounts_under(Path(bed.podshim_state_dir))
