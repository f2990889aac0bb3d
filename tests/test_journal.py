"""shim.state.journal: durable, atomic records of in-flight operations, replayed at start."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from shim.archive import fsutil
from shim.errors import Internal, InvalidArgument, NotFound
from shim.state import Journal, OpRecord
from shim.state import journal as journal_mod


@pytest.fixture
def j(tmp_path: Path) -> Journal:
    return Journal(tmp_path / "state")


def _files(j: Journal) -> list[str]:
    return sorted(os.listdir(j.ops_dir))


def test_begin_writes_before_returning(j: Journal) -> None:
    rec = j.begin("checkpoint", "pod-1", {"output_path": "/x", "cgroups": ["/kubepods/p"]})
    assert rec.path.parent == j.ops_dir and rec.path.name == f"{rec.op_id}.json"
    doc = json.loads(rec.path.read_bytes())
    assert doc["kind"] == "checkpoint" and doc["pod_key"] == "pod-1" and doc["phase"] == "begun"
    assert doc["data"]["cgroups"] == ["/kubepods/p"] and doc["pid"] == os.getpid()
    assert stat.S_IMODE(rec.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(j.ops_dir.stat().st_mode) == 0o700


def test_update_and_finish(j: Journal) -> None:
    rec = j.begin("restore", "pod-2", {"checkpoint_path": "/a"})
    j.update(rec, "sandbox", sandbox_id="sb-1")
    doc = json.loads(rec.path.read_bytes())
    assert doc["phase"] == "sandbox" and doc["data"] == {"checkpoint_path": "/a", "sandbox_id": "sb-1"}
    j.finish(rec)
    assert _files(j) == []
    j.finish(rec)  # idempotent
    with pytest.raises(NotFound, match="already finished"):
        j.update(rec, "late")


def test_pending_after_restart(tmp_path: Path) -> None:
    j1 = Journal(tmp_path)
    a = j1.begin("checkpoint", "pod-a", {"n": 1})
    b = j1.begin("checkpoint-container", "pod-b")
    j1.update(a, "archiving")
    done = j1.begin("restore", "pod-c")
    j1.finish(done)
    # a new podshim process reads what the previous one left
    got = Journal(tmp_path).pending()
    assert [r.op_id for r in got] == [a.op_id, b.op_id]
    assert got[0] == a and got[0].phase == "archiving" and got[0].data.extra == {"n": 1}
    assert isinstance(got[1], OpRecord) and got[1].kind == "checkpoint-container"


def test_pending_on_fresh_dir(tmp_path: Path) -> None:
    assert Journal(tmp_path / "never-created").pending() == []


def test_pending_ignores_temp_files(j: Journal) -> None:
    rec = j.begin("checkpoint", "pod")
    # a crash between write and rename leaves a temp sibling: never a record
    (j.ops_dir / fsutil.temp_name_for(rec.path.name)).write_bytes(b'{"half": ')
    (j.ops_dir / "README").write_text("not a record")
    assert [r.op_id for r in j.pending()] == [rec.op_id]


@pytest.mark.parametrize(
    "content",
    [b'{"version": 1, "op_id": "x"', b"[1, 2]", b"\xff\xfe", b'{"version": 99}', b""],
)
def test_pending_reports_corrupt_without_crashing(j: Journal, content: bytes) -> None:
    good = j.begin("checkpoint", "pod")
    bad = j.ops_dir / "20260101T000000-checkpoint-deadbeef.json"
    bad.write_bytes(content)
    scan = j.scan()
    assert [c.path for c in scan.corrupt] == [bad] and scan.corrupt[0].error
    assert [r.op_id for r in j.pending()] == [good.op_id]
    # set aside, kept for the operator, not replayed again
    assert not bad.exists() and (j.ops_dir / (bad.name + ".corrupt")).read_bytes() == content
    assert j.scan().corrupt == []


def test_record_renamed_by_hand_is_corrupt(j: Journal) -> None:
    rec = j.begin("checkpoint", "pod")
    os.rename(rec.path, j.ops_dir / "other.json")
    assert j.scan().records == [] and len(j.scan().corrupt) == 1


def test_bad_arguments(j: Journal) -> None:
    with pytest.raises(InvalidArgument, match="kind"):
        j.begin("dance", "pod")
    with pytest.raises(InvalidArgument, match="pod key"):
        j.begin("checkpoint", "")
    with pytest.raises(Internal, match="JSON"):
        j.begin("checkpoint", "pod", {"x": object()})
    assert _files(j) == []


def test_failed_update_keeps_previous_version(j: Journal, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = j.begin("checkpoint", "pod", {"k": "v"})
    before = rec.path.read_bytes()

    def crash(*a: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fsutil.os, "rename", crash)
    with pytest.raises(Internal):
        j.update(rec, "frozen")
    monkeypatch.undo()
    assert rec.phase == "begun"  # memory does not run ahead of the disk
    assert rec.path.read_bytes() == before
    assert _files(j) == [rec.path.name]
    assert journal_mod.Journal(j.state_dir).pending()[0].phase == "begun"
