"""Pods whose containers run as a non-root uid, checkpointed and restored end to end with runc and
crun, then checkpointed again once restored and restored again: each restore resumes the count
exactly, as the same uid, with the same resource limits.

CRIU reads a task's limits with prlimit(2), which the kernel refuses for a task of another uid
without CAP_SYS_RESOURCE; a node whose bounding set lacks it (this test bed's does, see
`node_lacks_sys_resource`) needs podshim's CRIU patch 0016, which reads them from
/proc/PID/limits instead. Without the patch the first CheckpointPod fails: run this module with
PODSHIM_TEST_CRIU_BIN=<a CRIU built without 0016> to see it.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.checks import rlimits
from shim.node import doctor
from testbed import pods, resume
from testbed.bed import TestBed
from testbed.checks import verbose_info

pytestmark = pytest.mark.e2e  # core and criu: tests/conftest.py

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 120
NOBODY = 65534  # what a pod's `runAsUser: 65534` / `runAsGroup: 65534` make the kubelet send
ARGS = ["--mem-mib", "8", "--interval-ms", "50"]
CAP_SYS_RESOURCE = 24


def node_lacks_sys_resource() -> bool:
    """CAP_SYS_RESOURCE is not in this process's bounding set, hence in no CRIU's the node runs."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return not int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1
    raise AssertionError("no CapBnd in /proc/self/status")


def nonroot_counter() -> cri.ContainerConfig:
    cc = pods.container_config("counter", args=ARGS)
    sc = cc.linux.security_context
    sc.run_as_user.CopyFrom(cri.Int64Value(value=NOBODY))
    sc.run_as_group.CopyFrom(cri.Int64Value(value=NOBODY))
    return cc


def task_identity(rt: Stub, cid: str) -> tuple[list[str], str]:
    """The container's process: its Uid/Gid lines (real, effective, saved, fs) and its limits."""
    pid = int(verbose_info(rt, cid)["pid"])
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    ids = [x.split(":", 1)[1].split() for x in status if x.startswith(("Uid:", "Gid:"))]
    return [" ".join(x) for x in ids], Path(f"/proc/{pid}/limits").read_text()


def checkpoint(rt: Stub, bed: TestBed, pod_id: str, log: Path, archives: list[Path]) -> tuple[Path, int]:
    def take() -> Path:
        out = Path(bed.checkpoint_root) / f"nonroot-{secrets.token_hex(3)}"
        out.mkdir(mode=0o700)
        archives.append(out)
        rt.CheckpointPod(pods.checkpoint_request(rt, pod_id, out), timeout=RPC_TIMEOUT)
        return out

    out, first = resume.checkpoint_exactly(take, {"counter": log})
    return out, first["counter"]


def restore(
    rt: Stub, archive: Path, first: int, log_root: Path, cleanup: list[str], handler: str
) -> tuple[str, str, Path]:
    config = pods.pod_config(f"nonroot-{secrets.token_hex(3)}", log_root)
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(archive),
            config=config,
            container_configs=[nonroot_counter()],
            runtime_handler=handler,
        ),
        timeout=RPC_TIMEOUT,
    )
    cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    log = Path(config.log_directory) / "counter" / "0.log"
    resume.assert_exact_resume({"counter": log}, {"counter": first})
    return resp.pod_sandbox_id, cid, log


def test_nonroot_pod_checkpoints_and_restores_twice(
    rt: Stub, bed: TestBed, runtime_handler: str, log_root: Path, pod_cleanup: list[str], archives: list[Path]
) -> None:
    """run as 65534:65534 → CheckpointPod → RestorePod → CheckpointPod → RestorePod: each restore
    resumes exactly, as 65534:65534, with the limits the source had."""
    src = pods.run_pod(
        rt,
        f"nonroot-src-{secrets.token_hex(3)}",
        log_root,
        {"counter": nonroot_counter()},
        runtime_handler=runtime_handler,
    )
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("counter"), 5, timeout=30)
    ids, limits = task_identity(rt, src.containers["counter"])
    assert ids == [" ".join([str(NOBODY)] * 4)] * 2, ids
    a0, first0 = checkpoint(rt, bed, src.id, src.log_path("counter"), archives)
    if node_lacks_sys_resource():  # the dump took the patch's way, not prlimit's
        dump_log = (a0 / "containers" / "counter" / "dump.log").read_text(errors="replace")
        assert "prlimit is refused without CAP_SYS_RESOURCE" in dump_log
    pods.remove_pod(rt, src.id)

    g1, cid1, log1 = restore(rt, a0, first0, log_root, pod_cleanup, runtime_handler)
    assert task_identity(rt, cid1) == (ids, limits)
    a1, first1 = checkpoint(rt, bed, g1, log1, archives)
    pods.remove_pod(rt, g1)

    _g2, cid2, _log2 = restore(rt, a1, first1, log_root, pod_cleanup, runtime_handler)
    assert task_identity(rt, cid2) == (ids, limits)


def test_nonroot_pod_refused_before_the_freeze_by_a_criu_without_the_patch(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], tmp_path: Path
) -> None:
    """Where CRIU could not read a non-root task's limits (no CAP_SYS_RESOURCE, a CRIU without
    patch 0016: here the bed's CRIU with the patch's log string overwritten, which the check
    looks for), CheckpointPod is FAILED_PRECONDITION naming the cause, and the pod runs on."""
    if not node_lacks_sys_resource():
        pytest.skip("this node's bounding set has CAP_SYS_RESOURCE: any CRIU reads the limits")
    marker = doctor.CRIU_PATCH_MARKERS[rlimits.PATCH]
    assert marker is not None
    criu = tmp_path / "unpatched" / "criu"
    criu.parent.mkdir()
    criu.write_bytes(bed.criu.read_bytes().replace(marker, b"x" * len(marker)))
    criu.chmod(0o755)
    src = pods.run_pod(rt, f"nonroot-old-{secrets.token_hex(3)}", log_root, {"counter": nonroot_counter()})
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("counter"), 3, timeout=30)
    out = Path(bed.checkpoint_root) / f"nonroot-old-{secrets.token_hex(3)}"
    out.mkdir(mode=0o700)
    try:
        with bed.extra_podshim(tmp_path, runtime={"criu": str(criu)}) as (sock, _log):
            channel = grpc.insecure_channel(f"unix://{sock}")
            try:
                with pytest.raises(grpc.RpcError) as e:
                    api_pb2_grpc.RuntimeServiceStub(channel).CheckpointPod(
                        pods.checkpoint_request(rt, src.id, out), timeout=RPC_TIMEOUT
                    )
            finally:
                channel.close()
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        details = e.value.details() or ""
        assert "uid 65534" in details and "CAP_SYS_RESOURCE" in details and rlimits.PATCH in details, details
        assert list(out.iterdir()) == []  # nothing written
        now = pods.counts(src.log_path("counter"))[-1]
        pods.wait_count(src.log_path("counter"), now + 3, timeout=20)  # never frozen
    finally:
        shutil.rmtree(out, ignore_errors=True)
