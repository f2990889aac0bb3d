"""A restored pod is the pod that was checkpointed, end to end on the real containerd,
runc/crun and CRIU: the new pod keeps its own identity (hostname, domain name), periodic timers
keep firing, and more. Each test runs with runc and with crun (the `runtime_handler` fixture).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.archive import manifest
from testbed import _sys, pods, resume
from testbed.bed import TestBed

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 120
SMALL_ARGS = ["--mem-mib", "4", "--interval-ms", "50"]
TICKS_RE = re.compile(rb"ticks tfd=(\d+) tfd100=(\d+) posix=(\d+) itimer=(\d+) ts=(\d+\.\d+)")


# ---------------------------------------------------------------------------- helpers


@pytest.fixture
def out_dirs(bed: TestBed) -> Iterator[list[Path]]:
    """Checkpoint directories made by a test; removed after it."""
    made: list[Path] = []
    yield made
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def new_out(bed: TestBed, tag: str, made: list[Path]) -> Path:
    out = Path(bed.checkpoint_root) / f"{tag}-{secrets.token_hex(3)}"
    out.mkdir(mode=0o700)
    made.append(out)
    return out


def checkpoint(rt: Stub, pod_id: str, out: Path, options: dict[str, str] | None = None) -> None:
    rt.CheckpointPod(
        pods.checkpoint_request(rt, pod_id, out, options=options or {}),
        timeout=RPC_TIMEOUT,
    )


def restore_and_start(
    rt: Stub,
    path: Path,
    config: cri.PodSandboxConfig,
    containers: list[cri.ContainerConfig],
    runtime_handler: str,
    cleanup: list[str],
) -> cri.RestorePodResponse:
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(path),
            config=config,
            container_configs=containers,
            runtime_handler=runtime_handler,
        ),
        timeout=RPC_TIMEOUT,
    )
    cleanup.append(resp.pod_sandbox_id)
    for c in resp.restored_containers:
        rt.StartContainer(cri.StartContainerRequest(container_id=c.container_id), timeout=RPC_TIMEOUT)
    return resp


def sandbox_pid(rt: Stub, pod_id: str) -> int:
    st = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True))
    pid = int(json.loads(st.info["info"])["pid"])
    assert pid > 0, f"sandbox {pod_id[:13]} has no pid"
    return pid


def container_pid(rt: Stub, cid: str) -> int:
    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True))
    pid = int(json.loads(st.info["info"])["pid"])
    assert pid > 0, f"container {cid[:13]} has no pid"
    return pid


def uts_of_pid(pid: int) -> tuple[str, str]:
    """(hostname, domain name) of the UTS namespace `pid` lives in, read from inside it."""
    out = subprocess.run(
        ["nsenter", "-t", str(pid), "-u", "cat", "/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    return out[0], out[1]


def uts_in_container(rt: Stub, cid: str) -> tuple[str, str]:
    """(hostname, domain name) as the container's own processes see them (an exec inside it)."""
    cmd = ["cat", "/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname"]
    r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=10))
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.decode().split("\n")
    return lines[0], lines[1]


def set_domainname(pid: int, name: str) -> None:
    subprocess.run(
        ["nsenter", "-t", str(pid), "-u", "sh", "-c", f"echo {name} > /proc/sys/kernel/domainname"],
        check=True,
    )


def ticks(log_path: Path) -> list[tuple[int, int, int, int, float]]:
    """(timerfd, 100 ms timerfd, POSIX timer, itimer, ts) of every ticker line in a CRI log."""
    try:
        raw = log_path.read_bytes()
    except FileNotFoundError:
        return []
    return [(int(a), int(b), int(c), int(d), float(t)) for a, b, c, d, t in TICKS_RE.findall(raw)]


# ---------------------------------------------------------------------------- 1. identity


def test_restored_pod_keeps_its_own_hostname_and_domainname(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str, out_dirs: list[Path]
) -> None:
    """CRIU restores the dumped UTS state: it must not land in the new pod's UTS namespace, which
    the restored container only joins (the pause container owns it)."""
    tag = f"uts-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    cc = pods.container_config("app", args=SMALL_ARGS)
    src = pods.run_pod(rt, f"{tag}-src", log_root, {"app": cc}, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("app"), 3)
    set_domainname(sandbox_pid(rt, src.id), "source.example")
    assert uts_in_container(rt, src.containers["app"]) == (f"{tag}-src", "source.example")
    out = new_out(bed, tag, out_dirs)
    checkpoint(rt, src.id, out)

    config = pods.pod_config(f"{tag}-new", log_root)
    resp = restore_and_start(rt, out, config, [cc], runtime_handler, pod_cleanup)
    cid = resp.restored_containers[0].container_id
    pods.wait_for(lambda: pods.counts(Path(config.log_directory) / "app" / "0.log"), what="restored output")

    pause = uts_of_pid(sandbox_pid(rt, resp.pod_sandbox_id))
    restored = uts_of_pid(container_pid(rt, cid))
    inside = uts_in_container(rt, cid)
    assert pause[0] == f"{tag}-new", f"the new pod's pause container is named {pause[0]!r}"
    assert pause[1] != "source.example", "the new pod took the checkpointed pod's domain name"
    assert restored == pause and inside == pause, (restored, inside, pause)
    # the source pod is untouched
    assert uts_in_container(rt, src.containers["app"]) == (f"{tag}-src", "source.example")


# ---------------------------------------------------------------------------- 2. timers


def test_periodic_timers_keep_firing_after_restore(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str, out_dirs: list[Path]
) -> None:
    """A 5 ms timerfd (and a 100 ms one) that expired while the pod was frozen is dumped with no
    remaining time; restored, it must keep firing, as the POSIX timer and the itimer do."""
    tag = f"timers-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    cc = pods.container_config("ticker", command=["/ticker"], args=["--interval-ms", "5"])
    src = pods.run_pod(rt, f"{tag}-src", log_root, {"ticker": cc}, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    pods.wait_for(lambda: [t for t in ticks(src.log_path("ticker")) if t[0] >= 100], what="the ticker")
    out = new_out(bed, tag, out_dirs)
    checkpoint(rt, src.id, out)

    config = pods.pod_config(f"{tag}-new", log_root)
    restore_and_start(rt, out, config, [cc], runtime_handler, pod_cleanup)
    log_path = Path(config.log_directory) / "ticker" / "0.log"
    first = pods.wait_for(lambda: ticks(log_path), what="the restored ticker's output")[0]
    assert first[0] >= 100, f"the ticker started again instead of resuming: {first}"
    assert "ready" not in log_path.read_text(errors="replace"), "the restored ticker ran its start-up again"

    names = ("timerfd 5 ms", "timerfd 100 ms", "POSIX timer", "setitimer")
    wanted = (20, 3, 20, 20)  # expirations after the first restored line, each timer

    def advanced() -> bool:
        last = ticks(log_path)[-1]
        return all(last[i] - first[i] >= wanted[i] for i in range(4))

    try:
        pods.wait_for(advanced, timeout=15, what="every timer to keep firing")
    except TimeoutError:
        last = ticks(log_path)[-1]
        stopped = [names[i] for i in range(4) if last[i] - first[i] < wanted[i]]
        raise AssertionError(
            f"after the restore {', '.join(stopped)} stopped firing: first {first[:4]}, last {last[:4]} "
            f"({len(ticks(log_path))} lines)"
        ) from None


# ---------------------------------------------------------------------------- 3. shared state

# kind -> (container a's /sharer args, container b's, options, what the refusal names)
SHARED = {
    "sysv-shm": (["sysv", "5e1f"], ["sysv", "5e1f"], {}, "SysV shared memory segment key 0x5e1f"),
    "unix-stream": (["listen", "podshim-sk"], ["connect", "podshim-sk"], {}, "unix stream connection"),
    "unix-stream-ext": (
        ["listen", "podshim-sk"],
        ["connect", "podshim-sk"],
        {"ext-unix-sk": "true"},
        "unix stream connection",
    ),
}


def freezer_state(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if "freezer" in ctrls.split(","):
            return Path(f"/sys/fs/cgroup/freezer{path}/freezer.state").read_text().strip()
        if ctrls == "" and Path(f"/sys/fs/cgroup{path}/cgroup.freeze").exists():
            return (
                "FROZEN"
                if Path(f"/sys/fs/cgroup{path}/cgroup.freeze").read_text().strip() == "1"
                else "THAWED"
            )
    return "THAWED"


@pytest.mark.parametrize("kind", SHARED)
def test_state_shared_between_containers_is_refused_before_freezing(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    runtime_handler: str,
    out_dirs: list[Path],
    kind: str,
) -> None:
    """SysV shared memory in the pod's IPC namespace that two containers share, a unix stream
    connection between two containers: CheckpointPod refuses them up front (FAILED_PRECONDITION
    naming the object and the containers), leaving the pod running, unfrozen. (A POSIX segment
    in the pod's /dev/shm travels with the pod: tests/test_pod_volumes.py.)"""
    args_a, args_b, options, needle = SHARED[kind]
    tag = f"share-{kind}-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    containers = {
        "alpha": pods.container_config("alpha", command=["/sharer"], args=args_a),
        "beta": pods.container_config("beta", command=["/sharer"], args=args_b),
    }
    src = pods.run_pod(rt, tag, log_root, containers, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    for name in containers:
        log_path = src.log_path(name)
        pods.wait_for(lambda p=log_path: b"ready" in _read(p), what=f"{name} holding its state")
    out = new_out(bed, tag, out_dirs)
    with pytest.raises(grpc.RpcError) as err:
        checkpoint(rt, src.id, out, options)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    message = err.value.details()
    for part in (needle, "'alpha'", "'beta'", "nothing was frozen"):
        assert part in message, f"{part!r} not in {message!r}"
    assert list(out.iterdir()) == [], "the refused checkpoint wrote into output_path"
    for name, cid in src.containers.items():
        st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
        assert st.state == cri.CONTAINER_RUNNING, f"{name} is {cri.ContainerState.Name(st.state)}"
        assert freezer_state(container_pid(rt, cid)) == "THAWED"
        r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["true"], timeout=10))
        assert r.exit_code == 0, f"{name} does not answer after the refusal"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


# ---------------------------------------------------------------------------- 4. cgroups


def cgroup_leftovers(parent: str) -> list[str]:
    """Every cgroup directory left below the pod's cgroup parent, in any hierarchy."""
    left = []
    for top in _sys.cgroup_dirs(parent):
        for d, dirs, _ in os.walk(top):
            left.extend(str(Path(d, n)) for n in dirs)
    return sorted(left)


def test_failed_restore_leaves_no_cgroup(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str, out_dirs: list[Path]
) -> None:
    """A restore whose CRIU fails at StartContainer (a damaged memory image the manifest vouches
    for) leaves no cgroup behind once RestorePod removed its sandbox: crun's `.proxy-crun`
    cgroups (one per hierarchy, per container) and the container's own go too."""
    tag = f"cgleak-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    containers = {n: pods.container_config(n, args=SMALL_ARGS) for n in ("alpha", "beta")}
    src = pods.run_pod(rt, f"{tag}-src", log_root, containers, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    for n in containers:
        pods.wait_count(src.log_path(n), 3)
    out = new_out(bed, tag, out_dirs)
    checkpoint(rt, src.id, out)
    img = out / "containers/beta/checkpoint/pagemap-1.img"  # the second container fails
    raw = bytearray(img.read_bytes())
    raw[:8] = bytes(b ^ 0xFF for b in raw[:8])
    img.write_bytes(bytes(raw))
    manifest.write_manifest(out, manifest.read_manifest(out))

    config = pods.pod_config(f"{tag}-new", log_root)
    parent = config.linux.cgroup_parent
    try:
        with pytest.raises(grpc.RpcError) as err:
            resp = rt.RestorePod(
                cri.RestorePodRequest(
                    checkpoint_path=str(out),
                    config=config,
                    container_configs=list(containers.values()),
                    runtime_handler=runtime_handler,
                    options={"start": "true"},
                ),
                timeout=RPC_TIMEOUT,
            )
            pod_cleanup.append(resp.pod_sandbox_id)
        assert "pagemap-1.img" in err.value.details(), err.value.details()
        try:
            pods.wait_for(lambda: not cgroup_leftovers(parent), timeout=10, what="no cgroup left")
        except TimeoutError:
            raise AssertionError(f"the failed restore left cgroups: {cgroup_leftovers(parent)}") from None
    finally:
        for d in sorted(cgroup_leftovers(parent), key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        for d in _sys.cgroup_dirs(parent):
            with contextlib.suppress(OSError):
                d.rmdir()


# ---------------------------------------------------------------------------- 5. replicas


def test_concurrent_restores_of_one_archive(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str, out_dirs: list[Path]
) -> None:
    """Two RestorePod of one archive at the same time (replicas from one warm checkpoint): both
    succeed (restores only read the archive) and both counters resume from the checkpoint."""
    tag = f"replicas-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    cc = pods.container_config("app", args=["--mem-mib", "32", "--interval-ms", "50"])
    src = pods.run_pod(rt, f"{tag}-src", log_root, {"app": cc}, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("app"), 10)

    def take() -> Path:
        out = new_out(bed, tag, out_dirs)
        checkpoint(rt, src.id, out)
        return out

    out, first = resume.checkpoint_exactly(take, {"app": src.log_path("app")})

    configs = [pods.pod_config(f"{tag}-{i}", log_root) for i in range(2)]
    barrier = threading.Barrier(len(configs))

    def one(config: cri.PodSandboxConfig) -> cri.RestorePodResponse | grpc.RpcError:
        barrier.wait()
        try:
            return rt.RestorePod(
                cri.RestorePodRequest(
                    checkpoint_path=str(out),
                    config=config,
                    container_configs=[cc],
                    runtime_handler=runtime_handler,
                    options={"start": "true"},
                ),
                timeout=RPC_TIMEOUT,
            )
        except grpc.RpcError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
        results = list(pool.map(one, configs))
    pod_cleanup.extend(r.pod_sandbox_id for r in results if isinstance(r, cri.RestorePodResponse))
    failed = [f"{r.code().name}: {r.details()}" for r in results if isinstance(r, grpc.RpcError)]
    assert not failed, f"concurrent restores of one archive failed: {failed}"
    for config in configs:
        log_path = Path(config.log_directory) / "app" / "0.log"
        resume.assert_exact_resume({"app": log_path}, first, follow=5)  # each from the cut, counting on


# ---------------------------------------------------------------------------- 6. CRIU options


def test_deleted_open_file_over_a_mib_checkpoints_without_options(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    runtime_handler: str,
    out_dirs: list[Path],
    tmp_path: Path,
) -> None:
    """A deleted but open 2 MiB file (a rotated log held open), over CRIU's 1 MiB ghost-file
    limit: CheckpointPod without options (as the kubelet sends it) sizes ghost-limit before the
    freeze (docs/design/checkpoint-pod.md (What the kubelet sends)) and the restore has the file's
    content. Over the node's cap ([checkpoint] ghost_limit_max) it is FAILED_PRECONDITION before
    anything is frozen; an explicit ghost-limit too small fails in CRIU naming the option."""
    tag = f"ghost-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    script = (
        "dd if=/dev/zero of=/tmp/big bs=1024 count=2048 2>/dev/null && exec 3</tmp/big && rm /tmp/big "
        "&& echo ready && exec sleep 100000"
    )
    cc = pods.container_config("app", image=pods.BUSYBOX_IMAGE, command=["sh", "-c", script], args=[])
    src = pods.run_pod(rt, tag, log_root, {"app": cc}, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    pods.wait_for(lambda: b"ready" in _read(src.log_path("app")), what="the file held open")
    # an explicit ghost-limit too small: CRIU refuses, the message names the option and the size
    out = new_out(bed, f"{tag}-small", out_dirs)
    with pytest.raises(grpc.RpcError) as err:
        checkpoint(rt, src.id, out, {"ghost-limit": "1M"})
    assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
    assert "ghost-limit=2097152" in err.value.details(), err.value.details()
    assert list(out.iterdir()) == []
    assert freezer_state(container_pid(rt, src.containers["app"])) == "THAWED"

    out = new_out(bed, f"{tag}-yes", out_dirs)
    checkpoint(rt, src.id, out)  # no options
    assert json.loads((out / "manifest.json").read_text())["options"]["ghost-limit"] == str(3 << 20)
    config = pods.pod_config(f"{tag}-new", log_root)
    resp = restore_and_start(rt, out, config, [cc], runtime_handler, pod_cleanup)
    cid = resp.restored_containers[0].container_id
    r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["wc", "-c", "/proc/1/fd/3"], timeout=10))
    assert r.exit_code == 0 and r.stdout.split()[0] == b"2097152", (r.stdout, r.stderr)

    # a node that caps ghost files at 1 MiB refuses it before the freeze, naming file and key
    with bed.extra_podshim(tmp_path, checkpoint={"ghost_limit_max": "1M"}) as (socket, _log):
        capped = new_out(bed, f"{tag}-cap", out_dirs)
        with pytest.raises(grpc.RpcError) as err:
            checkpoint(pods.stubs(socket)[0], src.id, capped)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    for needle in ("/tmp/big", "2097152 bytes", "ghost_limit_max", "nothing was frozen"):
        assert needle in err.value.details(), err.value.details()
    assert list(capped.iterdir()) == []
    assert freezer_state(container_pid(rt, src.containers["app"])) == "THAWED"


def test_inotify_watch_in_rootfs_checkpoints_without_options(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str, out_dirs: list[Path]
) -> None:
    """An inotify watch on a file of the container's rootfs (overlayfs: CRIU cannot reopen it by
    handle): CheckpointPod without options finds the watched file's directory before the freeze
    and passes it to CRIU as irmap-scan-path; the restored watch still reports writes."""
    tag = f"inotify-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    script = "mkdir -p /data/deep && exec /sharer watch /data/deep/f"
    cc = pods.container_config("app", command=["sh", "-c", script], args=[])
    src = pods.run_pod(rt, tag, log_root, {"app": cc}, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    pods.wait_for(lambda: b"ready" in _read(src.log_path("app")), what="the watch")

    out = new_out(bed, f"{tag}-yes", out_dirs)
    checkpoint(rt, src.id, out)  # no options
    assert json.loads((out / "manifest.json").read_text())["options"]["irmap-scan-paths"] == "/data/deep"
    config = pods.pod_config(f"{tag}-new", log_root)
    resp = restore_and_start(rt, out, config, [cc], runtime_handler, pod_cleanup)
    cid = resp.restored_containers[0].container_id
    log_path = Path(config.log_directory) / "app" / "0.log"
    r = rt.ExecSync(
        cri.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo b >> /data/deep/f"], timeout=10)
    )
    assert r.exit_code == 0, r.stderr
    pods.wait_for(lambda: b"event " in _read(log_path), what="the restored watch to report the write")


def test_checkpoint_container_refuses_a_dev_shm_file_in_use(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """CheckpointContainer (KEP-2008) of a container holding a POSIX shared memory segment: the
    pod's /dev/shm is not in the checkpoint, so the refusal comes before the freeze."""
    tag = f"ccshm-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    cc = pods.container_config("alpha", command=["/sharer"], args=["posix", "podshim-seg"])
    src = pods.run_pod(rt, tag, log_root, {"alpha": cc}, runtime_handler=runtime_handler)
    pod_cleanup.append(src.id)
    pods.wait_for(lambda: b"ready" in _read(src.log_path("alpha")), what="the segment")
    location = Path(bed.checkpoint_root) / f"{tag}.tar"
    with pytest.raises(grpc.RpcError) as err:
        rt.CheckpointContainer(
            cri.CheckpointContainerRequest(container_id=src.containers["alpha"], location=str(location)),
            timeout=RPC_TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "/dev/shm/podshim-seg" in err.value.details() and "'alpha'" in err.value.details()
    assert not location.exists()
    assert freezer_state(container_pid(rt, src.containers["alpha"])) == "THAWED"
