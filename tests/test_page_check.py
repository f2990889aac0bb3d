"""An eager restore's page images checked beside CRIU's restore (docs/design/restore-pod.md (RestorePod)
steps 1 and 4): the contract annotation, which members RestorePod leaves to podshim-runc, and the
wrapper's check and its decision (continue the held tasks, or kill them), on real processes. The
end-to-end cases are in tests/test_restore_pod.py and tests/faults/test_restore_crash.py."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import contract, errors
from shim.archive import manifest
from shim.config import Config
from shim.ops.restore_pod import deferred_pages
from shim.wrapper import cleanup, page_check
from shim.wrapper import restore as hook
from tests.fakes import FakeUpstream
from tests.test_orchestration import _open_records, _request, _restorer, _with_member

DIGEST = "ab" * 32


# ---------------------------------------------------------------------------- the annotation


def test_page_digests_round_trip() -> None:
    digests = {"checkpoint/pages-2.img": "cd" * 32, "checkpoint/pages-1.img": DIGEST}
    value = contract.page_digests_record(digests)
    assert contract.parse_page_digests(value) == digests
    assert value.index("pages-1") < value.index("pages-2")  # stable: sorted


@pytest.mark.parametrize(
    "value",
    [
        "",
        "not json",
        "[]",
        "{}",  # an eager check of nothing is no check: podshim never sets it empty
        json.dumps({"checkpoint/core-1.img": DIGEST}),  # not a page image
        json.dumps({"checkpoint/pages-1.img/../../etc/shadow": DIGEST}),
        json.dumps({"../checkpoint/pages-1.img": DIGEST}),
        json.dumps({"/checkpoint/pages-1.img": DIGEST}),
        json.dumps({"checkpoint/pages-x.img": DIGEST}),
        json.dumps({"checkpoint/pages-1.img\n": DIGEST}),
        json.dumps({"checkpoint/pages-1.img": "AB" * 32}),  # hex is lower case
        json.dumps({"checkpoint/pages-1.img": "ab"}),
        json.dumps({"checkpoint/pages-1.img": 1}),
    ],
)
def test_malformed_page_digests_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        contract.parse_page_digests(value)


def test_deferred_pages_are_only_criu_page_images() -> None:
    """What RestorePod leaves to podshim-runc: the container's pages-<n>.img, by their path in the
    container's dir; any other member (a page image of another container, an odd name) is verified
    before a container exists."""
    m = manifest.Manifest(sandbox=manifest.SandboxInfo(id="s", metadata={}, config={}))
    for rel in (
        "containers/a/checkpoint/pages-1.img",
        "containers/a/checkpoint/pages-12.img",
        "containers/a/checkpoint/pages-x.img",
        "containers/a/checkpoint/pagemap-1.img",
        "containers/a/checkpoint/core-1.img",
        "containers/ab/checkpoint/pages-1.img",
    ):
        m.files[rel] = manifest.FileEntry(1, hashlib.sha256(rel.encode()).hexdigest())
    got = deferred_pages(m, "containers/a")
    assert got == {
        "checkpoint/pages-1.img": hashlib.sha256(b"containers/a/checkpoint/pages-1.img").hexdigest(),
        "checkpoint/pages-12.img": hashlib.sha256(b"containers/a/checkpoint/pages-12.img").hexdigest(),
    }
    contract.parse_page_digests(contract.page_digests_record(got))  # what the wrapper accepts


# ---------------------------------------------------------------------------- RestorePod's side


def _capture_configs(up: FakeUpstream) -> dict[str, cri.ContainerConfig]:
    configs: dict[str, cri.ContainerConfig] = {}
    create = up.CreateContainer

    async def capture(req: cri.CreateContainerRequest, timeout: float) -> Any:
        configs[req.config.metadata.name] = req.config
        return await create(req, timeout)

    up.CreateContainer = capture  # type: ignore[method-assign]
    return configs


async def test_deferred_page_image_is_not_checked_up_front(cfg: Config, up: FakeUpstream) -> None:
    """defer_pages (eager, plain, annotations known to pass): a page image that differs does not fail
    RestorePod; its recorded sha256 goes to podshim-runc in the annotation instead."""
    r, _kept = _restorer(cfg, up)
    _with_member(r, "containers/a/checkpoint/pages-1.img", b"x" * 4096, b"y" * 4096)
    plain_check = r.checks.check

    async def check(req: cri.RestorePodRequest, pages_from_source: bool = False) -> Any:
        checked = await plain_check(req)
        checked.defer_pages = True
        return checked

    r.checks.check = check  # type: ignore[method-assign]
    configs = _capture_configs(up)
    await r.restore(_request(), 30.0)
    got = contract.parse_page_digests(configs["a"].annotations[contract.PAGE_DIGESTS_ANNOTATION])
    assert got == {"checkpoint/pages-1.img": hashlib.sha256(b"y" * 4096).hexdigest()}
    assert contract.PAGE_DIGESTS_ANNOTATION not in configs["b"].annotations  # it has no page image
    assert not _open_records(cfg)


async def test_other_images_stay_checked_up_front_when_pages_are_deferred(
    cfg: Config, up: FakeUpstream
) -> None:
    """What CRIU parses (here a core image) never reaches it unverified: DATA_LOSS before any
    container is created, the sandbox removed."""
    r, _kept = _restorer(cfg, up)
    _with_member(r, "containers/a/checkpoint/core-1.img", b"x" * 4096, b"y" * 4096)
    plain_check = r.checks.check

    async def check(req: cri.RestorePodRequest, pages_from_source: bool = False) -> Any:
        checked = await plain_check(req)
        checked.defer_pages = True
        return checked

    r.checks.check = check  # type: ignore[method-assign]
    with pytest.raises(errors.DataLoss, match="core-1.img has sha256"):
        await r.restore(_request(), 30.0)
    assert "CreateContainer" not in up.names() and not up.sandboxes


async def test_without_deferral_a_page_image_is_checked_up_front(cfg: Config, up: FakeUpstream) -> None:
    """No wiring verdict (or not OK, lazy, encrypted): the page images are checked before any
    container, as before, and no annotation is set."""
    r, _kept = _restorer(cfg, up)
    _with_member(r, "containers/a/checkpoint/pages-1.img", b"x" * 4096, b"y" * 4096)
    with pytest.raises(errors.DataLoss, match="pages-1.img has sha256"):
        await r.restore(_request(), 30.0)
    assert "CreateContainer" not in up.names()


@pytest.fixture
def up() -> FakeUpstream:
    return FakeUpstream()


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    (tmp_path / "roots").mkdir()
    return Config(state_dir=str(tmp_path / "state"), allowed_roots=(str(tmp_path / "roots"),))


# ---------------------------------------------------------------------------- the wrapper's check


def _images(root: Path, contents: dict[str, bytes]) -> dict[str, str]:
    (root / "checkpoint").mkdir(parents=True, exist_ok=True)
    for rel, data in contents.items():
        (root / rel).write_bytes(data)
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in contents.items()}


def test_page_images_match(tmp_path: Path) -> None:
    digests = _images(
        tmp_path,
        {
            "checkpoint/pages-1.img": os.urandom(9 << 20),
            "checkpoint/pages-2.img": b"",
            "checkpoint/pages-3.img": b"z",
        },
    )
    check = page_check.PageImages(tmp_path, digests)
    check.start()
    assert check.wait() == ""
    assert check.bytes == (9 << 20) + 1 and check.seconds > 0


def test_page_image_mismatch_names_the_member(tmp_path: Path) -> None:
    digests = _images(
        tmp_path, {"checkpoint/pages-1.img": os.urandom(5 << 20), "checkpoint/pages-2.img": b"a"}
    )
    data = bytearray((tmp_path / "checkpoint/pages-1.img").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "checkpoint/pages-1.img").write_bytes(bytes(data))
    check = page_check.PageImages(tmp_path, digests)
    check.start()
    problem = check.wait()
    assert problem.startswith("checksum mismatch of checkpoint/pages-1.img"), problem
    assert digests["checkpoint/pages-1.img"] in problem


def test_missing_or_symlinked_page_image_is_unreadable(tmp_path: Path) -> None:
    digests = _images(tmp_path, {"checkpoint/pages-1.img": b"a"})
    (tmp_path / "checkpoint/pages-1.img").unlink()
    check = page_check.PageImages(tmp_path, digests)
    check.start()
    assert check.wait().startswith("cannot read checkpoint/pages-1.img")
    (tmp_path / "target").write_bytes(b"a")
    (tmp_path / "checkpoint/pages-1.img").symlink_to(tmp_path / "target")  # same bytes, not followed
    check = page_check.PageImages(tmp_path, digests)
    check.start()
    assert check.wait().startswith("cannot read checkpoint/pages-1.img")


def test_stopped_check_reports_nothing(tmp_path: Path) -> None:
    digests = _images(tmp_path, {"checkpoint/pages-1.img": os.urandom(64 << 20)})
    check = page_check.PageImages(tmp_path, {**digests, "checkpoint/pages-1.img": DIGEST})
    check.stop.set()  # the restore failed: its own error is reported
    check.start()
    assert check.wait() == ""


def test_an_unlisted_page_image_refuses_the_restore(tmp_path: Path) -> None:
    """A page image in the checkpoint dir the annotation does not list would be restored unchecked."""
    digests = _images(tmp_path, {"checkpoint/pages-1.img": b"a", "checkpoint/pages-2.img": b"b"})
    del digests["checkpoint/pages-2.img"]
    spec = {"annotations": {contract.PAGE_DIGESTS_ANNOTATION: contract.page_digests_record(digests)}}
    with pytest.raises(hook.RestoreFailed, match="not a page image RestorePod recorded"):
        hook._page_check(spec, tmp_path, "cid")
    (tmp_path / "checkpoint/pages-2.img").unlink()
    assert hook._page_check(spec, tmp_path, "cid") is not None
    (tmp_path / "checkpoint/pages-x.img").write_bytes(b"c")  # no name CRIU reads: checked up front
    assert hook._page_check(spec, tmp_path, "cid") is not None
    assert hook._page_check({"annotations": {}}, tmp_path, "cid") is None
    spec["annotations"][contract.PAGE_DIGESTS_ANNOTATION] = '{"checkpoint/../x": "1"}'
    with pytest.raises(hook.RestoreFailed, match="malformed"):
        hook._page_check(spec, tmp_path, "cid")


# ---------------------------------------------------------------------------- continue or kill


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.fixture
def held(tmp_path: Path) -> Any:
    """A stopped two-process "container" (a shell and its child), as CRIU leaves a restore with
    leave-stopped: its pid file names the shell."""
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    children: list[int] = []
    while not children and time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(x) for x in f.read().split()]
        time.sleep(0.01)
    assert children
    pids = [proc.pid, *children]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        while _state(pid) != "T":
            time.sleep(0.01)
    pid_file = tmp_path / "pid"
    pid_file.write_text(str(proc.pid))
    yield proc, pids, str(pid_file)
    for pid in pids:
        with __import__("contextlib").suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def test_matching_pages_continue_every_process(tmp_path: Path, held: Any) -> None:
    proc, pids, pid_file = held
    digests = _images(tmp_path / "c", {"checkpoint/pages-1.img": b"a"})
    check = page_check.PageImages(tmp_path / "c", digests)
    check.start()
    page_check.settler(check, "", pid_file, tmp_path)(0)
    assert check.problem == ""
    assert cleanup.container_pids("", pid_file) == set(pids)
    assert all(_state(p) in ("S", "R") for p in pids), f"a process left stopped: {[_state(p) for p in pids]}"
    logged = json.loads((tmp_path / page_check.PAGE_CHECK_LOG).read_text())
    assert logged["ok"] and logged["files"] == 1 and logged["bytes"] == 1


def test_a_mismatch_kills_every_process_before_it_ran(tmp_path: Path, held: Any) -> None:
    proc, pids, pid_file = held
    digests = _images(tmp_path / "c", {"checkpoint/pages-1.img": b"a"})
    check = page_check.PageImages(tmp_path / "c", {"checkpoint/pages-1.img": DIGEST})
    check.start()
    page_check.settler(check, "", pid_file, tmp_path)(0)
    assert check.problem.startswith("checksum mismatch of checkpoint/pages-1.img")
    assert proc.wait(timeout=10) == -signal.SIGKILL
    for pid in pids:  # SIGKILLed: dying (no cgroup here for kill_tasks to wait on)
        deadline = time.monotonic() + 10
        while _state(pid) not in ("gone", "Z") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(pid) in ("gone", "Z"), f"{pid} survived the mismatch"
    assert digests  # (the image itself was fine: the recorded digest differs)
    assert not json.loads((tmp_path / page_check.PAGE_CHECK_LOG).read_text())["ok"]


def test_a_failed_restore_stops_the_check(tmp_path: Path, held: Any) -> None:
    """runc restore failed: CRIU killed its tasks itself; the check stops and decides nothing."""
    proc, pids, pid_file = held
    _images(tmp_path / "c", {"checkpoint/pages-1.img": os.urandom(32 << 20)})
    check = page_check.PageImages(tmp_path / "c", {"checkpoint/pages-1.img": DIGEST})
    check.start()
    page_check.settler(check, "", pid_file, tmp_path)(1)
    assert check.problem in ("",) or check.problem.startswith("checksum mismatch")  # a race: either
    assert [_state(p) for p in pids] == ["T", "T"]  # the failure path of the restore handles them


# ---------------------------------------------------------------------------- the wiring check


@pytest.mark.parametrize(
    ("patterns", "ok"),
    [
        (["podshim.*"], True),
        (["podshim.restore.*"], True),
        (["podshim.restore.checkpoint-dir", "podshim.restore.criu-options"], False),
        (
            [
                "podshim.restore.checkpoint-dir",
                "podshim.restore.criu-options",
                "podshim.restore.page-digests",
            ],
            True,
        ),
    ],
)
def test_wiring_requires_the_page_digests_to_pass(patterns: list[str], ok: bool) -> None:
    """Dropped on the way to podshim-runc, the annotation would leave an eager restore running on
    page images nobody checked: a handler that does not pass it is wired wrong (and RestorePod
    defers the page images only on a handler wired OK)."""
    from shim.checks import wiring
    from tests.test_wiring import runtime, status_info

    w = wiring.judge(status_info({"runc": runtime("/usr/local/bin/podshim-runc", patterns)}), "", 1)
    assert (w.verdict is wiring.Verdict.OK) is ok, w.problem
    if not ok:
        assert contract.PAGE_DIGESTS_ANNOTATION in w.problem
