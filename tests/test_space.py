"""Know before freezing that it will fit (issue 11 item 8): a checkpoint whose estimated size (the
containers' resident memory and writable layers, plus a margin) exceeds the free space of the
output file system is refused with RESOURCE_EXHAUSTED before anything is frozen or written."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.checks import space
from testbed import pods
from testbed.bed import TestBed
from testbed.checks import container_cgroup, freezer_state

Rt = api_pb2_grpc.RuntimeServiceStub
SMALL_MIB = 16
COUNTER_MIB = 64


@pytest.fixture
def small_fs(bed: TestBed) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted at a directory inside the allowed checkpoint root."""
    d = Path(bed.checkpoint_root) / f"small-{secrets.token_hex(3)}"
    d.mkdir(mode=0o700)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_MIB}m,mode=0700", "tmpfs", str(d)], check=True
    )
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
        d.rmdir()


@pytest.fixture
def big_pod(rt: Rt, bed: TestBed, pod_cleanup: list[str]) -> pods.Pod:
    args = ["--mem-mib", str(COUNTER_MIB), "--interval-ms", "100"]
    pod = pods.run_pod(
        rt,
        f"space-{secrets.token_hex(3)}",
        bed.pod_logs_dir,
        {"counter": pods.container_config("counter", args=args)},
    )
    pod_cleanup.append(pod.id)
    pods.wait_count(pod.log_path("counter"), 3, timeout=60)
    return pod


def _events_since(bed: TestBed, mark: int) -> list[dict[str, object]]:
    with open(bed.podshim_log, "rb") as f:
        f.seek(mark)
        lines = f.read().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _refused(call: object) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    code, details = err.value.code(), err.value.details() or ""
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code}: {details}"
    assert "MiB free" in details and "needs about" in details, details
    assert "nothing was frozen" in details, details
    return details


def _assert_running(rt: Rt, pod: pods.Pod) -> None:
    cid = pod.containers["counter"]
    assert (
        rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state == cri.CONTAINER_RUNNING
    )
    assert freezer_state(container_cgroup(rt, cid)) == "THAWED"
    assert freezer_state(pod.config.linux.cgroup_parent) == "THAWED"
    now = pods.counts(pod.log_path("counter"))[-1]
    pods.wait_count(pod.log_path("counter"), now + 2, timeout=15)


@pytest.mark.e2e
def test_checkpoint_pod_that_cannot_fit_is_refused_before_freezing(
    rt: Rt, bed: TestBed, small_fs: Path, big_pod: pods.Pod
) -> None:
    out = small_fs / "out"
    out.mkdir(mode=0o700)
    mark = bed.podshim_log.stat().st_size
    details = _refused(
        lambda: rt.CheckpointPod(
            cri.CheckpointPodRequest(pod_sandbox_id=big_pod.id, output_path=str(out)), timeout=60
        )
    )
    # the numbers: the counter's memory alone is over the file system's size
    need = float(details.split("needs about ")[1].split(" MiB")[0])
    free = float(details.split(" has ")[1].split(" MiB free")[0])
    assert need > COUNTER_MIB > SMALL_MIB >= free, details
    assert list(out.iterdir()) == [], "something was written"
    events = _events_since(bed, mark)
    mine = [e for e in events if e.get("pod") == big_pod.id]
    assert not [e for e in mine if e.get("event") in ("checkpoint prepared", "pod frozen")], mine
    _assert_running(rt, big_pod)


@pytest.mark.e2e
@pytest.mark.usefixtures("own_container_checkpoint")  # podshim's own, also on containerd 2.x
def test_checkpoint_container_that_cannot_fit_is_refused_before_freezing(
    rt: Rt, bed: TestBed, small_fs: Path, big_pod: pods.Pod
) -> None:
    cid = big_pod.containers["counter"]
    mark = bed.podshim_log.stat().st_size
    _refused(
        lambda: rt.CheckpointContainer(
            cri.CheckpointContainerRequest(container_id=cid, location=str(small_fs)), timeout=60
        )
    )
    assert list(small_fs.iterdir()) == [], "something was written"
    events = _events_since(bed, mark)
    assert not [e for e in events if e.get("container") == cid and e.get("event") == "container frozen"]
    _assert_running(rt, big_pod)


def test_estimate_margin() -> None:
    """10 % of memory + layers, and never less than 64 MiB on top."""
    e = space.Estimate(memory=1000 << 20, layers=24 << 20, margin=0)
    assert e.total == 1024 << 20
    tiny = space.Estimate(0, 0, int(0 * space.MARGIN_FRACTION) + space.MARGIN_BYTES)
    assert tiny.total == 64 << 20
