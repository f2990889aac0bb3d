"""Know before freezing that it will fit: a checkpoint whose estimated size (the
containers' resident memory and writable layers, plus a margin) exceeds the free space of the
output file system is refused with RESOURCE_EXHAUSTED before anything is frozen or written."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim import errors
from shim.archive import dirfd, fsutil
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
            cri.CheckpointPodRequest(
                pod_sandbox_id=big_pod.id,
                container_ids=pods.running_ids(rt, big_pod.id),
                output_path=str(out),
            ),
            timeout=60,
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


@contextlib.contextmanager
def _tmpfs(bed: TestBed, inodes: int, size_mib: int = 256) -> Iterator[Path]:
    """A tmpfs of `inodes` inodes (its root included) at a directory inside the checkpoint root."""
    d = Path(bed.checkpoint_root) / f"inodes-{secrets.token_hex(3)}"
    d.mkdir(mode=0o700)
    opts = f"size={size_mib}m,nr_inodes={inodes},mode=0700"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
        d.rmdir()


@pytest.mark.e2e
def test_every_step_out_of_inodes_is_resource_exhausted(rt: Rt, bed: TestBed, pod_cleanup: list[str]) -> None:
    """CheckpointPod into a filesystem with one, two … five inodes fewer than its archive needs:
    wherever it runs out (the dumps, the container files, the manifest's temporary file: the last
    inode), the answer is RESOURCE_EXHAUSTED naming what is left, the pod runs on thawed and no
    archive is left looking complete; with enough inodes the same checkpoint succeeds."""
    pod = pods.run_pod(
        rt,
        f"inodes-{secrets.token_hex(3)}",
        bed.pod_logs_dir,
        {"counter": pods.container_config("counter", args=["--mem-mib", "4", "--interval-ms", "50"])},
    )
    pod_cleanup.append(pod.id)
    pods.wait_count(pod.log_path("counter"), 3, timeout=60)

    def checkpoint(out: Path) -> None:
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=pod.id, container_ids=pods.running_ids(rt, pod.id), output_path=str(out)
            ),
            timeout=60,
        )

    with _tmpfs(bed, 10_000) as roomy:
        checkpoint(roomy)
        needed = 1 + sum(len(dirs) + len(files) for _, dirs, files in os.walk(roomy))  # the root too
    for short in range(1, 6):
        with _tmpfs(bed, needed - short) as out:
            with pytest.raises(grpc.RpcError) as err:
                checkpoint(out)
            code, details = err.value.code(), err.value.details() or ""
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{short} inode(s) short: {code}: {details}"
            assert "no space left" in details and "free inodes" in details, details
            assert not (out / "manifest.json").exists(), "an archive that looks complete was left"
            print(f"\n{short} inode(s) short: {details[:240]}")
        _assert_running(rt, pod)
    with _tmpfs(bed, needed + 4) as out:
        checkpoint(out)
        assert (out / "manifest.json").is_file()


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs whose every inode is in use (its root and one file), with bytes to spare."""
    d = tmp_path / "full"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=2", "tmpfs", str(d)], check=True)
    try:
        (d / "taken").write_bytes(b"x")
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


WRITES = {
    "atomic_write": lambda d: fsutil.atomic_write(d / "manifest.json", b"{}"),
    "write_private_file": lambda d: fsutil.write_private_file(d / "config.dump", b"{}"),
    "make_private_dir": lambda d: fsutil.make_private_dir(d / "containers"),
    "DirHandle.write_file": lambda d: _dir_write(d),
}


def _dir_write(d: Path) -> None:
    with dirfd.held(d) as h:
        h.write_file("manifest.json", b"{}")


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_out_of_inodes_is_resource_exhausted(full_tmpfs: Path, write: str) -> None:
    with pytest.raises(errors.ResourceExhausted) as err:
        WRITES[write](full_tmpfs)
    message = err.value.message
    assert "no space left on its filesystem" in message and "0 free inodes" in message, message
    assert str(full_tmpfs) in message, message  # the path, never only a descriptor's
    assert "/proc/self/fd" not in message, message
    assert sorted(os.listdir(full_tmpfs)) == ["taken"], "a temporary file was left"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_out_of_space_and_quota_are_resource_exhausted_other_errors_internal(
    tmp_path: Path, code: int
) -> None:
    e = errors.storage_error(
        OSError(code, os.strerror(code)), f"cannot write {tmp_path}/x", tmp_path, "4 bytes"
    )
    assert isinstance(e, errors.ResourceExhausted) and "it needs 4 bytes" in e.message, e.message
    other = errors.storage_error(OSError(errno.EIO, "I/O error"), "cannot write x", tmp_path)
    assert isinstance(other, errors.Internal) and "I/O error" in other.message
