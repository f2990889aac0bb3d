"""What every fault test needs: a podshim with failpoints armed in place of the bed's, the
checks after recovery (pod thawed and counting, no partial archive, no orphan sandbox,
container or mount, empty journal), and small process/cgroup utilities."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.archive import manifest as mf
from testbed import _sys, checks, criu_hold, pods, resume
from testbed.bed import VENV_BIN, TestBed
from testbed.checks import container_cgroup, freezer_state

Rt = api_pb2_grpc.RuntimeServiceStub
FAILPOINTS_ENV = "PODSHIM_FAILPOINTS"
CALL_TIMEOUT = 120.0
# holds the dump step (runc and CRIU ended, the pod still frozen: shim/criu/runtime.py) far longer
# than any deadline a test sets, so that the deadline runs out in the dump step on any machine,
# however fast it dumps; the sleep is awaited on the event loop, so the deadline cancels it. (A
# deadline while CRIU still dumps: podshim lets the dump finish first, tests/test_dump_given_up.py)
HOLD_DUMP = "checkpoint.dump-ended=sleep:600"
# the deadline of a call HOLD_DUMP makes outlast it: ample for CheckpointPod's checks (bounded by
# it), the files written before the freeze, the freeze (about 0.15 s here) and the dump of the
# tests' counters (runc and CRIU: 0.3-1.5 s here for 64-512 MiB, several times that at load 10)
HELD_DEADLINE = 10.0


# ---------------------------------------------------------------------------- podshim


def wait_serving(rt: Rt, timeout: float = 30.0) -> cri.VersionResponse:
    """Version through `rt`, waiting for the channel to (re)connect after a podshim restart."""
    return rt.Version(cri.VersionRequest(), timeout=timeout, wait_for_ready=True)


def wait_reaching_containerd(rt: Rt, timeout: float = 30.0) -> None:
    """Until both of podshim's ways to containerd are back after its restart: the front's
    (ListPodSandbox is passed through) and the daemon's (Version is podshim's own); each
    reconnects on its own backoff."""

    def reaching() -> bool:
        try:
            rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=2)
            rt.Version(cri.VersionRequest(), timeout=2)
            return True
        except grpc.RpcError:
            return False

    pods.wait_for(reaching, timeout, what="podshim reaching containerd again")


def fresh_rt(bed: TestBed) -> Rt:
    """A stub on a new channel to podshim (no reconnect backoff inherited from a dead podshim)."""
    return pods.stubs(bed.podshim_socket)[0]


class FailpointPodshim:
    """`podshim serve` with PODSHIM_FAILPOINTS=`spec`, in place of the bed's podshim: same config,
    socket and state dir, so the journal it writes is the one the bed's podshim replays.

    On exit the failpoint process is dead (SIGKILLed if still alive) and the bed's normal podshim
    runs again, whatever happened in between.
    """

    def __init__(self, bed: TestBed, spec: str, env: dict[str, str] | None = None) -> None:
        self.bed = bed
        self.spec = spec
        self.extra_env = env or {}  # e.g. criu_hold's preload for the runc/CRIU it starts
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = bed.log_dir / f"podshim-failpoint-{secrets.token_hex(3)}.log"

    def __enter__(self) -> FailpointPodshim:
        self.bed.kill_podshim()
        env = self.bed._env()
        env[FAILPOINTS_ENV] = self.spec
        env.update(self.extra_env)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(VENV_BIN / "podshim"), "serve", "--config", str(self.bed.podshim_config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.bed.base_dir,
                start_new_session=True,
            )
        rt = fresh_rt(self.bed)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"failpoint podshim exited at start:\n{self.log.read_text()[-2000:]}")
            try:
                rt.Version(cri.VersionRequest(), timeout=1)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return self

    @property
    def rt(self) -> Rt:
        return fresh_rt(self.bed)

    def wait_dead(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(15)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        self.kill()
        if not self.bed.podshim_running:
            self.bed.start_podshim_again()


def restart_podshim(bed: TestBed) -> None:
    """Start the bed's podshim (without failpoints) if it is not running: it replays the journal."""
    if not bed.podshim_running:
        bed.start_podshim_again()


# ---------------------------------------------------------------------------- state of the node


def journal_files(bed: TestBed) -> list[str]:
    return checks.journal_files(bed.podshim_state_dir)


def wait_journal_empty(bed: TestBed, timeout: float = 30.0) -> None:
    pods.wait_for(
        lambda: not journal_files(bed), timeout, what=f"an empty journal (left: {journal_files(bed)})"
    )


def sandbox_ids(rt: Rt) -> set[str]:
    return {p.id for p in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items}


def container_ids(rt: Rt) -> set[str]:
    return {c.id for c in rt.ListContainers(cri.ListContainersRequest()).containers}


def mounts_naming(bed: TestBed, ids: set[str]) -> list[str]:
    """Mount points under the bed dir that belong to one of `ids` (rootfs, shm, ...)."""
    return [
        m.mount_point for m in _sys.mounts_under(bed.base_dir) if any(i and i in m.mount_point for i in ids)
    ]


def processes_under(path: Path | str) -> list[int]:
    """Live processes whose argv names `path` or a path below it (CRIU's title), or that hold a
    file under it open (runc/crun checkpoint: podshim passes them its held directories as
    `/proc/self/fd/N`; CRIU, and a task it restores, hold the images)."""
    prefix = str(path).rstrip("/") + "/"
    out = []
    for pid in _sys.all_pids():
        if pid == os.getpid() or not _sys.alive(pid):
            continue
        argv = _sys.read_cmdline(pid)
        if any(a == str(path) or prefix in a for a in argv) or _sys.holds_open(pid, str(path)):
            out.append(pid)
    return out


def tree_listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@dataclass
class CounterPod:
    pod: pods.Pod
    cgroups: list[str]  # the pod's cgroup parent, then each container's

    @property
    def id(self) -> str:
        return self.pod.id

    def last_count(self, name: str = "counter") -> int:
        c = pods.counts(self.pod.log_path(name))
        return c[-1] if c else -1


@contextlib.contextmanager
def containerd_env(bed: TestBed, env: dict[str, str]) -> Iterator[None]:
    """containerd (so its shims and podshim-runc) restarted with `env`, and back without it."""
    saved = dict(bed.extra_env)

    def restart() -> None:
        bed.stop_containerd()
        bed.start_containerd()
        wait_reaching_containerd(pods.stubs(bed.podshim_socket)[0])

    bed.extra_env = {**saved, **env}
    try:
        restart()
        yield
    finally:
        bed.extra_env = saved
        restart()


def start_counter_pod(
    rt: Rt,
    bed: TestBed,
    name: str,
    cleanup: list[str],
    mem_mib: int = 8,
    containers: tuple[str, ...] = ("counter",),
    ready_timeout: float = 60.0,
) -> CounterPod:
    """A pod of counter containers (kubelet-like), running and counting."""
    args = ["--mem-mib", str(mem_mib), "--interval-ms", "100"]
    configs = {c: pods.container_config(c, args=list(args)) for c in containers}
    pod = pods.run_pod(rt, f"{name}-{secrets.token_hex(3)}", bed.pod_logs_dir, configs)
    cleanup.append(pod.id)
    for c in containers:
        pods.wait_count(pod.log_path(c), 2, timeout=ready_timeout)
    cgroups = [pod.config.linux.cgroup_parent, *(container_cgroup(rt, pod.containers[c]) for c in containers)]
    return CounterPod(pod, cgroups)


def new_output_dir(bed: TestBed, name: str, parent: Path | None = None) -> Path:
    d = (parent or Path(bed.checkpoint_root)) / f"{name}-{secrets.token_hex(4)}"
    d.mkdir(mode=0o700)
    return d


def checkpoint(rt: Rt, pod_id: str, out: Path, timeout: float = CALL_TIMEOUT, **fields: Any) -> None:
    """CheckpointPod of the pod's running containers, unless `fields` give container_ids."""
    rt.CheckpointPod(pods.checkpoint_request(rt, pod_id, out, **fields), timeout=timeout)


def assert_thawed_and_counting(rt: Rt, cp: CounterPod, names: tuple[str, ...] = ("counter",)) -> None:
    for cg in cp.cgroups:
        assert freezer_state(cg) == "THAWED", f"{cg} is {freezer_state(cg)}"
    st = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=cp.id)).status
    assert st.state == cri.SANDBOX_READY
    for n in names:
        cid = cp.pod.containers[n]
        state = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state
        assert state == cri.CONTAINER_RUNNING, f"{n}: {cri.ContainerState.Name(state)}"
        before = cp.last_count(n)
        pods.wait_count(cp.pod.log_path(n), before + 2, timeout=15)


def assert_empty_dir(d: Path) -> None:
    assert d.is_dir() and not d.is_symlink(), f"{d} was removed or replaced"
    left = tree_listing(d)
    assert left == [], f"partial archive left in {d}: {left[:10]}"


def assert_checkpoint_works(rt: Rt, bed: TestBed, cp: CounterPod, name: str = "next") -> Path:
    """The next CheckpointPod of the pod succeeds and its archive verifies; the pod runs on."""
    out = new_output_dir(bed, name)
    checkpoint(rt, cp.id, out)
    m = mf.load_and_verify(out, [str(bed.checkpoint_root)])
    assert {c.name for c in m.containers if c.checkpointed} == set(cp.pod.containers)
    assert_thawed_and_counting(rt, cp, tuple(cp.pod.containers))
    return out


@contextlib.contextmanager
def stopped_processes(pids: list[int]) -> Iterator[None]:
    """SIGSTOP `pids` for the duration of the block (SIGCONT after, even on failure)."""
    for p in pids:
        _sys.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in pids:
            _sys.kill(p, signal.SIGCONT)


# ---------------------------------------------------------------------------- restore


@dataclass
class Archive:
    path: Path
    containers: list[cri.ContainerConfig]  # the configs a kubelet sends to restore it
    first: dict[str, int] = field(default_factory=dict)  # the count each prints first (resume.py)


def take_archive(rt: Rt, bed: TestBed, name: str, containers: tuple[str, ...], created: list[str]) -> Archive:
    """A counter pod (8 MiB per container) and its CheckpointPod archive."""
    cp = start_counter_pod(rt, bed, name, created, mem_mib=8, containers=containers)

    def take() -> Path:
        out = new_output_dir(bed, name)
        checkpoint(rt, cp.id, out)
        return out

    out, first = resume.checkpoint_exactly(take, {c: cp.pod.log_path(c) for c in containers})
    configs = [pods.container_config(c, args=["--mem-mib", "8", "--interval-ms", "100"]) for c in containers]
    return Archive(out, configs, first)


def restore(
    rt: Rt, archive: Archive, config: cri.PodSandboxConfig, options: dict[str, str] | None = None
) -> cri.RestorePodResponse:
    return rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(archive.path),
            config=config,
            container_configs=archive.containers,
            options=options or {},
        ),
        timeout=CALL_TIMEOUT,
    )


def sandboxes_named(rt: Rt, name: str) -> list[str]:
    f = cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.name": name})
    return [p.id for p in rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=f)).items]


def remove_cgroup_parent(config: cri.PodSandboxConfig) -> None:
    """The pod-level cgroup is the kubelet's to remove (containerd leaves it) once it is empty."""
    for d in _sys.cgroup_dirs(config.linux.cgroup_parent):
        with contextlib.suppress(OSError):
            d.rmdir()


@dataclass
class NodeState:
    """What a failed or interrupted operation must leave as it found: sandboxes, containers,
    mounts under the bed, the runtime's state dirs, the journal."""

    sandboxes: set[str]
    containers: set[str]
    mounts: set[str]
    runc_state: set[str]
    journal: list[str]

    @classmethod
    def take(cls, rt: Rt, bed: TestBed) -> NodeState:
        try:
            runc_state = set(os.listdir(bed.runc_root))
        except FileNotFoundError:
            runc_state = set()
        return cls(
            sandboxes=sandbox_ids(rt),
            containers=container_ids(rt),
            mounts={m.mount_point for m in _sys.mounts_under(bed.base_dir)},
            runc_state=runc_state,
            journal=journal_files(bed),
        )


# ---------------------------------------------------------------------------- background calls


class Call(threading.Thread):
    """CheckpointPod in the background; `error` is the RpcError or None once joined."""

    def __init__(self, rt: Rt, pod_id: str, out: Path) -> None:
        super().__init__(daemon=True)
        self.rt, self.pod_id, self.out = rt, pod_id, out
        self.error: grpc.RpcError | None = None
        self.seconds = 0.0

    def run(self) -> None:
        start = time.monotonic()
        try:
            checkpoint(self.rt, self.pod_id, self.out, timeout=120)
        except grpc.RpcError as e:
            self.error = e
        self.seconds = time.monotonic() - start


HOLD_WAIT = 60.0  # for CRIU to reach its hold (runc's and CRIU's start, the first pages)


@contextlib.contextmanager
def held_podshim(bed: TestBed, hold_dir: Path) -> Iterator[tuple[FailpointPodshim, criu_hold.CriuHold]]:
    """In place of the bed's podshim (same config, socket and journal), one whose runc's and
    crun's CRIU runs with criu_hold.so (armed by the caller); it and the hold. On the way out
    every held CRIU is let go, then the bed's podshim runs again."""
    hold = criu_hold.CriuHold(hold_dir, criu_hold.build(Path(bed.base_dir)))
    with FailpointPodshim(bed, "", env=hold.env()) as fp, hold:
        yield fp, hold


def held_criu(
    hold: criu_hold.CriuHold, task: int, running: Callable[[], bool], what: str = "mid-dump"
) -> int:
    """The CRIU held dumping `task` (once armed), disarmed for the dumps after it; the test fails
    if the call ends first."""
    end = time.monotonic() + HOLD_WAIT
    while True:
        try:
            criu = hold.wait_held([task], 0.2)[task]
            hold.disarm()
            return criu
        except TimeoutError:
            if not running() or time.monotonic() > end:
                hold.release_all()
                pytest.fail(f"CRIU was not held {what} (the checkpoint ended first or never dumped)")


def counter_task(rt: Rt, cp: CounterPod) -> int:
    """The pid of the counter pod's counter process."""
    return int(checks.verbose_info(rt, cp.pod.containers["counter"])["pid"])
