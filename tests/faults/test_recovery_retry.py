"""Sandboxes nobody removed: a recovery that fails is retried with backoff while
podshim runs, and a sandbox a restore created without podshim learning its id is found by its
metadata.

Unit level (a fake upstream): the retry, its lock, the wait for a sandbox an unanswered
RunPodSandbox may still create. End to end (real containerd): (a) podshim killed while
RestorePod(start=true) waits on StartContainer (containerd refuses to remove the sandbox while
the container is starting), (b) containerd down during a rollback, (c) the answer of
RunPodSandbox lost: each sandbox is removed and the journal closed while podshim runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from api.runtime.v1 import api_pb2 as cri
from shim import errors
from shim.state import Journal
from testbed import _sys, pods
from testbed.bed import TestBed

from .helpers import (
    Archive,
    FailpointPodshim,
    Rt,
    journal_files,
    processes_under,
    remove_cgroup_parent,
    restore,
    sandboxes_named,
    take_archive,
    wait_serving,
)
from .test_recover import FakeRuntime, FakeUpstream, make_engine, root  # noqa: F401 - `root` fixture


class ListingRuntime(FakeRuntime):
    """FakeRuntime that also lists sandboxes (`listed`: what ListPodSandbox answers)."""

    def __init__(self, fail: grpc.StatusCode | None = None) -> None:
        super().__init__(fail)
        self.listed: list[cri.PodSandbox] = []

    async def ListPodSandbox(self, req: Any, timeout: float = 0) -> cri.ListPodSandboxResponse:  # noqa: N802
        if self.fail:
            raise _err(self.fail)
        return cri.ListPodSandboxResponse(items=[s for s in self.listed if s.id not in self.gone])


def _err(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="upstream down")


def _failed_count() -> float:
    labels = {"operation": "restore_pod", "result": "RECOVERY_FAILED"}
    return REGISTRY.get_sample_value("podshim_operations_total", labels) or 0.0


async def _until(cond: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "not within the time allowed"
        await asyncio.sleep(0.05)


async def test_failed_rollback_is_retried_while_running(root: Path) -> None:  # noqa: F811
    up = FakeUpstream(fail=grpc.StatusCode.UNAVAILABLE)
    j = Journal(root / "state")
    rec = j.begin("restore", "default/api", {"checkpoint_path": "/x"})
    j.update(rec, "sandbox", sandbox_id="sb-r")
    failed = _failed_count()
    eng = make_engine(root, up)
    await eng.recover()
    assert [r.op_id for r in j.scan().records] == [rec.op_id]
    # the first attempt failed, then the retry RETRY_FIRST later: both counted
    await _until(lambda: _failed_count() >= failed + 2)
    with pytest.raises(errors.Aborted, match="recovery"):  # a new restore of that pod waits
        eng.locks.acquire("restore_pod", ["pod default/api"])
    up.runtime.fail = None  # containerd is back
    await _until(lambda: not j.scan().records)
    assert "sb-r" in up.runtime.gone
    eng.locks.acquire("restore_pod", ["pod default/api"])  # released


class StartingRuntime(FakeRuntime):
    """containerd while a container of the sandbox is still starting: Remove refused `busy` times."""

    def __init__(self, busy: int) -> None:
        super().__init__()
        self.busy = busy

    async def RemovePodSandbox(self, req: Any, timeout: float = 0) -> cri.RemovePodSandboxResponse:  # noqa: N802
        if self.busy > 0:
            self.busy -= 1
            self.calls.append(("remove", req.pod_sandbox_id))
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNKNOWN,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details='failed to remove container "c": container is in starting state, can\'t be removed',
            )
        return await super().RemovePodSandbox(req, timeout)


async def test_sandbox_of_a_starting_container_is_removed_later(root: Path) -> None:  # noqa: F811
    """(a) podshim killed while StartContainer of a restored container runs: containerd refuses
    to remove the sandbox until the start has ended; the retries remove it then."""
    up = FakeUpstream()
    up.runtime = StartingRuntime(busy=3)
    j = Journal(root / "state")
    rec = j.begin("restore", "default/api", {"checkpoint_path": "/x"})
    j.update(rec, "sandbox", sandbox_id="sb-s")
    await make_engine(root, up).recover()
    assert j.scan().records, "closed although the sandbox is still there"
    await _until(lambda: not j.scan().records)
    assert (
        "sb-s" in up.runtime.gone
        and [c for c in up.runtime.calls if c[0] == "remove"] == [("remove", "sb-s")] * 4
    )


async def test_unanswered_sandbox_is_waited_for(root: Path) -> None:  # noqa: F811
    """RunPodSandbox got no answer: its sandbox appears only later; found by its metadata."""
    up = FakeUpstream()
    up.runtime = ListingRuntime()
    md = {"name": "web", "namespace": "default", "uid": "u-1", "attempt": 0}
    j = Journal(root / "state")
    rec = j.begin("restore", "default/web", {"checkpoint_path": "/x", "sandbox_metadata": md})
    j.update(rec, "sandbox-unknown", sandbox_unknown_since=time.time())
    eng = make_engine(root, up)
    await eng.recover()
    assert j.scan().records, "closed although the sandbox may still appear"
    await asyncio.sleep(0.8)
    other = cri.PodSandbox(  # same name, another uid: not ours
        id="sb-other",
        metadata=cri.PodSandboxMetadata(name="web", namespace="default", uid="u-2"),
        created_at=time.time_ns(),
    )
    ours = cri.PodSandbox(
        id="sb-late",
        metadata=cri.PodSandboxMetadata(name="web", namespace="default", uid="u-1"),
        created_at=time.time_ns(),
    )
    up.runtime.listed = [other, ours]
    await _until(lambda: not j.scan().records)
    assert up.runtime.gone == {"sb-late"}


async def test_unanswered_sandbox_that_never_appears(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from shim.ops import restore_pod as restore_mod

    monkeypatch.setattr(restore_mod, "SANDBOX_SETTLE", 1.0)
    up = FakeUpstream()
    up.runtime = ListingRuntime()
    md = {"name": "web", "namespace": "default", "uid": "u-1", "attempt": 0}
    j = Journal(root / "state")
    rec = j.begin("restore", "default/web", {"checkpoint_path": "/x", "sandbox_metadata": md})
    j.update(rec, "sandbox-unknown", sandbox_unknown_since=time.time())
    await make_engine(root, up).recover()
    await _until(lambda: not j.scan().records)
    assert up.runtime.gone == set()


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def archive(rt: Rt, bed: TestBed) -> Iterator[Archive]:
    created: list[str] = []
    try:
        a = take_archive(rt, bed, "retry-src", ("counter",), created)
        yield a
        shutil.rmtree(a.path, ignore_errors=True)
    finally:
        for pod_id in created:
            with contextlib.suppress(Exception):
                pods.remove_pod(rt, pod_id)


@pytest.fixture
def new_pod(bed: TestBed, log_root: Path, rt: Rt) -> Iterator[cri.PodSandboxConfig]:
    config = pods.pod_config(f"retried-{secrets.token_hex(3)}", log_root)
    yield config
    direct = pods.stubs(bed.containerd_socket)[0]
    with contextlib.suppress(Exception):
        for sid in sandboxes_named(direct, config.metadata.name):
            pods.remove_pod(direct, sid)
    remove_cgroup_parent(config)


def _direct(bed: TestBed) -> Rt:
    return pods.stubs(bed.containerd_socket)[0]


def _removed_while_running(bed: TestBed, name: str, podshim_pid: int | None, timeout: float = 60.0) -> None:
    """The restore's sandbox gone and the journal closed, by the podshim that runs now."""
    pods.wait_for(
        lambda: not sandboxes_named(_direct(bed), name) and not journal_files(bed),
        timeout,
        interval=0.25,
        what=f"sandbox {name} removed and the journal closed while podshim runs",
    )
    if podshim_pid is not None:
        assert bed.podshim_pid == podshim_pid and bed.podshim_running, "podshim was restarted meanwhile"


@pytest.mark.e2e
def test_unanswered_run_pod_sandbox(
    rt: Rt, bed: TestBed, archive: Archive, new_pod: cri.PodSandboxConfig
) -> None:
    """(c) containerd created the sandbox but its answer never reached podshim (the failpoint
    raises right after RunPodSandbox returned, as a deadline or a lost connection would): the
    rollback finds the sandbox by its metadata and removes it."""
    with FailpointPodshim(bed, "restore.sandbox-answer=error") as fp:
        with pytest.raises(grpc.RpcError) as err:
            restore(fp.rt, archive, new_pod)
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
        _removed_while_running(bed, new_pod.metadata.name, None, timeout=30)
        assert fp.proc is not None and fp.proc.poll() is None


@pytest.mark.e2e
def test_containerd_down_during_rollback(
    rt: Rt, bed: TestBed, archive: Archive, new_pod: cri.PodSandboxConfig
) -> None:
    """(b) the restore fails while containerd is down, so its rollback fails too: retried while
    podshim runs, the sandbox is removed once containerd is back."""
    with FailpointPodshim(bed, "restore.after-sandbox=sleep:6") as fp:
        errors_: list[grpc.RpcError] = []

        def run() -> None:
            try:
                restore(fp.rt, archive, new_pod)
            except grpc.RpcError as e:
                errors_.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        pods.wait_for(
            lambda: sandboxes_named(_direct(bed), new_pod.metadata.name),
            30,
            interval=0.05,
            what="the restore's sandbox",
        )
        bed.stop_containerd()
        try:
            t.join(120)
            assert errors_, "RestorePod succeeded with containerd down"
            print(f"RestorePod with containerd down: {errors_[0].code()}: {errors_[0].details()}")
            time.sleep(2)  # a few failed retries
            assert journal_files(bed), "the record was closed although the sandbox was not removed"
        finally:
            bed.start_containerd()
        _removed_while_running(bed, new_pod.metadata.name, None)
        assert fp.proc is not None and fp.proc.poll() is None
        assert b"retrying the recovery" in fp.log.read_bytes()
    wait_serving(rt)


@pytest.mark.e2e
def test_podshim_killed_while_start_container_hangs(
    rt: Rt, bed: TestBed, archive: Archive, new_pod: cri.PodSandboxConfig
) -> None:
    """(a) RestorePod(start=true) waits on StartContainer (CRIU hangs: the test SIGSTOPs it)
    when podshim is SIGKILLed: containerd refuses to remove a sandbox whose container is
    starting, so the first recovery attempt fails; the retries remove it once it can."""
    copy = Path(bed.checkpoint_root) / f"hang-{secrets.token_hex(3)}"
    shutil.copytree(archive.path, copy)
    try:
        hung = Archive(copy, archive.containers)

        def run() -> None:
            with contextlib.suppress(grpc.RpcError):
                restore(rt, hung, new_pod, {"start": "true"})

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert _sys.stop_criu_reading(str(copy), 60)
        bed.kill_podshim()
        mark = bed.podshim_log.stat().st_size
        bed.start_podshim_again()
        pid = bed.podshim_pid
        wait_serving(rt)
        _removed_while_running(bed, new_pod.metadata.name, pid)
        with open(bed.podshim_log, "rb") as f:
            f.seek(mark)
            text = f.read()
        print(f"recovery attempts retried: {text.count(b'retrying the recovery')}")
    finally:
        for p in processes_under(copy):
            with contextlib.suppress(OSError):
                os.kill(p, 9)
        shutil.rmtree(copy, ignore_errors=True)
