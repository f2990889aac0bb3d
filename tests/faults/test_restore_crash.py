"""RestorePod interrupted: podshim SIGKILLed after the sandbox was created but before its id was
journaled, after the sandbox and between two containers, and
podshim-runc SIGKILLed inside the restore (under containerd, at StartContainer), through podshim's
broker and through its hook: before the restore, and while the restored tasks are held stopped for
the page images' checksums; and podshim SIGKILLed while it settles podshim-runc's restore.

After podshim's restart (journal replay) or the failed start: the new sandbox and its
containers are gone, nothing is left mounted or in the runtime's state, the journal is empty,
the archive is unchanged, and the next RestorePod of the same archive succeeds and resumes.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from testbed import _sys, pods, resume
from testbed.bed import TestBed

from .helpers import (
    FAILPOINTS_ENV,
    Archive,
    FailpointPodshim,
    NodeState,
    Rt,
    containerd_env,
    journal_files,
    mounts_naming,
    remove_cgroup_parent,
    restore,
    sandboxes_named,
    take_archive,
    wait_journal_empty,
    wait_serving,
)

pytestmark = pytest.mark.e2e


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def archive(rt: Rt, bed: TestBed) -> Iterator[Archive]:
    """One archive of a two-container counter pod (so a crash can fall between the two)."""
    created: list[str] = []
    try:
        a = take_archive(rt, bed, "restore-crash-src", ("first", "second"), created)
        yield a
        shutil.rmtree(a.path, ignore_errors=True)
    finally:
        for pod_id in created:
            with contextlib.suppress(Exception):
                pods.remove_pod(rt, pod_id)


@pytest.fixture
def new_pod(bed: TestBed, log_root: Path, rt: Rt) -> Iterator[cri.PodSandboxConfig]:
    """The config of the pod a test restores into; whatever carries its name is removed after."""
    config = pods.pod_config(f"restored-{secrets.token_hex(3)}", log_root)
    yield config
    with contextlib.suppress(Exception):
        for sid in sandboxes_named(rt, config.metadata.name):
            pods.remove_pod(rt, sid)
    remove_cgroup_parent(config)


def _assert_nothing_left(
    rt: Rt, bed: TestBed, config: cri.PodSandboxConfig, before: NodeState, ids: set[str]
) -> None:
    assert sandboxes_named(rt, config.metadata.name) == []
    after = NodeState.take(rt, bed)
    assert after == before, f"left behind: {before} -> {after}"
    assert mounts_naming(bed, ids) == []
    assert not _sys.cgroup_pids(config.linux.cgroup_parent), "processes left in the new pod's cgroup"
    for d in _sys.cgroup_dirs(config.linux.cgroup_parent):
        assert [p.name for p in d.iterdir() if p.is_dir()] == [], f"container cgroups left in {d}"


def _assert_restore_works(rt: Rt, archive: Archive, log_root: Path, pod_cleanup: list[str]) -> None:
    config = pods.pod_config(f"after-{secrets.token_hex(3)}", log_root)
    resp = restore(rt, archive, config, {"start": "true"})
    pod_cleanup.append(resp.pod_sandbox_id)  # its removal also removes the pod-level cgroup
    logs = {c.name: Path(config.log_directory) / c.name / "0.log" for c in resp.restored_containers}
    assert sorted(logs) == sorted(archive.first), (logs, archive.first)
    resume.assert_exact_resume(logs, archive.first)  # every container exactly from the cut


@pytest.mark.parametrize(
    ("failpoint", "created_containers"),
    [("restore.sandbox-unrecorded", 0), ("restore.after-sandbox", 0), ("restore.after-container", 1)],
    ids=["sandbox-id-unrecorded", "after-sandbox", "between-containers"],
)
def test_podshim_killed_during_restore(
    rt: Rt,
    bed: TestBed,
    archive: Archive,
    new_pod: cri.PodSandboxConfig,
    log_root: Path,
    pod_cleanup: list[str],
    failpoint: str,
    created_containers: int,
) -> None:
    digest = _digest(archive.path)
    before = NodeState.take(rt, bed)
    with FailpointPodshim(bed, f"{failpoint}=kill") as fp:
        with pytest.raises(grpc.RpcError) as err:
            restore(fp.rt, archive, new_pod)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        fp.wait_dead(30)
        # the crash left a half-restored pod: the sandbox and `created_containers` of two
        half = sandboxes_named(rt_direct := pods.stubs(bed.containerd_socket)[0], new_pod.metadata.name)
        assert len(half) == 1, half
        f = cri.ContainerFilter(pod_sandbox_id=half[0])
        made = [c.id for c in rt_direct.ListContainers(cri.ListContainersRequest(filter=f)).containers]
        assert len(made) == created_containers
        assert journal_files(bed)
    wait_serving(rt)
    wait_journal_empty(bed)
    _assert_nothing_left(rt, bed, new_pod, before, {half[0], *made})
    assert _digest(archive.path) == digest, "the archive changed"
    _assert_restore_works(rt, archive, log_root, pod_cleanup)


def _naming(container_id: str) -> list[int]:
    """Processes whose argv names the container (podshim-runc, its hook, the runtime)."""
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and any(container_id in a for a in _sys.read_cmdline(int(p.name)))
    ]


def _is_pause(pid: int) -> bool:
    argv = _sys.read_cmdline(pid)
    return bool(argv) and Path(argv[0]).name == "pause"


# podshim-runc restores through podshim's broker, or alone (its hook) when podshim does not answer
# (docs/design/runtime-wrapper.md (The runtime wrapper)): each of its deaths is tested on both paths
PATHS = pytest.mark.parametrize("path", ["", ",runc-wrapper.broker=off"], ids=["broker", "hook"])


@PATHS
def test_podshim_runc_killed_in_restore_hook(
    rt: Rt,
    bed: TestBed,
    archive: Archive,
    new_pod: cri.PodSandboxConfig,
    log_root: Path,
    pod_cleanup: list[str],
    path: str,
) -> None:
    digest = _digest(archive.path)
    with containerd_env(bed, {FAILPOINTS_ENV: "runc-wrapper.before-restore=kill" + path}):
        rt = pods.stubs(bed.podshim_socket)[0]
        before = NodeState.take(rt, bed)
        # RestorePod returns CREATED containers; the hook runs at StartContainer and dies there
        resp = restore(rt, archive, new_pod)
        sid = resp.pod_sandbox_id
        ids = {sid, *(c.container_id for c in resp.restored_containers)}
        first = resp.restored_containers[0].container_id
        with pytest.raises(grpc.RpcError) as err:
            rt.StartContainer(cri.StartContainerRequest(container_id=first), timeout=60)
        print(f"StartContainer with podshim-runc killed: {err.value.code()}: {err.value.details()}")
        st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=first)).status
        assert st.state != cri.CONTAINER_RUNNING
        survivors = [p for p in _sys.cgroup_pids(new_pod.linux.cgroup_parent) if not _is_pause(p)]
        assert not survivors, f"processes survived the failed restore: {survivors}"
        # what the kubelet then does: remove the pod; nothing of it may stay
        pods.remove_pod(rt, sid)
        _assert_nothing_left(rt, bed, new_pod, before, ids)

        # start=true: the failed start is RestorePod's own failure, and it removes the new pod
        other = pods.pod_config(f"restored-{secrets.token_hex(3)}", log_root)
        try:
            with pytest.raises(grpc.RpcError) as err:
                restore(rt, archive, other, {"start": "true"})
            print(f"RestorePod start=true: {err.value.code()}: {err.value.details()}")
            assert "first" in (err.value.details() or ""), err.value.details()
            _assert_nothing_left(rt, bed, other, before, set())
        finally:
            for s in sandboxes_named(rt, other.metadata.name):
                pods.remove_pod(rt, s)
            remove_cgroup_parent(other)
    rt = pods.stubs(bed.podshim_socket)[0]
    wait_serving(rt)
    assert _digest(archive.path) == digest, "the archive changed"
    _assert_restore_works(rt, archive, log_root, pod_cleanup)


def _pod_processes(config: cri.PodSandboxConfig) -> dict[int, str]:
    """The new pod's processes but its pause, with their state letter (T: stopped)."""
    out = {}
    for pid in _sys.cgroup_pids(config.linux.cgroup_parent):
        if _is_pause(pid):
            continue
        with contextlib.suppress(OSError, IndexError):
            out[pid] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return out


@PATHS
def test_podshim_runc_killed_while_the_tasks_are_held_stopped(
    rt: Rt,
    bed: TestBed,
    archive: Archive,
    new_pod: cri.PodSandboxConfig,
    log_root: Path,
    pod_cleanup: list[str],
    path: str,
    tmp_path: Path,
) -> None:
    """An eager restore's tasks are held stopped (CRIU's leave-stopped) until podshim-runc has
    checked the page images (docs/design/restore-pod.md (RestorePod) step 4). Held there until the
    test lets go (`runc-wrapper.held-stopped=wait:FILE`): every process of the container is
    stopped and silent, then continued, and it counts on. podshim-runc SIGKILLed at that point
    (`=kill`): its watchdog kills them all, nothing is left stopped or running, the pod can be
    removed leaving nothing, and the archive restores afterwards."""
    digest = _digest(archive.path)
    release = tmp_path / "release"
    with containerd_env(bed, {FAILPOINTS_ENV: f"runc-wrapper.held-stopped=wait:{release}" + path}):
        rt = pods.stubs(bed.podshim_socket)[0]
        resp = restore(rt, archive, new_pod)
        pod_cleanup.append(resp.pod_sandbox_id)
        first = resp.restored_containers[0]
        log = Path(new_pod.log_directory) / first.name / "0.log"
        started: list[BaseException | None] = []

        def start() -> None:
            try:
                rt.StartContainer(cri.StartContainerRequest(container_id=first.container_id), timeout=60)
                started.append(None)
            except BaseException as e:  # noqa: BLE001 - reported below
                started.append(e)

        t = threading.Thread(target=start, daemon=True)
        t.start()
        held = pods.wait_for(
            lambda: (p := _pod_processes(new_pod)) and all(s == "T" for s in p.values()) and p,
            20,
            interval=0.02,
            what="the restored processes held stopped",
        )
        print(f"\nheld stopped: {held}")
        assert not pods.counts(log), "a held process printed"
        assert t.is_alive(), "StartContainer answered while its tasks were held"
        release.touch()
        t.join(30)
        assert started == [None], started
        n = pods.wait_for(lambda: pods.counts(log), 20, what="the continued counter's output")[0]
        pods.wait_count(log, n + 3, timeout=20)  # it counts on
        assert all(s != "T" for s in _pod_processes(new_pod).values()), _pod_processes(new_pod)
        pods.remove_pod(rt, resp.pod_sandbox_id)

    other = pods.pod_config(f"restored-{secrets.token_hex(3)}", log_root)
    try:
        with containerd_env(bed, {FAILPOINTS_ENV: "runc-wrapper.held-stopped=kill" + path}):
            rt = pods.stubs(bed.podshim_socket)[0]
            before = NodeState.take(rt, bed)
            resp = restore(rt, archive, other)
            sid = resp.pod_sandbox_id
            ids = {sid, *(c.container_id for c in resp.restored_containers)}
            first = resp.restored_containers[0]
            with pytest.raises(grpc.RpcError) as err:
                rt.StartContainer(cri.StartContainerRequest(container_id=first.container_id), timeout=60)
            print(
                f"StartContainer, podshim-runc killed while held: {err.value.code()}: {err.value.details()}"
            )
            # the watchdog kills what podshim-runc held (it runs on once podshim-runc is gone)
            pods.wait_for(lambda: not _pod_processes(other), 20, what="the held processes killed")
            assert not pods.counts(Path(other.log_directory) / first.name / "0.log"), "a held process ran"
            st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=first.container_id)).status
            assert st.state != cri.CONTAINER_RUNNING
            pods.remove_pod(rt, sid)
            _assert_nothing_left(rt, bed, other, before, ids)
    finally:
        for s in sandboxes_named(pods.stubs(bed.podshim_socket)[0], other.metadata.name):
            pods.remove_pod(pods.stubs(bed.podshim_socket)[0], s)
        remove_cgroup_parent(other)
    rt = pods.stubs(bed.podshim_socket)[0]
    wait_serving(rt)
    assert _digest(archive.path) == digest, "the archive changed"
    _assert_restore_works(rt, archive, log_root, pod_cleanup)


def test_podshim_killed_while_it_settles_a_restore(
    rt: Rt,
    bed: TestBed,
    archive: Archive,
    new_pod: cri.PodSandboxConfig,
    log_root: Path,
    pod_cleanup: list[str],
) -> None:
    """podshim serves podshim-runc's restore (its broker) and dies once the runtime's restore ended,
    the tasks held stopped for the page check (`restore-broker.after-restore=kill`): podshim-runc
    loses the connection, kills the restore and hands the create to its hook with
    PODSHIM_RUNC_ABORT, which kills what was restored and fails the create naming why. Nothing of
    the container ever ran, nothing stays stopped; the pod's removal leaves nothing; the archive
    restores afterwards."""
    digest = _digest(archive.path)
    before = NodeState.take(rt, bed)
    with FailpointPodshim(bed, "restore-broker.after-restore=kill") as fp:
        resp = restore(fp.rt, archive, new_pod)
        sid = resp.pod_sandbox_id
        ids = {sid, *(c.container_id for c in resp.restored_containers)}
        first = resp.restored_containers[0]
        with pytest.raises(grpc.RpcError) as err:
            fp.rt.StartContainer(cri.StartContainerRequest(container_id=first.container_id), timeout=60)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err.value
        fp.wait_dead(30)
    direct = pods.stubs(bed.containerd_socket)[0]
    # containerd's create ends on its own: podshim-runc's hook undoes the restore, then exits
    pods.wait_for(lambda: not _naming(first.container_id), 30, what="podshim-runc and its hook ended")
    if not bed.containerd_at_least("2.4"):
        # the hook's abort kept CRIU's log of the undone restore for the operator; containerd 2.4
        # cancels the create whose caller (podshim) went away, killing podshim-runc before its
        # hook runs, and its own clean-up of the failed create kills what was restored
        # (docs/design/versions.md (containerd, runc and CRIU versions))
        assert (bed.podshim_state_dir / "logs" / f"restore-{first.container_id}.log").is_file()
    assert not _pod_processes(new_pod), _pod_processes(new_pod)
    assert not pods.counts(Path(new_pod.log_directory) / first.name / "0.log"), "a held process ran"
    st = direct.ContainerStatus(cri.ContainerStatusRequest(container_id=first.container_id)).status
    assert st.state != cri.CONTAINER_RUNNING
    rt = pods.stubs(bed.podshim_socket)[0]
    wait_serving(rt)
    wait_journal_empty(bed)
    pods.remove_pod(rt, sid)
    _assert_nothing_left(rt, bed, new_pod, before, ids)
    assert _digest(archive.path) == digest, "the archive changed"
    _assert_restore_works(rt, archive, log_root, pod_cleanup)


def test_a_sandbox_stopped_by_another_caller_mid_restore_is_named(
    rt: Rt, bed: TestBed, archive: Archive, new_pod: cri.PodSandboxConfig, tmp_path: Path
) -> None:
    """Another caller (a kubelet that does not know the pod) stops the new sandbox while RestorePod
    is between its containers: the restore fails ABORTED saying so (not only the failed step's
    error), and leaves nothing behind."""
    go = tmp_path / "go"
    before = NodeState.take(rt, bed)
    direct = pods.stubs(bed.containerd_socket)[0]
    with FailpointPodshim(bed, f"restore.after-container=wait:{go}") as fp:
        result: dict[str, BaseException | cri.RestorePodResponse] = {}

        def call() -> None:
            try:
                result["r"] = restore(fp.rt, archive, new_pod, {"start": "true"})
            except grpc.RpcError as e:
                result["r"] = e

        t = threading.Thread(target=call, daemon=True)
        t.start()
        made = pods.wait_for(lambda: sandboxes_named(direct, new_pod.metadata.name), what="the new sandbox")
        direct.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=made[0]), timeout=60)
        go.touch()
        t.join(120)
    err = result.get("r")
    assert isinstance(err, grpc.RpcError), err
    assert err.code() == grpc.StatusCode.ABORTED, err.details()
    assert f"the new sandbox {made[0][:13]} was stopped by another caller" in (err.details() or "")
    wait_journal_empty(bed)
    _assert_nothing_left(rt, bed, new_pod, before, set(made))


@pytest.mark.parametrize("action", ["error", "kill"])
def test_a_failed_restore_leaves_the_new_pods_empty_dirs_empty(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], action: str
) -> None:
    """RestorePod fills the new pod's emptyDir before its first container, then fails after the
    first container is created (a failpoint's error) or podshim is killed there: the rollback, or
    the next podshim's recovery from the journal, removes the sandbox and empties the emptyDir
    again, with its own mode back, so the caller's retry into the same pod directory is not
    refused as 'not empty' and restores the volume's files."""
    tag = f"vol-undo-{secrets.token_hex(2)}"

    def empty_dir(uid: str) -> Path:
        return pods.empty_dir(Path(bed.base_dir) / "kubelet", uid, "config")

    def app(volume: Path) -> cri.ContainerConfig:
        cc = pods.container_config("app")
        cc.mounts.append(cri.Mount(host_path=str(volume), container_path="/config"))
        return cc

    src_config = pods.pod_config(tag, log_root)
    src_dir = empty_dir(src_config.metadata.uid)
    (src_dir / "conf.d").mkdir()
    (src_dir / "conf.d" / "app.conf").write_text("rendered by the init container\n")
    src = pods.run_pod(rt, tag, log_root, {"app": app(src_dir)}, config=src_config)
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("app"), 3, timeout=30)
    out = Path(bed.checkpoint_root) / tag
    out.mkdir(mode=0o700)
    try:
        rt.CheckpointPod(pods.checkpoint_request(rt, src.id, out), timeout=120)
        config = pods.pod_config(f"{tag}-new", log_root)
        new_dir = empty_dir(config.metadata.uid)
        req = cri.RestorePodRequest(checkpoint_path=str(out), config=config, container_configs=[app(new_dir)])
        before = NodeState.take(rt, bed)
        with FailpointPodshim(bed, f"restore.after-container={action}") as fp:
            with pytest.raises(grpc.RpcError) as err:
                fp.rt.RestorePod(req, timeout=120)
            if action == "kill":
                assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                fp.wait_dead(30)
                assert list(new_dir.iterdir()) != [], "the fill did not happen before the kill"
            else:
                assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
                assert "failpoint restore.after-container" in (err.value.details() or "")
        wait_serving(rt)
        wait_journal_empty(bed)
        _assert_nothing_left(rt, bed, config, before, set())
        assert list(new_dir.iterdir()) == [], "the failed restore's files were left in the new pod's emptyDir"
        assert new_dir.stat().st_mode & 0o7777 == 0o777

        resp = rt.RestorePod(req, timeout=120)  # the retry, into the same pod directory
        pod_cleanup.append(resp.pod_sandbox_id)
        assert (new_dir / "conf.d" / "app.conf").read_text() == "rendered by the init container\n"
    finally:
        shutil.rmtree(out, ignore_errors=True)
