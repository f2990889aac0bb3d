"""podshim checks its own wiring (docs/design/runtime-wrapper.md (Wiring check)).

Unit tests of the pure parts (containerd's filepath.Match, the verdict from a verbose Status,
the restore marker, the persisted ids), then end to end: test beds whose containerd is wired
wrong (plain runc as BinaryName; podshim's annotations not passed) refuse every restore with
FAILED_PRECONDITION naming the handler and the key, leave nothing behind, warn at start-up and
set podshim_wiring_ok to 0; a bed whose BinaryName looks like podshim-runc but skips the restore
is caught after StartContainer by the missing marker (the container is stopped and removed).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.checks import wiring
from shim.contract import RESTORE_ANNOTATION, RESTORED_MARKER
from shim.deadlines import PASSTHROUGH_DEADLINE_MARGIN
from testbed import _sys, pods
from testbed.bed import TestBed
from testbed.versions import real_runc

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 120

# ---------------------------------------------------------------------------- unit


@pytest.mark.parametrize(
    "pattern,name,want",
    [
        ("podshim.*", RESTORE_ANNOTATION, True),
        ("podshim.*", "podshim.restore.criu-options", True),
        ("*", RESTORE_ANNOTATION, True),
        ("podshim.restore.*", RESTORE_ANNOTATION, True),
        ("podshim.restore.checkpoint-?ir", RESTORE_ANNOTATION, True),
        ("podshim.[a-r]estore.*", RESTORE_ANNOTATION, True),
        ("podshim.[^r]estore.*", RESTORE_ANNOTATION, False),
        ("podshim\\.*", RESTORE_ANNOTATION, True),
        ("podshim/*", RESTORE_ANNOTATION, False),
        ("*", "a/b", False),  # Go's `*` never crosses a `/` (fnmatch's does)
        ("a/*", "a/b", True),
        ("io.kubernetes.*", RESTORE_ANNOTATION, False),
        ("podshim.[", RESTORE_ANNOTATION, False),  # malformed: matches nothing
        ("", RESTORE_ANNOTATION, False),
    ],
)
def test_go_match(pattern: str, name: str, want: bool) -> None:
    assert wiring.go_match(pattern, name) is want


def status_info(runtimes: dict[str, object], default: str = "runc") -> dict[str, str]:
    """A verbose Status info as containerd 1.6 (and, in this part, 1.7/2.x) reports it."""
    return {
        "config": json.dumps({"containerd": {"defaultRuntimeName": default, "runtimes": runtimes}}),
        "golang": '"go1.19.8"',
    }


def runtime(binary: str | None, annotations: list[str] | None, rtype: str = "io.containerd.runc.v2") -> dict:
    return {
        "runtimeType": rtype,
        "ContainerAnnotations": annotations,
        "PodAnnotations": None,
        "options": None if binary is None else {"BinaryName": binary, "Root": "/run/x"},
    }


def test_judge_ok_and_default_handler() -> None:
    info = status_info({"runc": runtime("/usr/local/bin/podshim-runc", ["podshim.*"])})
    w = wiring.judge(info, "", 1)
    assert (w.handler, w.verdict, w.binary) == ("runc", wiring.Verdict.OK, "/usr/local/bin/podshim-runc")
    assert wiring.judge(info, "runc", 2).verdict is wiring.Verdict.OK


def test_judge_plain_runc_names_handler_and_key() -> None:
    for binary in ("/usr/sbin/runc", "", None):
        w = wiring.judge(status_info({"runc": runtime(binary, ["podshim.*"])}), "", 1)
        assert w.verdict is wiring.Verdict.WRONG
        assert "'runc'" in w.problem and "not podshim-runc" in w.problem
        assert (
            '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options] BinaryName' in w.problem
        )
    w2 = wiring.judge(status_info({"runc": runtime("runc", ["podshim.*"])}), "runc", 2)
    assert (
        '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options] BinaryName' in w2.problem
    )


def test_judge_annotations_not_passed() -> None:
    for patterns in (None, [], ["io.kubernetes.cri.*"], ["podshim.restore.checkpoint-dir"]):
        w = wiring.judge(status_info({"runc": runtime("/opt/podshim-runc", patterns)}), "runc", 1)
        assert w.verdict is wiring.Verdict.WRONG, patterns
        assert "container_annotations" in w.problem and '["podshim.*"]' in w.problem
        assert "podshim.restore.criu-options" in w.problem


def test_judge_both_wrong_names_both() -> None:
    w = wiring.judge(status_info({"runc": runtime("/usr/sbin/runc", [])}), "runc", 1)
    assert "BinaryName" in w.problem and "container_annotations" in w.problem


def test_judge_unknown_handler_and_runtime_type() -> None:
    info = status_info(
        {"runc": runtime("/x/podshim-runc", ["podshim.*"]), "kata": runtime(None, [], "io.kata")}
    )
    w = wiring.judge(info, "crun", 1)
    assert w.verdict is wiring.Verdict.WRONG and "'crun' is not configured in the upstream" in w.problem
    assert "kata, runc" in w.problem
    w = wiring.judge(info, "kata", 1)
    assert w.verdict is wiring.Verdict.WRONG and "runtime_type 'io.kata'" in w.problem


@pytest.mark.parametrize(
    "info",
    [
        {},
        {"config": "not json"},
        {"config": json.dumps(["a list"])},
        {"config": json.dumps({"something": "else"})},  # e.g. another CRI runtime's config
        {"config": json.dumps({"containerd": {"runtimes": "odd"}})},
        {"config": json.dumps({"containerd": {"runtimes": {}}})},  # no default to resolve ""
        status_info({"runc": {"runtimeType": "io.containerd.runc.v2", "options": "odd"}}),
        status_info({"runc": {"options": {"BinaryName": "/x/podshim-runc"}, "ContainerAnnotations": "x"}}),
    ],
)
def test_judge_unknown_shapes_cannot_verify(info: dict[str, str]) -> None:
    w = wiring.judge(info, "", 0)
    assert w.verdict is wiring.Verdict.UNKNOWN and w.problem


def test_executes_podshim_runc(tmp_path: Path) -> None:
    assert wiring.executes_podshim_runc("/usr/local/bin/podshim-runc")
    assert wiring.executes_podshim_runc("/opt/x/podshim-runc-fast")
    assert not wiring.executes_podshim_runc("/usr/sbin/runc")
    assert not wiring.executes_podshim_runc("")
    link = tmp_path / "runc"
    link.symlink_to(tmp_path / "podshim-runc")  # installed under the runtime's usual name
    assert wiring.executes_podshim_runc(str(link))


def test_major_version() -> None:
    assert wiring.major_version("1.6.20~ds1") == 1
    assert wiring.major_version("v2.1.9") == 2
    assert wiring.major_version("") == 0


def test_marker_verdict(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "c1").mkdir(parents=True)
    assert wiring.marker_verdict([str(a), str(b)], "c1") is False  # state dir without the marker
    (a / "c1" / RESTORED_MARKER).write_text("x")
    assert wiring.marker_verdict(["", str(b), str(a)], "c1") is True
    assert wiring.marker_verdict([str(a), str(b)], "gone") is None  # no state dir: cannot tell


def test_restored_containers_persist(tmp_path: Path) -> None:
    r = wiring.RestoredContainers(str(tmp_path))
    assert r.lookup("abc") is None
    r.add("abc123")
    r.add("abd456")
    assert (r.lookup("abc123"), r.lookup("abc"), r.lookup("ab"), r.lookup("x")) == (
        "abc123",
        "abc123",
        None,
        None,
    )
    again = wiring.RestoredContainers(str(tmp_path))  # a restarted podshim
    again.load()
    assert again.ids == {"abc123", "abd456"}
    again.discard("abc123")
    assert sorted(os.listdir(tmp_path / wiring.RESTORED_DIR)) == ["abd456"]


# ---------------------------------------------------------------------------- end to end


@dataclass
class Archives:
    pod: Path  # a CheckpointPod archive of one counter
    tar: Path  # a CheckpointContainer tar of the same counter
    containers: list[cri.ContainerConfig]  # RestorePod's container configs


@pytest.fixture(scope="module")
def archives_src(bed: TestBed, rt: Stub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Archives]:
    """Checkpoints taken in the session bed (wired right), to be restored in the wrong ones. The
    container tar is podshim's own (an extra podshim with container_checkpoint = "always"), also
    where the upstream implements CheckpointContainer itself (containerd 2.x)."""
    log_root = Path(bed.base_dir) / "pod-logs"
    cc = pods.container_config("counter", args=["--mem-mib", "4", "--interval-ms", "50"])
    src = pods.run_pod(rt, f"wiring-src-{secrets.token_hex(2)}", log_root, {"counter": cc})
    out = Path(bed.checkpoint_root) / f"wiring-{secrets.token_hex(3)}"
    tar = Path(bed.checkpoint_root) / f"wiring-{secrets.token_hex(3)}.tar"
    try:
        pods.wait_count(src.log_path("counter"), 5)
        out.mkdir(mode=0o700)
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=src.id, container_ids=pods.running_ids(rt, src.id), output_path=str(out)
            ),
            timeout=RPC_TIMEOUT,
        )
        work = tmp_path_factory.mktemp("always")
        with bed.extra_podshim(work, checkpoint={"container_checkpoint": "always"}) as (sock, _log):
            pods.stubs(sock)[0].CheckpointContainer(
                cri.CheckpointContainerRequest(container_id=src.containers["counter"], location=str(tar)),
                timeout=RPC_TIMEOUT,
            )
        restore_cc = pods.container_config("counter", args=list(cc.args))
        yield Archives(out, tar, [restore_cc])
    finally:
        pods.remove_pod(rt, src.id)
        shutil.rmtree(out, ignore_errors=True)
        tar.unlink(missing_ok=True)


def copy_into(bed: TestBed, a: Archives) -> Archives:
    pod = Path(bed.checkpoint_root) / a.pod.name
    if not pod.exists():
        shutil.copytree(a.pod, pod)
        shutil.copy2(a.tar, Path(bed.checkpoint_root) / a.tar.name)
    return Archives(pod, Path(bed.checkpoint_root) / a.tar.name, a.containers)


def wrong_bed(**kw: object) -> Iterator[TestBed]:
    with TestBed(**kw) as b:  # type: ignore[arg-type]
        yield b


@pytest.fixture(scope="module")
def plain_runc_bed() -> Iterator[TestBed]:
    """The runc handler's BinaryName is the plain runc: restores cannot restore."""
    yield from wrong_bed(runc_binary=real_runc())


@pytest.fixture(scope="module")
def no_annotations_bed() -> Iterator[TestBed]:
    """podshim-runc as BinaryName, but containerd does not pass podshim's annotations to it."""
    yield from wrong_bed(container_annotations=["io.kubernetes.cri.*"])


@pytest.fixture(scope="module")
def skipping_bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestBed]:
    """A BinaryName named like podshim-runc that execs the plain runc (it never restores): the
    wiring check passes, only the marker check after StartContainer can tell."""
    d = tmp_path_factory.mktemp("skipping")
    os.chmod(d, 0o755)
    script = d / "podshim-runc-skips-restores"
    script.write_text(f'#!/bin/sh\nexec {real_runc()} "$@"\n')
    script.chmod(0o755)
    yield from wrong_bed(runc_binary=script)


@dataclass
class Seen:
    sandboxes: set[str]
    containers: set[str]
    runc_state: set[str]
    restored_ids: set[str]

    @classmethod
    def take(cls, rt: Stub, bed: TestBed) -> Seen:
        def listdir(d: Path) -> set[str]:
            try:
                return set(os.listdir(d))
            except FileNotFoundError:
                return set()

        return cls(
            {p.id for p in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items},
            {c.id for c in rt.ListContainers(cri.ListContainersRequest()).containers},
            listdir(Path(bed.runc_root)),
            listdir(Path(bed.podshim_state_dir) / wiring.RESTORED_DIR),
        )


def stub(b: TestBed) -> Stub:
    return pods.stubs(b.podshim_socket)[0]


def refused(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value


def restore_request(a: Archives, config: cri.PodSandboxConfig, start: bool = False) -> cri.RestorePodRequest:
    return cri.RestorePodRequest(
        checkpoint_path=str(a.pod),
        config=config,
        container_configs=a.containers,
        options={"start": "true"} if start else {},
    )


def from_tar_request(sandbox: pods.Pod, tar: Path, name: str = "imported") -> cri.CreateContainerRequest:
    cc = pods.container_config(name, image=str(tar), args=[])
    return cri.CreateContainerRequest(pod_sandbox_id=sandbox.id, config=cc, sandbox_config=sandbox.config)


def assert_refuses_restores(b: TestBed, src: Archives, *needles: str) -> None:
    """RestorePod and CreateContainer from a tar both answer FAILED_PRECONDITION with every
    needle in the message, and nothing is left behind."""
    rt = stub(b)
    a = copy_into(b, src)
    log_root = Path(b.base_dir) / "pod-logs"
    host = pods.run_pod(rt, f"host-{secrets.token_hex(2)}", log_root, {}, start=False)  # for the tar
    try:
        before = Seen.take(rt, b)
        config = pods.pod_config(f"wrong-{secrets.token_hex(2)}", log_root)
        for start in (False, True):
            req = restore_request(a, config, start)
            err = refused(lambda: rt.RestorePod(req, timeout=RPC_TIMEOUT))  # noqa: B023 - called at once
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
            for needle in ("RestorePod refused, nothing was created", *needles):
                assert needle in (err.details() or ""), (needle, err.details())
            assert Seen.take(rt, b) == before
        err = refused(lambda: rt.CreateContainer(from_tar_request(host, a.tar), timeout=RPC_TIMEOUT))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
        for needle in (f"restore from {a.tar} refused, nothing was created", *needles):
            assert needle in (err.details() or ""), (needle, err.details())
        assert Seen.take(rt, b) == before
        assert not _sys.cgroup_pids(config.linux.cgroup_parent)
        imports = Path(b.podshim_state_dir) / "imports"
        assert not imports.exists() or not os.listdir(imports), "an import dir was left"
    finally:
        pods.remove_pod(rt, host.id)


def section(b: TestBed) -> str:
    v3 = getattr(b, "containerd_version", "1.6").startswith("2.")
    return 'plugins."io.containerd.cri.v1.runtime"' if v3 else 'plugins."io.containerd.grpc.v1.cri"'


def startup_warning(b: TestBed) -> dict[str, str]:
    """podshim's start-up log line about the runc handler's wiring (waits for the check)."""

    def find() -> dict[str, str] | None:
        for line in b.podshim_log.read_text(errors="replace").splitlines():
            with_json = line[line.find("{") :] if "{" in line else ""
            try:
                rec = json.loads(with_json)
            except ValueError:
                continue
            if rec.get("event", "").startswith("runtime handler wired") and rec.get("handler") == "runc":
                return rec
        return None

    return pods.wait_for(find, timeout=30, what="the start-up wiring log line")


@pytest.mark.e2e
def test_plain_runc_binary_refuses_restores(plain_runc_bed: TestBed, archives_src: Archives) -> None:
    key = f"[{section(plain_runc_bed)}.containerd.runtimes.runc.options] BinaryName"
    assert_refuses_restores(
        plain_runc_bed, archives_src, "'runc'", f"runs {real_runc()}, not podshim-runc", key
    )
    rec = startup_warning(plain_runc_bed)
    assert rec["level"] == "warning" and "refused" in rec["event"], rec
    assert key in rec["problem"], rec


@pytest.mark.e2e
def test_annotations_not_passed_refuses_restores(no_annotations_bed: TestBed, archives_src: Archives) -> None:
    key = f'[{section(no_annotations_bed)}.containerd.runtimes.runc] container_annotations = ["podshim.*"]'
    assert_refuses_restores(
        no_annotations_bed, archives_src, "'runc'", "does not pass podshim's annotations", key
    )
    rec = startup_warning(no_annotations_bed)
    assert rec["level"] == "warning" and key in rec["problem"], rec


def scrape_gauge(port: int, handler: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f'podshim_wiring_ok{{handler="{handler}"}} '):
            return float(line.split()[-1])
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.e2e
@pytest.mark.parametrize("which,want", [("plain_runc_bed", 0.0), ("bed", 1.0)])
def test_wiring_gauge_at_startup(
    request: pytest.FixtureRequest, tmp_path: Path, which: str, want: float
) -> None:
    """podshim_wiring_ok{handler="runc"}: 0 on the bed wired wrong, 1 on the session bed."""
    b: TestBed = request.getfixturevalue(which)
    port = free_port()
    os.chmod(tmp_path, 0o755)
    with b.extra_podshim(tmp_path, server={"metrics_address": f"127.0.0.1:{port}"}):

        def gauge() -> float | None:
            try:
                return scrape_gauge(port, "runc")
            except OSError:
                return None

        got = pods.wait_for(lambda: (g := gauge()) is not None and [g], timeout=30, what="the gauge")
        assert got == [want]


@pytest.mark.e2e
def test_start_of_an_unrestored_container_fails_and_removes_it(
    skipping_bed: TestBed, archives_src: Archives
) -> None:
    """The wiring looks right (a BinaryName named podshim-runc…), the restore does not run: the
    StartContainer of each restored container fails FAILED_PRECONDITION saying the process was
    not restored, and the container is gone — through podshim's StartContainer, RestorePod's
    start=true, a container from a tar, and after a podshim restart."""
    b = skipping_bed
    rt = stub(b)
    a = copy_into(b, archives_src)
    log_root = Path(b.base_dir) / "pod-logs"
    # an ordinary pod starts as usual (StartContainer passes through)
    plain = pods.run_pod(rt, f"plain-{secrets.token_hex(2)}", log_root)
    pods.wait_count(plain.log_path("counter"), 2)
    made: list[str] = [plain.id]
    try:

        def expect_not_restored(call: object) -> None:
            err = refused(call)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
            message = err.details() or ""
            assert "its process was not restored from the checkpoint" in message, message
            assert "stopped and removed" in message and RESTORED_MARKER in message, message

        # 1. RestorePod returns the container CREATED; its StartContainer fails and removes it
        config = pods.pod_config(f"skip-{secrets.token_hex(2)}", log_root)
        resp = rt.RestorePod(restore_request(a, config), timeout=RPC_TIMEOUT)
        made.append(resp.pod_sandbox_id)
        (restored,) = resp.restored_containers
        assert (Path(b.podshim_state_dir) / wiring.RESTORED_DIR / restored.container_id).is_file()
        expect_not_restored(
            lambda: rt.StartContainer(
                cri.StartContainerRequest(container_id=restored.container_id), timeout=60
            )
        )
        left = rt.ListContainers(
            cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=resp.pod_sandbox_id))
        )
        assert list(left.containers) == [], "the unrestored container was not removed"
        assert restored.container_id not in os.listdir(b.runc_root)
        assert not (Path(b.podshim_state_dir) / wiring.RESTORED_DIR / restored.container_id).exists()

        # 2. RestorePod start=true: the whole new pod goes
        before = Seen.take(rt, b)
        config2 = pods.pod_config(f"skip-{secrets.token_hex(2)}", log_root)
        expect_not_restored(
            lambda: rt.RestorePod(restore_request(a, config2, start=True), timeout=RPC_TIMEOUT)
        )
        assert Seen.take(rt, b) == before

        # 3. from a container tar, with podshim restarted between create and start
        host = pods.run_pod(rt, f"host-{secrets.token_hex(2)}", log_root, {}, start=False)
        made.append(host.id)
        cid = rt.CreateContainer(from_tar_request(host, a.tar), timeout=RPC_TIMEOUT).container_id
        b.kill_podshim()
        b.start_podshim_again()
        rt = stub(b)
        expect_not_restored(
            lambda: rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
        )
        left = rt.ListContainers(
            cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=host.id))
        )
        assert list(left.containers) == []
        # the ordinary pod was never touched
        last = pods.counts(plain.log_path("counter"))[-1]
        pods.wait_count(plain.log_path("counter"), last + 1)
    finally:
        for pod_id in made:
            try:
                pods.remove_pod(rt, pod_id)
            except grpc.RpcError:
                pass
        time.sleep(0)


# ---------------------------------------------------------------------------- StartContainer routing


class _Aborted(Exception):
    pass


class _Context:
    code: grpc.StatusCode | None = None
    details = ""

    async def abort(self, code: grpc.StatusCode, details: str = "", *_: object) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)


class _Passthrough:
    """Counts the upstream calls StartContainer makes (all of them go through here)."""

    def __init__(self) -> None:
        self.forwarded: list[bytes] = []

    def unary(self, method: str, recover: object = None, code_for: object = None) -> object:
        async def forward(request: bytes, context: object) -> bytes:
            self.forwarded.append(request)
            return b""

        return forward


class _Engine:
    def __init__(self, pending: set[str], fails: bool = False) -> None:
        self.pending, self.fails = pending, fails
        self.lookups: list[str] = []
        self.confirmed: list[str] = []

    @property
    def restores_pending(self) -> bool:
        return bool(self.pending)

    def restored_id(self, container_id: str) -> str | None:
        self.lookups.append(container_id)
        return container_id if container_id in self.pending else None

    async def confirm_restored(self, container_id: str) -> None:
        self.confirmed.append(container_id)
        if self.fails:
            from shim.errors import FailedPrecondition

            raise FailedPrecondition("its process was not restored")


@pytest.mark.parametrize(
    ("pending", "asked", "fails", "lookups", "confirmed", "code"),
    [
        (set(), "c1", False, [], [], None),  # no restore pending: not even decoded
        ({"r1"}, "c1", False, ["c1"], [], None),  # another container: forwarded, nothing added
        ({"r1"}, "r1", False, ["r1"], ["r1"], None),  # a restored one: checked after the start
        ({"r1"}, "r1", True, ["r1"], ["r1"], grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
async def test_start_container_routing(
    pending: set[str],
    asked: str,
    fails: bool,
    lookups: list[str],
    confirmed: list[str],
    code: grpc.StatusCode | None,
) -> None:
    from shim.server.runtime import RuntimeHandlers

    upstream, engine, context = _Passthrough(), _Engine(pending, fails), _Context()
    handler = RuntimeHandlers(upstream, engine).handlers()[  # type: ignore[arg-type]
        "/runtime.v1.RuntimeService/StartContainer"
    ]
    raw = cri.StartContainerRequest(container_id=asked).SerializeToString()
    if code is None:
        await handler.unary_unary(raw, context)
    else:
        with pytest.raises(_Aborted):
            await handler.unary_unary(raw, context)
    assert upstream.forwarded == [raw]  # one upstream call, the caller's bytes unchanged
    assert (engine.lookups, engine.confirmed, context.code) == (lookups, confirmed, code)


class _FailingUpstream:
    """An upstream whose every unary call fails with `err` (for the real Passthrough)."""

    endpoint = "unix:///nonexistent/upstream.sock"

    def __init__(self, err: grpc.aio.AioRpcError) -> None:
        self.err = err
        self.timeouts: list[float | None] = []

    def raw_unary(self, method: str) -> object:
        async def call(request: bytes, timeout: float | None = None, metadata: object = None) -> bytes:
            self.timeouts.append(timeout)
            raise self.err

        return call


class _CallContext(_Context):
    def time_remaining(self) -> float:
        return 30.0

    def invocation_metadata(self) -> tuple[()]:
        return ()


@pytest.mark.parametrize(
    ("details", "code"),
    [
        # podshim-runc failed the create for a page image's checksum: podshim's documented code
        ("failed to create task: checksum mismatch of checkpoint/pages-1.img (…)", grpc.StatusCode.DATA_LOSS),
        ("failed to create task: CRIU restore failed", grpc.StatusCode.UNKNOWN),  # any other: the upstream's
    ],
)
async def test_start_of_a_restored_container_failed_for_a_page_image_is_data_loss(
    details: str, code: grpc.StatusCode
) -> None:
    """docs/design/restore-pod.md (RestorePod) step 4: the real passthrough of a restored container's
    StartContainer gives a page-image mismatch DATA_LOSS (same message), anything else unchanged."""
    from shim.server.proxy import Passthrough
    from shim.server.runtime import RuntimeHandlers
    from tests.fakes import rpc_error

    upstream = _FailingUpstream(rpc_error("UNKNOWN", details))
    context = _CallContext()
    handler = RuntimeHandlers(Passthrough(upstream), _Engine({"r1"})).handlers()[  # type: ignore[arg-type]
        "/runtime.v1.RuntimeService/StartContainer"
    ]
    with pytest.raises(_Aborted):
        await handler.unary_unary(cri.StartContainerRequest(container_id="r1").SerializeToString(), context)
    assert (context.code, context.details) == (code, details)
    # the caller's 30 s less the margin that lets the upstream's DEADLINE_EXCEEDED reach it first
    assert upstream.timeouts == [30.0 - PASSTHROUGH_DEADLINE_MARGIN]
