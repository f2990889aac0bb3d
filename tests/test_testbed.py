"""The test bed itself: a private containerd runs a pod with the counter image through CRI, and
stopping the bed leaves nothing behind on the host, even after containerd was SIGKILLed."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testbed import _sys
from testbed._cri import CriClient, field_bytes, field_str
from testbed.bed import BUSYBOX_IMAGE, COUNTER_IMAGE, IMAGES, REPO, TestBed
from testbed.checks import set_freezer
from testbed.errors import TestBedError

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("containerd") is None,
    reason="needs root and containerd",
)


# ---------------------------------------------------------------------------- helpers


def _api() -> tuple[object, object]:
    from api.runtime.v1 import api_pb2, api_pb2_grpc

    return api_pb2, api_pb2_grpc


def _wait(pred: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _counts(log: Path) -> list[int]:
    try:
        text = log.read_text()
    except FileNotFoundError:
        return []
    return [int(m) for m in re.findall(r" stdout F count=(\d+) ts=", text)]


def _run_pod(
    bed: TestBed, name: str, image: str, args: list[str], cgroup_parent: str | None = None
) -> dict[str, object]:
    """RunPodSandbox + CreateContainer + StartContainer on containerd's socket, kubelet-style."""
    pb, _ = _api()
    rt = bed.runtime_stub(bed.containerd_socket)
    uid = uuid.uuid4().hex
    # As kubelet does: CRI's default (0) is POD, a PID namespace shared with the pause process.
    ns_options = pb.NamespaceOption(pid=pb.CONTAINER)
    log_dir = bed.pod_log_dir(f"{name}_{uid}")
    cgroup_parent = cgroup_parent or bed.cgroup_parent(uid)
    pod_config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace="default", uid=uid, attempt=0),
        hostname=name,
        log_directory=str(log_dir),
        labels={"io.kubernetes.pod.name": name},
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=cgroup_parent,
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=ns_options),
        ),
    )
    pod_id = rt.RunPodSandbox(pb.RunPodSandboxRequest(config=pod_config), timeout=60).pod_sandbox_id
    ctr_config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="main", attempt=0),
        image=pb.ImageSpec(image=image),
        args=args,
        log_path="main/0.log",
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(namespace_options=ns_options)
        ),
    )
    cid = rt.CreateContainer(
        pb.CreateContainerRequest(pod_sandbox_id=pod_id, config=ctr_config, sandbox_config=pod_config),
        timeout=60,
    ).container_id
    rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=60)
    status = rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid, verbose=True), timeout=10)
    pid = json.loads(status.info["info"])["pid"]
    pod_status = rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True))
    pod_info = json.loads(pod_status.info["info"])
    netns = [n["path"] for n in pod_info["runtimeSpec"]["linux"]["namespaces"] if n["type"] == "network"][0]
    return {
        "pod_id": pod_id,
        "cid": cid,
        "uid": uid,
        "pid": pid,
        "pause_pid": pod_info["pid"],
        "netns": netns,
        "log": log_dir / "main" / "0.log",
        "ip": pod_status.status.network.ip,
        "cgroup_parent": cgroup_parent,
    }


def _assert_nothing_left(bed: TestBed, pod: dict[str, object]) -> None:
    assert bed.leftovers() == []
    assert not bed.base_dir.exists()
    assert not _sys.mounts_under(bed.base_dir)
    for pid in (pod["pid"], pod["pause_pid"], bed.containerd_pid):
        assert isinstance(pid, int) and not _sys.alive(pid), f"process {pid} survived"
    assert not _sys.link_exists(bed.bridge)
    assert not os.path.exists(str(pod["netns"]))
    assert not [m for m in _sys.mounts() if m.mount_point == pod["netns"]]
    assert not _sys.cgroup_dirs(bed.cgroup_root)
    assert not [p for p in Path("/var/lib/cni/results").glob(f"*{pod['pod_id']}*")]
    assert not [p for p in _sys.all_pids() if str(bed.base_dir) in " ".join(_sys.read_cmdline(p))]


@pytest.fixture
def private_bed() -> Iterator[TestBed]:
    """A bed of this test's own, containerd only (podshim off): the test stops it itself."""
    bed = TestBed(start_podshim=False)
    bed.start()
    try:
        yield bed
    finally:
        if bed.base_dir.exists():
            bed.stop()


# ---------------------------------------------------------------------------- e2e


@pytest.mark.e2e
@NEEDS_ROOT
def test_counter_pod_runs_and_stop_leaves_nothing(private_bed: TestBed) -> None:
    bed = private_bed
    pb, _ = _api()
    rt = bed.runtime_stub(bed.containerd_socket)
    version = rt.Version(pb.VersionRequest())
    assert version.runtime_name == "containerd" and version.runtime_api_version == "v1"

    # The three locally built images are visible to CRI under their full names.
    tags = {
        t
        for i in bed.image_stub(bed.containerd_socket).ListImages(pb.ListImagesRequest()).images
        for t in i.repo_tags
    }
    assert set(IMAGES) <= tags

    pod = _run_pod(
        bed,
        "counter",
        COUNTER_IMAGE,
        ["--interval-ms", "100", "--mem-mib", "8", "--state-file", "/tmp/count"],
    )
    log = Path(str(pod["log"]))
    _wait(lambda: len(_counts(log)) >= 3, what="three counter lines")
    first = _counts(log)
    assert first[:3] == [0, 1, 2]
    _wait(lambda: len(_counts(log)) > len(first), what="the counter's log to grow")
    assert "ready mem_mib=8" in log.read_text()

    # The pod got an address of the bed's subnet, on the bed's bridge.
    assert bed.subnet is not None and ipaddress.ip_address(str(pod["ip"])) in bed.subnet
    # The container lives in the kubelet-style cgroup parent.
    cgroups = Path(f"/proc/{pod['pid']}/cgroup").read_text()
    assert f"memory:{pod['cgroup_parent']}/{pod['cid']}" in cgroups
    # containerd's runc shim uses the bed's private runc root, suffixed with the namespace.
    assert (bed.runc_root / str(pod["cid"]) / "state.json").is_file()
    # The rootfs is writable (state file) and busybox works inside for ExecSync.
    r = rt.ExecSync(pb.ExecSyncRequest(container_id=pod["cid"], cmd=["cat", "/tmp/count"], timeout=10))
    assert r.exit_code == 0 and int(r.stdout) >= 2
    # SIGUSR1 makes the counter check its memory pattern.
    r = rt.ExecSync(pb.ExecSyncRequest(container_id=pod["cid"], cmd=["kill", "-USR1", "1"], timeout=10))
    assert r.exit_code == 0
    _wait(lambda: "verify ok mem_mib=8" in log.read_text(), what="verify line")

    bed.stop()
    _assert_nothing_left(bed, pod)


@pytest.mark.e2e
@NEEDS_ROOT
def test_stop_cleans_up_after_containerd_was_killed(private_bed: TestBed) -> None:
    bed = private_bed
    pod = _run_pod(bed, "orphan", BUSYBOX_IMAGE, ["sleep", "3600"])
    # A pod whose cgroup parent is outside the bed's subtree (a shared /podshim-test parent).
    outside = f"/podshim-test/pod{uuid.uuid4().hex[:16]}"
    other = _run_pod(bed, "outside", BUSYBOX_IMAGE, ["sleep", "3600"], cgroup_parent=outside)
    # A frozen container (as a checkpoint leaves it) and a containerd that died.
    set_freezer(f"{pod['cgroup_parent']}/{pod['cid']}", "FROZEN")
    assert bed.containerd_pid is not None
    os.kill(bed.containerd_pid, signal.SIGKILL)
    _wait(lambda: not bed.containerd_running, what="containerd to die")
    assert _sys.alive(int(str(pod["pid"]))), "the container outlives containerd (its shim holds it)"

    bed.stop()
    _assert_nothing_left(bed, pod)
    _assert_nothing_left(bed, other)
    assert not _sys.cgroup_dirs(outside), "the pod-level cgroup outside the bed is gone too"
    assert not _sys.cgroup_dirs(f"{outside}/{other['cid']}")


def _testbed_cli(state_dir: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`python -m testbed ...` with its own record dir: one "checkout" (a bed someone brought up
    with make up may be running beside it)."""
    env = {**os.environ, "PODSHIM_TESTBED_STATE_DIR": str(state_dir)}
    cmd = [sys.executable, "-m", "testbed", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def _env_lines(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines())


@pytest.mark.e2e
@NEEDS_ROOT
def test_cli_up_env_down(tmp_path: Path) -> None:
    state_dir = tmp_path / "testbed-state"
    base = Path(f"/run/podshim-testbed-cli-{uuid.uuid4().hex[:6]}")
    up = _testbed_cli(state_dir, "up", "--dir", str(base), "--no-podshim", "--no-mirror")
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.splitlines() == [
            f"PODSHIM_SOCKET={base}/podshim.sock",
            f"CONTAINERD_SOCKET={base}/containerd.sock",
            f"CHECKPOINT_ROOT={base}/checkpoints",
        ]
        desc = json.loads((state_dir / "default.json").read_text())["bed"]
        assert _sys.alive(desc["containerd_pid"]), "containerd keeps running after `up` returned"
        env = _testbed_cli(state_dir, "env")
        assert env.stdout == up.stdout
    finally:
        down = _testbed_cli(state_dir, "down")
    assert down.returncode == 0, down.stderr
    assert not base.exists() and not (state_dir / "default.json").exists()
    assert not _sys.alive(desc["containerd_pid"])
    assert not _sys.link_exists(desc["bridge"])


@pytest.mark.e2e
@NEEDS_ROOT
def test_two_checkouts_beds_side_by_side(tmp_path: Path) -> None:
    """`make up` in two checkouts (their own record dirs), each with podshim and its registry
    mirror: both run at once, each `env` names its own, and `down` in one leaves the other
    running."""
    checkouts = [tmp_path / "checkout-a", tmp_path / "checkout-b"]
    envs: list[dict[str, str]] = []
    try:
        for c in checkouts:
            up = _testbed_cli(c, "up")
            assert up.returncode == 0, up.stderr
            envs.append(_env_lines(up.stdout))
        a, b = envs
        for key in ("PODSHIM_SOCKET", "CONTAINERD_SOCKET", "CHECKPOINT_ROOT", "REGISTRY_MIRROR"):
            assert a[key] != b[key], key
        for c, e in zip(checkouts, envs, strict=True):
            assert _env_lines(_testbed_cli(c, "env").stdout) == e
            with CriClient(e["PODSHIM_SOCKET"]) as cli:
                cli.runtime.Version(_api()[0].VersionRequest(), timeout=10)
                assert (
                    cli.image_present("podshim/busybox:1") is False
                )  # the mirror serves, nothing pulled yet
        down = _testbed_cli(checkouts[0], "down")
        assert down.returncode == 0, down.stderr
        assert not Path(a["PODSHIM_SOCKET"]).exists()
        with CriClient(b["PODSHIM_SOCKET"]) as cli:  # the other checkout's bed is untouched
            cli.runtime.Version(_api()[0].VersionRequest(), timeout=10)
            pulled = cli.image.PullImage(
                _api()[0].PullImageRequest(
                    image=_api()[0].ImageSpec(image=f"{b['REGISTRY_MIRROR']}/podshim/busybox:1")
                ),
                timeout=60,
            )
            assert pulled.image_ref.startswith("sha256:")
    finally:
        for c in checkouts:
            _testbed_cli(c, "down")
    for e in envs:
        assert not Path(e["PODSHIM_SOCKET"]).parent.exists()


# ---------------------------------------------------------------------------- no root needed


def test_hand_encoded_request_matches_the_stubs() -> None:
    """The raw encoder (for requests the stubs refuse to build) writes what the stubs write."""
    pb, _ = _api()
    ref = pb.ImageStatusRequest(image=pb.ImageSpec(image=COUNTER_IMAGE)).SerializeToString()
    assert ref == field_bytes(1, field_str(1, COUNTER_IMAGE))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_images_build_is_deterministic_and_cached(tmp_path: Path) -> None:
    build = [sys.executable, str(REPO / "images" / "build.py")]
    for out in ("a", "b"):
        subprocess.run([*build, str(tmp_path / out)], check=True, capture_output=True, timeout=300)
    for name in ("pause.tar", "busybox.tar", "counter.tar"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    listing = json.loads((tmp_path / "a" / "images.json").read_text())
    assert [i["name"] for i in listing] == list(IMAGES)
    before = (tmp_path / "a" / "counter.tar").stat().st_mtime_ns
    subprocess.run([*build, str(tmp_path / "a")], check=True, capture_output=True, timeout=300)
    assert (tmp_path / "a" / "counter.tar").stat().st_mtime_ns == before, "unchanged inputs: no rebuild"


@pytest.mark.parametrize("unified", [False, True], ids=["v1-freezer", "cgroup2"])
def test_freezer_state_and_set_freezer_on_either_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unified: bool
) -> None:
    """The tests read and set a cgroup's freezer as the kernel shows it on a v1/hybrid host
    (freezer.state) and on a cgroup2-only one (cgroup.freeze asked, cgroup.events reached)."""
    from testbed import checks

    monkeypatch.setattr(checks, "UNIFIED", unified)
    monkeypatch.setattr(checks, "FREEZER", tmp_path)
    d = tmp_path / "pod" / "c"
    d.mkdir(parents=True)
    if unified:
        (d / "cgroup.freeze").write_text("0\n")
        (d / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    else:
        (d / "freezer.state").write_text("THAWED\n")
    assert checks.freezer_state("/pod/c") == "THAWED"
    checks.set_freezer("/pod/c", "FROZEN")
    if unified:
        assert (d / "cgroup.freeze").read_text() == "1"
        assert checks.freezer_state("/pod/c") == "FREEZING"  # asked, not reached yet
        (d / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    assert checks.freezer_state("/pod/c") == "FROZEN"
    checks.set_freezer("/pod/c", "THAWED")
    if unified:
        assert (d / "cgroup.freeze").read_text() == "0"
    else:
        assert checks.freezer_state("/pod/c") == "THAWED"


def test_the_tests_freezer_is_the_one_podshim_uses() -> None:
    """On this host the tests look where podshim freezes (shim/cgroups/freezer.py)."""
    from shim.cgroups import detect_hierarchy
    from testbed import checks

    assert checks.FREEZER == detect_hierarchy().root


def test_lacks_room_names_what_is_missing(tmp_path: Path) -> None:
    from testbed import checks

    assert checks.lacks_room(1, 1, tmp_path) is None
    assert "MiB of memory, this machine has" in (checks.lacks_room(1 << 40, 1, tmp_path) or "")
    assert f"free in {tmp_path}" in (checks.lacks_room(1, 1 << 40, tmp_path) or "")


@NEEDS_ROOT
def test_a_killed_runs_pod_cgroups_are_swept() -> None:
    """What a test run that was killed left in its pod cgroup root (here: a process, as a CRIU
    restore that no bed knew of) is killed and removed by the next bed's start; a live run's
    root is left alone."""
    from testbed import pods

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{_sys.POD_CGROUP_ROOT_PREFIX}{gone.pid}"
    mine = pods.CGROUP_ROOT  # this process is alive
    left = subprocess.Popen(["sleep", "300"])
    kept = subprocess.Popen(["sleep", "300"])
    try:
        for root, proc in ((stale, left), (mine, kept)):
            for h in _sys.cgroup_hierarchies():
                if h.name in ("freezer", "memory"):
                    d = h / root.strip("/") / "podx"
                    d.mkdir(parents=True)
                    (d / "cgroup.procs").write_text(str(proc.pid))
        (Path(_sys.cgroup_dirs(stale + "/podx")[0]) / "freezer.state").write_text("FROZEN")
        assert stale in _sys.sweep_stale_pod_roots()
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert not _sys.cgroup_dirs(stale)
        assert kept.poll() is None and _sys.cgroup_dirs(mine + "/podx")
    finally:
        for proc in (left, kept):
            proc.kill()
            proc.wait()
        _sys.remove_cgroup_tree(mine + "/podx")
        _sys.remove_cgroup_tree(stale)


def test_restore_via_create_is_an_option_of_a_2x_bed(tmp_path: Path) -> None:
    from testbed import bed_files

    def toml(version: str, on: bool) -> str:
        return bed_files.containerd_toml(
            version=version,
            runtimes=[("runc", tmp_path / "runc", tmp_path / "root")],
            container_annotations=["podshim.*"],
            runc_criu=None,
            root=tmp_path / "r",
            state=tmp_path / "s",
            socket=tmp_path / "c.sock",
            log_level="info",
            opt_dir=tmp_path / "opt",
            cni_conf_dir=tmp_path / "cni",
            pause_image="localhost/podshim/pause:1",
            registry_mirror=None,
            hosts_dir=tmp_path / "certs.d",
            restore_via_create=on,
        )

    key = "enable_experimental_restore_via_create"
    assert key not in toml("2.2", False)  # off by default: containerd 2.2's own default
    on = toml("2.2", True)
    # in the CRI runtime plugin's own table, where containerd 2.2 reads it
    runtime = on.split('[plugins."io.containerd.cri.v1.runtime"]\n', 1)[1].split("\n\n", 1)[0]
    assert f"{key} = true" in runtime
    with pytest.raises(ValueError, match="2.x only"):
        toml("1.6", True)
    with pytest.raises(TestBedError, match="no restore via CreateContainer"):
        TestBed(tmp_path / "bed", containerd="1.6", restore_via_create=True)
