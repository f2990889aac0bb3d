"""RestorePod end to end: through podshim's socket, on the real containerd + runc + CRIU.

A checkpoint is taken with CheckpointPod from a running counter pod, then restored into new pods
(new uid, name, cgroup parent and log directory) the way a kubelet does it: RestorePod returns
CREATED containers, StartContainer brings the process state back. The failure paths check the
gRPC code, a message naming the problem, and that nothing is left behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.archive import manifest
from shim.criu.runtime import binary_version
from shim.deadlines import RESTORE_CLEANUP_MARGIN
from testbed import _sys, pods, resume
from testbed.bed import TestBed
from testbed.checks import assert_netns_unlocked

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
ImageStub = api_pb2_grpc.ImageServiceStub

BIG_ARGS = ["--mem-mib", "64", "--interval-ms", "50"]  # the warm-start workload
SMALL_ARGS = ["--mem-mib", "4", "--interval-ms", "50"]
SOURCE_ATTEMPT = 2  # the source container's restart count, which a restore must continue
RPC_TIMEOUT = 120
POD_NAME_LABEL = "io.kubernetes.pod.name"
CNI_RESULTS = "/var/lib/cni/results"
PAGES_IMG = "containers/counter/checkpoint/pages-1.img"
PAGEMAP_IMG = "containers/counter/checkpoint/pagemap-1.img"


# ---------------------------------------------------------------------------- helpers


def counter_config(name: str, args: list[str], attempt: int = 0) -> cri.ContainerConfig:
    cc = pods.container_config(name, args=list(args))
    cc.metadata.attempt = attempt
    return cc


def log_text(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def container_log(config: cri.PodSandboxConfig, name: str) -> Path:
    return Path(config.log_directory) / name / "0.log"


def status(rt: Stub, cid: str, verbose: bool = False) -> cri.ContainerStatusResponse:
    return rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=verbose))


def container_pid(rt: Stub, cid: str) -> int:
    info = json.loads(status(rt, cid, verbose=True).info["info"])
    pid = int(info["pid"])
    assert pid > 0, f"container {cid[:13]} has no pid in its verbose status"
    return pid


def pod_containers(rt: Stub, pod_id: str) -> list[cri.Container]:
    f = cri.ContainerFilter(pod_sandbox_id=pod_id)
    return list(rt.ListContainers(cri.ListContainersRequest(filter=f)).containers)


def pods_named(rt: Stub, name: str) -> list[cri.PodSandbox]:
    f = cri.PodSandboxFilter(label_selector={POD_NAME_LABEL: name})
    return list(rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=f)).items)


def restore(
    rt: Stub,
    path: Path | str,
    config: cri.PodSandboxConfig,
    containers: list[cri.ContainerConfig],
    options: dict[str, str] | None = None,
    runtime_handler: str = "",
) -> cri.RestorePodResponse:
    return rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(path),
            config=config,
            container_configs=containers,
            runtime_handler=runtime_handler,
            options=options or {},
        ),
        timeout=RPC_TIMEOUT,
    )


def wait_counting(log_path: Path, after: int, timeout: float = 20.0) -> int:
    """Wait for the counter in `log_path` to print a value > `after`; return the last value."""
    return pods.wait_count(log_path, after + 1, timeout=timeout)


def cgroup_paths(pid: int) -> dict[str, str]:
    """controller -> cgroup path of `pid` (cgroup v1 lines; the v2 line is keyed "")."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def remove_pod_cgroup(config: cri.PodSandboxConfig) -> None:
    """The pod-level cgroup is the kubelet's (containerd leaves it): remove it if it is empty."""
    parent = config.linux.cgroup_parent.strip("/")
    for d in _sys.cgroup_dirs(parent):
        with contextlib.suppress(OSError):
            d.rmdir()


@dataclass
class Checkpoint:
    path: Path
    source: pods.Pod
    containers: list[cri.ContainerConfig]  # as a kubelet sends them at restore (attempt 0)
    first: dict[str, int]  # the count each container prints first after the cut (resume.py)
    cut: resume.Cut


def checkpoint_counters(
    rt: Stub, bed: TestBed, src: pods.Pod, name: str, counters: list[str], **request: object
) -> tuple[Path, dict[str, int]]:
    """CheckpointPod of the running pod `src` into a new directory under bed.checkpoint_root (the
    request's other fields in `request`), and the count each of its `counters` must print first
    when restored (testbed/resume.py: a checkpoint whose cut the logs cannot place is taken again)."""

    def take() -> Path:
        out = Path(bed.checkpoint_root) / f"{name}-{secrets.token_hex(3)}"
        out.mkdir(mode=0o700)
        req = pods.checkpoint_request(rt, src.id, out, **request)
        rt.CheckpointPod(req, timeout=RPC_TIMEOUT)
        assert (out / "manifest.json").is_file()
        return out

    return resume.checkpoint_exactly(take, {c: src.log_path(c) for c in counters})


def take_checkpoint(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    name: str,
    containers: dict[str, cri.ContainerConfig],
    cleanup: list[str],
    runtime_handler: str = "",
) -> Checkpoint:
    """A running counter pod and its CheckpointPod archive under bed.checkpoint_root, with the
    count each container must print first when restored (testbed/resume.py)."""
    src = pods.run_pod(rt, name, log_root, containers, runtime_handler=runtime_handler)
    cleanup.append(src.id)
    for cname in containers:
        pods.wait_count(src.log_path(cname), 10)
    out, first = checkpoint_counters(rt, bed, src, name, list(containers))
    restore_configs = [counter_config(cname, list(cc.args), attempt=0) for cname, cc in containers.items()]
    return Checkpoint(out, src, restore_configs, first, resume.Cut.of_archive(out))


def assert_resumed(log_path: Path, ckpt: Checkpoint, cname: str) -> int:
    """The restored counter printed exactly the count the checkpointed one was to print next, then
    counts on (resume.assert_exact_resume); returns that count."""
    return resume.assert_exact_resume({cname: log_path}, ckpt.first)[cname]


@dataclass
class HostState:
    """What a failed restore must not leave: sandboxes, containers, mounts, runc state, CNI state
    (libcni's result cache of the bed's network names each attachment and its netns; the
    host-local IPAM dir holds each allocated address), journal records."""

    sandboxes: set[str]
    containers: set[str]
    mounts: set[str]
    cni: set[str]
    ipam: set[str]
    runc_state: set[str]
    journal: set[str]

    @classmethod
    def take(cls, rt: Stub, bed: TestBed) -> HostState:
        def listdir(d: Path | str) -> set[str]:
            try:
                return set(os.listdir(d))
            except FileNotFoundError:
                return set()

        return cls(
            sandboxes={p.id for p in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items},
            containers={c.id for c in rt.ListContainers(cri.ListContainersRequest()).containers},
            mounts={m.mount_point for m in _sys.mounts_under(bed.base_dir)},
            cni={f for f in listdir(CNI_RESULTS) if f.startswith(bed.cni_network + "-")},
            ipam={str(p.relative_to(bed.cni_ipam_dir)) for p in Path(bed.cni_ipam_dir).rglob("*")},
            runc_state=listdir(bed.runc_root),
            journal=listdir(Path(bed.podshim_state_dir) / "ops"),
        )


def expect_failure(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    cleanup: list[str],
    path: Path | str,
    containers: list[cri.ContainerConfig],
    code: grpc.StatusCode,
    *needles: str,
    options: dict[str, str] | None = None,
    runtime_handler: str = "",
) -> str:
    """RestorePod fails with `code`, a message containing every needle, and leaves nothing."""
    name = f"fail-{secrets.token_hex(3)}"
    config = pods.pod_config(name, log_root)
    before = HostState.take(rt, bed)
    try:
        with pytest.raises(grpc.RpcError) as err:
            resp = restore(rt, path, config, containers, options, runtime_handler)
            cleanup.append(resp.pod_sandbox_id)
        left = pods_named(rt, name)
        cleanup.extend(p.id for p in left)
        assert err.value.code() == code, err.value.details()
        message = err.value.details()
        for needle in needles:
            assert needle in message, f"{needle!r} not in {message!r}"
        assert left == [], f"the failed restore left sandbox(es) {[p.id[:13] for p in left]}"
        after = HostState.take(rt, bed)
        assert after == before, f"the failed restore left something behind: {before} -> {after}"
        pid_left = _sys.cgroup_pids(config.linux.cgroup_parent)
        assert not pid_left, f"processes left in the new pod's cgroup: {sorted(pid_left)}"
        return message
    finally:
        remove_pod_cgroup(config)


def task_dir(bed: TestBed, cid: str) -> Path:
    """The container's bundle under containerd's runc shim (podshim-runc's work dir is in it)."""
    return Path(bed.containerd_state) / "io.containerd.runtime.v2.task" / "k8s.io" / cid


def flip_byte(path: Path) -> None:
    """One byte in the middle of `path` flipped: same size, only a checksum can tell."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def stopped_processes(cgroup_parent: str) -> list[int]:
    """Processes of a pod's cgroup left stopped (state T)."""
    out = []
    for pid in _sys.cgroup_pids(cgroup_parent):
        with contextlib.suppress(OSError, IndexError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                out.append(pid)
    return out


def _is_pause(pid: int) -> bool:
    argv = _sys.read_cmdline(pid)
    return bool(argv) and Path(argv[0]).name == "pause"


def copy_archive(src: Path, bed: TestBed, tag: str) -> Path:
    dest = Path(bed.checkpoint_root) / f"{src.name}-{tag}-{secrets.token_hex(3)}"
    shutil.copytree(src, dest)
    return dest


def tree_fingerprint(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under `root`: (mode, size, mtime_ns) by relative path."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d, n)
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def good(rt: Stub, bed: TestBed) -> Iterator[Checkpoint]:
    """The shared good archive: one 64 MiB counter (restart count 2) checkpointed while it runs.

    Module-scoped (pod_cleanup is per test): its source pod is removed at the module's end. Tests
    that corrupt an archive work on a copy; no test modifies this one."""
    yield from _good_archive(rt, bed, "")


@pytest.fixture(scope="module")
def good_crun(rt: Stub, bed: TestBed) -> Iterator[Checkpoint]:
    """The same archive, of a pod run by crun (taken only when a crun test asks for it)."""
    yield from _good_archive(rt, bed, "crun")


@pytest.fixture
def good_for_handler(request: pytest.FixtureRequest, runtime_handler: str) -> Checkpoint:
    """`good` for runc, `good_crun` for crun: the archive of a pod run by the test's handler."""
    return request.getfixturevalue("good_crun" if runtime_handler == "crun" else "good")


def _good_archive(rt: Stub, bed: TestBed, handler: str) -> Iterator[Checkpoint]:
    log_root = Path(bed.base_dir) / "pod-logs"
    created: list[str] = []
    try:
        yield take_checkpoint(
            rt,
            bed,
            log_root,
            f"restore-src{'-' + handler if handler else ''}",
            {"counter": counter_config("counter", BIG_ARGS, attempt=SOURCE_ATTEMPT)},
            created,
            handler,
        )
    finally:
        for pod_id in created:
            with contextlib.suppress(Exception):
                pods.remove_pod(rt, pod_id)


def runtime_root(bed: TestBed, handler: str) -> Path:
    """Where the handler's OCI runtime keeps its container state."""
    return Path(bed.crun_root if handler == "crun" else bed.runc_root)


@pytest.fixture
def scratch(bed: TestBed) -> Iterator[list[Path]]:
    """Archive copies made by a test; removed after it."""
    made: list[Path] = []
    yield made
    for p in made:
        shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------- restore


def test_warm_start_resumes_from_checkpoint(
    rt: Stub,
    bed: TestBed,
    good_for_handler: Checkpoint,
    runtime_handler: str,
    log_root: Path,
    pod_cleanup: list[str],
) -> None:
    good = good_for_handler
    before = tree_fingerprint(good.path)
    config = pods.pod_config(f"warm-restored{'-' + runtime_handler if runtime_handler else ''}", log_root)
    resp = restore(rt, good.path, config, good.containers, runtime_handler=runtime_handler)
    pod_cleanup.append(resp.pod_sandbox_id)
    assert resp.pod_sandbox_id and resp.pod_sandbox_id != good.source.id
    assert [c.name for c in resp.restored_containers] == ["counter"]
    cid = resp.restored_containers[0].container_id
    assert cid != good.source.containers["counter"]

    # CREATED, as the merged CRI says: the process state comes back at StartContainer.
    st = status(rt, cid).status
    assert st.state == cri.CONTAINER_CREATED
    assert st.metadata.name == "counter"
    new_log = container_log(config, "counter")
    assert pods.counts(new_log) == [], "the restored container ran before StartContainer"

    rt.StartContainer(cri.StartContainerRequest(container_id=cid))  # as the kubelet does
    first = assert_resumed(new_log, good, "counter")
    wait_counting(new_log, first + 10)  # it keeps counting
    assert status(rt, cid).status.state == cri.CONTAINER_RUNNING
    # its page images were checked by podshim-runc while CRIU restored it, the tasks held stopped
    # meanwhile (docs/design/restore-pod.md (RestorePod) step 4), with runc and crun alike
    page_check = json.loads((task_dir(bed, cid) / "podshim-restore" / "page-check.json").read_text())
    print(f"\npage check beside the restore ({runtime_handler or 'runc'}): {page_check}")
    assert page_check["ok"] and page_check["files"] >= 1 and page_check["bytes"] >= 64 << 20, page_check
    # podshim prepared and settled the restore for podshim-runc (its broker), no Python hook ran
    # (docs/design/runtime-wrapper.md (The runtime wrapper))
    lines = bed.podshim_log.read_text().splitlines()
    served = [json.loads(line) for line in lines if "restore served" in line and cid in line]
    assert served and served[-1]["ok"], served
    # podshim's CRIU ([runtime] criu: the bed's PODSHIM_TEST_CRIU) dumped and restored it, not the
    # one on containerd's PATH: runc >= 1.2 and crun run PATH's `criu`, containerd 2.x passes no
    # CriuPath, so podshim puts its own first (shim/criu/options.py criu_path_env)
    want = binary_version(str(bed.criu))
    dump_log = good.path / "containers" / "counter" / "dump.log"
    for log in (dump_log, task_dir(bed, cid) / "podshim-restore" / "restore.log"):
        ran = re.search(r"\) Version: (\S+) ", log.read_text())
        assert ran and ran.group(1) == want, (log, want, ran)

    # The source pod keeps running, independently.
    src_log = good.source.log_path("counter")
    src_now = pods.counts(src_log)[-1]
    wait_counting(src_log, src_now + 3)
    assert status(rt, good.source.containers["counter"]).status.state == cri.CONTAINER_RUNNING

    # The 64 MiB pattern survived the round trip: the counter checks every word on SIGUSR1
    # (pid 1 of its own PID namespace).
    r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["kill", "-USR1", "1"], timeout=10))
    assert r.exit_code == 0, r.stderr
    pods.wait_for(lambda: "verify " in log_text(new_log), what="the restored counter's verify line")
    assert "verify ok mem_mib=64" in log_text(new_log), log_text(new_log)[-600:]
    assert "verify FAILED" not in log_text(new_log)

    # The restored process lives in the NEW pod's cgroups, not the source's.
    pid = container_pid(rt, cid)
    parent = config.linux.cgroup_parent
    cgroups = cgroup_paths(pid)
    for ctrl in ("memory", "cpu", "pids", "freezer"):
        assert cgroups[ctrl].startswith(parent + "/"), (ctrl, cgroups[ctrl], parent)
    assert good.source.config.linux.cgroup_parent not in "".join(cgroups.values())

    # The new pod is a regular, ready pod with its own address from CNI.
    pst = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=resp.pod_sandbox_id)).status
    assert pst.state == cri.SANDBOX_READY
    assert pst.metadata.uid == config.metadata.uid and pst.metadata.name == config.metadata.name
    src_ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=good.source.id)).status.network.ip
    assert pst.network.ip and pst.network.ip != src_ip

    # The restore used the archive in place and changed nothing in it.
    assert tree_fingerprint(good.path) == before


def test_restart_count_continues_from_checkpoint(
    rt: Stub, good: Checkpoint, log_root: Path, pod_cleanup: list[str]
) -> None:
    """The restored container continues the checkpointed restart count (SOURCE_ATTEMPT) in its
    attempt and in the kubelet's restartCount annotation alike, also when the request carries the
    kubelet's "0": the kubelet reads the count from the annotation and creates its next attempt as
    count + 1 (v1.37.2 kuberuntime startContainer), and containerd refuses a second container of one
    name, which it makes from the attempt, while the first exists."""
    config = pods.pod_config("restart-count", log_root)
    assert all(c.metadata.attempt == 0 for c in good.containers)
    resp = restore(rt, good.path, config, good.containers)
    pod_cleanup.append(resp.pod_sandbox_id)
    st = status(rt, resp.restored_containers[0].container_id).status
    assert st.metadata.attempt == SOURCE_ATTEMPT
    assert st.annotations.get("io.kubernetes.container.restartCount") == str(SOURCE_ATTEMPT)
    assert st.state == cri.CONTAINER_CREATED

    # as the kubelet sends it: attempt 0 and the annotation "0"
    kubelet = pods.pod_config("restart-count-kubelet", log_root)
    cc = cri.ContainerConfig()
    cc.CopyFrom(good.containers[0])
    cc.annotations["io.kubernetes.container.restartCount"] = "0"
    resp = restore(rt, good.path, kubelet, [cc])
    pod_cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    st = status(rt, cid).status
    count = int(st.annotations["io.kubernetes.container.restartCount"])
    assert (st.metadata.attempt, count) == (SOURCE_ATTEMPT, SOURCE_ATTEMPT), (st.metadata, st.annotations)

    def create(attempt: int) -> str:
        again = counter_config("counter", list(cc.args), attempt=attempt)
        again.log_path = f"counter/{attempt}.log"
        again.annotations["io.kubernetes.container.restartCount"] = str(attempt)
        req = cri.CreateContainerRequest(
            pod_sandbox_id=resp.pod_sandbox_id, config=again, sandbox_config=kubelet
        )
        return rt.CreateContainer(req, timeout=RPC_TIMEOUT).container_id

    # the kubelet's next container of that name (a restart: the old one is kept beside it), whose
    # attempt is count + 1
    assert status(rt, create(count + 1)).status.metadata.attempt == SOURCE_ATTEMPT + 1
    # what the annotation's "0" would have led to on a later restart: the restored container's name
    with pytest.raises(grpc.RpcError) as err:
        create(SOURCE_ATTEMPT)
    assert "reserve" in err.value.details() or "exists" in err.value.details(), err.value.details()


def test_option_start_returns_running_containers(
    rt: Stub, good: Checkpoint, log_root: Path, pod_cleanup: list[str]
) -> None:
    config = pods.pod_config("start-opt", log_root)
    resp = restore(rt, good.path, config, good.containers, options={"start": "true"})
    pod_cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    assert status(rt, cid).status.state == cri.CONTAINER_RUNNING  # no StartContainer was called
    first = assert_resumed(container_log(config, "counter"), good, "counter")
    wait_counting(container_log(config, "counter"), first + 3)


def test_multi_container_pod(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    names = ["alpha", "beta", "gamma"]
    ckpt = take_checkpoint(
        rt,
        bed,
        log_root,
        "multi-src",
        {n: counter_config(n, SMALL_ARGS) for n in names},
        pod_cleanup,
        runtime_handler,
    )
    config = pods.pod_config("multi-restored", log_root)
    resp = restore(rt, ckpt.path, config, ckpt.containers, runtime_handler=runtime_handler)
    pod_id = resp.pod_sandbox_id
    pod_cleanup.append(pod_id)
    ids = {c.name: c.container_id for c in resp.restored_containers}
    assert list(ids) == names  # checkpoint order
    for cid in ids.values():
        rt.StartContainer(cri.StartContainerRequest(container_id=cid))

    listed = {c.metadata.name: c for c in pod_containers(rt, pod_id)}
    assert set(listed) == set(names)
    for n in names:
        assert listed[n].id == ids[n]
        assert listed[n].state == cri.CONTAINER_RUNNING, (n, listed[n].state)
        r = rt.ExecSync(
            cri.ExecSyncRequest(
                container_id=ids[n], cmd=["sh", "-c", f"echo exec-in-{n}; exit 7"], timeout=10
            )
        )
        assert (r.stdout, r.exit_code) == (f"exec-in-{n}\n".encode(), 7), r.stderr
        # logs continue in the new pod's log paths, from the checkpointed values
        new_log = container_log(config, n)
        first = assert_resumed(new_log, ckpt, n)
        wait_counting(new_log, first + 5)
    # the source's logs are its own: the restored processes write only to the new paths
    for n in names:
        assert not (Path(ckpt.source.config.log_directory) / n / "1.log").exists()

    # Stop and remove through podshim like any pod: nothing of it is left.
    pids = {n: container_pid(rt, ids[n]) for n in names}
    cgroups = {n: cgroup_paths(pids[n])["memory"] for n in names}
    # As the kubelet does: stop each container with a grace period (SIGTERM reaches the restored
    # counter, which exits 0), then the sandbox (containerd kills whatever is left).
    for n in names:
        rt.StopContainer(cri.StopContainerRequest(container_id=ids[n], timeout=10))
        st = status(rt, ids[n]).status
        assert (st.state, st.exit_code) == (cri.CONTAINER_EXITED, 0), (n, st.state, st.exit_code)
        assert "stopping count=" in log_text(container_log(config, n)), f"{n} did not get SIGTERM"
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod_id))
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
    assert pod_containers(rt, pod_id) == []
    assert pods_named(rt, "multi-restored") == []
    with pytest.raises(grpc.RpcError) as err:
        rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    pods.wait_for(lambda: not any(_sys.alive(p) for p in pids.values()), 10, what="restored processes gone")
    leftovers = [
        m.mount_point
        for m in _sys.mounts_under(bed.base_dir)
        if any(i in m.mount_point for i in ids.values())
    ]
    assert leftovers == []
    assert not any((runtime_root(bed, runtime_handler) / i).exists() for i in ids.values())
    for n in names:
        assert _sys.cgroup_dirs(cgroups[n]) == [], f"cgroup of {n} left: {cgroups[n]}"
    remove_pod_cgroup(config)  # the kubelet's part
    assert _sys.cgroup_dirs(config.linux.cgroup_parent) == []


def test_completed_init_container_is_not_rerun(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """A container that had exited (a completed init container) is recorded, not dumped, and not
    run again. A config naming it is INVALID_ARGUMENT, nothing created: the merged API wants one
    CREATED container in the answer per config, which the caller starts, and none may stand for it
    (the kubelet needs none: a pod whose regular container started is initialized). Without it the
    answer has one entry per config and the running container resumes."""
    init = pods.container_config(
        "init", image=pods.BUSYBOX_IMAGE, command=["sh", "-c", "echo init-ran"], args=[]
    )
    containers = {"init": init, "counter": counter_config("counter", SMALL_ARGS)}
    src = pods.run_pod(
        rt, f"init-src-{secrets.token_hex(3)}", log_root, containers, runtime_handler=runtime_handler
    )
    pod_cleanup.append(src.id)
    pods.wait_for(
        lambda: status(rt, src.containers["init"]).status.state == cri.CONTAINER_EXITED, what="init to exit"
    )
    pods.wait_count(src.log_path("counter"), 5)
    out, first = checkpoint_counters(rt, bed, src, "init", ["counter"])
    m = manifest.read_manifest(out)
    assert [(c.name, c.checkpointed) for c in m.containers] == [("init", False), ("counter", True)]

    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        out,
        [init, containers["counter"]],
        grpc.StatusCode.INVALID_ARGUMENT,
        "init had exited when the pod was checkpointed",
        "leave its config out",
        runtime_handler=runtime_handler,
    )
    configs = [containers["counter"]]
    config = pods.pod_config("init-restored", log_root)
    resp = restore(rt, out, config, configs, runtime_handler=runtime_handler)
    pod_cleanup.append(resp.pod_sandbox_id)
    assert [c.name for c in resp.restored_containers] == [c.metadata.name for c in configs]
    rt.StartContainer(cri.StartContainerRequest(container_id=resp.restored_containers[0].container_id))
    assert [c.metadata.name for c in pod_containers(rt, resp.pod_sandbox_id)] == ["counter"]
    resume.assert_exact_resume({"counter": container_log(config, "counter")}, first)
    assert not container_log(config, "init").exists(), "the completed init container ran again"
    shutil.rmtree(out, ignore_errors=True)


def test_listening_server_serves_after_restore(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """The warm-start case: a server listening on a TCP port is checkpointed and restored, and
    the restored process answers on that port in the new pod (with its new IP). Its page is a
    token the container's command drew when it started: a container started afresh would draw
    another, so serving the source's token shows the process was restored, not run again."""
    web = pods.container_config(
        "web",
        image=pods.BUSYBOX_IMAGE,
        command=[
            "sh",
            "-c",
            "mkdir -p /www && cat /proc/sys/kernel/random/uuid > /www/index.html && "
            "exec httpd -f -p 8080 -h /www",
        ],
        args=[],
    )
    src = pods.run_pod(
        rt, f"web-src-{secrets.token_hex(3)}", log_root, {"web": web}, runtime_handler=runtime_handler
    )
    pod_cleanup.append(src.id)
    get = ["wget", "-qO-", "http://127.0.0.1:8080/index.html"]

    def page_of(cid: str) -> str | None:
        r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=get, timeout=10))
        return r.stdout.decode().strip() if r.exit_code == 0 else None

    page = pods.wait_for(lambda: page_of(src.containers["web"]), what="the source server")

    def serves(cid: str) -> bool:
        return page_of(cid) == page

    out = Path(bed.checkpoint_root) / f"web-{secrets.token_hex(3)}"
    out.mkdir(mode=0o700)
    try:
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=src.id, container_ids=pods.running_ids(rt, src.id), output_path=str(out)
            ),
            timeout=RPC_TIMEOUT,
        )
        # the page file goes away in the source: the restored server must serve the checkpoint's
        rt.ExecSync(cri.ExecSyncRequest(container_id=src.containers["web"], cmd=["rm", "/www/index.html"]))
        config = pods.pod_config("web-restored", log_root)
        resp = restore(rt, out, config, [web], runtime_handler=runtime_handler)
        pod_cleanup.append(resp.pod_sandbox_id)
        cid = resp.restored_containers[0].container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid))
        pods.wait_for(lambda: serves(cid), 10, what="the restored server to answer")
        pid = container_pid(rt, cid)
        assert "httpd" in " ".join(_sys.read_cmdline(pid)), "the restored process is not the server"
        assert not serves(src.containers["web"]), "the source lost its page: the restore served its own"
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_established_tcp_connection_is_closed_on_restore(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """KEP alpha: a checkpoint may hold an established TCP connection (tcp-established=true);
    the restore closes it. The client of a loopback connection inside the pod sees it end and
    exits, while in the source pod the same connection stays up."""
    # the server writes one line a second; the client (its stdin a fifo that never ends, so it
    # never half-closes) prints what it gets, and exits when the connection ends. The shell (the
    # container's init) then waits 2 s before it exits: CRIU detaches the restored processes one
    # by one, and an init that exited at once would take the pid namespace's other processes
    # down before CRIU detached them ("Unable to detach: No such process", a failed restore)
    tcp = pods.container_config(
        "tcp",
        image=pods.BUSYBOX_IMAGE,
        command=[
            "sh",
            "-c",
            "while true; do echo tick; sleep 1; done | nc -l -p 7777 & "
            f"mkfifo /tmp/f; sleep 100000 > /tmp/f & {pods.until_listening(7777)}; "
            "nc 127.0.0.1 7777 < /tmp/f; echo client-ended; sleep 2",
        ],
        args=[],
    )
    containers = {"tcp": tcp, "counter": counter_config("counter", SMALL_ARGS)}
    src = pods.run_pod(
        rt, f"tcp-src-{secrets.token_hex(3)}", log_root, containers, runtime_handler=runtime_handler
    )
    pod_cleanup.append(src.id)
    pods.wait_for(
        lambda: log_text(src.log_path("tcp")).count("tick") >= 2, what="the connection to carry data"
    )
    pods.wait_count(src.log_path("counter"), 5)
    out, first = checkpoint_counters(rt, bed, src, "tcp", ["counter"], options={"tcp-established": "true"})
    # podshim locked the pod's netns once for both dumps, not each CRIU on its own
    # (docs/design/checkpoint-pod.md (The freeze window)), and unlocked it: no CRIU chain is left
    import pycriu

    for name in containers:
        with open(out / "containers" / name / "checkpoint" / "inventory.img", "rb") as f:
            assert pycriu.images.load(f)["entries"][0].get("network_lock_method") == 2  # skip
    assert_netns_unlocked(rt, src.id)
    try:
        config = pods.pod_config("tcp-restored", log_root)
        resp = restore(rt, out, config, list(containers.values()), runtime_handler=runtime_handler)
        pod_cleanup.append(resp.pod_sandbox_id)
        ids = {c.name: c.container_id for c in resp.restored_containers}
        rt.StartContainer(cri.StartContainerRequest(container_id=ids["counter"]))
        try:
            rt.StartContainer(cri.StartContainerRequest(container_id=ids["tcp"]))
        except grpc.RpcError as e:
            # the restored client can find its connection closed and exit before containerd's
            # start step: containerd then reports the process as already stopped
            assert "stopped process" in (e.details() or ""), e.details()
        # the restored client's connection is gone: it says so and its container exits
        pods.wait_for(
            lambda: status(rt, ids["tcp"]).status.state == cri.CONTAINER_EXITED,
            20,
            what="the restored client to exit",
        )
        assert "client-ended" in log_text(container_log(config, "tcp"))
        # ... while the rest of the restored pod runs on, from its checkpointed state
        resume.assert_exact_resume({"counter": container_log(config, "counter")}, first)
        assert status(rt, ids["counter"]).status.state == cri.CONTAINER_RUNNING
        # and the source's connection is untouched
        assert status(rt, src.containers["tcp"]).status.state == cri.CONTAINER_RUNNING
        assert "client-ended" not in log_text(src.log_path("tcp"))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_restore_twice_and_after_source_removed(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """Runs with runc and with crun (the runtime_handler fixture)."""
    ckpt = take_checkpoint(
        rt,
        bed,
        log_root,
        "twice-src",
        {"counter": counter_config("counter", SMALL_ARGS)},
        pod_cleanup,
        runtime_handler,
    )
    assert manifest.read_manifest(ckpt.path).host.runtime_name == (runtime_handler or "runc")
    fingerprint = tree_fingerprint(ckpt.path)
    restored = []
    for i in range(2):
        if i == 1:  # the second restore comes after the source pod is gone
            pods.remove_pod(rt, ckpt.source.id)
            with pytest.raises(grpc.RpcError):
                rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=ckpt.source.id))
        config = pods.pod_config(f"twice-{i}", log_root)
        resp = restore(rt, ckpt.path, config, ckpt.containers, runtime_handler=runtime_handler)
        pod_cleanup.append(resp.pod_sandbox_id)
        rt.StartContainer(cri.StartContainerRequest(container_id=resp.restored_containers[0].container_id))
        restored.append((config, resp))
    # Both resume from the same state, and run side by side.
    for config, resp in restored:
        log = container_log(config, "counter")
        first = assert_resumed(log, ckpt, "counter")
        wait_counting(log, first + 5)
        cid = resp.restored_containers[0].container_id
        assert status(rt, cid).status.state == cri.CONTAINER_RUNNING
        # restored by the runtime the pod asked for
        state_dir = runtime_root(bed, runtime_handler)
        assert (state_dir / cid).is_dir(), f"{cid[:13]} is not in {state_dir}"
    ips = [
        rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=r.pod_sandbox_id)).status.network.ip
        for _, r in restored
    ]
    assert all(ips) and ips[0] != ips[1]
    # The archive is untouched: same tree, and every checksum still verifies.
    assert tree_fingerprint(ckpt.path) == fingerprint
    m = manifest.load_and_verify(ckpt.path, [str(bed.checkpoint_root)])
    assert [c.name for c in m.containers] == ["counter"]


def test_create_container_with_podshim_annotation_is_refused(
    rt: Stub, good: Checkpoint, log_root: Path, pod_cleanup: list[str]
) -> None:
    # (pods.run_pod with containers={} would create its default counter)
    config = pods.pod_config("reserved-annot", log_root)
    pod_id = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config)).pod_sandbox_id
    pod_cleanup.append(pod_id)
    cc = counter_config("counter", BIG_ARGS)
    cc.annotations["podshim.restore.checkpoint-dir"] = str(good.path / "containers" / "counter")
    with pytest.raises(grpc.RpcError) as err:
        rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "podshim.restore.checkpoint-dir" in err.value.details()
    assert pod_containers(rt, pod_id) == []


def test_passthrough_pod_behaves_as_plain_runc(
    rt: Stub, direct_rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """podshim-runc in front of runc (or crun) changes nothing for a pod that is not restored."""
    containers = {"counter": counter_config("counter", SMALL_ARGS)}
    pod = pods.run_pod(rt, "plain", log_root, containers, runtime_handler=runtime_handler)
    state_dir = runtime_root(bed, runtime_handler)
    pod_cleanup.append(pod.id)
    cid = pod.containers["counter"]
    log = pod.log_path("counter")
    pods.wait_count(log, 3)
    assert pods.counts(log)[0] == 0 and "ready mem_mib=4" in log_text(log)  # a fresh start
    assert status(rt, cid).status.state == cri.CONTAINER_RUNNING
    # A normal container of the real runtime, with no podshim restore marker.
    assert (state_dir / cid / ("status" if runtime_handler == "crun" else "state.json")).is_file()
    assert not (state_dir / cid / "podshim-restored").exists()
    # Exec through podshim answers exactly what containerd answers.
    cmd = ["sh", "-c", "echo out; cat /proc/1/cmdline | tr '\\0' ' '; echo err >&2; exit 5"]
    ours = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=10))
    theirs = direct_rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=10))
    assert (ours.stdout, ours.stderr, ours.exit_code) == (theirs.stdout, theirs.stderr, theirs.exit_code)
    assert ours.exit_code == 5 and ours.stdout.startswith(b"out\n") and b"--mem-mib 4" in ours.stdout
    assert (
        status(rt, cid).status
        == direct_rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    )
    # Stop: SIGTERM reaches the counter, which exits 0; remove leaves no container.
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=10))
    st = status(rt, cid).status
    assert (st.state, st.exit_code) == (cri.CONTAINER_EXITED, 0)
    assert "stopping count=" in log_text(log)
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    assert pod_containers(rt, pod.id) == []
    assert not (state_dir / cid).exists()


# ---------------------------------------------------------------------------- failure paths


def test_missing_archive_is_not_found(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str]
) -> None:
    missing = Path(bed.checkpoint_root) / "no-such-checkpoint"
    expect_failure(
        rt, bed, log_root, pod_cleanup, missing, good.containers, grpc.StatusCode.NOT_FOUND, str(missing)
    )
    # a directory that is not a complete checkpoint (no manifest.json) is not found either
    empty = Path(bed.checkpoint_root) / f"empty-{secrets.token_hex(3)}"
    empty.mkdir()
    try:
        expect_failure(
            rt, bed, log_root, pod_cleanup, empty, good.containers, grpc.StatusCode.NOT_FOUND, "manifest.json"
        )
    finally:
        empty.rmdir()


def test_path_outside_allowed_roots_is_invalid(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    # a real checkpoint, but outside the allowed roots
    outside = Path(bed.base_dir) / f"outside-{secrets.token_hex(3)}"
    shutil.copytree(good.path, outside)
    scratch.append(outside)
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        outside,
        good.containers,
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside the allowed checkpoint roots",
    )
    # a symlink inside the root that points outside it
    link = Path(bed.checkpoint_root) / f"link-{secrets.token_hex(3)}"
    link.symlink_to(outside)
    try:
        expect_failure(
            rt,
            bed,
            log_root,
            pod_cleanup,
            link,
            good.containers,
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside the allowed checkpoint roots",
        )
    finally:
        link.unlink()
    # `..` is refused before anything is resolved
    dotdot = f"{bed.checkpoint_root}/../{outside.name}"
    expect_failure(
        rt, bed, log_root, pod_cleanup, dotdot, good.containers, grpc.StatusCode.INVALID_ARGUMENT, "'..'"
    )


def test_corrupted_memory_image_is_data_loss(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """A CRIU image other than the page images (here the pagemap, which CRIU parses) is checked
    before any container exists: DATA_LOSS from RestorePod, nothing created."""
    copy = copy_archive(good.path, bed, "flip")
    scratch.append(copy)
    flip_byte(copy / PAGEMAP_IMG)
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        copy,
        good.containers,
        grpc.StatusCode.DATA_LOSS,
        PAGEMAP_IMG,
        "sha256",
    )
    # an extra file is a modified archive too
    copy2 = copy_archive(good.path, bed, "extra")
    scratch.append(copy2)
    (copy2 / "containers" / "counter" / "stray.img").write_bytes(b"x")
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        copy2,
        good.containers,
        grpc.StatusCode.DATA_LOSS,
        "containers/counter/stray.img",
    )


def test_corrupted_page_image_fails_the_start_before_the_process_runs(
    rt: Stub,
    bed: TestBed,
    good_for_handler: Checkpoint,
    runtime_handler: str,
    log_root: Path,
    pod_cleanup: list[str],
    scratch: list[Path],
) -> None:
    """The page images of an eager restore are checked by podshim-runc while CRIU restores, the
    tasks held stopped (docs/design/restore-pod.md (RestorePod) step 4): one flipped byte lets
    RestorePod create the container, and StartContainer fails DATA_LOSS naming the member; the process never
    ran (no count printed), none of it is left, stopped or not, and the archive is unchanged.
    RestorePod start=true answers DATA_LOSS and removes the pod."""
    good = good_for_handler
    copy = copy_archive(good.path, bed, "flip-pages")
    scratch.append(copy)
    flip_byte(copy / PAGES_IMG)
    before = tree_fingerprint(copy)
    config = pods.pod_config(f"flip-pages-{secrets.token_hex(3)}", log_root)
    try:
        resp = restore(rt, copy, config, good.containers, runtime_handler=runtime_handler)
        pod_cleanup.append(resp.pod_sandbox_id)
        cid = resp.restored_containers[0].container_id
        with pytest.raises(grpc.RpcError) as err:
            rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
        message = err.value.details() or ""
        print(f"\nStartContainer of a corrupt page image: {err.value.code()}: {message}")
        assert "checksum mismatch of checkpoint/pages-1.img" in message, message
        assert "killed before they ran" in message, message
        assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value.code()
        time.sleep(1)  # a process that ran would have printed a count by now (every 50 ms)
        assert pods.counts(container_log(config, "counter")) == [], "the process ran on unchecked memory"
        assert status(rt, cid).status.state != cri.CONTAINER_RUNNING
        left = [p for p in _sys.cgroup_pids(config.linux.cgroup_parent) if not _is_pause(p)]
        assert left == [], f"processes of the failed restore left: {left}"
        assert stopped_processes(config.linux.cgroup_parent) == []
        state = runtime_root(bed, runtime_handler) / cid
        assert not state.exists(), f"the runtime's state of the killed container is left: {state}"
        pods.remove_pod(rt, resp.pod_sandbox_id)
    finally:
        remove_pod_cgroup(config)
    # start=true: RestorePod's own failure, DATA_LOSS naming the member, nothing left
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        copy,
        good.containers,
        grpc.StatusCode.DATA_LOSS,
        "checksum mismatch of checkpoint/pages-1.img",
        options={"start": "true"},
        runtime_handler=runtime_handler,
    )
    assert tree_fingerprint(copy) == before, "the archive changed"


def test_truncated_manifest_is_data_loss(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    copy = copy_archive(good.path, bed, "trunc")
    scratch.append(copy)
    m = copy / "manifest.json"
    raw = m.read_bytes()
    m.write_bytes(raw[: len(raw) // 2])
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        copy,
        good.containers,
        grpc.StatusCode.DATA_LOSS,
        "manifest.json",
        "truncated",
    )


def test_unknown_format_version_is_failed_precondition(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    copy = copy_archive(good.path, bed, "fmt")
    scratch.append(copy)
    doc = json.loads((copy / "manifest.json").read_text())
    assert doc["format"] == manifest.FORMAT
    doc["format"] = "podshim.checkpoint.v99"
    (copy / "manifest.json").write_text(json.dumps(doc))
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        copy,
        good.containers,
        grpc.StatusCode.FAILED_PRECONDITION,
        "podshim.checkpoint.v99",
    )


def test_container_configs_must_match_the_checkpoint(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str]
) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    base = good.containers[0]

    def variant(**changes: object) -> cri.ContainerConfig:
        cc = cri.ContainerConfig()
        cc.CopyFrom(base)
        for field, value in changes.items():
            if field == "envs":
                cc.envs.append(cri.KeyValue(key="EXTRA", value=b"1"))
            elif field == "image":
                cc.image.image = str(value)
            else:
                del getattr(cc, field)[:]
                getattr(cc, field).extend(value)  # type: ignore[attr-defined]
        return cc

    expect_failure(rt, bed, log_root, pod_cleanup, good.path, [], bad, "missing counter")
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        good.path,
        [base, counter_config("sidecar", SMALL_ARGS)],
        bad,
        "not in the checkpoint sidecar",
    )
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        good.path,
        [variant(args=["--mem-mib", "8"])],
        bad,
        "'counter'",
        "args",
    )
    expect_failure(rt, bed, log_root, pod_cleanup, good.path, [variant(envs=True)], bad, "'counter'", "env")
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        good.path,
        [variant(image=pods.BUSYBOX_IMAGE)],
        bad,
        "'counter'",
        "image",
        pods.BUSYBOX_IMAGE,
    )


def test_unknown_runtime_handler_is_invalid(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str]
) -> None:
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        good.path,
        good.containers,
        grpc.StatusCode.INVALID_ARGUMENT,
        "'no-such-handler'",
        runtime_handler="no-such-handler",
    )


def test_archive_of_another_runtime_is_failed_precondition(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str], crun_handler: str
) -> None:
    """A runc checkpoint restored with the crun handler: refused before anything is created."""
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        good.path,
        good.containers,
        grpc.StatusCode.FAILED_PRECONDITION,
        "OCI runtime runc, the restore would use crun",
        runtime_handler=crun_handler,
    )


def test_deadline_shorter_than_verifying_creates_nothing(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path
) -> None:
    """The deadline counts from the request: verifying the archive is bounded by it, and
    podshim answers DEADLINE_EXCEEDED itself (before gRPC cancels it) with nothing created. A
    deadline shorter than the rollback margin podshim keeps leaves no time for a restore on any
    machine: refused once verified, or while verifying if that takes longer. (9/10 of the margin:
    gRPC's timeout header rounds up, a 1 s deadline reaches the server as about 1.009 s.)"""
    config = pods.pod_config(f"short-{secrets.token_hex(3)}", log_root)
    request = cri.RestorePodRequest(
        checkpoint_path=str(good.path), config=config, container_configs=good.containers
    )
    with pytest.raises(grpc.RpcError) as err:
        rt.RestorePod(request, timeout=0.9 * RESTORE_CLEANUP_MARGIN)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = err.value.details() or ""
    assert "while verifying" in details or "leaves no time" in details, details
    assert pods_named(rt, config.metadata.name) == []


def test_new_pod_lacking_an_interface_is_failed_precondition(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """The checkpointed pod had a second network (net1) the new pod does not get: refused once
    the sandbox shows it, naming the interface, and the new sandbox is removed."""
    copy = copy_archive(good.path, bed, "net1")
    scratch.append(copy)
    net = copy / "sandbox/network.json"
    doc = json.loads(net.read_text())
    nics = doc["netns"]["interfaces"]
    assert "eth0" in {i["name"] for i in nics}, nics  # what the source pod really had
    nics.append({"name": "net1", "mac": "", "mtu": 1500, "up": True, "addresses": ["192.0.2.7/24"]})
    net.write_text(json.dumps(doc))
    manifest.write_manifest(copy, manifest.read_manifest(copy))  # a consistent archive
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        copy,
        good.containers,
        grpc.StatusCode.FAILED_PRECONDITION,
        "lacks interface(s) net1",
    )


def test_unknown_option_is_invalid(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str]
) -> None:
    expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        good.path,
        good.containers,
        grpc.StatusCode.INVALID_ARGUMENT,
        "bogus",
        options={"bogus": "1"},
    )


def test_criu_failure_names_the_log_and_removes_the_sandbox(
    rt: Stub,
    bed: TestBed,
    good_for_handler: Checkpoint,
    runtime_handler: str,
    log_root: Path,
    pod_cleanup: list[str],
    scratch: list[Path],
) -> None:
    good = good_for_handler
    # A damaged memory image the manifest vouches for: validation passes, CRIU fails.
    copy = copy_archive(good.path, bed, "criu")
    scratch.append(copy)
    img = copy / PAGEMAP_IMG
    raw = bytearray(img.read_bytes())
    raw[:8] = bytes(b ^ 0xFF for b in raw[:8])
    img.write_bytes(bytes(raw))
    m = manifest.read_manifest(copy)
    manifest.write_manifest(copy, m)
    manifest.load_and_verify(copy, [str(bed.checkpoint_root)])  # the archive looks sound
    message = expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        copy,
        good.containers,
        grpc.StatusCode.INTERNAL,
        "'counter'",
        "pagemap-1.img",
        "CRIU log",
        options={"start": "true"},
        runtime_handler=runtime_handler,
    )
    kept = re.search(r"CRIU log: (/[^)\s]+)", message)
    assert kept, message
    assert Path(kept.group(1)).is_file(), f"the CRIU log {kept.group(1)} was not kept"
    assert "Error" in Path(kept.group(1)).read_text(errors="replace")


def test_short_pages_image_fails_in_criu(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """A pages image shorter than its pagemap, which the manifest vouches for: CRIU's restorer
    fails (the project's CRIU patch 0006; CRIU 4.1.1 looped on it forever, logging each retry,
    until the disk was full) and the restore ends INTERNAL naming the kept CRIU log, well within
    the caller's deadline."""
    copy = copy_archive(good.path, bed, "short")
    scratch.append(copy)
    img = copy / PAGES_IMG
    os.truncate(img, img.stat().st_size // 2)
    manifest.write_manifest(copy, manifest.read_manifest(copy))  # podshim's size check would refuse it
    message = expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        copy,
        good.containers,
        grpc.StatusCode.INTERNAL,
        "CRIU log",
        options={"start": "true"},
    )
    kept = re.search(r"CRIU log: (/[^)\s]+)", message)
    assert kept, message
    assert "Can't read pages data: the pages image ends at" in Path(kept.group(1)).read_text(errors="replace")
    assert not kill_restores_of(copy), "the failed restore left a process holding the archive"


def kill_restores_of(archive: Path) -> list[str]:
    """SIGKILL whatever still restores from `archive` (runc restore, CRIU, the half-restored
    task, which is runc's child, or a task CRIU left holding the archive open); returns a
    description of what was killed."""
    holders = {p for p in _sys.all_pids() if _sys.holds_open(p, str(archive))}
    roots = _sys.pids_mentioning(str(archive)) | holders
    roots.discard(os.getpid())
    pids = {p for p in roots | _sys.descendants(roots) if _sys.alive(p)}
    found = [f"{p} {' '.join(_sys.read_cmdline(p))[:60] or '(no cmdline)'}" for p in sorted(pids)]
    _sys.thaw_pid_cgroups(pids)
    for p in pids:
        _sys.kill(p, signal.SIGKILL)
    assert not _sys.wait_gone(pids, 10.0)
    return found


def test_deadline_during_a_hung_criu_restore(
    rt: Stub, bed: TestBed, good: Checkpoint, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """The caller's deadline passes while CRIU hangs: DEADLINE_EXCEEDED; the new sandbox is still
    removed and the journal record closed although the rollback outlasts the deadline (gRPC
    cancels podshim's handler at the deadline, in the middle of the rollback).

    CRIU hangs by construction: the test SIGSTOPs it as soon as it holds the archive open."""
    copy = copy_archive(good.path, bed, "hang")
    scratch.append(copy)
    config = pods.pod_config("hang", log_root)
    before = HostState.take(rt, bed)
    stopper = concurrent.futures.ThreadPoolExecutor(1)
    stopped = stopper.submit(_sys.stop_criu_reading, str(copy), 60)
    try:
        with pytest.raises(grpc.RpcError) as err:
            resp = rt.RestorePod(
                cri.RestorePodRequest(
                    checkpoint_path=str(copy),
                    config=config,
                    container_configs=good.containers,
                    options={"start": "true"},
                ),
                timeout=6,
            )
            pod_cleanup.append(resp.pod_sandbox_id)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        assert stopped.result(), "CRIU was not stopped"

        def rolled_back() -> bool:
            left = pods_named(rt, "hang")
            pod_cleanup.extend(p.id for p in left if p.id not in pod_cleanup)
            now = HostState.take(rt, bed)
            return not left and (now.sandboxes, now.containers, now.cni, now.ipam, now.journal) == (
                before.sandboxes,
                before.containers,
                before.cni,
                before.ipam,
                before.journal,
            )

        pods.wait_for(rolled_back, timeout=40, interval=0.5, what="the rollback of the timed-out restore")
        # containerd kills podshim-runc when StartContainer is cancelled; podshim-runc's watchdog
        # then kills `runc restore`, CRIU and the half-restored task and detaches CRIU's mounts.
        assert not kill_restores_of(copy), "a cancelled StartContainer left the CRIU restore running"

        def host_clean() -> bool:
            now = HostState.take(rt, bed)
            return (now.mounts, now.runc_state) == (before.mounts, before.runc_state)

        try:
            pods.wait_for(host_clean, timeout=30, interval=0.5, what="no mounts or runc state left")
        except TimeoutError:
            now = HostState.take(rt, bed)
            raise AssertionError(
                f"left: mounts {now.mounts - before.mounts}, runc state {now.runc_state - before.runc_state}"
            ) from None
    finally:
        stopper.shutdown(cancel_futures=True)
        kill_restores_of(copy)
        now = HostState.take(rt, bed)
        for mount in sorted(now.mounts - before.mounts, key=len, reverse=True):
            _sys.umount_lazy(mount)
        for cid in now.runc_state - before.runc_state:
            subprocess.run(
                [str(bed.real_runc), "--root", str(bed.runc_root), "delete", "--force", cid],
                capture_output=True,
            )
        remove_pod_cgroup(config)


# ---------------------------------------------------------------------------- a kubelet's pods


@dataclass
class KubeletCheckpoint:
    path: Path
    source: pods.Pod
    first: int  # the count the checkpointed counter prints first after the cut (testbed/resume.py)
    kubelet_root: Path


def kubelet_checkpoint(
    rt: Stub,
    img: ImageStub,
    bed: TestBed,
    log_root: Path,
    name: str,
    cleanup: list[str],
    volumes: tuple[str, ...] = (),
) -> KubeletCheckpoint:
    """A counter pod created as a kubelet creates it (image by ID, user_specified_image, per-pod
    /etc/hosts and termination log, a directory of the pod's on each of `volumes`), checkpointed
    with what the kubelet sends: the container ids and an empty options map."""
    kubelet_root = Path(bed.base_dir) / "kubelet"
    config = pods.pod_config(name, log_root)
    cc = pods.kubelet_container_config(img, config, kubelet_root, "counter", args=SMALL_ARGS)
    cc.mounts.extend(kubelet_volume(kubelet_root, config, dest) for dest in volumes)
    src = pods.run_pod(rt, name, log_root, {"counter": cc}, config=config)
    cleanup.append(src.id)
    pods.wait_count(src.log_path("counter"), 10)
    out, first = checkpoint_counters(
        rt, bed, src, name, ["counter"], container_ids=[src.containers["counter"]], options={}
    )
    return KubeletCheckpoint(out, src, first["counter"], kubelet_root)


def kubelet_volume(kubelet_root: Path, config: cri.PodSandboxConfig, dest: str) -> cri.Mount:
    """A volume of the pod `config` (a new directory under its kubelet pod dir) mounted on `dest`."""
    host = pods.kubelet_pod_dir(kubelet_root, config) / "volumes" / secrets.token_hex(3)
    host.mkdir(parents=True)
    (host / "token").write_text("not a real token")
    return cri.Mount(host_path=str(host), container_path=dest, readonly=True)


SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_kubelet_pod_needs_the_checkpoint_bind_mounts(
    rt: Stub, img: ImageStub, bed: TestBed, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """A kubelet pod's checkpoint holds its containers' bind mounts (termination log, a
    service-account token) in spec.dump. container_configs lacking one is FAILED_PRECONDITION naming
    each container and mount (not /etc/hosts: containerd mounts the sandbox's), before any sandbox
    exists, as for a container tar (shim/checks/mounts.py), instead of failing in CRIU at
    StartContainer; with them the counter resumes."""
    ck = kubelet_checkpoint(
        rt, img, bed, log_root, f"kubelet-mnt-{secrets.token_hex(2)}", pod_cleanup, volumes=(SERVICE_ACCOUNT,)
    )
    scratch.append(ck.path)
    config = pods.pod_config("kubelet-mnt-restored", log_root)
    cc = pods.kubelet_container_config(img, config, ck.kubelet_root, "counter", args=SMALL_ARGS)
    bare = cri.ContainerConfig()
    bare.CopyFrom(cc)
    del bare.mounts[:]
    code = grpc.StatusCode.FAILED_PRECONDITION
    details = expect_failure(
        rt, bed, log_root, pod_cleanup, ck.path, [bare], code, "container 'counter'", pods.TERMINATION_LOG
    )
    assert SERVICE_ACCOUNT in details and "/etc/hosts" not in details, details
    expect_failure(
        rt, bed, log_root, pod_cleanup, ck.path, [cc], code, f"container 'counter': {SERVICE_ACCOUNT}"
    )

    cc.mounts.append(kubelet_volume(ck.kubelet_root, config, SERVICE_ACCOUNT))
    resp = restore(rt, ck.path, config, [cc], options={"start": "true"})
    pod_cleanup.append(resp.pod_sandbox_id)
    new_log = container_log(config, "counter")
    resume.assert_exact_resume({"counter": new_log}, {"counter": ck.first})


def test_kubelet_pod_restores_by_image_id_digest_or_name(
    rt: Stub, img: ImageStub, bed: TestBed, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """docs/design/archive.md (Image identity): the checkpoint of a pod a kubelet made (its
    containers created with the image ID) records the image's ID and name, and RestorePod takes
    the same image by its ID (the kubelet's container_configs), a digest reference or its name;
    the restored counter resumes. Another image is a config mismatch, INVALID_ARGUMENT, and
    DATA_LOSS stays for a config.dump that names another image than the manifest."""
    ck = kubelet_checkpoint(rt, img, bed, log_root, f"kubelet-img-{secrets.token_hex(2)}", pod_cleanup)
    scratch.append(ck.path)
    counter_id = pods.image_id(img, pods.COUNTER_IMAGE)
    entry = manifest.read_manifest(ck.path).container("counter")
    assert (entry.image_id, entry.user_specified_image) == (counter_id, pods.COUNTER_IMAGE), entry
    record = json.loads((ck.path / "containers/counter/config.dump").read_text())
    assert record["image_id"] == counter_id and record["config"]["image"]["image"] == counter_id

    # the kubelet's shape: the new pod's uid, name, log dir and its own per-pod files
    config = pods.pod_config("kubelet-img-restored", log_root)
    cc = pods.kubelet_container_config(img, config, ck.kubelet_root, "counter", args=SMALL_ARGS)
    resp = restore(rt, ck.path, config, [cc])
    pod_cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    assert status(rt, cid).status.state == cri.CONTAINER_CREATED
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    new_log = container_log(config, "counter")
    first = resume.assert_exact_resume({"counter": new_log}, {"counter": ck.first})["counter"]
    wait_counting(new_log, first + 3)

    # the same image by name and by a digest reference: restored (CREATED) too
    with pods.digest_reference(bed, pods.COUNTER_IMAGE) as digest_ref:
        for i, ref in enumerate((pods.COUNTER_IMAGE, digest_ref)):
            by = pods.pod_config(f"kubelet-img-ref{i}", log_root)
            other = pods.kubelet_container_config(img, by, ck.kubelet_root, "counter", args=SMALL_ARGS)
            other.image.CopyFrom(cri.ImageSpec(image=ref))
            r = restore(rt, ck.path, by, [other])
            pod_cleanup.append(r.pod_sandbox_id)
            got = status(rt, r.restored_containers[0].container_id).status
            assert got.state == cri.CONTAINER_CREATED, (ref, got.state)

    # another image, by its ID as the kubelet would send it: a config mismatch
    busybox_id = pods.image_id(img, pods.BUSYBOX_IMAGE)
    wrong = pods.kubelet_container_config(img, config, ck.kubelet_root, "counter", args=SMALL_ARGS)
    wrong.image.CopyFrom(cri.ImageSpec(image=busybox_id, user_specified_image=pods.BUSYBOX_IMAGE))
    bad = grpc.StatusCode.INVALID_ARGUMENT
    expect_failure(rt, bed, log_root, pod_cleanup, ck.path, [wrong], bad, "'counter'", busybox_id, counter_id)

    # an archive whose config.dump names another image than its manifest changed: DATA_LOSS
    changed = copy_archive(ck.path, bed, "other-image")
    scratch.append(changed)
    dump = changed / "containers/counter/config.dump"
    doc = json.loads(dump.read_text())
    doc["config"]["image"]["image"] = busybox_id
    dump.write_text(json.dumps(doc))
    rehash(changed, "containers/counter/config.dump")
    expect_failure(
        rt, bed, log_root, pod_cleanup, changed, [cc], grpc.StatusCode.DATA_LOSS, "config.dump", busybox_id
    )


def test_user_specified_image_must_name_the_checkpoints_image(
    rt: Stub, img: ImageStub, bed: TestBed, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """The image's ID in `image.image` with another image's name in `user_specified_image` (the
    name the restored container would report) is a config mismatch, INVALID_ARGUMENT naming the
    container and both images, with nothing created, as the restore from a container tar answers
    it; the checkpoint's name, its ID, a digest reference of it and the empty value all restore,
    and the counter resumes."""
    ck = kubelet_checkpoint(rt, img, bed, log_root, f"kubelet-usi-{secrets.token_hex(2)}", pod_cleanup)
    scratch.append(ck.path)
    counter_id = pods.image_id(img, pods.COUNTER_IMAGE)
    config = pods.pod_config("kubelet-usi-restored", log_root)
    wrong = pods.kubelet_container_config(img, config, ck.kubelet_root, "counter", args=SMALL_ARGS)
    assert wrong.image.image == counter_id
    wrong.image.user_specified_image = pods.BUSYBOX_IMAGE
    details = expect_failure(
        rt,
        bed,
        log_root,
        pod_cleanup,
        ck.path,
        [wrong],
        grpc.StatusCode.INVALID_ARGUMENT,
        "container 'counter'",
        f"user_specified_image {pods.BUSYBOX_IMAGE!r}",
        pods.COUNTER_IMAGE,
        counter_id,
    )
    assert pods.image_id(img, pods.BUSYBOX_IMAGE) in details, details  # what that name is here

    with pods.digest_reference(bed, pods.COUNTER_IMAGE) as digest_ref:
        for i, named in enumerate((pods.COUNTER_IMAGE, counter_id, digest_ref, "")):
            by = pods.pod_config(f"kubelet-usi-ok{i}", log_root)
            cc = pods.kubelet_container_config(img, by, ck.kubelet_root, "counter", args=SMALL_ARGS)
            cc.image.user_specified_image = named
            r = restore(rt, ck.path, by, [cc])
            pod_cleanup.append(r.pod_sandbox_id)
            cid = r.restored_containers[0].container_id
            assert status(rt, cid).status.state == cri.CONTAINER_CREATED, named
    # the last, restored with no name: it runs the checkpoint's process
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    resume.assert_exact_resume({"counter": container_log(by, "counter")}, {"counter": ck.first})


def test_env_value_not_utf8_restores_with_the_identical_request(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """A container created with `BIN=\\xff` (the released API's env values are bytes; containerd 1.6
    keeps the config as JSON, with U+FFFD for the byte, and config.dump records that) restores
    from its own checkpoint with the very config it was created with, and resumes. A genuinely
    different value is still INVALID_ARGUMENT naming the env."""
    name = f"env-bytes-{secrets.token_hex(2)}"
    cc = counter_config("counter", SMALL_ARGS)
    cc.envs.append(cri.KeyValue(key="BIN", value=b"\xff"))
    src = pods.run_pod(rt, name, log_root, {"counter": cc})
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("counter"), 10)
    out, first = checkpoint_counters(rt, bed, src, name, ["counter"])
    scratch.append(out)

    for value in (b"x", b"\xff\xff", b""):
        other = cri.ContainerConfig()
        other.CopyFrom(cc)
        other.envs[-1].value = value
        bad = grpc.StatusCode.INVALID_ARGUMENT
        expect_failure(rt, bed, log_root, pod_cleanup, out, [other], bad, "'counter'", "env differs")

    config = pods.pod_config(f"{name}-restored", log_root)
    resp = restore(rt, out, config, [cc], options={"start": "true"})
    pod_cleanup.append(resp.pod_sandbox_id)
    resume.assert_exact_resume({"counter": container_log(config, "counter")}, first)


def test_kubelet_archive_of_an_older_podshim_restores(
    rt: Stub, img: ImageStub, bed: TestBed, log_root: Path, pod_cleanup: list[str], scratch: list[Path]
) -> None:
    """An archive written before the image ID was recorded (no image_id / user_specified_image in
    manifest.json and config.dump; config.dump's config.image is the ID the kubelet sent, the
    manifest names the tag) restores: its references are resolved on this node."""
    ck = kubelet_checkpoint(rt, img, bed, log_root, f"kubelet-old-{secrets.token_hex(2)}", pod_cleanup)
    scratch.append(ck.path)
    old = copy_archive(ck.path, bed, "format-without-image-ids")
    scratch.append(old)
    dump = old / "containers/counter/config.dump"
    doc = json.loads(dump.read_text())
    del doc["image_id"], doc["user_specified_image"]
    dump.write_text(json.dumps(doc))
    rehash(old, "containers/counter/config.dump")
    m = json.loads((old / "manifest.json").read_text())
    for c in m["containers"]:
        del c["image_id"], c["user_specified_image"]
    (old / "manifest.json").write_text(json.dumps(m, indent=1))
    assert m["containers"][0]["image"] == pods.COUNTER_IMAGE
    assert doc["config"]["image"]["image"] == pods.image_id(img, pods.COUNTER_IMAGE)

    config = pods.pod_config("kubelet-old-restored", log_root)
    cc = pods.kubelet_container_config(img, config, ck.kubelet_root, "counter", args=SMALL_ARGS)
    resp = restore(rt, old, config, [cc], options={"start": "true"})
    pod_cleanup.append(resp.pod_sandbox_id)
    new_log = container_log(config, "counter")
    resume.assert_exact_resume({"counter": new_log}, {"counter": ck.first})


def rehash(root: Path, rel: str) -> None:
    """Make manifest.json agree with the changed member `rel` (its checksum is no signature)."""
    data = (root / rel).read_bytes()
    m = json.loads((root / "manifest.json").read_text())
    m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (root / "manifest.json").write_text(json.dumps(m, indent=1))
