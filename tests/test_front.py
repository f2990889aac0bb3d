"""podshim-front (native/front/), the compiled server of podshim's socket (docs/design/proxy.md
(The proxy)).

First the program alone, between two recording gRPC servers standing in for the upstream and the
daemon, so that what reaches each is seen: a method the daemon owns reaches the daemon and never
the upstream, every other CRI method the upstream and never the daemon; requests, metadata,
deadlines, statuses, trailers and streams pass unchanged; a caller that goes away cancels the
call behind it. Then with a real podshim and containerd: the front outlives a killed daemon and
the next daemon adopts it, the node's CRI survives repeated kills of either half, a front that
dies is started again within a bounded back-off, and `[server] front = false` serves as before.
tests/test_proxy.py and tests/test_metrics.py run through the front too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import threading
import time
import tomllib
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import __version__
from shim.config import RUNTIME_NAMES
from shim.deadlines import FRONT_RESTART_JITTER, FRONT_RESTART_MAX, PASSTHROUGH_DEADLINE_MARGIN
from shim.server.app import unary_methods
from shim.server.runtime import version_answer
from testbed import _sys, bed_files, checks, pods
from testbed.bed import TestBed

REPO = Path(__file__).resolve().parents[1]
FRONT = REPO / ".venv" / "bin" / "podshim-front"
RUNTIME = "/runtime.v1.RuntimeService/"
IMAGE = "/runtime.v1.ImageService/"
OWN = (RUNTIME + "Version", RUNTIME + "CheckpointPod")
DAEMON_SAYS_UPSTREAM_DOWN = (
    "podshim: upstream runtime at unix:///run/containerd/containerd.sock is unavailable (connection error: "
    'desc = "transport: Error while dialing: dial unix /run/containerd/containerd.sock: connect: no such '
    'file or directory")'
)


@dataclass
class Seen:
    method: str
    request: bytes
    metadata: dict[str, str]
    time_remaining: float | None


@dataclass
class Recorder(grpc.GenericRpcHandler):
    """A gRPC server that records every call and answers: Version with its own name; a
    ContainerStatus of "missing" with NOT_FOUND and a trailer; ExecSync after `hold` seconds
    (or when the caller is gone); GetContainerEvents with three messages, then waits for the
    caller to go; anything else with the request's bytes."""

    name: str
    calls: list[Seen] = field(default_factory=list)
    gone: threading.Event = field(default_factory=threading.Event)  # a held call was cancelled
    hold: float = 10.0
    version: bytes | None = None  # Version's answer; None: one naming this server

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.endswith("/GetContainerEvents"):
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: self.events(method, req, ctx))
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self.unary(method, req, ctx))

    def _record(self, method: str, request: bytes, ctx: grpc.ServicerContext) -> None:
        md = {m.key: m.value for m in ctx.invocation_metadata()}
        self.calls.append(Seen(method, request, md, ctx.time_remaining()))

    def unary(self, method: str, request: bytes, ctx: grpc.ServicerContext) -> bytes:
        self._record(method, request, ctx)
        if method.endswith("/Version"):
            if self.version is not None:
                return self.version
            return cri.VersionResponse(runtime_name=self.name).SerializeToString()
        if method.endswith("/ContainerStatus"):
            if cri.ContainerStatusRequest.FromString(request).container_id == "missing":
                ctx.set_trailing_metadata((("x-why", "no such container"),))
                ctx.abort(grpc.StatusCode.NOT_FOUND, f"{self.name}: container missing not found")
        if method.endswith("/CheckpointPod"):  # the daemon up, its upstream down: its own words
            ctx.abort(grpc.StatusCode.UNAVAILABLE, DAEMON_SAYS_UPSTREAM_DOWN)
        if method.endswith("/ExecSync"):
            ctx.add_callback(self.gone.set)
            end = time.monotonic() + self.hold
            while ctx.is_active() and time.monotonic() < end:
                time.sleep(0.02)
        return request

    def events(self, method: str, request: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        self._record(method, request, ctx)
        ctx.add_callback(self.gone.set)
        for i in range(3):
            yield cri.ContainerEventResponse(container_id=f"c{i}").SerializeToString()
        while ctx.is_active():
            time.sleep(0.02)

    def methods(self) -> list[str]:
        return [c.method for c in self.calls]


def serve(recorder: Recorder, path: Path) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((recorder,))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


@dataclass
class Front:
    proc: subprocess.Popen[bytes]
    socket: Path
    metrics_socket: Path
    upstream: Recorder
    daemon: Recorder
    daemon_server: grpc.Server

    def call(self, method: str, request: bytes = b"", **kw: Any) -> bytes:
        with grpc.insecure_channel(f"unix://{self.socket}") as ch:
            return ch.unary_unary(method)(request, **kw)  # type: ignore[no-any-return]


def start_front(
    tmp: Path, upstream: Path, daemon: Path, listen_fd: int | None = None, *extra: str
) -> subprocess.Popen[bytes]:
    """podshim-front on tmp/front.sock: bound by itself, or the socket inherited as listen_fd."""
    assert FRONT.exists(), f"{FRONT} is missing: run make setup"
    inherited = [] if listen_fd is None else [f"--listen-fd={listen_fd}"]
    proc = subprocess.Popen(
        [
            str(FRONT),
            f"--listen={tmp / 'front.sock'}",
            *inherited,
            f"--upstream=unix://{upstream}",
            f"--daemon={daemon}",
            f"--own={','.join(OWN)}",
            f"--unary={','.join(unary_methods())}",
            f"--metrics-socket={tmp / 'metrics.sock'}",
            "--grace=1s",
            f"--deadline-margin={PASSTHROUGH_DEADLINE_MARGIN}s",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=() if listen_fd is None else (listen_fd,),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    assert line == "ready", (
        f"{line!r}; stderr: {proc.stderr.read().decode() if proc.poll() is not None else ''}"
    )
    return proc


@contextlib.contextmanager
def running_front(tmp: Path, upstream: Recorder, daemon: Recorder, *extra: str) -> Iterator[Front]:
    """A front between `upstream` and `daemon`, each served in tmp; all three stopped after."""
    servers = [serve(upstream, tmp / "up.sock"), serve(daemon, tmp / "daemon.sock")]
    proc = start_front(tmp, tmp / "up.sock", tmp / "daemon.sock", None, *extra)
    try:
        yield Front(proc, tmp / "front.sock", tmp / "metrics.sock", upstream, daemon, servers[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        for s in servers:
            s.stop(0)


@pytest.fixture
def front(tmp_path: Path) -> Iterator[Front]:
    with running_front(tmp_path, Recorder("upstream"), Recorder("daemon")) as f:
        yield f


def test_owned_methods_reach_the_daemon_and_the_rest_never_does(front: Front) -> None:
    version = cri.VersionResponse.FromString(
        front.call(RUNTIME + "Version", cri.VersionRequest().SerializeToString())
    )
    assert version.runtime_name == "daemon"
    request = cri.ListContainersRequest(filter=cri.ContainerFilter(id="abc")).SerializeToString()
    passed = [
        RUNTIME + "ListContainers",
        RUNTIME + "ContainerStatus",
        RUNTIME + "ExecSync",
        IMAGE + "ListImages",
    ]
    for method in passed:
        front.upstream.hold = 0
        assert front.call(method, request, timeout=10) == request  # bytes through, unchanged both ways
    assert front.daemon.methods() == [RUNTIME + "Version"]
    assert front.upstream.methods() == passed
    assert all(c.request == request for c in front.upstream.calls)
    # a method newer than podshim's proto (not in --unary) is pumped, whatever its shape
    assert front.call(RUNTIME + "SomethingNewer", b"\x0a\x01x", timeout=10) == b"\x0a\x01x"
    assert front.upstream.methods()[-1] == RUNTIME + "SomethingNewer"
    with pytest.raises(grpc.RpcError) as err:  # not a CRI service: neither gets it
        front.call("/grpc.health.v1.Health/Check", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert len(front.daemon.calls) == 1 and len(front.upstream.calls) == len(passed) + 1


def test_metadata_and_deadline_reach_either_side(front: Front) -> None:
    md = (("x-trace", "t-1"),)
    front.call(RUNTIME + "Version", b"", metadata=md, timeout=7)
    front.call(RUNTIME + "ListPodSandbox", b"", metadata=md, timeout=7)
    for seen in (front.daemon.calls[-1], front.upstream.calls[-1]):
        assert seen.metadata.get("x-trace") == "t-1"
        # the hop keeps its margin and re-encodes the rest (grpc-timeout: 8 digits, rounded up)
        remaining = seen.time_remaining
        assert remaining is not None and 5 < remaining <= 7.05 - PASSTHROUGH_DEADLINE_MARGIN
    front.call(RUNTIME + "ListPodSandbox", b"")  # no deadline: none behind either
    remaining = front.upstream.calls[-1].time_remaining
    assert remaining is None or remaining > 1e9, remaining  # grpcio's sync server: "infinity"


def test_status_message_and_trailers_come_back_unchanged(front: Front) -> None:
    with grpc.insecure_channel(f"unix://{front.socket}") as ch:
        call = ch.unary_unary(RUNTIME + "ContainerStatus")
        with pytest.raises(grpc.RpcError) as err:
            call(cri.ContainerStatusRequest(container_id="missing").SerializeToString(), timeout=10)
    e: Any = err.value
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert e.details() == "upstream: container missing not found"
    assert ("x-why", "no such container") in tuple(e.trailing_metadata())


def test_the_daemons_own_unavailable_comes_back_unchanged(front: Front) -> None:
    """The daemon answers UNAVAILABLE because its upstream is down: its words reach the caller as
    they are, though they quote a transport error; only when the daemon itself cannot be reached
    does the front speak for it."""
    with pytest.raises(grpc.RpcError) as err:
        front.call(RUNTIME + "CheckpointPod", b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == DAEMON_SAYS_UPSTREAM_DOWN
    front.daemon_server.stop(0)
    with pytest.raises(grpc.RpcError) as err:
        front.call(RUNTIME + "CheckpointPod", b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    details = err.value.details() or ""
    assert details.startswith("podshim: its daemon at ") and "is unavailable" in details, details
    assert front.call(RUNTIME + "ListPodSandbox", b"x", timeout=10) == b"x"  # the upstream's calls pass on


def test_a_deadline_ends_the_call_behind_it(front: Front) -> None:
    front.upstream.hold = 30
    with pytest.raises(grpc.RpcError) as err:
        front.call(RUNTIME + "ExecSync", b"", timeout=0.5)
    # DEADLINE_EXCEEDED, never the CANCELLED of the stream reset the front's server sends at the
    # deadline: the front's own status (its upstream call ends PASSTHROUGH_DEADLINE_MARGIN before
    # the caller's deadline, "context deadline exceeded") or, on a machine slow enough that the
    # caller's timer fires within that margin, the caller's own ("Deadline Exceeded")
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    details = err.value.details() or ""
    assert "context deadline exceeded" in details or details == "Deadline Exceeded", details
    # the upstream's call ends with the caller's deadline, long before the 30 s it would hold
    assert front.upstream.gone.wait(20), "the upstream's call outlived the caller's deadline"


def test_streams_pass_and_a_cancel_reaches_the_upstream(front: Front) -> None:
    with grpc.insecure_channel(f"unix://{front.socket}") as ch:
        stream = ch.unary_stream(RUNTIME + "GetContainerEvents")(cri.GetEventsRequest().SerializeToString())
        got = [cri.ContainerEventResponse.FromString(next(stream)).container_id for _ in range(3)]
        assert got == ["c0", "c1", "c2"]
        assert not front.upstream.gone.is_set()
        stream.cancel()
        assert front.upstream.gone.wait(5), "the upstream stream outlived its caller"
    assert front.daemon.calls == []


def test_an_upstream_that_is_not_there_is_unavailable_naming_it(tmp_path: Path) -> None:
    daemon = Recorder("daemon")
    server = serve(daemon, tmp_path / "daemon.sock")
    proc = start_front(tmp_path, tmp_path / "absent.sock", tmp_path / "daemon.sock")
    try:
        with grpc.insecure_channel(f"unix://{tmp_path / 'front.sock'}") as ch:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                ch.unary_unary(RUNTIME + "ListContainers")(b"", timeout=10)
            assert time.monotonic() - start < 5, "fails fast"
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details() or ""
        assert "upstream runtime at" in details and str(tmp_path / "absent.sock") in details, details
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        server.stop(0)


def test_metrics_count_the_calls_passed_to_the_upstream(front: Front) -> None:
    for _ in range(2):
        front.call(RUNTIME + "ListContainers", b"", timeout=10)
    with pytest.raises(grpc.RpcError):
        front.call(
            RUNTIME + "ContainerStatus",
            cri.ContainerStatusRequest(container_id="missing").SerializeToString(),
        )
    front.call(RUNTIME + "Version", b"")  # the daemon's: it counts what it passes on itself
    text = _metrics(front)
    assert 'podshim_proxy_requests_total{code="OK",method="ListContainers"} 2' in text
    assert 'podshim_proxy_requests_total{code="NOT_FOUND",method="ContainerStatus"} 1' in text
    assert 'podshim_proxy_request_duration_seconds_count{method="ListContainers"} 2' in text
    assert 'method="Version"' not in text


UPSTREAM_VERSIONS = {
    "debian": cri.VersionResponse(
        version="0.1.0", runtime_name="containerd", runtime_version="1.6.20~ds1", runtime_api_version="v1"
    ),
    "build-metadata": cri.VersionResponse(
        version="0.1.0", runtime_name="containerd", runtime_version="2.1.9+unknown", runtime_api_version="v1"
    ),
    "sparse": cri.VersionResponse(runtime_name="cri-o", runtime_version="1.34.0"),
}


@pytest.mark.parametrize("runtime_name", RUNTIME_NAMES)
@pytest.mark.parametrize("upstream_version", UPSTREAM_VERSIONS, ids=str)
def test_version_is_answered_by_the_front_as_the_daemon_would(
    tmp_path: Path, runtime_name: str, upstream_version: str
) -> None:
    """With --version-name, while its connection to the daemon is up, the front answers Version
    itself from the upstream's answer, byte for byte what the daemon's version_answer gives (an
    unknown field of the upstream's dropped, as there), counted as a call passed to the upstream.
    Once the daemon is gone Version goes to it, which owns it, and is UNAVAILABLE until a daemon
    serves again: an answer still means a daemon serves."""
    theirs = UPSTREAM_VERSIONS[upstream_version]
    upstream = Recorder("upstream", version=theirs.SerializeToString() + b"\xa2\x06\x01x")  # field 100
    daemon = Recorder("daemon")
    extra = (f"--version-name={runtime_name}", f"--podshim-version={__version__}")
    with running_front(tmp_path, upstream, daemon, *extra) as front:
        _wait_for_daemon(front)
        daemon.calls.clear()
        request = cri.VersionRequest(version="v1").SerializeToString()
        ours = front.call(RUNTIME + "Version", request, timeout=10)
        expected = version_answer(theirs, runtime_name).SerializeToString()
        assert ours == expected, cri.VersionResponse.FromString(ours)
        assert upstream.methods() == [RUNTIME + "Version"] and daemon.methods() == []
        assert upstream.calls[0].request == request
        assert 'podshim_proxy_requests_total{code="OK",method="Version"} 1' in _metrics(front)
        upstream.version = b"\xff"  # no message: INTERNAL, naming what could not be read
        with pytest.raises(grpc.RpcError) as err:
            front.call(RUNTIME + "Version", b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "VersionResponse cannot be read" in str(err.value.details())

        front.daemon_server.stop(0).wait()
        # the front learns of the closed connection as it reads it (until then it answers, here
        # INTERNAL from the unreadable answer): UNAVAILABLE from then on, never the upstream's
        end = time.monotonic() + 10
        while True:
            with pytest.raises(grpc.RpcError) as err:
                front.call(RUNTIME + "Version", b"", timeout=10)
            if err.value.code() != grpc.StatusCode.INTERNAL or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "its daemon at" in str(err.value.details()), err.value.details()
        # a daemon serving again: Version answers again once the front has reconnected (within its
        # 1 s backoff), by the daemon or, the connection up, by the front
        upstream.version = theirs.SerializeToString()
        (tmp_path / "daemon.sock").unlink(missing_ok=True)
        server = serve(daemon, tmp_path / "daemon.sock")
        try:
            end = time.monotonic() + 10
            while True:
                try:
                    again = front.call(RUNTIME + "Version", b"", timeout=10)
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < end, e.details()
                    time.sleep(0.05)
            assert again in (expected, cri.VersionResponse(runtime_name="daemon").SerializeToString())
        finally:
            server.stop(0)


def _wait_for_daemon(front: Front) -> None:
    """Until the front's connection to its daemon (made at its start) is up: an owned call
    answered by the daemon (CheckpointPod, which the Recorder refuses in its own words)."""
    with pytest.raises(grpc.RpcError) as err:
        front.call(RUNTIME + "CheckpointPod", b"", timeout=10)
    assert err.value.details() == DAEMON_SAYS_UPSTREAM_DOWN


def _metrics(front: Front) -> str:
    from shim.server.front import _UnixHTTPConnection

    conn = _UnixHTTPConnection(str(front.metrics_socket), 5)
    conn.request("GET", "/metrics")
    return conn.getresponse().read().decode()


def test_sigterm_stops_it_and_removes_only_its_own_socket(tmp_path: Path) -> None:
    servers = [serve(Recorder("u"), tmp_path / "up.sock"), serve(Recorder("d"), tmp_path / "daemon.sock")]
    try:
        proc = start_front(tmp_path, tmp_path / "up.sock", tmp_path / "daemon.sock")
        proc.send_signal(signal.SIGINT)  # a terminal's ^C is the daemon's to act on
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0
        assert not (tmp_path / "front.sock").exists() and not (tmp_path / "metrics.sock").exists()
        # the path bound anew by someone else (a podshim started after): left alone
        proc = start_front(tmp_path, tmp_path / "up.sock", tmp_path / "daemon.sock")
        (tmp_path / "front.sock").unlink()
        (tmp_path / "front.sock").write_text("another's")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0
        assert (tmp_path / "front.sock").read_text() == "another's"
    finally:
        for s in servers:
            s.stop(0)


def test_an_inherited_socket_outlives_its_front(tmp_path: Path) -> None:
    """--listen-fd: the front serves a socket its starter bound and holds (as the daemon does).
    Killed, it leaves the socket listening: a connection made meanwhile is not refused, and a call
    on it, without wait_for_ready, is answered by the next front given the same descriptor. The
    socket file is never removed, by a SIGTERM either (the daemon's to remove); a front whose
    daemon stays unreachable past its orphan timeout removes it (no daemon is left to)."""
    daemon = Recorder("daemon")
    servers = [serve(Recorder("upstream"), tmp_path / "up.sock"), serve(daemon, tmp_path / "daemon.sock")]
    path = tmp_path / "front.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(64)
        inode = path.stat().st_ino
        proc = start_front(tmp_path, tmp_path / "up.sock", tmp_path / "daemon.sock", listener.fileno())
        version = RUNTIME + "Version"
        with grpc.insecure_channel(f"unix://{path}") as ch:
            assert (
                cri.VersionResponse.FromString(ch.unary_unary(version)(b"", timeout=10)).runtime_name
                == "daemon"
            )
        proc.kill()
        proc.wait(10)
        (tmp_path / "metrics.sock").unlink()  # left by the kill (the daemon removes it likewise)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))  # not refused: it waits in the backlog
        with grpc.insecure_channel(f"unix://{path}") as ch:
            waiting = ch.unary_unary(version).future(b"", timeout=30)  # no front to answer it yet
            proc = start_front(tmp_path, tmp_path / "up.sock", tmp_path / "daemon.sock", listener.fileno())
            assert cri.VersionResponse.FromString(waiting.result()).runtime_name == "daemon"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0
        assert path.stat().st_ino == inode, "the front removed its daemon's socket"
        servers.pop().stop(0)  # the daemon gone for good: the next front is orphaned
        proc = start_front(
            tmp_path, tmp_path / "up.sock", tmp_path / "daemon.sock", listener.fileno(), "--orphan-timeout=1s"
        )
        assert proc.wait(30) == 0
        assert not path.exists(), "an orphaned front left its socket"
    finally:
        listener.close()
        for s in servers:
            s.stop(0)


def test_the_adopting_daemon_takes_a_copy_of_the_fronts_socket(tmp_path: Path) -> None:
    """The descriptor a front's record names, taken from it (pidfd_getfd): the very socket the
    front listens on (a connection to the path reaches the copy), once its starter has closed its
    own; nothing is taken that is not a socket listening on the path, nor from another process
    that has the pid now."""
    from shim.procs import running_start_time
    from shim.server.front import _take_listener

    path = tmp_path / "front.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    with open(tmp_path / "file", "w") as f:
        fd, other = listener.fileno(), f.fileno()
        holder = subprocess.Popen(["sleep", "60"], pass_fds=(fd, other))
    listener.close()
    try:
        start = running_start_time(holder.pid)
        took = _take_listener(holder.pid, start, fd, str(path))
        assert took is not None
        with took, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            took.accept()[0].close()
        assert _take_listener(holder.pid, start, other, str(path)) is None  # a file
        assert _take_listener(holder.pid, start, fd, str(tmp_path / "elsewhere.sock")) is None
        assert _take_listener(holder.pid, start, 1000, str(path)) is None  # not open
        assert _take_listener(holder.pid, start + 1, fd, str(path)) is None  # another process
    finally:
        holder.kill()
        holder.wait()


def test_an_inherited_descriptor_that_is_not_a_listening_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "front.sock"
    with open(tmp_path / "file", "w") as f:
        fd = f.fileno()
        proc = subprocess.Popen(
            [str(FRONT), f"--listen={path}", f"--listen-fd={fd}", "--upstream=unix:///x"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            pass_fds=(fd,),
        )
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 1
    said = out.decode().strip()
    assert said == f"error: server.socket {path}: cannot listen: --listen-fd {fd} is not a listening socket"


# ---------------------------------------------------------------------------- with podshim


def _fronts_of(socket: Path) -> list[int]:
    found = []
    for pid in _sys.all_pids():
        argv = _sys.read_cmdline(pid)
        if argv and Path(argv[0]).name == "podshim-front" and f"--listen={socket}" in argv:
            found.append(pid)
    return found


def _front_of(socket: Path) -> int:
    found = _fronts_of(socket)
    assert len(found) == 1, found
    return found[0]


def _parent(pid: int) -> int:
    return _sys.parent_map()[pid]


def _serve_again(bed: TestBed, workdir: Path) -> subprocess.Popen[bytes]:
    """Another `podshim serve` with an extra podshim's config (what systemd's Restart= does)."""
    out = open(workdir / "podshim.log", "ab")  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(
            [*bed.podshim_command, "serve", "--config", str(workdir / "podshim.toml")],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in bed._env().items() if k not in ("PODSHIM_CONFIG", "PODSHIM_FAILPOINTS")},
            start_new_session=True,
        )
    finally:
        out.close()


def _version(rt: Any) -> str | None:
    """Version through the front, or None while it is refused (no front, or no daemon)."""
    try:
        return str(rt.Version(cri.VersionRequest(), timeout=5).runtime_version)
    except grpc.RpcError:
        return None


# a container that does not exist: StopContainer of it is OK from the daemon (the CRI's idempotent
# stop), UNAVAILABLE naming the daemon while no daemon is there
NO_SUCH_CONTAINER = "0" * 64


def _daemon_answers(rt: Any) -> bool:
    """Whether a method the daemon owns is answered through the front."""
    try:
        rt.StopContainer(cri.StopContainerRequest(container_id=NO_SUCH_CONTAINER), timeout=5)
    except grpc.RpcError:
        return False
    return True


@pytest.mark.e2e
def test_the_front_outlives_a_killed_daemon_and_the_next_daemon_adopts_it(
    bed: TestBed, tmp_path: Path
) -> None:
    """The daemon SIGKILLed: the front keeps the node's CRI up (the upstream's calls pass, the
    daemon's are UNAVAILABLE naming it); the next daemon adopts that very front; its graceful
    stop ends both and leaves no socket."""
    with bed.extra_podshim(tmp_path) as (socket, log):
        front = _front_of(socket)
        daemon = _parent(front)
        rt = pods.stubs(socket)[0]
        os.kill(daemon, signal.SIGKILL)
        assert not _sys.wait_gone({daemon}, 5)
        assert _fronts_of(socket) == [front], "the front died with its daemon"
        rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10)  # passes, straight to containerd
        # Version is the daemon's to answer while it is away (the front notices the closed
        # connection as it reads it, at once)
        pods.wait_for(lambda: _version(rt) is None, timeout=5, what="Version to become unavailable")
        with pytest.raises(grpc.RpcError) as err:
            rt.StopContainer(cri.StopContainerRequest(container_id=NO_SUCH_CONTAINER), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "its daemon at" in (err.value.details() or ""), err.value.details()
        again = _serve_again(bed, tmp_path)
        try:
            pods.wait_for(lambda: _daemon_answers(rt), timeout=30, what="the next daemon")
            assert _fronts_of(socket) == [front], "the next daemon replaced the front instead of adopting it"
            assert "front adopted" in log.read_text()
            assert "+podshim." in (_version(rt) or "")  # from containerd's answer
        finally:
            again.terminate()
            again.wait(30)
        assert not _sys.wait_gone({front}, 15), "the adopting daemon's stop left the front running"
        assert not socket.exists()


@pytest.mark.e2e
def test_the_nodes_cri_survives_repeated_kills_of_either_half(bed: TestBed, tmp_path: Path) -> None:
    """16 clients call ListPodSandbox (passed through) without a pause while the daemon is
    SIGKILLed three times and started again (as systemd's Restart= does), then the front three
    times, 5 s apart: no passed-through call is lost to a daemon kill (at most 1 %), none hangs,
    the counter pod beside them is never left frozen, and each front kill costs at most the
    bounded restart of the front (the daemon's logged delay) plus its start."""
    clients, period = 16, 5.0
    with bed.extra_podshim(tmp_path) as (socket, log):
        rt = pods.stubs(socket)[0]
        pod = pods.run_pod(rt, f"kills-{os.getpid()}", Path(bed.base_dir) / "pod-logs")
        stop = threading.Event()
        phase = ["steady"]
        results: list[tuple[str, str, float]] = []  # (phase, code, when)
        lock = threading.Lock()

        def client() -> None:
            with grpc.insecure_channel(f"unix://{socket}") as ch:
                stub = ch.unary_unary(RUNTIME + "ListPodSandbox")
                while not stop.is_set():
                    try:
                        stub(cri.ListPodSandboxRequest().SerializeToString(), timeout=10)
                        code = "OK"
                    except grpc.RpcError as e:
                        code = e.code().name
                    with lock:
                        results.append((phase[0], code, time.monotonic()))

        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        daemon_proc: subprocess.Popen[bytes] | None = None
        outages = []
        try:
            time.sleep(1)
            daemon = _parent(_front_of(socket))  # the first; then each one this test started
            for _ in range(3):
                phase[0] = "daemon"
                os.kill(daemon, signal.SIGKILL)
                assert not _sys.wait_gone({daemon}, 5)
                if daemon_proc is not None:
                    daemon_proc.wait(5)
                daemon_proc = _serve_again(bed, tmp_path)
                daemon = daemon_proc.pid
                pods.wait_for(lambda: _daemon_answers(rt), timeout=30, what="the daemon back")
                time.sleep(period)
            for _ in range(3):
                phase[0] = "front"
                front = _front_of(socket)
                killed = time.monotonic()
                os.kill(front, signal.SIGKILL)
                pods.wait_for(lambda f=front: _fronts_of(socket) not in ([], [f]), timeout=15, what="a front")
                pods.wait_for(lambda: _version(rt), timeout=15, what="the front back")
                outages.append(time.monotonic() - killed)
                time.sleep(period)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            if daemon_proc is not None:
                daemon_proc.terminate()
                daemon_proc.wait(30)
        assert not any(t.is_alive() for t in threads), "a client's call hung"
        by = Counter((p, c) for p, c, _ in results)
        during_daemon = [c for p, c, _ in results if p == "daemon"]
        lost = sum(1 for c in during_daemon if c != "OK")
        shown = [round(o, 3) for o in outages]
        # how long the clients saw UNAVAILABLE around each front kill (from their first to their last)
        spans, start, last = [], None, None
        for when in sorted(w for p, c, w in results if p == "front" and c != "OK"):
            if last is not None and when - last > 1.0:
                spans.append(round(last - start, 3))
                start = None
            start = when if start is None else start
            last = when
        if start is not None and last is not None:
            spans.append(round(last - start, 3))
        print(
            f"\ncalls by (phase, code): {dict(by)}; front kills: kill to Version served {shown} s, "
            f"the clients' UNAVAILABLE spans {spans} s"
        )
        assert len(during_daemon) > 1000, len(during_daemon)
        assert lost <= len(during_daemon) // 100, f"{lost} of {len(during_daemon)} passed-through calls lost"
        assert not [c for _, c, _ in results if c == "DEADLINE_EXCEEDED"], "a call hung to its deadline"
        delays = [
            json.loads(line)["after_seconds"]
            for line in log.read_text().splitlines()
            if "front exited; starting it again" in line
        ]
        assert len(delays) == 3 and max(delays) <= FRONT_RESTART_MAX * (1 + FRONT_RESTART_JITTER), delays
        assert checks.freezer_state(pod.config.linux.cgroup_parent) == "THAWED"
        pods.remove_pod(pods.stubs(bed.podshim_socket)[0], pod.id)


@pytest.mark.e2e
def test_a_killed_front_refuses_no_connection_and_keeps_its_socket(bed: TestBed, tmp_path: Path) -> None:
    """The daemon holds server.socket's listening socket and hands it to each front it starts:
    while a killed front is started again, connections wait in the socket's backlog. First the
    daemon is killed and started again, so that the socket is the adopted front's, which the next
    daemon takes a copy of (pidfd_getfd). Then two clients call Version in a loop (30 s deadline),
    one with wait_for_ready and one without, while the front is SIGKILLed five times: neither is
    ever refused a connection (no "failed to connect", no UNAVAILABLE while no front runs), none
    of their calls reaches its deadline; the only failures are calls that were on the connection
    the killed front held (its in-flight calls, at most two per kill). The socket file is the same
    one throughout, and the daemon's graceful stop removes it. Timings: bench/front_kill.py."""
    from bench.front_kill import Client, cause

    kills = 5
    with bed.extra_podshim(tmp_path) as (socket, log):
        st = socket.stat()
        identity = (st.st_ino, st.st_ctime_ns)
        assert stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)  # as the front made it when it bound it
        front = _front_of(socket)
        daemon = _parent(front)
        os.kill(daemon, signal.SIGKILL)
        assert not _sys.wait_gone({daemon}, 5)
        again = _serve_again(bed, tmp_path)
        clients = [Client(kind, str(socket), timeout=30) for kind in ("plain", "ready")]
        threads = [threading.Thread(target=c.run) for c in clients]
        try:
            rt = pods.stubs(socket)[0]
            pods.wait_for(lambda: _daemon_answers(rt), timeout=30, what="the next daemon")
            adopted = [json.loads(x) for x in log.read_text().splitlines() if '"front adopted"' in x]
            assert adopted and adopted[-1]["pid"] == front and adopted[-1]["socket_held"], adopted
            for t in threads:
                t.start()
            for _ in range(kills):
                steady = time.monotonic()
                for c in clients:  # a few answers on the connection before each kill
                    assert c.answered_after(steady, 30, count=20), f"{c.kind}: no answers"
                front = _front_of(socket)
                killed = time.monotonic()
                os.kill(front, signal.SIGKILL)
                for c in clients:
                    assert c.answered_after(killed, 60), f"{c.kind}: no answer after the kill"
                assert _fronts_of(socket) not in ([], [front])
                st = socket.stat()
                assert (st.st_ino, st.st_ctime_ns) == identity, "the socket file was replaced"
        finally:
            for c in clients:
                c.stop.set()
            for t in threads:
                t.join(40)
            again.terminate()
            again.wait(30)
        assert not any(t.is_alive() for t in threads), "a client's call hung"
        for c in clients:
            failed = [(x.code, cause(x), x.details) for x in c.calls if x.code != "OK"]
            print(f"\n{c.kind}: {len(c.calls)} calls, {len(failed)} failed: {Counter(f[:2] for f in failed)}")
            assert all(f[:2] == ("UNAVAILABLE", "dropped") for f in failed), failed
            assert len(failed) <= 2 * kills, failed
        assert _fronts_of(socket) == [], "the daemon's stop left a front running"
        assert not socket.exists(), "the daemon's stop left the socket"


@pytest.mark.e2e
def test_a_front_of_another_command_line_is_replaced_on_the_same_socket(bed: TestBed, tmp_path: Path) -> None:
    """The daemon killed and started again with another front command line (here its log level,
    as an upgrade would change it): the next daemon takes the old front's socket before it stops
    it, and the front it starts serves that same socket file."""
    with bed.extra_podshim(tmp_path) as (socket, log):
        st = socket.stat()
        front = _front_of(socket)
        daemon = _parent(front)
        os.kill(daemon, signal.SIGKILL)
        assert not _sys.wait_gone({daemon}, 5)
        config = tomllib.loads((tmp_path / "podshim.toml").read_text())
        config["log"]["level"] = "debug"
        (tmp_path / "podshim.toml").write_text(bed_files.toml_dump(config))
        again = _serve_again(bed, tmp_path)
        try:
            rt = pods.stubs(socket)[0]
            pods.wait_for(lambda: _daemon_answers(rt), timeout=30, what="the next daemon")
            assert _front_of(socket) != front and "front of another command line stopped" in log.read_text()
            assert (socket.stat().st_ino, socket.stat().st_ctime_ns) == (st.st_ino, st.st_ctime_ns)
        finally:
            again.terminate()
            again.wait(30)
        assert not socket.exists()


@pytest.mark.e2e
def test_a_graceful_stop_ends_both_and_leaves_no_socket(bed: TestBed, tmp_path: Path) -> None:
    with bed.extra_podshim(tmp_path) as (socket, _log):
        front = _front_of(socket)
        daemon = _parent(front)
        os.kill(daemon, signal.SIGTERM)
        assert not _sys.wait_gone({daemon, front}, 15)
        assert not socket.exists() and not (tmp_path / "state" / "daemon.sock").exists()


@pytest.mark.e2e
def test_a_front_that_dies_is_started_again(bed: TestBed, tmp_path: Path) -> None:
    """Killed again and again, the front is started again each time within the bounded back-off
    (never the doubling to seconds a crash loop would earn): the restart delays the daemon logs
    stay at or below FRONT_RESTART_MAX (jittered), however often it died."""
    kills = 8
    with bed.extra_podshim(tmp_path) as (socket, log):
        rt = pods.stubs(socket)[0]

        def serving() -> bool:
            try:
                return bool(rt.Version(cri.VersionRequest(), timeout=2).runtime_version)
            except grpc.RpcError:
                return False

        outages = []
        for _ in range(kills):
            first = _front_of(socket)
            killed = time.monotonic()
            os.kill(first, signal.SIGKILL)
            pods.wait_for(lambda f=first: _fronts_of(socket) not in ([], [f]), timeout=15, what="a new front")
            pods.wait_for(serving, timeout=15, what="podshim serving again through a new front")
            outages.append(round(time.monotonic() - killed, 3))
        delays = [
            json.loads(line)["after_seconds"]
            for line in log.read_text().splitlines()
            if "front exited; starting it again" in line
        ]
        print(f"\nfront killed {kills} times: restart delays {delays} s, CRI outages {outages} s")
        assert len(delays) == kills, delays
        assert max(delays) <= FRONT_RESTART_MAX * (1 + FRONT_RESTART_JITTER), delays


@pytest.mark.e2e
def test_without_the_front_the_daemon_serves_the_socket(bed: TestBed, tmp_path: Path) -> None:
    with bed.extra_podshim(tmp_path, server={"front": False}) as (socket, _log):
        assert not _fronts_of(socket)
        rt = pods.stubs(socket)[0]
        assert "+podshim." in rt.Version(cri.VersionRequest(), timeout=10).runtime_version
        assert rt.ListContainers(cri.ListContainersRequest(), timeout=10) is not None
        assert not (tmp_path / "state" / "daemon.sock").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("own_state_dir", [False, True], ids=["same-config", "same-socket"])
def test_a_second_podshim_is_refused(bed: TestBed, tmp_path: Path, own_state_dir: bool) -> None:
    """A second `podshim serve` with the same config (the state dir's lock) or on the same socket
    (a live server there) exits at once with a clear message, before its recovery: the first one
    keeps its socket and serves on."""
    (tmp_path / "first").mkdir()
    with bed.extra_podshim(tmp_path / "first") as (socket, _log):
        config = tomllib.loads((tmp_path / "first" / "podshim.toml").read_text())
        if own_state_dir:
            config["server"]["state_dir"] = str(tmp_path / "second-state")
        second = tmp_path / "second.toml"
        second.write_text(bed_files.toml_dump(config))
        done = subprocess.run(
            [*bed.podshim_command, "serve", "--config", str(second)],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "PODSHIM_FAILPOINTS"},
        )
        assert done.returncode == 1, done.stderr
        expected = "another process serves this socket" if own_state_dir else "another podshim (pid"
        assert expected in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        rt = pods.stubs(socket)[0]
        assert rt.Version(cri.VersionRequest(), timeout=10).runtime_version
