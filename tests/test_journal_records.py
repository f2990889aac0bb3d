"""Typed journal records (shim/state/records.py): a record written by the podshim before them
(untyped dicts, commit 6296e57) is read, recovered and written back in the same format, and a record
this podshim writes is what the previous one wrote (docs/design/crash-safety.md (Crash safety))."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim.archive import fsutil
from shim.archive.manifest import rfc3339_now
from shim.config import Config
from shim.engine import Engine
from shim.errors import Internal, InvalidArgument
from shim.state import Journal
from shim.state.records import (
    RECORDS,
    CheckpointRecord,
    ContainerCheckpointRecord,
    JournalData,
    LazyPagesRecord,
    RestoreRecord,
    VolumeFillRecord,
)
from tests.fakes import FakeUpstream

# Records exactly as the previous podshim's journal wrote them (6296e57's Journal.begin/update,
# captured from that code): only `data` differs by kind.
OLD_FILES = {
    "checkpoint": """{
 "data": {
  "cgroups": [
   "/kubepods/pod1",
   "/kubepods/pod1/c1"
  ],
  "output_path": "/roots/out"
 },
 "kind": "checkpoint",
 "op_id": "20261123T165844-checkpoint-80e6e85b",
 "phase": "frozen",
 "pid": 25499,
 "pod_key": "sb-1",
 "started": "2026-11-23T16:58:44.619Z",
 "updated": "2026-11-23T16:58:44.638Z",
 "version": 1
}
""",
    "checkpoint-container": """{
 "data": {
  "cgroups": [
   "/kubepods/pod2/c2"
  ],
  "container_id": "c2",
  "output_path": "/roots/.podshim-checkpoint.tmp-0a1b2c3d4e5f",
  "target": "/roots/checkpoint-web.tar"
 },
 "kind": "checkpoint-container",
 "op_id": "20261123T165844-checkpoint-container-70792b64",
 "phase": "begun",
 "pid": 25499,
 "pod_key": "sb-2",
 "started": "2026-11-23T16:58:44.643Z",
 "updated": "2026-11-23T16:58:44.643Z",
 "version": 1
}
""",
    "restore-unknown": """{
 "data": {
  "checkpoint_path": "/roots/ckpt",
  "sandbox_metadata": {
   "attempt": 1,
   "name": "web",
   "namespace": "default",
   "uid": "u-1"
  },
  "sandbox_unknown_since": 1795453124.6536179
 },
 "kind": "restore",
 "op_id": "20261123T165844-restore-004701bd",
 "phase": "sandbox-unknown",
 "pid": 25499,
 "pod_key": "default/web",
 "started": "2026-11-23T16:58:44.644Z",
 "updated": "2026-11-23T16:58:44.653Z",
 "version": 1
}
""",
    "restore-sandbox": """{
 "data": {
  "checkpoint_path": "/roots/ckpt",
  "sandbox_id": "sb-9"
 },
 "kind": "restore",
 "op_id": "20261123T165844-restore-83049a80",
 "phase": "sandbox",
 "pid": 25499,
 "pod_key": "default/api",
 "started": "2026-11-23T16:58:44.655Z",
 "updated": "2026-11-23T16:58:44.657Z",
 "version": 1
}
""",
}
TYPED = {
    "checkpoint": CheckpointRecord(output_path="/roots/out", cgroups=["/kubepods/pod1", "/kubepods/pod1/c1"]),
    "checkpoint-container": ContainerCheckpointRecord(
        output_path="/roots/.podshim-checkpoint.tmp-0a1b2c3d4e5f",
        cgroups=["/kubepods/pod2/c2"],
        container_id="c2",
        target="/roots/checkpoint-web.tar",
    ),
    "restore-unknown": RestoreRecord(
        checkpoint_path="/roots/ckpt",
        sandbox_metadata={"attempt": 1, "name": "web", "namespace": "default", "uid": "u-1"},
        sandbox_unknown_since=1795453124.6536179,
    ),
    "restore-sandbox": RestoreRecord(checkpoint_path="/roots/ckpt", sandbox_id="sb-9"),
}


def _put(state: Path, text: str, **data: Any) -> Path:
    """An old-format record file in `state`'s journal (its data replaced by `data` if given)."""
    doc = json.loads(text)
    if data:
        doc["data"] = data
    ops = state / "ops"
    ops.mkdir(parents=True, exist_ok=True)
    path = ops / f"{doc['op_id']}.json"
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


@pytest.mark.parametrize("name", sorted(OLD_FILES))
def test_an_old_record_reads_as_its_typed_record_and_writes_back_unchanged(tmp_path: Path, name: str) -> None:
    ops = tmp_path / "ops"
    ops.mkdir()
    doc = json.loads(OLD_FILES[name])
    (ops / f"{doc['op_id']}.json").write_text(OLD_FILES[name])
    (rec,) = Journal(tmp_path).scan().records
    assert type(rec.data) is RECORDS[doc["kind"]] and rec.data == TYPED[name]
    assert rec.to_json().decode() == OLD_FILES[name]  # the previous podshim reads it back as it wrote it


@pytest.mark.parametrize("name", sorted(OLD_FILES))
def test_a_new_record_is_in_the_old_format(tmp_path: Path, name: str) -> None:
    j = Journal(tmp_path)
    old = json.loads(OLD_FILES[name])
    rec = j.begin(old["kind"], old["pod_key"], TYPED[name])
    assert json.loads(rec.path.read_text())["data"] == old["data"]


def test_unknown_keys_are_kept_and_missing_ones_default(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    rec = j.begin("restore", "default/web", {"checkpoint_path": "/x", "from_a_newer_podshim": [1]})
    assert rec.data == RestoreRecord(checkpoint_path="/x", extra={"from_a_newer_podshim": [1]})
    j.update(rec, "sandbox", sandbox_id="sb-1")
    data = json.loads(rec.path.read_text())["data"]
    assert data == {"checkpoint_path": "/x", "from_a_newer_podshim": [1], "sandbox_id": "sb-1"}
    assert CheckpointRecord.from_dict({}) == CheckpointRecord(output_path="", cgroups=[])


def test_a_field_of_the_wrong_type_is_a_corrupt_record(tmp_path: Path) -> None:
    path = _put(tmp_path, OLD_FILES["checkpoint"], output_path="/roots/out", cgroups="/kubepods/pod1")
    j = Journal(tmp_path)
    scan = j.scan()
    assert (
        scan.records == [] and [c.path for c in scan.corrupt] == [path] and "cgroups" in scan.corrupt[0].error
    )
    with pytest.raises(InvalidArgument, match="sandbox_id"):
        j.begin("restore", "default/web", {"sandbox_id": 7})


def test_typed_misuse_is_refused(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    with pytest.raises(InvalidArgument, match="RestoreRecord is no record of kind 'checkpoint'"):
        j.begin("checkpoint", "pod", RestoreRecord())
    rec = j.begin("checkpoint", "pod", CheckpointRecord(output_path="/x"))
    before = rec.path.read_bytes()
    with pytest.raises(Internal, match="sandbox_id"):
        j.update(rec, "frozen", sandbox_id="sb-1")
    assert rec.path.read_bytes() == before and rec.phase == "begun"


def test_a_lazy_pages_record_of_the_untyped_journal_reads_back(tmp_path: Path) -> None:
    """The lazy-pages kind was journaled as a plain dict before it was typed: such a record (as
    shim/ops/lazy_pages.py wrote it, through each phase) reads as LazyPagesRecord, unchanged."""
    j = Journal(tmp_path)
    old = {"container": "counter", "work_dir": "/s/lazy/ab", "images": "/a/c/checkpoint", "decrypted_dir": ""}
    rec = j.begin("lazy-pages", "default/web", dict(old))
    j.update(rec, "serving", pid=4242, start_time=99)
    j.update(rec, "attached", container_id="c1", verifying=2)
    (back,) = Journal(tmp_path).scan().records
    assert back.data == LazyPagesRecord(
        container="counter",
        work_dir="/s/lazy/ab",
        images="/a/c/checkpoint",
        pid=4242,
        start_time=99,
        container_id="c1",
        verifying=2,
    )
    on_disk = json.loads(back.path.read_text())["data"]
    # the fields added since (the uffd guard's) are written with their defaults
    assert on_disk == {
        **old,
        "pid": 4242,
        "start_time": 99,
        "container_id": "c1",
        "verifying": 2,
        "guard": 0,
        "guard_start_time": -1,
    }


def test_every_kind_has_a_class_with_defaults() -> None:
    """Adding a kind must not break reading older records of it: every field has a default."""
    for kind, cls in RECORDS.items():
        assert issubclass(cls, JournalData) and cls.KIND == kind
        assert cls.from_dict({}).to_dict() is not None


# ---------------------------------------------------------------------- recovery of old records


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    (tmp_path / "roots").mkdir()
    return Config(state_dir=str(tmp_path / "state"), allowed_roots=(str(tmp_path / "roots"),))


async def test_old_checkpoint_record_clears_its_partial_archive(cfg: Config) -> None:
    out = Path(cfg.allowed_roots[0]) / "out"
    (out / "containers").mkdir(parents=True)
    (out / "containers" / "pages-1.img").write_bytes(b"x")
    _put(Path(cfg.state_dir), OLD_FILES["checkpoint"], output_path=str(out), cgroups=[])
    await Engine(cfg, FakeUpstream()).recover()  # type: ignore[arg-type]
    assert list(out.iterdir()) == [] and Journal(cfg.state_dir).scan().records == []


async def test_old_container_checkpoint_record_removes_its_staging_dir(cfg: Config) -> None:
    root = Path(cfg.allowed_roots[0])
    staging = root / fsutil.temp_name_for("podshim-checkpoint")
    staging.mkdir()
    (staging / "checkpoint.tar").write_bytes(b"partial")
    old = json.loads(OLD_FILES["checkpoint-container"])["data"]
    _put(
        Path(cfg.state_dir),
        OLD_FILES["checkpoint-container"],
        **{**old, "output_path": str(staging), "cgroups": []},
    )
    await Engine(cfg, FakeUpstream()).recover()  # type: ignore[arg-type]
    assert list(root.iterdir()) == [] and Journal(cfg.state_dir).scan().records == []


async def test_old_restore_records_remove_their_sandboxes(cfg: Config) -> None:
    """By the recorded id, and by the recorded metadata after a RunPodSandbox without an answer."""
    up = FakeUpstream()
    md = cri.PodSandboxMetadata(name="web", namespace="default", uid="u-1", attempt=1)
    up.sandboxes["sb-9"] = cri.PodSandboxStatus(id="sb-9", metadata=cri.PodSandboxMetadata(name="api"))
    up.sandboxes["sb-7"] = cri.PodSandboxStatus(id="sb-7", metadata=md, created_at=time.time_ns())
    up.sandboxes["sb-keep"] = cri.PodSandboxStatus(
        id="sb-keep", metadata=cri.PodSandboxMetadata(name="other")
    )
    state = Path(cfg.state_dir)
    _put(state, OLD_FILES["restore-sandbox"])
    unknown = json.loads(OLD_FILES["restore-unknown"])
    unknown["started"] = rfc3339_now()  # the sandbox was created after the restore began
    _put(state, json.dumps(unknown))
    await Engine(cfg, up).recover()  # type: ignore[arg-type]
    assert list(up.sandboxes) == ["sb-keep"] and Journal(state).scan().records == []
    assert ("RemovePodSandbox", "sb-9") in up.calls and ("RemovePodSandbox", "sb-7") in up.calls


async def test_a_kubelet_restores_fill_cut_short_is_emptied_at_recovery(cfg: Config, tmp_path: Path) -> None:
    """A kubelet's restore killed while it filled an emptyDir of the kubelet's pod: the record
    written before the fill empties the volume at the next start, giving back the mode the kubelet
    made it with (its retry then fills it whole instead of taking a half-filled volume for a
    filled one); the kubelet's sandbox is its own and stays."""
    from shim.ops import pod_volumes

    up = FakeUpstream()
    up.sandboxes["sb-kubelet"] = cri.PodSandboxStatus(
        id="sb-kubelet", metadata=cri.PodSandboxMetadata(name="web")
    )
    work = tmp_path / "pods" / "u-2" / "volumes" / "kubernetes.io~empty-dir" / "work"
    filled_before = tmp_path / "pods" / "u-2" / "volumes" / "kubernetes.io~empty-dir" / "cache"
    work.mkdir(parents=True)
    filled_before.mkdir()
    os.chmod(work, 0o777)
    (filled_before / "kept").write_text("an earlier container's fill")
    where = pod_volumes.Targets({"work": str(work), "cache": str(filled_before)}, None)
    recorded = pod_volumes.to_fill(where)
    assert [r["target"] for r in recorded] == [str(work)], "a volume already filled is no part of this fill"
    Journal(cfg.state_dir).begin(pod_volumes.KIND, "default/web", VolumeFillRecord(recorded))
    (work / "sub").mkdir()
    (work / "sub" / "half").write_bytes(b"x" * 100)
    os.chmod(work, 0o700)  # as the tar's root entry sets it
    await Engine(cfg, up).recover()  # type: ignore[arg-type]
    assert list(work.iterdir()) == [] and stat.S_IMODE(work.stat().st_mode) == 0o777
    assert (filled_before / "kept").read_text() == "an earlier container's fill"
    assert list(up.sandboxes) == ["sb-kubelet"] and not any(c[0] == "RemovePodSandbox" for c in up.calls)
    assert Journal(cfg.state_dir).scan().records == []
