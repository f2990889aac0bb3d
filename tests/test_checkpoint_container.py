"""CheckpointContainer (KEP-2008) and restore of its tar through CreateContainer, end to end.

Every call here goes through podshim's own checkpoint (the default `container_checkpoint =
"always"`), on containerd 2.x too, which would checkpoint containers itself
(tests/test_upstreams.py covers "fallback", handing the call to the upstream first). The archive is
checked as the Kubernetes node e2e test and checkpointctl read it, restored into a new sandbox
the CRI-O way (CreateContainer with the tar as image, then StartContainer), and read back with
`podshim inspect`. Every refusal is checked for its gRPC code, the container still counting
and unfrozen, and no file (tar, staging dir or journal record) left behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import stat
import subprocess
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from faults.helpers import HOLD_DUMP

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim import config as configmod
from shim.server.runtime import RuntimeHandlers
from testbed import pods, resume
from testbed.bed import TestBed
from testbed.checks import (
    assert_netns_unlocked,
    container_cgroup,
    expect_error,
    freezer_state,
    journal_files,
    set_freezer,
)

pytestmark = pytest.mark.e2e

Rt = api_pb2_grpc.RuntimeServiceStub

REPO = Path(__file__).resolve().parents[1]
PODSHIM = REPO / ".venv/bin/podshim"
CALL_TIMEOUT = 120.0
# the kubelet's name: checkpoint-<podName>_<podNamespace>-<containerName>-<RFC3339>.tar
KUBELET_NAME = re.compile(
    r"^checkpoint-(?P<pod>.+)_(?P<ns>[^_]+)-(?P<ctr>[^-]+)-(?P<ts>\d{4}-\d\d-\d\dT[0-9:.]+Z)\.tar$"
)
# checkpointctl lib/metadata.go ContainerConfig keys podshim writes
CONFIG_DUMP_KEYS = {
    "id",
    "name",
    "rootfsImage",
    "rootfsImageRef",
    "rootfsImageName",
    "runtime",
    "createdTime",
    "checkpointedTime",
    "restored",
}


# ---------------------------------------------------------------------------- helpers


def counter(name: str, mem_mib: int = 8, interval_ms: int = 100) -> cri.ContainerConfig:
    return pods.container_config(name, args=["--mem-mib", str(mem_mib), "--interval-ms", str(interval_ms)])


def start_pod(
    rt: Rt,
    name: str,
    log_root: Path,
    cleanup: list[str],
    containers: dict[str, cri.ContainerConfig] | None = None,
    runtime_handler: str = "",
) -> pods.Pod:
    pod = pods.run_pod(
        rt,
        f"{name}-{secrets.token_hex(3)}",
        log_root,
        containers or {"counter": counter("counter")},
        runtime_handler=runtime_handler,
    )
    cleanup.append(pod.id)
    return pod


def wait_counting(log_path: Path, ticks: int = 3, timeout: float = 30.0) -> int:
    now = pods.counts(log_path)
    return pods.wait_count(log_path, (now[-1] if now else -1) + ticks, timeout=timeout)


def checkpoint(
    rt: Rt, container_id: str, location: Path | str, timeout: int = 0, rpc: float = CALL_TIMEOUT
) -> Any:
    return rt.CheckpointContainer(
        cri.CheckpointContainerRequest(container_id=container_id, location=str(location), timeout=timeout),
        timeout=rpc,
    )


def checkpoint_counter(rt: Rt, bed: TestBed, container_id: str, log: Path, tag: str) -> tuple[Path, int]:
    """A tar of the running counter `container_id` (`log`: its log), and the count it prints first
    when restored (testbed/resume.py: a checkpoint whose cut the log cannot place is taken again)."""

    def take() -> Path:
        target = new_dir(bed, tag) / "counter.tar"
        checkpoint(rt, container_id, target)
        return target

    target, first = resume.checkpoint_exactly(take, {"counter": log})
    return target, first["counter"]


def container_freezer_state(rt: Rt, container_id: str) -> str:
    return freezer_state(container_cgroup(rt, container_id))


def assert_unharmed(rt: Rt, pod: pods.Pod, name: str = "counter", started_at: int | None = None) -> None:
    """RUNNING, not restarted, its cgroup THAWED, and still counting up one by one."""
    cid = pod.containers[name]
    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    assert st.state == cri.CONTAINER_RUNNING, cri.ContainerState.Name(st.state)
    if started_at is not None:
        assert st.started_at == started_at, "the container was restarted"
    assert container_freezer_state(rt, cid) == "THAWED"
    wait_counting(pod.log_path(name), ticks=3, timeout=15)
    values = pods.counts(pod.log_path(name))
    assert values == list(range(values[0], values[0] + len(values))), "the counter skipped or restarted"


def listing(d: Path) -> set[str]:
    return set(os.listdir(d))


def imports(bed: TestBed) -> list[str]:
    try:
        return os.listdir(Path(bed.podshim_state_dir) / "imports")
    except FileNotFoundError:
        return []


def new_dir(bed: TestBed, name: str) -> Path:
    d = Path(bed.checkpoint_root) / f"{name}-{secrets.token_hex(4)}"
    d.mkdir(mode=0o700)
    return d


def members(tar_path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(tar_path) as tar:
        return {m.name.rstrip("/"): m for m in tar.getmembers()}


def read_member(tar_path: Path, name: str) -> Any:
    with tarfile.open(tar_path) as tar:
        f = tar.extractfile(name)
        assert f is not None
        return json.loads(f.read())


def podshim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PODSHIM), *args], capture_output=True, text=True, timeout=60)


def run_sandbox(rt: Rt, name: str, log_root: Path, cleanup: list[str], runtime_handler: str = "") -> Any:
    config = pods.pod_config(f"{name}-{secrets.token_hex(3)}", log_root)
    pod_id = rt.RunPodSandbox(
        cri.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler)
    ).pod_sandbox_id
    cleanup.append(pod_id)
    return pod_id, config


def refused_cleanly(
    rt: Rt, bed: TestBed, pod: pods.Pod, code: grpc.StatusCode, call: Callable[[], Any], *words: str
) -> str:
    """`call` fails with `code`; the checkpoint root and the journal are as before; the counter is
    unharmed."""
    started = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=pod.containers["counter"])).status
    before = {p: listing(p) for p in Path(bed.checkpoint_root).rglob("*") if p.is_dir()}
    before[Path(bed.checkpoint_root)] = listing(Path(bed.checkpoint_root))
    details = expect_error(code, call, *words)

    def clean() -> bool:
        return (
            all(listing(d) == names for d, names in before.items())
            and journal_files(bed.podshim_state_dir) == []
        )

    # a caller's own deadline may fire while podshim is still cleaning up: give it a moment
    pods.wait_for(clean, timeout=10, what="no file left behind")
    assert_unharmed(rt, pod, started_at=started.started_at)
    return details


# ---------------------------------------------------------------------------- checkpoint


def test_checkpoint_keeps_the_container_running(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    pod = start_pod(rt, "ckpt", log_root, pod_cleanup, {"counter": counter("counter", mem_mib=32)})
    cid = pod.containers["counter"]
    log_path = pod.log_path("counter")
    wait_counting(log_path, 5)
    started = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.started_at
    out = new_dir(bed, "ckpt")
    before = pods.counts(log_path)[-1]
    checkpoint(rt, cid, out)
    after = pods.counts(log_path)[-1]

    # the container did not notice: running, same start, thawed, counting on one by one
    assert_unharmed(rt, pod, started_at=started)
    assert pods.counts(log_path)[-1] > after >= before

    # one tar, named like the kubelet names it, 0600, nothing else (no staging leftovers)
    files = listing(out)
    assert len(files) == 1, files
    name = files.pop()
    m = KUBELET_NAME.match(name)
    assert m, name
    assert (m["pod"], m["ns"], m["ctr"]) == (pod.config.metadata.name, "default", "counter")
    tar_path = out / name
    st = tar_path.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert journal_files(bed.podshim_state_dir) == []

    # the Kubernetes node e2e check: these exact entries
    entries = members(tar_path)
    for required in ("spec.dump", "config.dump", "checkpoint/inventory.img"):
        assert required in entries and entries[required].isreg(), required
    for f in (
        "status.dump",
        "rootfs-diff.tar",
        "deleted.files",
        "dump.log",
        "stats-dump",
        "podshim-manifest.json",
    ):
        assert f in entries and entries[f].isreg(), f
    pages = [e for n, e in entries.items() if re.fullmatch(r"checkpoint/pages-\d+\.img", n)]
    assert pages and sum(p.size for p in pages) >= 32 << 20, "the memory pages are missing"
    assert all(e.isreg() or e.isdir() for e in entries.values())

    # checkpointctl's ContainerConfig, podshim's record and manifest
    config = read_member(tar_path, "config.dump")
    assert CONFIG_DUMP_KEYS <= set(config), CONFIG_DUMP_KEYS - set(config)
    assert config["id"] == cid and config["name"] == "counter" and config["restored"] is False
    assert config["rootfsImageName"] == pods.COUNTER_IMAGE and config["rootfsImageRef"].startswith("sha256:")
    assert config["runtime"] == "runc"
    assert config["config"]["args"] == ["--mem-mib", "32", "--interval-ms", "100"]
    spec = read_member(tar_path, "spec.dump")
    assert spec["process"]["args"][-4:] == ["--mem-mib", "32", "--interval-ms", "100"]
    manifest = read_member(tar_path, "podshim-manifest.json")
    assert manifest["format"] == "podshim.container-checkpoint.v1"
    listed = {n for n, e in entries.items() if e.isreg()} - {"podshim-manifest.json"}
    assert set(manifest["files"]) == listed
    assert manifest["files"]["rootfs-diff.tar"]["size"] == entries["rootfs-diff.tar"].size
    assert 0 < manifest["timings"]["freeze_window"] < 10
    assert manifest["container"]["id"] == cid and manifest["pod"]["id"] == pod.id

    # the rootfs diff is an OCI layer of the writable layer
    with tarfile.open(tar_path) as tar:
        diff = tar.extractfile("rootfs-diff.tar")
        assert diff is not None
        with tarfile.open(fileobj=diff) as layer:
            layer.getmembers()  # a readable tar


def test_checkpoint_to_a_file_path_and_rootfs_diff(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    script = "echo written > /written.txt; rm /bin/true; while true; do sleep 1; done"
    busy = pods.container_config("busy", image=pods.BUSYBOX_IMAGE, command=["sh", "-c", script], args=[])
    pod = start_pod(rt, "diff", log_root, pod_cleanup, {"busy": busy, "counter": counter("counter")})
    cid = pod.containers["busy"]
    pods.wait_for(
        lambda: (
            rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["cat", "/written.txt"]), timeout=10).stdout
        ),
        what="the file written",
    )
    out = new_dir(bed, "file")
    target = out / "busy.tar"
    checkpoint(rt, cid, target)
    assert listing(out) == {"busy.tar"}
    with tarfile.open(target) as tar:
        diff = tar.extractfile("rootfs-diff.tar")
        assert diff is not None
        with tarfile.open(fileobj=diff) as layer:
            names = layer.getnames()
        deleted_file = tar.extractfile("deleted.files")
        assert deleted_file is not None
        deleted = json.loads(deleted_file.read())
    assert "written.txt" in names
    assert "/bin/true" in deleted or "bin/.wh.true" in names
    # the other container of the pod was never frozen or touched
    assert_unharmed(rt, pod)


# ---------------------------------------------------------------------------- restore


def test_restore_into_a_new_sandbox(
    rt: Rt,
    img: api_pb2_grpc.ImageServiceStub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    runtime_handler: str,
) -> None:
    src = start_pod(
        rt,
        "src",
        log_root,
        pod_cleanup,
        {"counter": counter("counter", mem_mib=16, interval_ms=50)},
        runtime_handler=runtime_handler,
    )
    src_log = src.log_path("counter")
    pods.wait_count(src_log, 20)
    target, first = checkpoint_counter(rt, bed, src.containers["counter"], src_log, "restore")
    assert target.is_file()
    assert read_member(target, "config.dump")["runtime"] == (runtime_handler or "runc")

    # a new sandbox: the forensic copy, restored beside the source (which keeps running)
    pod_id, config = run_sandbox(rt, "dst", log_root, pod_cleanup, runtime_handler)
    cc = pods.container_config("copy", image=str(target), args=[])  # args come from the checkpoint
    cid = rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config),
        timeout=CALL_TIMEOUT,
    ).container_id
    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    assert st.state == cri.CONTAINER_CREATED
    # created from the checkpoint's own image, which the tar names (not the tar path it was given)
    assert st.image.image == pods.COUNTER_IMAGE, st.image
    image = img.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=pods.COUNTER_IMAGE))).image
    assert st.image_ref in (image.id, *image.repo_digests), (
        st.image_ref,
        image.id,
        image.repo_digests,
    )
    assert len(imports(bed)) >= 1
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=CALL_TIMEOUT)

    restored_log = Path(config.log_directory) / cc.log_path
    resume.assert_exact_resume({"counter": restored_log}, {"counter": first}, follow=5)
    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    assert st.state == cri.CONTAINER_RUNNING
    # the source never stopped
    assert_unharmed(rt, src)
    # a damaged copy of the tar is refused before anything is created
    truncated, flipped = target.with_name("truncated.tar"), target.with_name("flipped.tar")
    data = target.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    pages = members(target)["checkpoint/pages-1.img"]
    at = pages.offset_data + pages.size // 2
    flipped.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    cc_bad = pods.container_config("bad", image=str(truncated), args=[])
    expect_error(
        grpc.StatusCode.DATA_LOSS,
        lambda: rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc_bad, sandbox_config=config),
            timeout=CALL_TIMEOUT,
        ),
        "truncated",
    )
    listed = rt.ListContainers(cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=pod_id)))
    assert [c.id for c in listed.containers] == [cid]
    assert len(imports(bed)) == 1  # the running copy's only
    # a page image's checksum is checked beside CRIU's read (podshim-runc, the bed's handlers pass
    # its annotations): the create goes through, the start fails before the process runs
    cc_bad = pods.container_config("flipped", image=str(flipped), args=[])
    bad_id = rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc_bad, sandbox_config=config),
        timeout=CALL_TIMEOUT,
    ).container_id
    expect_error(
        grpc.StatusCode.DATA_LOSS,
        lambda: rt.StartContainer(cri.StartContainerRequest(container_id=bad_id), timeout=CALL_TIMEOUT),
        "checkpoint/pages-1.img",
    )
    bad_log = Path(config.log_directory) / cc_bad.log_path
    assert pods.counts(bad_log) == [], "the process ran on memory whose checksum failed"
    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=bad_id)).status
    assert st.state != cri.CONTAINER_RUNNING, cri.ContainerState.Name(st.state)
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=bad_id), timeout=30)
    assert len(imports(bed)) == 1

    # the checkpoint is still intact for another restore, and its import goes with the container
    assert target.is_file()
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=30)
    assert imports(bed) == []


SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_the_containers_empty_dirs_travel_in_its_tar(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """What an init container rendered into an emptyDir and the state file the counter rewrites
    there on each tick travel in the container's tar: a create in a new pod with a fresh
    emptyDir of the same name finds them before the container exists, and the restored counter
    resumes at the next count, rewriting the same file. A create the upstream refuses after the
    fill (the container's name is taken) leaves the emptyDir empty, with the kubelet's mode."""
    kubelet = Path(bed.base_dir) / "kubelet"
    rendered = "rendered by the init container\n"

    def counting_into(volume: Path, **kw: Any) -> cri.ContainerConfig:
        cc = pods.container_config("counter", **kw)
        cc.mounts.append(cri.Mount(host_path=str(volume), container_path="/work"))
        return cc

    tag = f"ed-{secrets.token_hex(3)}"
    src_config = pods.pod_config(tag, log_root)
    src_dir = pods.empty_dir(kubelet, src_config.metadata.uid, "work")
    (src_dir / "msg").write_text(rendered)
    src_cc = counting_into(src_dir, args=["--interval-ms", "100", "--state-file", "/work/state"])
    src = pods.run_pod(
        rt, tag, log_root, {"counter": src_cc}, runtime_handler=runtime_handler, config=src_config
    )
    pod_cleanup.append(src.id)
    log = src.log_path("counter")
    pods.wait_count(log, 10)
    target, first = checkpoint_counter(rt, bed, src.containers["counter"], log, "empty-dir")
    assert {"sandbox/volumes.json", "sandbox/empty-dirs/work.tar"} <= set(members(target))
    assert "sandbox/empty-dirs/work.tar" in read_member(target, "podshim-manifest.json")["files"]
    pods.remove_pod(rt, src.id)

    pod_id, config = run_sandbox(rt, "ed-dst", log_root, pod_cleanup, runtime_handler)
    new_dir = pods.empty_dir(kubelet, config.metadata.uid, "work")
    plain = pods.container_config("counter")  # takes the name (and attempt) first
    rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=plain, sandbox_config=config),
        timeout=CALL_TIMEOUT,
    )
    copy = counting_into(new_dir, image=str(target), args=[])
    with pytest.raises(grpc.RpcError) as err:  # containerd's own error, whatever its code
        rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=copy, sandbox_config=config),
            timeout=CALL_TIMEOUT,
        )
    assert "reserved" in (err.value.details() or ""), err.value.details()
    assert list(new_dir.iterdir()) == [], "a refused create left the tar's files in the new emptyDir"
    assert stat.S_IMODE(new_dir.stat().st_mode) == 0o777

    copy.metadata.attempt, copy.log_path = 1, "counter/1.log"
    cid = rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=copy, sandbox_config=config),
        timeout=CALL_TIMEOUT,
    ).container_id
    # filled before the container existed: what the source had at the cut
    assert (new_dir / "msg").read_text() == rendered
    assert int((new_dir / "state").read_text()) in (first - 2, first - 1)
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=CALL_TIMEOUT)
    restored_log = Path(config.log_directory) / copy.log_path
    resume.assert_exact_resume({"counter": restored_log}, {"counter": first}, follow=5)
    pods.wait_for(lambda: int((new_dir / "state").read_text()) >= first + 3, what="the restored state file")
    out = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["cat", "/work/msg"]), timeout=10).stdout
    assert out.decode() == rendered


def test_restore_of_a_kubelet_container_needs_its_bind_mounts(
    rt: Rt, img: api_pb2_grpc.ImageServiceStub, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    """The tar of a container a kubelet made holds its bind mounts (per-pod /etc/hosts, the
    termination log, a service-account token) in spec.dump: CreateContainer from it without them
    is FAILED_PRECONDITION naming each one the upstream does not provide itself (containerd mounts
    the sandbox's /etc/hosts), before anything is created or CRIU runs; with them in the request
    the process resumes where it left off."""
    kubelet_root = Path(bed.base_dir) / "kubelet"
    src_config = pods.pod_config(f"kube-src-{secrets.token_hex(3)}", log_root)
    cc = pods.kubelet_container_config(img, src_config, kubelet_root, "counter", args=["--interval-ms", "50"])
    token = pods.kubelet_pod_dir(kubelet_root, src_config) / "volumes" / "token"
    token.mkdir(parents=True)
    (token / "token").write_text("not a real token")
    cc.mounts.append(cri.Mount(host_path=str(token), container_path=SERVICE_ACCOUNT, readonly=True))
    src = pods.run_pod(rt, src_config.metadata.name, log_root, {"counter": cc}, config=src_config)
    pod_cleanup.append(src.id)
    cid = src.containers["counter"]
    src_log = src.log_path("counter")
    pods.wait_count(src_log, 10)
    target, first = checkpoint_counter(rt, bed, cid, src_log, "kubelet-ctr")

    pod_id, config = run_sandbox(rt, "kube-dst", log_root, pod_cleanup)

    def create(*mounts: str) -> str:
        new = pods.container_config("copy", image=str(target), args=[])
        for dest in mounts:
            host = Path(bed.base_dir) / "kubelet" / "new" / secrets.token_hex(3)
            host.parent.mkdir(parents=True, exist_ok=True)
            host.mkdir() if dest == SERVICE_ACCOUNT else host.touch()
            new.mounts.append(cri.Mount(host_path=str(host), container_path=dest))
        req = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=new, sandbox_config=config)
        return rt.CreateContainer(req, timeout=CALL_TIMEOUT).container_id

    details = expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        create,
        pods.TERMINATION_LOG,
        SERVICE_ACCOUNT,
        "nothing was created",
    )
    assert "/etc/hosts" not in details, details  # containerd mounts the sandbox's own
    expect_error(grpc.StatusCode.FAILED_PRECONDITION, lambda: create(pods.TERMINATION_LOG), SERVICE_ACCOUNT)
    in_pod = rt.ListContainers(cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=pod_id)))
    assert list(in_pod.containers) == [] and imports(bed) == []

    copy = create(pods.TERMINATION_LOG, SERVICE_ACCOUNT)
    rt.StartContainer(cri.StartContainerRequest(container_id=copy), timeout=CALL_TIMEOUT)
    restored_log = Path(config.log_directory) / "copy" / "0.log"
    resume.assert_exact_resume({"copy": restored_log}, {"copy": first}, follow=5)


def log_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def create_from(rt: Rt, pod_id: str, config: Any, cc: cri.ContainerConfig) -> str:
    req = cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config)
    return rt.CreateContainer(req, timeout=CALL_TIMEOUT).container_id


def test_what_the_kubelet_sends_is_enough(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """The kubelet's checkpoint API calls CheckpointContainer with no options. A deleted file held
    open over CRIU's 1 MiB ghost-file limit and an inotify watch on a file of the container's
    rootfs (overlayfs: CRIU cannot reopen it by handle) checkpoint as they do with CheckpointPod:
    the node's defaults, ghost-limit and irmap-scan-path fitted before the freeze
    (docs/design/checkpoint-container.md (CheckpointContainer)); the tar restores both (the file's content,
    a watch that still reports a write)."""
    script = (
        "dd if=/dev/zero of=/tmp/big bs=1024 count=2048 2>/dev/null && exec 3</tmp/big && rm /tmp/big "
        "&& mkdir -p /data/deep && exec /sharer watch /data/deep/f"
    )
    cc = pods.container_config("app", command=["sh", "-c", script], args=[])
    src = start_pod(rt, "no-options", log_root, pod_cleanup, {"app": cc}, runtime_handler)
    pods.wait_for(lambda: b"ready" in log_bytes(src.log_path("app")), what="the file held open and the watch")
    target = new_dir(bed, "no-options") / "app.tar"
    checkpoint(rt, src.containers["app"], target)  # as the kubelet: no options
    options = read_member(target, "podshim-manifest.json")["options"]
    assert options["ghost-limit"] == str(3 << 20), options  # 2 MiB plus a quarter, whole MiB
    assert options["irmap-scan-paths"] == "/data/deep", options

    pod_id, config = run_sandbox(rt, "no-options-dst", log_root, pod_cleanup, runtime_handler)
    cid = create_from(rt, pod_id, config, pods.container_config("app", image=str(target), args=[]))
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=CALL_TIMEOUT)
    r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["wc", "-c", "/proc/1/fd/3"], timeout=10))
    assert r.exit_code == 0 and r.stdout.split()[0] == b"2097152", (r.stdout, r.stderr)
    write = ["sh", "-c", "echo b >> /data/deep/f"]
    r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=write, timeout=10))
    assert r.exit_code == 0, r.stderr
    restored_log = Path(config.log_directory) / "app" / "0.log"
    pods.wait_for(lambda: b"event " in log_bytes(restored_log), what="the restored watch to report the write")


def test_node_default_tcp_established_locks_the_pod_network(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], tmp_path: Path
) -> None:
    """A container holding an established (loopback) TCP connection: with the stock node defaults
    CRIU refuses it; on a node whose [checkpoint] tcp_established is on, CheckpointContainer (no
    options) dumps it with the pod's network namespace locked by podshim around the dump, as
    CheckpointPod does (CRIU told to skip its own lock), and unlocked after: no CRIU chain is left."""
    script = (
        "while true; do echo tick; sleep 1; done | nc -l -p 7777 & "
        f"mkfifo /tmp/f; sleep 100000 > /tmp/f & {pods.until_listening(7777)}; nc 127.0.0.1 7777 < /tmp/f"
    )
    tcp = pods.container_config("tcp", image=pods.BUSYBOX_IMAGE, command=["sh", "-c", script], args=[])
    src = start_pod(rt, "tcp", log_root, pod_cleanup, {"tcp": tcp})
    pods.wait_for(
        lambda: log_bytes(src.log_path("tcp")).count(b"tick") >= 2, what="the connection to carry data"
    )
    cid = src.containers["tcp"]
    out = new_dir(bed, "tcp")
    expect_error(grpc.StatusCode.INTERNAL, lambda: checkpoint(rt, cid, out / "stock.tar"), "tcp-established")
    assert list(out.iterdir()) == []
    with bed.extra_podshim(tmp_path, checkpoint={"tcp_established": True}) as (socket, _log):
        checkpoint(pods.stubs(socket)[0], cid, out / "tcp.tar")
    assert read_member(out / "tcp.tar", "podshim-manifest.json")["options"]["tcp-established"] == "true"
    import pycriu

    with tarfile.open(out / "tcp.tar") as tar:
        inventory = tar.extractfile("checkpoint/inventory.img")
        assert inventory is not None
        assert pycriu.images.load(inventory)["entries"][0].get("network_lock_method") == 2  # skip
    assert_netns_unlocked(rt, src.id)
    ticks = log_bytes(src.log_path("tcp")).count(b"tick")
    pods.wait_for(
        lambda: log_bytes(src.log_path("tcp")).count(b"tick") > ticks + 1, what="the connection to go on"
    )


def rewrite_tar(src: Path, dst: Path, member: str, change: Callable[[Any], None]) -> None:
    """A copy of the container tar `src` whose JSON `member` `change` edited, with
    podshim-manifest.json agreeing (its checksums are no signature)."""
    with tarfile.open(src) as tar:
        entries = [(m, tar.extractfile(m).read() if m.isfile() else b"") for m in tar.getmembers()]  # type: ignore[union-attr]
    data = dict((m.name, d) for m, d in entries)
    doc = json.loads(data[member])
    change(doc)
    data[member] = json.dumps(doc).encode()
    m = json.loads(data["podshim-manifest.json"])
    m["files"][member] = {"size": len(data[member]), "sha256": hashlib.sha256(data[member]).hexdigest()}
    data["podshim-manifest.json"] = json.dumps(m).encode()
    with tarfile.open(dst, "w") as out:
        for ti, _ in entries:
            if ti.isfile():
                ti.size = len(data[ti.name])
                out.addfile(ti, io.BytesIO(data[ti.name]))
            else:
                out.addfile(ti)


def test_a_kubelet_container_tar_restores_its_image_by_identity(
    rt: Rt, img: api_pb2_grpc.ImageServiceStub, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    """docs/design/archive.md (Image identity): the tar of a container the kubelet made (image by
    ID, user_specified_image) records the image's ID and name, as a pod checkpoint does. Restored,
    its container is created with that ID; an image the request names (user_specified_image) may
    be it by ID, digest reference or name, another image is a config mismatch (INVALID_ARGUMENT);
    a config.dump naming another image than the manifest is DATA_LOSS. Nothing is created or
    imported by a refusal."""
    counter_id, busybox_id = pods.image_id(img, pods.COUNTER_IMAGE), pods.image_id(img, pods.BUSYBOX_IMAGE)
    kubelet_root = Path(bed.base_dir) / "kubelet"
    src_config = pods.pod_config(f"kube-img-{secrets.token_hex(3)}", log_root)
    cc = pods.kubelet_container_config(img, src_config, kubelet_root, "counter", args=["--interval-ms", "50"])
    src = pods.run_pod(rt, src_config.metadata.name, log_root, {"counter": cc}, config=src_config)
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("counter"), 10)
    src_log = src.log_path("counter")
    target, first = checkpoint_counter(rt, bed, src.containers["counter"], src_log, "kube-img")
    recorded = read_member(target, "podshim-manifest.json")["container"]
    assert (recorded["image_id"], recorded["user_specified_image"]) == (counter_id, pods.COUNTER_IMAGE)
    dump = read_member(target, "config.dump")
    assert (dump["image_id"], dump["user_specified_image"]) == (counter_id, pods.COUNTER_IMAGE), dump

    pod_id, config = run_sandbox(rt, "kube-img-dst", log_root, pod_cleanup)

    def copy(tar: Path, expect: str = "") -> cri.ContainerConfig:
        new = pods.container_config(f"copy-{secrets.token_hex(2)}", image=str(tar), args=[])
        new.image.user_specified_image = expect
        term = kubelet_root / "new" / secrets.token_hex(3)
        term.parent.mkdir(parents=True, exist_ok=True)
        term.touch()
        new.mounts.append(cri.Mount(host_path=str(term), container_path=pods.TERMINATION_LOG))
        return new

    def nothing_left() -> None:
        listed = rt.ListContainers(
            cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=pod_id))
        )
        assert list(listed.containers) == [] and imports(bed) == []

    wrong = copy(target, pods.BUSYBOX_IMAGE)
    details = expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: create_from(rt, pod_id, config, wrong),
        busybox_id,
        counter_id,
    )
    assert "nothing was created" in details, details
    nothing_left()
    changed = target.with_name("other-image.tar")
    rewrite_tar(target, changed, "config.dump", lambda d: d["config"]["image"].update(image=busybox_id))
    expect_error(
        grpc.StatusCode.DATA_LOSS,
        lambda: create_from(rt, pod_id, config, copy(changed)),
        "config.image",
        busybox_id,
    )
    nothing_left()

    with pods.digest_reference(bed, pods.COUNTER_IMAGE) as digest_ref:
        for expect in (counter_id, digest_ref, pods.COUNTER_IMAGE):
            cid = create_from(rt, pod_id, config, copy(target, expect))
            st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
            assert st.state == cri.CONTAINER_CREATED, (expect, st.state)
            rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=30)
    resumed = copy(target)  # no image named: the checkpoint's, by its ID
    cid = create_from(rt, pod_id, config, resumed)
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=CALL_TIMEOUT)
    restored_log = Path(config.log_directory) / resumed.log_path
    resume.assert_exact_resume({"copy": restored_log}, {"copy": first})
    info = json.loads(
        rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True)).info["info"]
    )
    assert info["config"]["image"]["image"] == counter_id, info["config"]["image"]


def test_restore_refuses_hostile_and_missing_archives(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], tmp_path: Path
) -> None:
    pod_id, config = run_sandbox(rt, "hostile", log_root, pod_cleanup)
    d = new_dir(bed, "hostile")

    def create(image: str) -> Any:
        cc = pods.container_config("x", image=image, args=[])
        return rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config), timeout=30
        )

    def make_tar(name: str, entries: list[tuple[str, bytes | None, bytes]]) -> Path:
        p = d / name
        with tarfile.open(p, "w") as tar:
            for member, link, data in entries:
                ti = tarfile.TarInfo(member)
                if link is not None:
                    ti.type, ti.linkname = tarfile.SYMTYPE, link.decode()
                    tar.addfile(ti)
                else:
                    ti.size = len(data)
                    tar.addfile(ti, io.BytesIO(data))
        return p

    ok = [("config.dump", None, b"{}"), ("spec.dump", None, b"{}"), ("checkpoint/inventory.img", None, b"x")]
    escape = make_tar("escape.tar", [*ok, ("../../escaped", None, b"x")])
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, lambda: create(str(escape)), "..")
    link = make_tar("link.tar", [*ok, ("checkpoint/pages-1.img", b"/etc/shadow", b"")])
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, lambda: create(str(link)), "symlink")
    absolute = make_tar("abs.tar", [*ok, ("/etc/evil", None, b"x")])
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, lambda: create(str(absolute)), "absolute")
    not_ckpt = make_tar("plain.tar", [("hello", None, b"x")])
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT, lambda: create(str(not_ckpt)), "not a container checkpoint"
    )
    expect_error(grpc.StatusCode.NOT_FOUND, lambda: create(str(d / "missing.tar")))
    outside = tmp_path / "outside.tar"
    outside.write_bytes(escape.read_bytes())
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, lambda: create(str(outside)), "outside")
    assert not (tmp_path.parent / "escaped").exists() and not Path("/escaped").exists()
    assert imports(bed) == []
    assert (
        rt.ListContainers(
            cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=pod_id))
        ).containers
        == []
    )


# ---------------------------------------------------------------------------- inspect


def test_inspect_container_tar_and_pod_checkpoint(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    pod = start_pod(rt, "inspect", log_root, pod_cleanup, {"counter": counter("counter", mem_mib=16)})
    cid = pod.containers["counter"]
    wait_counting(pod.log_path("counter"))
    tar_path = new_dir(bed, "inspect") / "counter.tar"
    checkpoint(rt, cid, tar_path)

    r = podshim("inspect", str(tar_path), "-o", "json", "--verify")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kind"] == "container" and info["format"] == "podshim.container-checkpoint.v1"
    assert info["container"]["id"] == cid and info["container"]["name"] == "counter"
    assert info["container"]["image"] == pods.COUNTER_IMAGE
    assert info["pod"]["name"] == pod.config.metadata.name and info["pod"]["namespace"] == "default"
    assert info["missing_required"] == [] and info["verified"] is True
    assert info["pages_bytes"] >= 16 << 20 and info["rootfs_diff_bytes"] > 0
    assert info["freeze_window_seconds"] > 0 and info["host"]["criu_version"]
    table = podshim("inspect", str(tar_path))
    assert table.returncode == 0 and "counter" in table.stdout and "Freeze window" in table.stdout

    out = new_dir(bed, "inspect-pod")
    rt.CheckpointPod(
        cri.CheckpointPodRequest(
            pod_sandbox_id=pod.id, container_ids=pods.running_ids(rt, pod.id), output_path=str(out)
        ),
        timeout=CALL_TIMEOUT,
    )
    r = podshim("inspect", str(out), "-o", "json", "--verify")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kind"] == "pod" and info["format"] == "podshim.checkpoint.v1"
    assert info["pod"]["id"] == pod.id and info["pod"]["name"] == pod.config.metadata.name
    (c,) = info["containers"]
    assert c["name"] == "counter" and c["id"] == cid and c["checkpointed"] is True
    assert c["pages_bytes"] >= 16 << 20 and c["bytes"] > c["pages_bytes"]
    assert info["freeze_window_seconds"] > 0 and info["host"]["runtime_name"]
    assert info["total_bytes"] > c["bytes"]  # the sandbox files too
    ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id)).status.network.ip
    assert any(a.startswith(ip + "/") for a in info["network"]["eth0"]), info["network"]
    table = podshim("inspect", str(out))
    assert table.returncode == 0 and "CONTAINER" in table.stdout and "counter" in table.stdout
    assert f"eth0 {ip}/" in table.stdout, table.stdout

    # a truncated tar is reported, not trusted
    bad = tar_path.with_name("bad.tar")
    bad.write_bytes(tar_path.read_bytes()[: 10 << 20])
    r = podshim("inspect", str(bad))
    assert r.returncode == 1 and "truncated" in r.stderr, r.stderr


# ---------------------------------------------------------------------------- refusals


@pytest.fixture
def counter_pod(rt: Rt, log_root: Path, pod_cleanup: list[str]) -> pods.Pod:
    pod = start_pod(rt, "refuse", log_root, pod_cleanup)
    wait_counting(pod.log_path("counter"))
    return pod


def test_unknown_container_is_not_found(rt: Rt, bed: TestBed, counter_pod: pods.Pod) -> None:
    out = new_dir(bed, "unknown")
    refused_cleanly(
        rt,
        bed,
        counter_pod,
        grpc.StatusCode.NOT_FOUND,
        lambda: checkpoint(rt, "no-such-container-" + secrets.token_hex(4), out),
        "not found",
    )


def test_stopped_container_is_failed_precondition(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    pod = start_pod(
        rt, "stopped", log_root, pod_cleanup, {"counter": counter("counter"), "gone": counter("gone")}
    )
    wait_counting(pod.log_path("counter"))
    rt.StopContainer(cri.StopContainerRequest(container_id=pod.containers["gone"], timeout=5), timeout=30)
    out = new_dir(bed, "stopped")
    refused_cleanly(
        rt,
        bed,
        pod,
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: checkpoint(rt, pod.containers["gone"], out),
        "not running",
    )


def test_bad_locations(rt: Rt, bed: TestBed, counter_pod: pods.Pod, tmp_path: Path) -> None:
    cid = counter_pod.containers["counter"]
    root = Path(bed.checkpoint_root)
    out = new_dir(bed, "loc")
    existing = out / "existing.tar"
    existing.write_bytes(b"keep me")
    symlink_out = out / "escape"
    symlink_out.symlink_to(tmp_path)
    cases = [
        (grpc.StatusCode.INVALID_ARGUMENT, tmp_path / "x.tar", "outside"),
        (grpc.StatusCode.INVALID_ARGUMENT, tmp_path, "outside"),
        (grpc.StatusCode.INVALID_ARGUMENT, root.parent / "x.tar", "outside"),
        (grpc.StatusCode.INVALID_ARGUMENT, symlink_out, "outside"),
        (grpc.StatusCode.INVALID_ARGUMENT, symlink_out / "x.tar", "outside"),
        (grpc.StatusCode.INVALID_ARGUMENT, f"{out}/../../x.tar", ".."),
        (grpc.StatusCode.INVALID_ARGUMENT, "relative/x.tar", "absolute"),
        (grpc.StatusCode.INVALID_ARGUMENT, existing, "exists"),
        (grpc.StatusCode.NOT_FOUND, out / "missing-dir" / "x.tar", "does not exist"),
    ]
    for code, location, word in cases:
        refused_cleanly(rt, bed, counter_pod, code, lambda loc=location: checkpoint(rt, cid, loc), word)
    assert existing.read_bytes() == b"keep me"
    assert list(tmp_path.iterdir()) == []


def test_timeout_too_short(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], tmp_path: Path
) -> None:
    """The request's timeout, and the gRPC deadline, run out during a dump held longer than either
    (HOLD_DUMP, through a second podshim), whatever this machine's speed: DEADLINE_EXCEEDED,
    the container thawed, nothing left."""
    pod = start_pod(rt, "timeout", log_root, pod_cleanup, {"counter": counter("counter", mem_mib=64)})
    wait_counting(pod.log_path("counter"), 2, timeout=120)
    cid = pod.containers["counter"]
    out = new_dir(bed, "timeout")
    with bed.extra_podshim(tmp_path, failpoints=HOLD_DUMP) as (sock, _log):
        held = pods.stubs(sock)[0]
        start = time.monotonic()
        details = refused_cleanly(
            rt,
            bed,
            pod,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            lambda: checkpoint(held, cid, out, timeout=1),
            "did not finish within the deadline",
            "thawed",
        )
        assert "partial files removed" in details
        assert time.monotonic() - start < 30  # nothing outlived the deadline by much
        assert listing(out) == set()
        # the gRPC deadline counts as well
        refused_cleanly(
            rt,
            bed,
            pod,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            lambda: checkpoint(held, cid, out, rpc=1.5),
        )
        assert listing(out) == set()
        assert journal_files(tmp_path / "state") == []


# ---------------------------------------------------------------------------- crash recovery


@pytest.mark.parametrize(
    "failpoint", ["checkpoint-container.after-freeze", "checkpoint-container.before-publish"]
)
def test_crash_is_recovered_at_restart(
    bed: TestBed, log_root: Path, pod_cleanup: list[str], failpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """podshim dies with the container frozen (or the tar written but not yet named): the next
    podshim thaws the container and removes the staging dir from its journal."""
    rt = pods.stubs(bed.podshim_socket)[0]
    pod = start_pod(rt, "crash", log_root, pod_cleanup)
    cid = pod.containers["counter"]
    wait_counting(pod.log_path("counter"))
    out = new_dir(bed, "crash")
    bed.kill_podshim()
    try:
        with monkeypatch.context() as m:  # the bed passes its environment to the podshim it starts
            m.setenv("PODSHIM_FAILPOINTS", f"{failpoint}=kill")
            bed.start_podshim_again()
        rt = pods.stubs(bed.podshim_socket)[0]
        expect_error(grpc.StatusCode.UNAVAILABLE, lambda: checkpoint(rt, cid, out, rpc=30))
        pods.wait_for(lambda: not bed.podshim_running, timeout=10, what="podshim gone")
        # what the crash left: a staging dir and a journal record (and the cgroup frozen, or not)
        assert [n for n in listing(out) if n.startswith(".")], listing(out)
        assert len(journal_files(bed.podshim_state_dir)) == 1
    finally:
        bed.kill_podshim()
        bed.start_podshim_again()  # without the failpoint: it replays the journal
    rt = pods.stubs(bed.podshim_socket)[0]
    assert listing(out) == set() and journal_files(bed.podshim_state_dir) == []
    assert_unharmed(rt, pod)
    # and it works again
    checkpoint(rt, cid, out / "after.tar")
    assert listing(out) == {"after.tar"}


def test_recovery_leaves_a_paused_container_paused(
    bed: TestBed, log_root: Path, pod_cleanup: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The container was paused by someone else before CheckpointContainer, and podshim dies
    with it frozen: the journal does not name its cgroup, so the restarted podshim leaves it
    paused (while removing the staging dir)."""
    rt = pods.stubs(bed.podshim_socket)[0]
    pod = start_pod(rt, "paused", log_root, pod_cleanup)
    cid = pod.containers["counter"]
    wait_counting(pod.log_path("counter"))
    cgroup = container_cgroup(rt, cid)
    out = new_dir(bed, "paused")
    set_freezer(cgroup, "FROZEN")
    try:
        bed.kill_podshim()
        try:
            with monkeypatch.context() as m:
                m.setenv("PODSHIM_FAILPOINTS", "checkpoint-container.after-freeze=kill")
                bed.start_podshim_again()
            rt = pods.stubs(bed.podshim_socket)[0]
            expect_error(grpc.StatusCode.UNAVAILABLE, lambda: checkpoint(rt, cid, out, rpc=30))
            pods.wait_for(lambda: not bed.podshim_running, timeout=10, what="podshim gone")
            assert len(journal_files(bed.podshim_state_dir)) == 1
        finally:
            bed.kill_podshim()
            bed.start_podshim_again()  # without the failpoint: it replays the journal
        assert journal_files(bed.podshim_state_dir) == [] and listing(out) == set()
        assert freezer_state(cgroup) == "FROZEN", "recovery thawed a container it had not frozen"
    finally:
        set_freezer(cgroup, "THAWED")
    assert_unharmed(pods.stubs(bed.podshim_socket)[0], pod)


# ---------------------------------------------------------------------------- routing (in process)


class _Aborted(grpc.aio.AbortError):
    pass


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def time_remaining(self) -> float:
        return 30.0

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing: Any = ()) -> None:
        self.code = code
        raise _Aborted()


class _Upstream:
    timeout = 30.0

    def __init__(self, code: grpc.StatusCode | None) -> None:
        self.code, self.calls = code, 0

    async def call_unary(self, method: str, request: bytes, context: Any) -> bytes:
        self.calls += 1
        if self.code is not None:
            md = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(self.code, md, md, details=f"upstream says {self.code.name}")
        return b""

    async def abort_with(self, context: Any, err: grpc.aio.AioRpcError) -> None:
        await context.abort(err.code(), err.details() or "")

    def unary(self, method: str, recover: Any = None, code_for: Any = None) -> Any:
        return self.call_unary


class _Engine:
    def __init__(self, mode: str) -> None:
        self.container_checkpoint_mode, self.calls = mode, 0

    async def checkpoint_container(self, req: Any, context: Any) -> cri.CheckpointContainerResponse:
        self.calls += 1
        return cri.CheckpointContainerResponse()


@pytest.mark.parametrize(
    ("mode", "upstream_code", "asks_upstream", "podshim_does_it", "result"),
    [
        ("fallback", grpc.StatusCode.UNIMPLEMENTED, 1, 1, None),  # containerd 1.6
        ("fallback", None, 1, 0, None),  # an upstream that checkpoints itself
        ("fallback", grpc.StatusCode.NOT_FOUND, 1, 0, grpc.StatusCode.NOT_FOUND),  # its answer stands
        ("always", None, 0, 1, None),
    ],
)
async def test_checkpoint_container_routing(
    mode: str,
    upstream_code: grpc.StatusCode | None,
    asks_upstream: int,
    podshim_does_it: int,
    result: grpc.StatusCode | None,
) -> None:
    upstream, engine, context = _Upstream(upstream_code), _Engine(mode), _Context()
    handler = RuntimeHandlers(upstream, engine).handlers()[  # type: ignore[arg-type]
        "/runtime.v1.RuntimeService/CheckpointContainer"
    ]
    req = cri.CheckpointContainerRequest(container_id="c", location="/x")
    if result is None:
        await handler.unary_unary(req, context)
    else:
        with pytest.raises(_Aborted):
            await handler.unary_unary(req, context)
    assert (upstream.calls, engine.calls, context.code) == (asks_upstream, podshim_does_it, result)


def test_config_key(tmp_path: Path) -> None:
    assert configmod.load(env={}).container_checkpoint == "always"
    f = tmp_path / "c.toml"
    f.write_text('[checkpoint]\ncontainer_checkpoint = "fallback"\n')
    assert configmod.load(str(f), env={}).container_checkpoint == "fallback"
    env = {"PODSHIM_CHECKPOINT_CONTAINER_CHECKPOINT": "sometimes"}
    with pytest.raises(configmod.ConfigError, match="checkpoint.container_checkpoint"):
        configmod.load(env=env)
