"""CheckpointPodRequest.container_ids as the released CRI API (k8s.io/cri-api v0.37.2) words it:
"The list must be non-empty, must not contain duplicates, and must contain exactly the running
containers selected by the caller ... otherwise the runtime must fail the request without
producing a checkpoint". An empty list is INVALID_ARGUMENT (it no longer means "all running"),
before anything is frozen or written; `podshim checkpointpod` without --container fills in the
pod's running containers itself. No bed: the typed upstream seam's fake and a fake CLI stub."""

from __future__ import annotations

import argparse
import concurrent.futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import errors
from shim.cli.base import CliError
from shim.cli.commands import checkpointpod
from shim.config import Config
from shim.ops.checkpoint_checks import select_containers
from shim.ops.checkpoint_pod import PodCheckpointer
from shim.sandbox import ContainerView, PodView
from shim.state import Journal
from tests.fakes import FakeUpstream

# ---------------------------------------------------------------------------- the server's rule


def _container(cid: str, name: str, state: cri.ContainerState) -> ContainerView:
    return ContainerView(
        id=cid,
        name=name,
        state=state,
        status=cri.ContainerStatus(id=cid, state=state),
        config={},
        spec={},
        pid=0,
        runtime_root="",
        runtime_binary="",
    )


def _pod(*containers: ContainerView) -> PodView:
    md = cri.PodSandboxMetadata(name="web", namespace="default")
    status = cri.PodSandboxStatus(id="p" * 64, metadata=md, state=cri.SANDBOX_READY)
    return PodView("p" * 64, status, {}, {}, 0, "", {}, list(containers))


def test_an_empty_list_is_invalid_and_names_the_running_containers() -> None:
    pod = _pod(
        _container("a" * 64, "app", cri.CONTAINER_RUNNING),
        _container("b" * 64, "init", cri.CONTAINER_EXITED),
        _container("c" * 64, "sidecar", cri.CONTAINER_RUNNING),
    )
    with pytest.raises(errors.InvalidArgument) as err:
        select_containers(pod, [])
    msg = err.value.message
    assert "container_ids is empty" in msg and "default/web" in msg, msg
    assert "running: app, sidecar" in msg and "init" not in msg, msg
    assert "nothing was frozen or written" in msg, msg


def test_an_empty_list_of_a_pod_with_nothing_running_is_invalid_too() -> None:
    """Not the FAILED_PRECONDITION "no running container" of before: the request is what is wrong."""
    pod = _pod(_container("b" * 64, "done", cri.CONTAINER_EXITED))
    with pytest.raises(errors.InvalidArgument, match=r"container_ids is empty.*none running"):
        select_containers(pod, [])


def test_a_listed_subset_is_exactly_what_is_selected() -> None:
    a, c = (
        _container("a" * 64, "app", cri.CONTAINER_RUNNING),
        _container("c" * 64, "side", cri.CONTAINER_RUNNING),
    )
    pod = _pod(a, c)
    assert select_containers(pod, [c.id]) == [c]
    assert select_containers(pod, [c.id, a.id]) == [c, a]


@pytest.mark.parametrize(
    ("ids", "error", "says"),
    [
        (["a" * 64, "a" * 64], errors.InvalidArgument, "more than once"),
        ([""], errors.InvalidArgument, "empty id"),
        (["f" * 64], errors.NotFound, "not a container of pod"),
        (["b" * 64], errors.FailedPrecondition, "not running"),
    ],
    ids=["duplicate", "empty-id", "foreign", "exited"],
)
def test_the_other_rules_of_the_list_stay(ids: list[str], error: type, says: str) -> None:
    pod = _pod(
        _container("a" * 64, "app", cri.CONTAINER_RUNNING), _container("b" * 64, "done", cri.CONTAINER_EXITED)
    )
    with pytest.raises(error, match=says):
        select_containers(pod, ids)


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    (tmp_path / "roots").mkdir()
    return Config(state_dir=str(tmp_path / "state"), allowed_roots=(str(tmp_path / "roots"),))


async def test_checkpoint_pod_with_an_empty_list_freezes_and_writes_nothing(cfg: Config) -> None:
    """Through PodCheckpointer: the pod is read, nothing else is asked of the upstream, output_path
    stays empty and no journal record is opened."""
    up = FakeUpstream()
    up.sandboxes["p1"] = cri.PodSandboxStatus(
        id="p1", metadata=cri.PodSandboxMetadata(name="web", namespace="default"), state=cri.SANDBOX_READY
    )
    out = Path(cfg.allowed_roots[0]) / "out"
    out.mkdir()
    c = PodCheckpointer(cfg, up, Journal(cfg.state_dir))  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument, match="container_ids is empty"):
        await c.checkpoint(cri.CheckpointPodRequest(pod_sandbox_id="p1", output_path=str(out)), 30.0)
    assert set(up.names()) <= {"PodSandboxStatus", "ListContainers"}, up.calls
    assert list(out.iterdir()) == []
    assert Journal(cfg.state_dir).scan().records == []


# ---------------------------------------------------------------------------- podshim checkpointpod


class _Done:
    """A unary method whose `future` answers at once, recording each request."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def future(self, request: Any, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        self.requests.append(request)
        f: concurrent.futures.Future[Any] = concurrent.futures.Future()
        f.set_result(cri.CheckpointPodResponse())
        return f


class _NotFound(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND

    def details(self) -> str:
        return "sandbox not found"


class FakeStub:
    """The RuntimeService calls `checkpointpod` makes, over one pod's containers (name -> (state,
    created_at)); ListContainers honours the pod and state filters as containerd does."""

    POD = "9" * 64

    def __init__(
        self, containers: dict[str, tuple[cri.ContainerState, int]], pod_exists: bool = True
    ) -> None:
        self.containers = containers
        self.pod_exists = pod_exists
        self.CheckpointPod = _Done()  # noqa: N815 (the stub's method name)
        self.filters: list[cri.ContainerFilter] = []

    def ListPodSandbox(self, req: Any, timeout: float | None = None) -> Any:  # noqa: N802
        items = [cri.PodSandbox(id=self.POD)] if self.pod_exists else []
        return cri.ListPodSandboxResponse(items=items)

    def ListContainers(self, req: cri.ListContainersRequest, timeout: float | None = None) -> Any:  # noqa: N802
        self.filters.append(req.filter)
        f = req.filter
        out = [
            cri.Container(id=name * 64, pod_sandbox_id=self.POD, state=state, created_at=at)
            for name, (state, at) in self.containers.items()
            if self.pod_exists
            and (not f.pod_sandbox_id or f.pod_sandbox_id == self.POD)
            and (not f.HasField("state") or f.state.state == state)
        ]
        return cri.ListContainersResponse(containers=out)

    def PodSandboxStatus(self, req: Any, timeout: float | None = None) -> Any:  # noqa: N802
        if not self.pod_exists:
            raise _NotFound()
        md = cri.PodSandboxMetadata(name="web", namespace="default")
        return cri.PodSandboxStatusResponse(
            status=cri.PodSandboxStatus(id=self.POD, metadata=md, state=cri.SANDBOX_READY)
        )


def test_running_containers_are_the_pods_running_ones_oldest_first() -> None:
    stub = FakeStub(
        {"b": (cri.CONTAINER_RUNNING, 20), "a": (cri.CONTAINER_RUNNING, 10), "x": (cri.CONTAINER_EXITED, 5)}
    )
    assert checkpointpod.running_containers(stub, FakeStub.POD, 5) == ["a" * 64, "b" * 64]  # type: ignore[arg-type]
    f = stub.filters[-1]
    assert f.pod_sandbox_id == FakeStub.POD and f.state.state == cri.CONTAINER_RUNNING


def test_running_containers_of_a_pod_with_none_running_is_a_cli_error() -> None:
    stub = FakeStub({"x": (cri.CONTAINER_EXITED, 5)})
    with pytest.raises(
        CliError, match=r"default/web .* has no running container to checkpoint.*SANDBOX_READY"
    ):
        checkpointpod.running_containers(stub, FakeStub.POD, 5)  # type: ignore[arg-type]


def test_running_containers_of_an_unknown_pod_is_the_runtimes_not_found() -> None:
    with pytest.raises(grpc.RpcError) as err:
        checkpointpod.running_containers(FakeStub({}, pod_exists=False), FakeStub.POD, 5)  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _run(monkeypatch: pytest.MonkeyPatch, stub: FakeStub, path: Path, *extra: str) -> int:
    monkeypatch.setattr(checkpointpod, "runtime_stub", lambda args: stub)
    parser = argparse.ArgumentParser()
    checkpointpod.register(parser.add_subparsers())
    args = parser.parse_args(["checkpointpod", FakeStub.POD, str(path), *extra])
    args.runtime_endpoint, args.timeout, args.output = "unix:///nonexistent.sock", None, "json"
    return int(args.func(args))


def test_the_command_without_container_sends_the_running_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stub = FakeStub(
        {"a": (cri.CONTAINER_RUNNING, 1), "b": (cri.CONTAINER_RUNNING, 2), "x": (cri.CONTAINER_EXITED, 0)}
    )
    assert _run(monkeypatch, stub, tmp_path / "ck") == 0, capsys.readouterr().err
    (req,) = stub.CheckpointPod.requests
    assert list(req.container_ids) == ["a" * 64, "b" * 64]
    assert req.pod_sandbox_id == FakeStub.POD and req.output_path == str(tmp_path / "ck")


def test_the_command_with_container_sends_only_those(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stub = FakeStub({"a": (cri.CONTAINER_RUNNING, 1), "b": (cri.CONTAINER_RUNNING, 2)})
    assert _run(monkeypatch, stub, tmp_path / "ck", "--container", "b" * 64) == 0, capsys.readouterr().err
    (req,) = stub.CheckpointPod.requests
    assert list(req.container_ids) == ["b" * 64]


def test_the_command_with_nothing_running_creates_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for keep in ([], ["--keep", "2"]):
        stub = FakeStub({"x": (cri.CONTAINER_EXITED, 0)})
        assert _run(monkeypatch, stub, tmp_path / "ck", *keep) == 1
        assert "has no running container to checkpoint" in capsys.readouterr().err
        assert stub.CheckpointPod.requests == []
        assert list(tmp_path.iterdir()) == []  # no directory, no --keep marker
