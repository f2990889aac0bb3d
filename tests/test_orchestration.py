"""The orchestrations' edge cases through the typed upstream seam (tests/fakes.py), in
milliseconds: an upstream error at each step of RestorePod and the rollback that follows (its
order, the error code the caller gets, the journal), deadlines, and CheckpointPod's upstream
errors before anything is frozen. The end-to-end tests cover the same paths against containerd."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import errors
from shim.archive import manifest
from shim.config import Config
from shim.engine import Engine
from shim.ops.checkpoint_pod import PodCheckpointer
from shim.ops.restore_checks import Checked, Planned, RestoreOptions
from shim.ops.restore_pod import PodRestorer
from shim.state import Journal
from tests.fakes import ENDPOINT, FakeUpstream, rpc_error, unreachable

NAMES = ("a", "b")


@pytest.fixture
def up() -> FakeUpstream:
    return FakeUpstream()


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    (tmp_path / "roots").mkdir()
    return Config(state_dir=str(tmp_path / "state"), allowed_roots=(str(tmp_path / "roots"),))


def _restorer(cfg: Config, up: FakeUpstream, start: bool = False) -> tuple[PodRestorer, list[Any]]:
    r = PodRestorer(cfg, up, Journal(cfg.state_dir))  # type: ignore[arg-type]
    kept: list[Any] = []
    r.on_kept = kept.append
    root = Path(cfg.allowed_roots[0])
    plan = [
        Planned(
            entry=manifest.ContainerEntry(
                name=n,
                id=f"old-{n}",
                image="busybox",
                state="CONTAINER_RUNNING",
                restart_count=0,
                checkpointed=True,
                dir=f"containers/{n}",
            ),
            config=cri.ContainerConfig(metadata=cri.ContainerMetadata(name=n)),
            dir=root / "containers" / n,
        )
        for n in NAMES
    ]
    m = manifest.Manifest(sandbox=manifest.SandboxInfo(id="old", metadata={}, config={}))
    checked = Checked(
        opts=RestoreOptions(start=start), root=root, key=None, manifest=m, plan=plan, network={}
    )

    async def check(req: cri.RestorePodRequest, pages_from_source: bool = False) -> Checked:
        return checked

    r.checks.check = check  # type: ignore[method-assign]  # the archive's checks have their own tests
    return r, kept


def _request(handler: str = "") -> cri.RestorePodRequest:
    md = cri.PodSandboxMetadata(name="web", namespace="default", uid="u-1")
    return cri.RestorePodRequest(
        checkpoint_path="/x", config=cri.PodSandboxConfig(metadata=md), runtime_handler=handler
    )


def _open_records(cfg: Config) -> list[Any]:
    return Journal(cfg.state_dir).scan().records


async def test_restore_creates_the_sandbox_then_each_container(cfg: Config, up: FakeUpstream) -> None:
    r, kept = _restorer(cfg, up)
    resp = await r.restore(_request(), 30.0)
    assert up.calls == [("RunPodSandbox", "web"), ("CreateContainer", "a"), ("CreateContainer", "b")]
    assert [c.name for c in resp.restored_containers] == list(NAMES)
    assert resp.pod_sandbox_id in up.sandboxes and not _open_records(cfg) and not kept


@pytest.mark.parametrize(
    ("step", "fail", "start", "error", "says"),
    [
        (
            "CreateContainer",
            [rpc_error("INVALID_ARGUMENT", "bad mount")],
            False,
            errors.InvalidArgument,
            "creating container 'a'",
        ),
        (
            "CreateContainer",
            [None, rpc_error("NOT_FOUND", "image gone")],
            False,
            errors.NotFound,
            "creating container 'b'",
        ),
        (
            "CreateContainer",
            [None, rpc_error("RESOURCE_EXHAUSTED", "no room")],
            False,
            errors.Internal,
            "RESOURCE_EXHAUSTED",
        ),
        (
            "StartContainer",
            [None, rpc_error("FAILED_PRECONDITION", "criu")],
            True,
            errors.FailedPrecondition,
            "starting restored container 'b'",
        ),
    ],
)
async def test_an_upstream_error_after_the_sandbox_rolls_it_back(
    cfg: Config, up: FakeUpstream, step: str, fail: list[Any], start: bool, error: type, says: str
) -> None:
    r, kept = _restorer(cfg, up, start=start)
    up.fail[step] = fail
    with pytest.raises(error, match=says):
        await r.restore(_request(), 30.0)
    sid = up.calls[0]
    assert sid[0] == "RunPodSandbox"
    # after the failed step: its state read (stopped by someone else?), then the rollback in this
    # order: stop, remove, then read back that it is gone
    failed_at = max(i for i, (name, _) in enumerate(up.calls) if name == step)
    rollback = up.calls[failed_at + 1 :]
    assert [n for n, _ in rollback] == [
        "PodSandboxStatus",
        "StopPodSandbox",
        "RemovePodSandbox",
        "PodSandboxStatus",
    ]
    assert len({a for _, a in rollback}) == 1 and not up.sandboxes
    assert not _open_records(cfg) and not kept


async def test_a_refused_sandbox_leaves_nothing_to_roll_back(cfg: Config, up: FakeUpstream) -> None:
    r, kept = _restorer(cfg, up)
    up.fail["RunPodSandbox"] = rpc_error("INVALID_ARGUMENT", "bad port mapping")
    with pytest.raises(errors.InvalidArgument, match="creating the new sandbox"):
        await r.restore(_request(), 30.0)
    assert up.names() == ["RunPodSandbox"] and not _open_records(cfg) and not kept


async def test_an_unanswered_sandbox_is_kept_for_recovery(cfg: Config, up: FakeUpstream) -> None:
    """RunPodSandbox without an answer: the sandbox may still appear; the rollback looks for it
    by its metadata, finds none yet, and keeps the record (Engine retries; a restart replays it).
    The caller gets the upstream's own error."""
    r, kept = _restorer(cfg, up)
    up.fail["RunPodSandbox"] = unreachable()
    with pytest.raises(errors.Unavailable, match=ENDPOINT):
        await r.restore(_request(), 30.0)
    assert up.names() == ["RunPodSandbox", "ListPodSandbox"]
    (rec,) = _open_records(cfg)
    assert rec.data.sandbox_unknown_since is not None and [k.op_id for k in kept] == [rec.op_id]


async def test_the_unknown_handler_answer_is_invalid_argument(cfg: Config, up: FakeUpstream) -> None:
    r, _ = _restorer(cfg, up)
    up.fail["RunPodSandbox"] = rpc_error(
        "UNKNOWN", 'failed to get sandbox runtime: no runtime for "ghost" is configured'
    )
    with pytest.raises(errors.InvalidArgument, match="runtime_handler 'ghost'"):
        await r.restore(_request("ghost"), 30.0)


async def test_a_failed_rollback_keeps_the_record_and_the_first_error(cfg: Config, up: FakeUpstream) -> None:
    r, kept = _restorer(cfg, up)
    up.fail["CreateContainer"] = rpc_error("INVALID_ARGUMENT", "bad mount")
    up.fail["StopPodSandbox"] = up.fail["RemovePodSandbox"] = up.fail["PodSandboxStatus"] = unreachable()
    with pytest.raises(errors.InvalidArgument, match="bad mount"):
        await r.restore(_request(), 30.0)
    (rec,) = _open_records(cfg)
    assert rec.data.sandbox_id in up.sandboxes and [k.op_id for k in kept] == [rec.op_id]


async def test_the_deadline_ends_a_hung_create_and_rolls_back(cfg: Config, up: FakeUpstream) -> None:
    r, kept = _restorer(cfg, up)
    up.hang.add("CreateContainer")
    with pytest.raises(errors.DeadlineExceeded, match="within the caller's deadline"):
        await r.restore(_request(), 1.2)  # 0.2 s once the clean-up margin is kept
    assert up.names()[-3:] == ["StopPodSandbox", "RemovePodSandbox", "PodSandboxStatus"]
    assert not up.sandboxes and not _open_records(cfg) and not kept


async def test_a_cancelled_restore_holds_the_pod_until_its_rollback_ends(
    cfg: Config, up: FakeUpstream
) -> None:
    """The caller goes away (its deadline) while RestorePod rolls back (StopPodSandbox can take
    seconds behind a hung CRIU restore): the call ends only with the rollback, so the pod's lock
    is held meanwhile and a retry is ABORTED instead of creating a second sandbox beside the one
    being removed."""
    engine = Engine(cfg, up)  # type: ignore[arg-type]
    r, _kept = _restorer(cfg, up)
    engine.restorer.checks.check = r.checks.check  # type: ignore[method-assign]
    up.fail["CreateContainer"] = [rpc_error("INVALID_ARGUMENT", "bad mount")]
    rollback = up.held["StopPodSandbox"] = asyncio.Event()
    first = asyncio.ensure_future(engine.restore_pod(_request(), 30.0))
    while "StopPodSandbox" not in up.names():
        await asyncio.sleep(0.01)
    first.cancel()  # the caller's deadline, during the rollback
    await asyncio.sleep(0.05)
    assert not first.done()
    with pytest.raises(errors.Aborted, match="in progress on pod default/web"):
        await engine.restore_pod(_request(), 5.0)
    rollback.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not up.sandboxes and not _open_records(cfg) and engine.locks._held == {}


# ---------------------------------------------------------------------------- CheckpointPod


def _checkpointer(cfg: Config, up: FakeUpstream) -> tuple[PodCheckpointer, Path]:
    out = Path(cfg.allowed_roots[0]) / "out"
    out.mkdir()
    return PodCheckpointer(cfg, up, Journal(cfg.state_dir)), out  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setup", "error", "says"),
    [
        (lambda up: None, errors.NotFound, "podshim pods"),  # no such sandbox
        (lambda up: up.fail.__setitem__("PodSandboxStatus", unreachable()), errors.Unavailable, ENDPOINT),
        (
            lambda up: up.fail.__setitem__("PodSandboxStatus", rpc_error("DEADLINE_EXCEEDED", "slow")),
            errors.DeadlineExceeded,
            "reading pod p1",
        ),
        (
            lambda up: up.sandboxes.__setitem__(
                "p1", cri.PodSandboxStatus(id="p1", state=cri.SANDBOX_NOTREADY)
            ),
            errors.FailedPrecondition,
            "not ready",
        ),
    ],
)
async def test_checkpoint_upstream_errors_before_the_freeze(
    cfg: Config, up: FakeUpstream, setup: Any, error: type, says: str
) -> None:
    c, out = _checkpointer(cfg, up)
    setup(up)
    with pytest.raises(error, match=says):
        await c.checkpoint(cri.CheckpointPodRequest(pod_sandbox_id="p1", output_path=str(out)), 30.0)
    assert up.names()[0] == "PodSandboxStatus"
    assert set(up.names()) <= {"PodSandboxStatus", "ListContainers"}  # nothing frozen, stopped or written
    assert not list(out.iterdir()) and not _open_records(cfg)


async def test_checkpoint_deadline_while_reading_the_pod(cfg: Config, up: FakeUpstream) -> None:
    c, out = _checkpointer(cfg, up)
    up.hang.add("PodSandboxStatus")
    with pytest.raises(errors.DeadlineExceeded, match="nothing was frozen or written"):
        await c.checkpoint(cri.CheckpointPodRequest(pod_sandbox_id="p1", output_path=str(out)), 0.3)
    assert not list(out.iterdir()) and not _open_records(cfg)


async def test_deadline_while_a_decrypted_dir_is_made_still_removes_it(
    cfg: Config, up: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's deadline lands while the thread making `<state_dir>/decrypted/<name>` runs:
    run_to_end drops that thread's result, so the rollback must have known the name before. No
    plaintext directory may outlive the failed RestorePod (it once stayed until the next restore)."""
    import asyncio
    import dataclasses
    import threading

    from shim.archive import crypto

    made, release = threading.Event(), threading.Event()
    real = crypto.new_decrypted_dir

    def slow_new_decrypted_dir(*args: Any) -> Path:
        d = real(*args)
        made.set()
        release.wait(10)  # the deadline passes while the dir exists and the thread still runs
        return d

    monkeypatch.setattr(crypto, "new_decrypted_dir", slow_new_decrypted_dir)
    r, _ = _restorer(cfg, up)
    plain_check = r.checks.check

    async def encrypted_check(req: cri.RestorePodRequest, pages_from_source: bool = False) -> Checked:
        checked = await plain_check(req)
        checked.manifest.encryption = manifest.Encryption(scheme="test", key_id="k", mac="")
        return dataclasses.replace(checked, key=object())  # type: ignore[arg-type]  # never read here

    r.checks.check = encrypted_check  # type: ignore[method-assign]
    task = asyncio.ensure_future(r.restore(_request(), deadline=30))
    assert await asyncio.to_thread(made.wait, 10), "the decrypted dir was never made"
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    left = list(crypto.decrypted_root(cfg.state_dir).iterdir())
    assert left == [], f"plaintext dirs left behind: {left}"
    # the new sandbox is created beside the decryption (docs/design/restore-pod.md (RestorePod) step 1):
    # it is removed again, after the decryption stopped
    assert not up.sandboxes, "the sandbox created beside the decryption was left behind"
    assert up.names()[-3:] == ["StopPodSandbox", "RemovePodSandbox", "PodSandboxStatus"]


# ---------------------------------------------------------------------------- RestorePod: undo order


def _with_member(r: PodRestorer, rel: str, data: bytes, recorded: bytes) -> None:
    """Give the fake archive a member `rel` holding `data`, which the manifest records as
    `recorded` (a different one: a corrupt member), left to the checksums beside the sandbox."""
    import hashlib

    plain_check = r.checks.check

    async def check(req: cri.RestorePodRequest, pages_from_source: bool = False) -> Checked:
        checked = await plain_check(req)
        path = checked.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        checked.manifest.files[rel] = manifest.FileEntry(len(recorded), hashlib.sha256(recorded).hexdigest())
        checked.unverified = [rel]
        return checked

    r.checks.check = check  # type: ignore[method-assign]


async def test_a_corrupt_member_found_beside_the_sandbox_removes_it(cfg: Config, up: FakeUpstream) -> None:
    """The checksums run beside RunPodSandbox (docs/design/restore-pod.md (RestorePod) step 1): a
    member that differs fails the restore with DATA_LOSS naming it before any container is
    created, and the sandbox created meanwhile is removed, the journal record closed."""
    r, kept = _restorer(cfg, up)
    _with_member(r, "containers/a/checkpoint/pages-1.img", b"x" * 4096, b"y" * 4096)
    with pytest.raises(errors.DataLoss, match="pages-1.img has sha256"):
        await r.restore(_request(), 30.0)
    rollback = ["PodSandboxStatus", "StopPodSandbox", "RemovePodSandbox", "PodSandboxStatus"]
    assert up.names() == ["RunPodSandbox", *rollback]
    assert not up.sandboxes and not _open_records(cfg) and not kept


async def test_a_sandbox_removed_by_another_caller_is_named(cfg: Config, up: FakeUpstream) -> None:
    """The new sandbox gone when a step fails (a kubelet removed it): ABORTED saying so, with the
    step's own error after it; the record closed."""
    r, kept = _restorer(cfg, up)
    up.fail["CreateContainer"] = rpc_error("NOT_FOUND", "sandbox not found")
    real = up.create_container

    async def create_after_removal(*args: Any, **kwargs: Any) -> Any:
        up.sandboxes.clear()  # another caller removed it
        return await real(*args, **kwargs)

    up.create_container = create_after_removal  # type: ignore[method-assign]
    with pytest.raises(
        errors.Aborted, match="was removed by another caller during the restore.*sandbox not found"
    ):
        await r.restore(_request(), 30.0)
    assert not _open_records(cfg) and not kept


async def test_undo_runs_last_in_first_out(
    cfg: Config, up: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each undo is registered right after its step and they run in reverse: the restored-container
    ids are forgotten, then the sandbox (with its containers) is removed, then the decrypted
    plaintext, and the journal record is closed last."""
    import dataclasses

    from shim.archive import crypto
    from shim.checks.wiring import RestoredContainers

    order: list[str] = []
    monkeypatch.setattr(crypto, "decrypt_members", lambda *a, **k: None)
    real_remove = crypto.remove_decrypted

    def remove_decrypted(d: Path) -> None:
        order.append("remove plaintext " + ("(sandbox still there)" if up.sandboxes else "(sandbox gone)"))
        real_remove(d)

    monkeypatch.setattr(crypto, "remove_decrypted", remove_decrypted)
    r, kept = _restorer(cfg, up)
    restored = RestoredContainers(cfg.state_dir)
    r.restored = restored
    real_discard = restored.discard

    def discard(cid: str) -> None:
        order.append(f"forget {cid}")
        real_discard(cid)

    restored.discard = discard  # type: ignore[method-assign]
    journal_finish = r.journal.finish

    def finish(rec: Any) -> None:
        order.append("close record")
        journal_finish(rec)

    r.journal.finish = finish  # type: ignore[method-assign]
    plain_check = r.checks.check

    async def encrypted_check(req: cri.RestorePodRequest, pages_from_source: bool = False) -> Checked:
        checked = await plain_check(req)
        checked.manifest.encryption = manifest.Encryption(scheme="test", key_id="k", mac="")
        return dataclasses.replace(checked, key=object())  # type: ignore[arg-type]  # never read here

    r.checks.check = encrypted_check  # type: ignore[method-assign]
    up.fail["CreateContainer"] = [None, rpc_error("INVALID_ARGUMENT", "bad mount")]
    with pytest.raises(errors.InvalidArgument, match="creating container 'b'"):
        await r.restore(_request(), 30.0)
    first = next(a for n, a in up.calls if n == "CreateContainer")
    assert first == "a"
    (cid,) = [c for c in order if c.startswith("forget ")]
    assert order == [
        cid,
        "remove plaintext (sandbox gone)",
        "remove plaintext (sandbox gone)",
        "close record",
    ], order
    assert not restored.ids and not up.sandboxes and not kept
    assert list(crypto.decrypted_root(cfg.state_dir).iterdir()) == []


async def test_a_kubelets_restore_journals_its_fill_while_it_writes(
    cfg: Config, up: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """restore_into's fill (a kubelet's pod, no RestorePod record around it) has a volume-fill
    record naming the still-empty volume for as long as it writes, and none once it has ended,
    filled or failed: a crash in it is undone at the next start, a finished fill never is."""
    from shim.aio import Steps
    from shim.archive import volumes
    from shim.ops import pod_volumes

    r, _ = _restorer(cfg, up)
    checked = await r.checks.check(_request())
    checked.volume_record = volumes.Record(("work",), False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(
        pod_volumes, "targets", lambda *a, **k: pod_volumes.Targets({"work": str(work)}, None)
    )
    seen: list[Any] = []

    def fill(*args: Any, **kwargs: Any) -> list[pod_volumes.Filled]:
        seen.append([(rec.kind, rec.data.volumes) for rec in _open_records(cfg)])
        if len(seen) == 2:
            raise errors.DataLoss("the tar is truncated")
        (work / "msg").write_text("rendered")
        return [pod_volumes.Filled("work", str(work), 8, volumes.Prior.of(work.stat()))]

    monkeypatch.setattr(pod_volumes, "fill", fill)
    sandbox = _request().config
    filled: list[pod_volumes.Filled] = []
    await r._fill_volumes(checked, [], sandbox, "sb-1", Steps(), filled, partial=True)
    [[(kind, recorded)]] = seen
    assert kind == "volume-fill" and [v["target"] for v in recorded] == [str(work)]
    assert [f.name for f in filled] == ["work"] and _open_records(cfg) == []
    (work / "msg").unlink()
    with pytest.raises(errors.DataLoss):
        await r._fill_volumes(checked, [], sandbox, "sb-1", Steps(), filled, partial=True)
    assert len(seen) == 2 and _open_records(cfg) == []
