"""Live migration between two test nodes (docs/design/migration.md (Live migration)):
two beds whose podshims run in network namespaces of their own joined by a veth pair
(testbed/nodes.py), each with node credentials of one CA.

A counter pod migrates from A to B through CRI (RestorePod with `lazy-migration-from` on B,
CheckpointPod with `lazy-migration` on A, both at once) and through `podshim migrate`; its memory
pattern is verified on B. Then the failure matrix: B's podshim killed, A's podshim killed, the
link cut, and a deadline, each before B's containers run (held there by B's failpoint
`migration.before-ready`) and after (held before `done` by `migration.before-done`): before, A's
pod thaws and runs on and B keeps nothing; after, B's containers are killed (reason, metric) and
A's pod thaws only after B's last output. Never two copies at once, never none at the end, and
no sandbox, listener, mount or frozen cgroup left on either node.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from api.runtime.v1 import api_pb2 as cri
from shim.cgroups import FreezerState, default_freezer
from shim.migration import credentials, wire
from testbed import pods
from testbed.bed import VENV_BIN, TestBed
from testbed.nodes import Nodes, node_pair

pytestmark = pytest.mark.e2e

RPC_TIMEOUT = 300
SMALL = 64  # MiB: the failure matrix's counter
ENTRY_RE = re.compile(rb"count=(\d+) ts=(\d+\.\d+)")
FAILPOINTS = "PODSHIM_FAILPOINTS"
LEASE_AND_FENCE = 4.0  # MIGRATION_LEASE + MIGRATION_FENCE_MARGIN (shim/deadlines.py)


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    with node_pair() as n:
        yield n


def stub(bed: TestBed) -> Any:
    return pods.stubs(bed.podshim_socket)[0]


def entries(path: Path) -> list[tuple[int, float]]:
    try:
        return [(int(c), float(t)) for c, t in ENTRY_RE.findall(path.read_bytes())]
    except FileNotFoundError:
        return []


def set_failpoints(bed: TestBed, spec: str) -> None:
    """Restart the bed's podshim with PODSHIM_FAILPOINTS=spec ("" for none)."""
    if bed.extra_env.get(FAILPOINTS, "") == spec and bed.podshim_running:
        return
    if spec:
        bed.extra_env[FAILPOINTS] = spec
    else:
        bed.extra_env.pop(FAILPOINTS, None)
    if bed.podshim_running:
        bed.kill_podshim(signal.SIGTERM)
    bed.start_podshim_again()


def restart(bed: TestBed) -> None:
    """Start a killed podshim again, without failpoints (its recovery runs first)."""
    bed.extra_env.pop(FAILPOINTS, None)
    bed.start_podshim_again()


@dataclass
class Migration:
    nodes: Nodes
    source: pods.Pod
    mib: int
    dest_config: cri.PodSandboxConfig
    out: Path
    into: Path
    answers: dict[str, Any] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    def restore_request(self) -> cri.RestorePodRequest:
        """B's RestorePod of the migration."""
        return cri.RestorePodRequest(
            checkpoint_path=str(self.into),
            config=self.dest_config,
            container_configs=[counter_config(self.mib)],
            options={"lazy-migration-from": self.nodes.link.names[0]},
        )

    def start(self, a_timeout: float = RPC_TIMEOUT, b_timeout: float = RPC_TIMEOUT) -> Migration:
        n = self.nodes
        restore = self.restore_request()
        checkpoint = pods.checkpoint_request(
            stub(n.a), self.source.id, self.out, options={"lazy-migration": n.link.listen(1)}
        )

        def call(key: str, method: Any, req: Any, timeout: float) -> None:
            try:
                self.answers[key] = method(req, timeout=timeout)
            except grpc.RpcError as e:
                self.answers[key] = e
            self.answers[f"{key}_at"] = time.time()

        self.threads = [
            threading.Thread(target=call, args=("b", stub(n.b).RestorePod, restore, b_timeout)),
            threading.Thread(target=call, args=("a", stub(n.a).CheckpointPod, checkpoint, a_timeout)),
        ]
        for t in self.threads:
            t.start()
        return self

    def wait(self, timeout: float = RPC_TIMEOUT) -> Migration:
        for t in self.threads:
            t.join(timeout)
        return self

    def code(self, side: str) -> grpc.StatusCode:
        a = self.answers[side]
        return a.code() if isinstance(a, grpc.RpcError) else grpc.StatusCode.OK

    @property
    def dest_pod(self) -> pods.Pod:
        return pods.Pod("", self.dest_config, {})


def counter_config(mib: int) -> cri.ContainerConfig:
    return pods.container_config("counter", args=["--mem-mib", str(mib), "--interval-ms", "50"])


def start_source(n: Nodes, mib: int) -> Migration:
    tag = secrets.token_hex(3)
    src = pods.run_pod(
        stub(n.a), f"mig-{tag}", Path(n.a.base_dir) / "pod-logs", {"counter": counter_config(mib)}
    )
    pods.wait_count(src.log_path("counter"), 3, timeout=60 + mib / 50)
    out = Path(n.a.checkpoint_root) / f"out-{tag}"
    into = Path(n.b.checkpoint_root) / f"in-{tag}"
    out.mkdir(mode=0o700)
    into.mkdir(mode=0o700)
    config = pods.pod_config(f"mig-{tag}", Path(n.b.base_dir) / "pod-logs")
    return Migration(n, src, mib, config, out, into)


def restore_in_thread(
    n: Nodes, req: cri.RestorePodRequest, timeout: float
) -> tuple[dict[str, Any], threading.Thread]:
    """B's RestorePod in a thread; its answer (or RpcError) lands in the dict under "b"."""
    answers: dict[str, Any] = {}

    def call() -> None:
        try:
            answers["b"] = stub(n.b).RestorePod(req, timeout=timeout)
        except grpc.RpcError as e:
            answers["b"] = e

    t = threading.Thread(target=call)
    t.start()
    return answers, t


def dest_sandboxes(n: Nodes) -> list[str]:
    return [p.id for p in stub(n.b).ListPodSandbox(cri.ListPodSandboxRequest()).items]


def container_pid(rt: Any, cid: str) -> int:
    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True))
    return int(json.loads(st.info["info"])["pid"])


def frozen_cgroups(bed: TestBed) -> list[str]:
    f = default_freezer()
    out = []
    for d in Path(f.path(bed.cgroup_root)).rglob("*"):
        if d.is_dir():
            rel = "/" + str(d.relative_to(f.path("/")))
            with contextlib.suppress(Exception):
                if f.state(rel) is not FreezerState.THAWED:
                    out.append(rel)
    return out


@contextlib.contextmanager
def never_frozen(pod: pods.Pod, bed: TestBed) -> Iterator[None]:
    """The pod's cgroup is sampled (every millisecond) for as long as the block runs, and podshim's
    log read for a freeze of it: neither may show the pod frozen (a freeze for a dump lasts tens
    of milliseconds at least, the sampling cannot miss it)."""
    f = default_freezer()
    cgroup = pod.config.linux.cgroup_parent
    seen: set[FreezerState] = set()
    stop = threading.Event()
    mark = Path(bed.podshim_log).stat().st_size

    def sample() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                seen.add(f.state(cgroup))
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
    assert seen == {FreezerState.THAWED}, f"the pod's cgroup was seen {sorted(s.name for s in seen)}"
    with open(bed.podshim_log, "rb") as log:
        log.seek(mark)
        frozen = [ln for ln in log.read().splitlines() if b"pod frozen" in ln and pod.id.encode() in ln]
    assert not frozen, frozen


def wait_until(what: str, cond: Any, timeout: float = 60.0) -> Any:
    return pods.wait_for(cond, timeout=timeout, what=what)


def log_has(bed: TestBed, text: str) -> bool:
    return text in Path(bed.podshim_log).read_text(errors="replace")


def leftovers_report(n: Nodes) -> str:
    """What holds a pod or a port on the nodes: each namespace's listeners with their processes,
    and the runtime/CRIU processes of either bed (state, wchan, command line)."""
    lines = [
        f"node {'AB'[i]} listeners: {n.link.ns_run(i, 'ss', '-Hltnp', check=False).stdout.strip()}"
        for i in (0, 1)
    ]
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(str(bed.base_dir) in cmd for bed in (n.a, n.b)) and ("criu" in cmd or "runc" in cmd):
            with contextlib.suppress(OSError):
                wchan = Path(f"/proc/{p.info['pid']}/wchan").read_text()
                lines.append(f"{p.info['pid']} {p.info['status']} {wchan} {cmd[:300]}")
    return "\n".join(lines)


def assert_clean(n: Nodes, keep_b: frozenset[str] = frozenset()) -> None:
    """No listener in either node's namespace, no sandbox left on B (but `keep_b`), no frozen
    cgroup and no CRIU mount left on either node."""
    if n.link.listening(0) or n.link.listening(1):
        raise AssertionError(f"a listener is left:\n{leftovers_report(n)}")
    wait_until("B's sandboxes to go", lambda: set(dest_sandboxes(n)) <= keep_b or None, 60)
    for bed in (n.a, n.b):
        assert frozen_cgroups(bed) == [], bed.base_dir
        criu_mounts = [
            ln
            for ln in Path("/proc/self/mountinfo").read_text().splitlines()
            if str(bed.base_dir) in ln and ("criu" in ln or "podshim-restore" in ln)
        ]
        assert criu_mounts == [], criu_mounts


def assert_runs_on(m: Migration, after: float = 0.0) -> list[tuple[int, float]]:
    """A's counter runs on (its pod thawed): new lines after `after` (epoch seconds)."""
    path = m.source.log_path("counter")
    try:
        return wait_until(
            "A's counter to run on", lambda: [e for e in entries(path) if e[1] > after] or None, 30
        )
    except TimeoutError:
        _explain_not_running(m)
        raise


def _explain_not_running(m: Migration) -> None:
    """What a failure's report needs to tell a pod left frozen from one whose counter died or one
    a CRIU still holds: A's frozen cgroups, its containers' states and their processes' (traced
    by?), the listeners and runtime/CRIU processes left, the tails of A's podshim log (it holds
    every test's) and B's."""
    a = m.nodes.a
    with contextlib.suppress(Exception):
        print("A's frozen cgroups:", frozen_cgroups(a))
    with contextlib.suppress(Exception):
        listed = stub(a).ListContainers(
            cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=m.source.id))
        )
        states = [(c.metadata.name, cri.ContainerState.Name(c.state)) for c in listed.containers]
        print("A's containers:", states)
        for c in listed.containers:  # stopped, traced (by whom), frozen?
            with contextlib.suppress(Exception):
                status = Path(f"/proc/{container_pid(stub(a), c.id)}/status").read_text().splitlines()
                print(c.metadata.name, [ln for ln in status if ln.startswith(("State", "TracerPid"))])
    with contextlib.suppress(Exception):
        print(leftovers_report(m.nodes))
    print("A's podshim log, its tail:\n" + Path(a.podshim_log).read_text(errors="replace")[-8000:])
    print(
        "B's podshim log (this test's), its tail:\n"
        + Path(m.nodes.b.podshim_log).read_text(errors="replace")[-6000:]
    )


# ---------------------------------------------------------------------------- success


# Strangers at B's listener, from A's network namespace: once the port listens, 20 TCP connections
# that say nothing and 20 that send bytes that are no TLS ("wave" on stdout); a second such wave
# when a line comes on stdin, while the source connects; all held open until the process is ended.
STRANGERS = """
import os, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
held = []
def wave():
    for i in range(20):
        held.append(socket.create_connection((host, port), timeout=5))
        g = socket.create_connection((host, port), timeout=5)
        held.append(g)
        try:
            g.sendall(os.urandom(200))
        except OSError:
            pass
    print("wave", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    try:
        socket.create_connection((host, port), timeout=1).close()
        break
    except OSError:
        time.sleep(0.005)
wave()
sys.stdin.readline()
wave()
time.sleep(120)
"""


def migrate_timed(n: Nodes, m: Migration, listening: Callable[[], None]) -> tuple[float, dict[str, Any]]:
    """B's RestorePod, then (once `listening` returns) A's CheckpointPod: the seconds from A's
    call to both answers, and B's answer (under "b")."""
    answers, t = restore_in_thread(n, m.restore_request(), RPC_TIMEOUT)
    listening()
    started = time.monotonic()
    stub(n.a).CheckpointPod(
        pods.checkpoint_request(stub(n.a), m.source.id, m.out, options={"lazy-migration": n.link.listen(1)}),
        timeout=RPC_TIMEOUT,
    )
    t.join(RPC_TIMEOUT)
    took = time.monotonic() - started
    assert isinstance(answers["b"], cri.RestorePodResponse), answers["b"]
    return took, answers


def test_strangers_at_the_listener_neither_stall_nor_stop_a_migration(nodes: Nodes) -> None:
    """40 silent or garbage connections at B's listener before the source connects and 40 more
    while it does: the migration completes, its counter resumes exactly, every garbage client is
    refused (the listener handshakes side by side, each within a short bound). The same migration
    without strangers is timed first, for the figure printed beside it (not asserted: a time)."""
    n = nodes
    set_failpoints(n.a, "")
    set_failpoints(n.b, "")
    host, port = wire.split_address(n.link.listen(1))
    port_text = f":{port}"

    def b_listens() -> None:
        wait_until("B's listener", lambda: any(a.endswith(port_text) for a in n.link.listening(1)))

    alone = start_source(n, 64)
    took_alone, answered = migrate_timed(n, alone, b_listens)
    assert_clean(n, keep_b=frozenset({answered["b"].pod_sandbox_id}))
    pods.remove_pod(stub(n.b), answered["b"].pod_sandbox_id)

    m = start_source(n, 64)
    mark = Path(n.b.podshim_log).stat().st_size
    strangers = subprocess.Popen(
        ["nsenter", f"--net={n.link.netns(0)}", str(VENV_BIN / "python"), "-c", STRANGERS, host, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert strangers.stdin is not None and strangers.stdout is not None

    def strangers_in_place() -> None:
        assert strangers.stdout is not None and strangers.stdin is not None
        assert strangers.stdout.readline().strip() == "wave", "the strangers did not reach the listener"
        strangers.stdin.write("go\n")  # the second wave, while A connects
        strangers.stdin.flush()

    try:
        took, answers = migrate_timed(n, m, strangers_in_place)
    finally:
        strangers.kill()
        out, _ = strangers.communicate()
    waves = 1 + out.count("wave")
    a_entries = entries(m.source.log_path("counter"))
    b_log = Path(m.dest_config.log_directory) / "counter" / "0.log"
    b_entries = wait_until("B's counter", lambda: entries(b_log) or None)
    assert b_entries[0][0] == a_entries[-1][0] + 1, (a_entries[-3:], b_entries[:3])
    with open(n.b.podshim_log, "rb") as f:
        f.seek(mark)
        refused = f.read().count(b"migration listener: peer refused")
    print(
        f"\nmigration of 64 MiB alone {took_alone:.2f} s; with {waves * 40} strangers at the listener "
        f"{took:.2f} s ({took / took_alone:.2f} x), {refused} refused"
    )
    assert refused >= 20, refused
    dest = answers["b"].pod_sandbox_id
    assert_clean(n, keep_b=frozenset({dest}))
    pods.remove_pod(stub(n.b), dest)


@pytest.mark.parametrize("mib", [256, 1024, 4096])
def test_migrates_a_counter_with_its_memory(nodes: Nodes, mib: int) -> None:
    n = nodes
    set_failpoints(n.a, "")
    set_failpoints(n.b, "")
    m = start_source(n, mib).start().wait()
    assert m.code("b") == grpc.StatusCode.OK, m.answers["b"]
    assert m.code("a") == grpc.StatusCode.OK, m.answers["a"]
    resp = m.answers["b"]
    (restored,) = resp.restored_containers
    b_log = Path(m.dest_config.log_directory) / "counter" / "0.log"
    b_entries = wait_until("B's counter", lambda: entries(b_log) or None)
    a_entries = entries(m.source.log_path("counter"))
    # B continues where A stopped: no count lost, none repeated, and A printed nothing after. A is
    # killed frozen, so its log ends with the last line it wrote before the cut: B's first is the
    # next, exactly (a line A was frozen in the middle of is B's to write)
    assert b_entries[0][0] == a_entries[-1][0] + 1, (a_entries[-3:], b_entries[:3])
    b_entries = wait_until("B's counter", lambda: (e := entries(b_log)) and len(e) > 3 and e)
    assert [c for c, _ in b_entries[:4]] == list(range(b_entries[0][0], b_entries[0][0] + 4)), b_entries[:4]
    assert a_entries[-1][1] < b_entries[0][1]
    os.kill(container_pid(stub(n.b), restored.container_id), signal.SIGUSR1)
    verdict = wait_until(
        "the verify line", lambda: [ln for ln in b_log.read_text().splitlines() if "verify" in ln], 120
    )
    assert verdict[0].endswith(f"verify ok mem_mib={mib}"), verdict
    # A's pod: its containers removed, its sandbox stopped
    rt_a = stub(n.a)
    assert not rt_a.ListContainers(
        cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=m.source.id))
    ).containers
    assert (
        rt_a.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=m.source.id)).status.state
        == cri.SANDBOX_NOTREADY
    )
    timings = [
        json.loads(ln)
        for ln in Path(n.a.podshim_log).read_text().splitlines()
        if '"migration complete"' in ln
    ]
    print(
        f"{mib} MiB migration timings (s from the freeze):",
        {k: v for k, v in timings[-1].items() if isinstance(v, float)},
    )
    assert_clean(n, keep_b=frozenset({resp.pod_sandbox_id}))
    pods.remove_pod(stub(n.b), resp.pod_sandbox_id)
    pods.remove_pod(rt_a, m.source.id)
    # both copies of the archive hold no pages (the source served them): never restorable alone
    for node, archive in ((n.a, m.out), (n.b, m.into)):
        assert (archive / "manifest.json").exists()
        with pytest.raises(grpc.RpcError) as err:
            stub(node).RestorePod(
                cri.RestorePodRequest(
                    checkpoint_path=str(archive),
                    config=pods.pod_config(f"again-{secrets.token_hex(3)}", Path(node.base_dir) / "pod-logs"),
                    container_configs=[counter_config(mib)],
                ),
                timeout=60,
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert "live migration's archive" in (err.value.details() or "")


def test_podshim_migrate_drives_both_nodes(nodes: Nodes) -> None:
    n = nodes
    set_failpoints(n.a, "")
    set_failpoints(n.b, "")
    m = start_source(n, SMALL)
    res = subprocess.run(
        [
            str(VENV_BIN / "podshim"),
            "-r",
            str(n.a.podshim_socket),
            "-o",
            "json",
            "migrate",
            m.source.id,
            str(m.out),
        ]
        + ["--to", n.link.listen(1), "--to-endpoint", str(n.b.podshim_socket), "--from-name", n.link.names[0]]
        + ["--to-path", str(m.into), "--log-directory", m.dest_config.log_directory],
        capture_output=True,
        text=True,
        timeout=RPC_TIMEOUT,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["destination"] == n.link.listen(1) and [c["name"] for c in out["containers"]] == ["counter"]
    b_log = Path(m.dest_config.log_directory) / "counter" / "0.log"
    assert wait_until("B's counter", lambda: entries(b_log) or None)[0][0] > 0
    pods.remove_pod(stub(n.b), out["destinationPodSandboxId"])
    pods.remove_pod(stub(n.a), m.source.id)


# ---------------------------------------------------------------------------- refusals


def test_refused_by_the_precheck_before_anything_is_frozen(nodes: Nodes) -> None:
    """B is asked for an image it lacks: B refuses the offer, A answers FAILED_PRECONDITION
    without having frozen the pod (its counter never paused), B created and kept nothing."""
    n = nodes
    set_failpoints(n.a, "")
    set_failpoints(n.b, "")
    m = start_source(n, SMALL)
    cc = counter_config(SMALL)
    cc.image.image = "localhost/podshim/not-there:1"
    restore = cri.RestorePodRequest(
        checkpoint_path=str(m.into),
        config=m.dest_config,
        container_configs=[cc],
        options={"lazy-migration-from": n.link.names[0]},
    )
    with never_frozen(m.source, n.a):
        answers, t = restore_in_thread(n, restore, 60)
        with pytest.raises(grpc.RpcError) as err:
            stub(n.a).CheckpointPod(
                pods.checkpoint_request(
                    stub(n.a), m.source.id, m.out, options={"lazy-migration": n.link.listen(1)}
                ),
                timeout=60,
            )
        t.join(60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "not-there" in err.value.details() and "nothing was frozen" in err.value.details()
    assert answers["b"].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not list(m.into.iterdir()) and not list(m.out.iterdir())
    assert_clean(n)
    pods.remove_pod(stub(n.a), m.source.id)


def test_a_config_for_an_exited_container_is_refused_before_anything_is_frozen(nodes: Nodes) -> None:
    """A's pod has a completed init container (recorded, not dumped): a RestorePod naming it is
    refused by B's pre-check as RestorePod refuses it (INVALID_ARGUMENT, before A freezes: one
    CREATED container per config, none can stand for it); A answers FAILED_PRECONDITION, its
    counter never paused, B created and kept nothing."""
    n = nodes
    set_failpoints(n.a, "")
    set_failpoints(n.b, "")
    tag = secrets.token_hex(3)
    init = pods.container_config(
        "init", image=pods.BUSYBOX_IMAGE, command=["sh", "-c", "echo init-ran"], args=[]
    )
    configs = {"init": init, "counter": counter_config(SMALL)}
    src = pods.run_pod(stub(n.a), f"mig-init-{tag}", Path(n.a.base_dir) / "pod-logs", configs)
    pods.wait_for(
        lambda: (
            stub(n.a)
            .ContainerStatus(cri.ContainerStatusRequest(container_id=src.containers["init"]))
            .status.state
            == cri.CONTAINER_EXITED
        ),
        what="init to exit",
    )
    pods.wait_count(src.log_path("counter"), 3, timeout=60)
    out = Path(n.a.checkpoint_root) / f"out-{tag}"
    into = Path(n.b.checkpoint_root) / f"in-{tag}"
    out.mkdir(mode=0o700)
    into.mkdir(mode=0o700)
    restore = cri.RestorePodRequest(
        checkpoint_path=str(into),
        config=pods.pod_config(f"mig-init-{tag}", Path(n.b.base_dir) / "pod-logs"),
        container_configs=[init, configs["counter"]],
        options={"lazy-migration-from": n.link.names[0]},
    )
    with never_frozen(src, n.a):
        answers, t = restore_in_thread(n, restore, 60)
        with pytest.raises(grpc.RpcError) as err:
            stub(n.a).CheckpointPod(
                pods.checkpoint_request(stub(n.a), src.id, out, options={"lazy-migration": n.link.listen(1)}),
                timeout=60,
            )
        t.join(60)
    assert answers["b"].code() == grpc.StatusCode.INVALID_ARGUMENT, answers["b"]
    assert "init had exited when the pod was checkpointed" in answers["b"].details()
    assert "leave its config out" in answers["b"].details()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "init had exited" in err.value.details() and "nothing was frozen" in err.value.details()
    assert not list(into.iterdir()) and not list(out.iterdir())
    assert_clean(n)
    pods.remove_pod(stub(n.a), src.id)


def test_an_unauthenticated_peer_is_refused(nodes: Nodes) -> None:
    """While B listens for a migration: a client without a certificate, one of another CA and one
    of the CA naming another node are refused; nothing listens once B's RestorePod has ended."""
    n = nodes
    set_failpoints(n.b, "")
    into = Path(n.b.checkpoint_root) / f"in-{secrets.token_hex(3)}"
    into.mkdir(mode=0o700)
    restore = cri.RestorePodRequest(
        checkpoint_path=str(into),
        config=pods.pod_config("lonely", Path(n.b.base_dir) / "pod-logs"),
        container_configs=[counter_config(SMALL)],
        options={"lazy-migration-from": n.link.names[0]},
    )
    answers, t = restore_in_thread(n, restore, 12)
    wait_until("B to listen", lambda: n.link.listen(1) in n.link.listening(1) or None, 10)
    other = credentials.issue(Path(n.b.base_dir) / "other-ca", {n.link.names[0]: [n.link.address(0)]})
    cert, key = other[n.link.names[0]]
    impostor = credentials.NodeCredentials(
        str(cert), str(key), str(Path(n.b.base_dir) / "other-ca" / "ca.pem")
    )
    no_cert = ssl.create_default_context(cafile=str(n.pki / "ca.pem"))
    no_cert.check_hostname = False
    # node B's own credentials: a certificate of the CA that does not name node A
    wrong_name = credentials.NodeCredentials(
        str(n.pki / f"{n.link.names[1]}.pem"),
        str(n.pki / f"{n.link.names[1]}-key.pem"),
        str(n.pki / "ca.pem"),
    )

    def attempt(ctx: ssl.SSLContext) -> None:
        cmd = _in_netns(n, 0)
        with cmd:
            s = wire.connect(n.link.listen(1), ctx, {"t": "control", "migration": "x"}, 5.0)
            if not s.recv(1):
                raise wire.LinkLost("closed by B")

    for ctx in (no_cert, impostor.client_context(), wrong_name.client_context()):
        with pytest.raises((ssl.SSLError, OSError, wire.LinkLost)):
            attempt(ctx)
    t.join(30)
    assert answers["b"].code() == grpc.StatusCode.DEADLINE_EXCEEDED, answers["b"]
    refusals = Path(n.b.podshim_log).read_text().count("migration listener: peer refused")
    assert refusals >= 3
    assert n.link.listening(1) == []
    assert not list(into.iterdir())


@contextlib.contextmanager
def _in_netns(n: Nodes, i: int) -> Iterator[None]:
    """This thread in node i's network namespace for the block (a client on node A)."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet = 0x40000000
    fd = os.open(str(n.link.netns(i)), os.O_RDONLY)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        yield
    finally:
        libc.setns(home, clone_newnet)
        os.close(fd)
        os.close(home)


# ---------------------------------------------------------------------------- failures


HOLDS = {
    "before": "migration.before-ready",  # B holds its created pod, before the containers run
    "after": "migration.before-done",  # B's containers run; it holds its `done`
}


def _hold(n: Nodes, when: str) -> str:
    """B's failpoint spec: held until the failure ends the migration (B's hold watches the link,
    the source's abort and the lease), not for a time the failure must come within."""
    return f"{HOLDS[when]}=wait:{n.b.base_dir}/never-released"


def _reached(n: Nodes, m: Migration, when: str) -> bool:
    """Wait until the migration is held where the failpoint holds it (True), or has ended before
    it got there (False: A answered first)."""

    def state() -> str | None:
        if when == "before" and log_has(n.b, "migration: containers created"):
            return "held"
        if when == "after" and "b" in m.answers:
            assert m.code("b") == grpc.StatusCode.OK, m.answers["b"]
            return "held"
        return "ended" if "a" in m.answers else None

    return wait_until(f"the migration held {when} B runs", state, RPC_TIMEOUT) == "held"


def _deadline_while_held(n: Nodes, when: str) -> Migration:
    """A migration whose source's deadline passes while B is held. The deadline is a time, the
    hold an event: a deadline that came before the hold (a slow machine) is a failure at an
    earlier instant, whose outcome is asserted too (A runs on, B keeps nothing); then the
    migration is tried again with twice the time."""
    deadline = 20.0
    while True:
        m = start_source(n, SMALL)
        m.start(a_timeout=deadline)
        if _reached(n, m, when):
            return m
        m.wait()
        assert m.code("a") == grpc.StatusCode.DEADLINE_EXCEEDED, m.answers["a"]
        assert_runs_on(m)
        assert_clean(n)
        pods.remove_pod(stub(n.a), m.source.id)
        deadline *= 2
        assert deadline < RPC_TIMEOUT, "the migration never got to B's hold"


def _b_last(m: Migration) -> tuple[int, float] | None:
    got = entries(Path(m.dest_config.log_directory) / "counter" / "0.log")
    return got[-1] if got else None


def test_source_killed_while_its_dumps_serve_before_the_transfer(nodes: Nodes) -> None:
    """A's podshim dies after its dumps' page servers came up and it froze the pod again, before
    the archive went out (journal phase `frozen`): its recovery ends those dumps at once (their
    tasks are cured: a CRIU with a page server), not through stop_dump's wait for tasks in their
    ptrace-stop (they are frozen), and thaws the pod, whose counter runs on from where it was; B
    removes what it made."""
    n = nodes
    set_failpoints(n.a, "migration.before-transfer=kill")
    set_failpoints(n.b, "")
    Path(n.a.podshim_log).write_text("")  # this test's lines only
    m = start_source(n, SMALL)
    m.start()
    m.wait()
    assert m.code("a") != grpc.StatusCode.OK and m.code("b") != grpc.StatusCode.OK
    frozen_at = entries(m.source.log_path("counter"))[-1]
    restart(n.a)
    resumed = assert_runs_on(m, after=frozen_at[1])
    assert resumed[0][0] == frozen_at[0] + 1, (frozen_at, resumed[0])  # the same process, not a restart
    assert not log_has(n.a, "runs CRIU's code in the container's tasks")  # stop_dump's wait: not taken
    leftovers = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(str(m.out) in a for a in p.info["cmdline"] or [])
    ]
    assert leftovers == []
    # recovery clears the partial archive right after the thaw
    try:
        wait_until("A's partial archive to go", lambda: not list(m.out.iterdir()) or None, 30)
    except TimeoutError:
        print("DEBUGLOG", Path(n.a.podshim_log).read_text()[-6000:])
        raise
    assert not list(m.into.iterdir())
    assert_clean(n)
    pods.remove_pod(stub(n.a), m.source.id)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("failure", ["b-killed", "a-killed", "link-cut", "deadline"])
def test_failure(nodes: Nodes, failure: str, when: str) -> None:
    n = nodes
    set_failpoints(n.a, "")
    set_failpoints(n.b, _hold(n, when))
    Path(n.b.podshim_log).write_text("")  # this test's lines only
    if failure == "deadline":
        m = _deadline_while_held(n, when)
    else:
        m = start_source(n, SMALL).start()
        assert _reached(n, m, when)
    frozen_at = entries(m.source.log_path("counter"))[-1][1]
    failed_at = time.time()
    if failure == "b-killed":
        n.b.kill_podshim()
    elif failure == "a-killed":
        n.a.kill_podshim()
    elif failure == "link-cut":
        n.link.cut()
    m.wait()
    if failure == "link-cut":
        n.link.mend()
    if failure == "a-killed":
        restart(n.a)  # its recovery thaws the pod (after the lease when B may have run)
    if failure == "b-killed":
        restart(n.b)  # its recovery removes the new pod
    # A's pod runs on, after B's last output
    b_last = _b_last(m)
    resumed = assert_runs_on(m, after=frozen_at)
    if when == "after":
        # (B may have printed nothing: cut off from A, its first missing page blocks it)
        if b_last is not None:
            assert resumed[0][1] > b_last[1], f"A ran again ({resumed[0]}) before B's copy stopped ({b_last})"
        if failure != "deadline":  # A waits out B's lease after the failure, whatever B did
            assert resumed[0][1] - failed_at >= LEASE_AND_FENCE - 0.5, (resumed[0], failed_at)
        assert not log_has(n.b, "migration complete")
        if failure != "b-killed":  # B's podshim killed its containers with the reason (else its guard)
            wait_until("B's reason", lambda: log_has(n.b, "failed after the containers ran") or None, 30)
    else:
        assert b_last is None, "B's containers ran before `go`"
    if failure != "a-killed":
        assert m.code("a") != grpc.StatusCode.OK
    assert_clean(n)
    pods.remove_pod(stub(n.a), m.source.id)
