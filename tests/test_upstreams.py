"""What podshim does with what each upstream implements itself (containerd 1.6, 1.7, 2.1; the bed's
upstream is PODSHIM_TEST_CONTAINERD). With `container_checkpoint = "fallback"` (the default,
"always", is podshim's own on every version), CheckpointContainer goes to the upstream first:
containerd 1.6 and 1.7 answer UNIMPLEMENTED and podshim writes its own tar; containerd 2.x
checkpoints the container itself and podshim passes its tar through. Either tar restores through
podshim (CreateContainer with the tar as image, then StartContainer): the process continues from
the checkpoint.
"""

from __future__ import annotations

import json
import secrets
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import pods, resume
from testbed.bed import TestBed
from testbed.checks import expect_error, journal_files

pytestmark = pytest.mark.e2e

Rt = api_pb2_grpc.RuntimeServiceStub
CALL_TIMEOUT = 120.0


def tar_members(path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(path) as tar:
        return {m.name.rstrip("/"): m for m in tar.getmembers()}


def tar_json(path: Path, name: str) -> Any:
    with tarfile.open(path) as tar:
        f = tar.extractfile(name)
        assert f is not None
        return json.loads(f.read())


def tar_taker(rt: Rt, cid: str, out: Path) -> Callable[[], Path]:
    """CheckpointContainer of `cid` into a new tar in `out` at each call (resume.checkpoint_exactly
    may take several)."""
    attempts = iter(range(resume.CUT_ATTEMPTS))

    def take() -> Path:
        target = out / f"counter-{next(attempts)}.tar"
        rt.CheckpointContainer(
            cri.CheckpointContainerRequest(container_id=cid, location=str(target)), timeout=CALL_TIMEOUT
        )
        return target

    return take


@pytest.mark.usefixtures("upstream_first_container_checkpoint")
def test_checkpoint_container_is_upstream_first(
    rt: Rt, direct_rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    counter = pods.container_config("counter", args=["--mem-mib", "8", "--interval-ms", "50"])
    src = pods.run_pod(rt, f"upfirst-{secrets.token_hex(3)}", log_root, {"counter": counter})
    pod_cleanup.append(src.id)
    cid, src_log = src.containers["counter"], src.log_path("counter")
    pods.wait_count(src_log, 10)
    out = Path(bed.checkpoint_root) / f"upfirst-{secrets.token_hex(4)}"
    out.mkdir(mode=0o700)

    # what the upstream itself answers (an unknown id: nothing is written either way)
    gone = cri.CheckpointContainerRequest(container_id="no-such-container", location=str(out / "x.tar"))
    if bed.containerd_at_least("2.0"):  # 2.x implements CheckpointContainer
        expect_error(grpc.StatusCode.NOT_FOUND, lambda: direct_rt.CheckpointContainer(gone, timeout=30))
    else:  # 1.6 and 1.7 do not
        expect_error(grpc.StatusCode.UNIMPLEMENTED, lambda: direct_rt.CheckpointContainer(gone, timeout=30))

    # through podshim with fallback: the upstream's when it has one
    take = tar_taker(rt, cid, out)

    first: int | tuple[int, ...]
    if bed.containerd_at_least("2.0"):
        # containerd's own tar records no cut: the first count is bounded by the source's log
        # around the call, from the last count logged before it began (the dumped process had
        # printed it) to the first the source made after the call returned (after the thaw, so
        # at least the dumped process's next one; by its own clock: whatever the logger's lag)
        before = pods.counts(src_log)[-1]
        target = take()
        returned = time.time()
        made_after = pods.wait_for(
            lambda: [x.count for x in resume.lines(src_log) if x.ts > returned],
            what="the source's first count after the checkpoint",
        )
        first = tuple(range(before + 1, made_after[0] + 1))
    else:  # podshim's tar records its cut: the one count (testbed/resume.py)
        target, firsts = resume.checkpoint_exactly(take, {"counter": src_log}, discard=Path.unlink)
        first = firsts["counter"]
    after = pods.counts(src_log)[-1]
    entries = tar_members(target)
    for required in ("spec.dump", "config.dump", "checkpoint/inventory.img", "rootfs-diff.tar"):
        assert required in entries and entries[required].isreg(), (required, sorted(entries))
    config = tar_json(target, "config.dump")
    assert config["id"] == cid and config["rootfsImageName"] == pods.COUNTER_IMAGE
    if bed.containerd_at_least("2.0"):
        # containerd's own tar: its runtime type, no podshim manifest, podshim journaled nothing
        assert "podshim-manifest.json" not in entries and "podshim" not in config
        assert config["runtime"] == "io.containerd.runc.v2"
    else:
        assert tar_json(target, "podshim-manifest.json")["format"] == "podshim.container-checkpoint.v1"
        assert config["runtime"] == "runc"
    assert journal_files(bed.podshim_state_dir) == []
    pods.wait_count(src_log, after + 3)  # the source keeps running

    # either tar restores through podshim into a new sandbox: the counter continues
    config_dst = pods.pod_config(f"updst-{secrets.token_hex(3)}", log_root)
    pod_id = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config_dst)).pod_sandbox_id
    pod_cleanup.append(pod_id)
    cc = pods.container_config("copy", image=str(target), args=[])  # the command comes from the tar
    new_id = rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config_dst),
        timeout=CALL_TIMEOUT,
    ).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=new_id), timeout=CALL_TIMEOUT)
    restored_log = Path(config_dst.log_directory) / cc.log_path
    # exactly the count after the cut (one of the bounded ones for containerd's tar), then on
    # one by one, never its start-up again
    got = resume.assert_exact_resume({"copy": restored_log}, {"copy": first})["copy"]
    pods.wait_count(restored_log, got + 5)
    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=new_id)).status
    assert st.state == cri.CONTAINER_RUNNING


def test_containerd_restores_podshims_container_tar_itself(
    rt: Rt, direct_rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    """podshim's own container tar (the default on every version, manifest and all) is a
    checkpoint containerd 2.2 restores by itself, through its own CreateContainer with the tar as
    the image (`enable_experimental_restore_via_create`): the counter resumes at the count after
    the cut. containerd 1.x has no such restore; 2.4 dropped it."""
    if not bed.restore_via_create:
        pytest.skip(
            f"containerd {bed.containerd_version} does not restore a checkpoint tar itself (2.2 does)"
        )
    counter = pods.container_config("counter", args=["--mem-mib", "8", "--interval-ms", "50"])
    src = pods.run_pod(rt, f"byctrd-{secrets.token_hex(3)}", log_root, {"counter": counter})
    pod_cleanup.append(src.id)
    cid, src_log = src.containers["counter"], src.log_path("counter")
    pods.wait_count(src_log, 10)
    out = Path(bed.checkpoint_root) / f"byctrd-{secrets.token_hex(4)}"
    out.mkdir(mode=0o700)
    take = tar_taker(rt, cid, out)

    target, firsts = resume.checkpoint_exactly(take, {"counter": src_log}, discard=Path.unlink)
    assert tar_json(target, "podshim-manifest.json")["format"] == "podshim.container-checkpoint.v1"
    config_dst = pods.pod_config(f"byctrd-dst-{secrets.token_hex(3)}", log_root)
    pod_id = direct_rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config_dst)).pod_sandbox_id
    pod_cleanup.append(pod_id)
    cc = pods.container_config("copy", image=str(target), args=[])
    new_id = direct_rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config_dst),
        timeout=CALL_TIMEOUT,
    ).container_id
    direct_rt.StartContainer(cri.StartContainerRequest(container_id=new_id), timeout=CALL_TIMEOUT)
    restored_log = Path(config_dst.log_directory) / cc.log_path
    got = resume.assert_exact_resume({"copy": restored_log}, {"copy": firsts["counter"]})["copy"]
    pods.wait_count(restored_log, got + 5)


def test_checkpoint_pod_records_the_runtime_handler(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], archives: list[Path], crun_handler: str
) -> None:
    """containerd 2.x no longer puts `runtimeHandler` in the pod's verbose info (1.6 and 1.7 do):
    podshim reads PodSandboxStatus.runtime_handler, so the archive still names the pod's handler
    (what `podshim restorepod` restores with by default)."""
    counter = pods.container_config("counter", args=["--mem-mib", "4", "--interval-ms", "50"])
    pod = pods.run_pod(rt, f"handler-{secrets.token_hex(3)}", log_root, {"counter": counter}, crun_handler)
    pod_cleanup.append(pod.id)
    pods.wait_count(pod.log_path("counter"), 3)
    out = Path(bed.checkpoint_root) / f"handler-{secrets.token_hex(4)}"
    out.mkdir(mode=0o700)
    archives.append(out)
    req = cri.CheckpointPodRequest(
        pod_sandbox_id=pod.id, container_ids=pods.running_ids(rt, pod.id), output_path=str(out)
    )
    rt.CheckpointPod(req, timeout=CALL_TIMEOUT)
    status = json.loads((out / "sandbox" / "status.json").read_text())
    assert status["runtime_handler"] == "crun", status.get("runtime_handler")
