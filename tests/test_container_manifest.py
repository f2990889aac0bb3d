"""The container checkpoint tar's manifest, podshim-manifest.json (shim/archive/manifest.py
ContainerTarManifest): the format the previous podshim wrote reads and writes back byte for byte,
and the one set of checks serves CreateContainer-from-a-tar (restore_container.load_imported) and
`podshim inspect --verify` (docs/design/checkpoint-container.md (CheckpointContainer))."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import contract
from shim.aio import Steps
from shim.archive import layout
from shim.archive.container_tar import MANIFEST_FILE, ContainerTarManifest, container_tar_files
from shim.archive.manifest import FileEntry
from shim.cli.commands.inspect import inspect_container_tar
from shim.criu.options import CriuOptions
from shim.errors import DataLoss, FailedPrecondition
from shim.ops.restore_container import load_imported, restore_config

# podshim-manifest.json as the podshim before ContainerTarManifest wrote it (its
# ContainerCheckpointer._manifest dict through layout.json_bytes), values from a real checkpoint
OLD_MANIFEST = """{
 "container": {
  "id": "4f1c0e",
  "image": "localhost/podshim-test/counter:1",
  "image_ref": "sha256:93ab",
  "name": "counter",
  "restart_count": 0,
  "state": "CONTAINER_RUNNING"
 },
 "created": "2026-11-23T16:58:44.619Z",
 "criu_stats": {
  "freezing_time": 0,
  "frozen_time": 41203,
  "pages_written": 8312
 },
 "files": {
  "checkpoint/inventory.img": {
   "sha256": "ab12",
   "size": 42
  },
  "config.dump": {
   "sha256": "cd34",
   "size": 1000
  }
 },
 "format": "podshim.container-checkpoint.v1",
 "host": {
  "arch": "x86_64",
  "cgroup_version": "",
  "cpuinfo": "",
  "criu_version": "4.1.1",
  "kernel": "6.18.0",
  "podshim_version": "0.1.0",
  "runtime_name": "runc",
  "runtime_version": "1.1.5"
 },
 "options": {
  "file-locks": "true",
  "tcp-established": "false"
 },
 "pod": {
  "id": "9e2d",
  "name": "web",
  "namespace": "default",
  "uid": "u-1"
 },
 "timings": {
  "archive": 0.20713,
  "freeze_window": 0.412207,
  "total": 1.5
 }
}
"""


def test_the_previous_format_reads_and_writes_back_byte_for_byte() -> None:
    m = ContainerTarManifest.from_dict(json.loads(OLD_MANIFEST), "ck.tar")
    assert m.files["config.dump"] == FileEntry(size=1000, sha256="cd34")
    assert m.options == {"file-locks": "true", "tcp-established": "false"} and m.timings["freeze_window"] > 0
    assert m.to_json().decode() == OLD_MANIFEST
    m.check_format("ck.tar")


@pytest.mark.parametrize(
    ("doc", "error", "says"),
    [
        ([], DataLoss, "malformed"),
        ({"format": "podshim.container-checkpoint.v1"}, DataLoss, "malformed"),  # no files
        ({"files": {}, "timings": []}, DataLoss, "malformed"),
        ({"files": {"a": {"size": "1", "sha256": "x"}}}, DataLoss, "a differs from its manifest"),
    ],
)
def test_a_shape_podshim_never_writes_is_data_loss(doc: object, error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        ContainerTarManifest.from_dict(doc, "ck.tar")


def test_another_format_is_read_but_refused_by_check_format() -> None:
    m = ContainerTarManifest.from_dict({"format": "podshim.container-checkpoint.v9", "files": {}}, "ck.tar")
    with pytest.raises(FailedPrecondition, match="v9' is not supported"):
        m.check_format("ck.tar")


# ---------------------------------------------------------------------------- one tree, both readers


def _tree(root: Path) -> dict[str, bytes]:
    files = {
        layout.SPEC_DUMP_FILE: b'{"process": {"args": ["sleep", "1"]}}',
        layout.CONFIG_DUMP_FILE: json.dumps({"id": "c1", "podshim": {"format": "x"}}).encode(),
        "checkpoint/inventory.img": b"inventory",
        layout.ROOTFS_DIFF_TAR: b"diff",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _manifest_for(files: dict[str, bytes], **kw: object) -> ContainerTarManifest:
    entries = {rel: FileEntry(len(d), hashlib.sha256(d).hexdigest()) for rel, d in files.items()}
    return ContainerTarManifest(files=entries, options={contract.FILE_LOCKS: "true"}, **kw)  # type: ignore[arg-type]


def test_the_writer_and_the_reader_agree_on_a_tree(tmp_path: Path) -> None:
    files = _tree(tmp_path)
    m = _manifest_for(files)
    (tmp_path / MANIFEST_FILE).write_bytes(m.to_json())
    assert container_tar_files(tmp_path) == m.files  # the manifest is not listed in itself
    ck = load_imported(tmp_path, tmp_path / "ck.tar", Steps())
    assert ck.manifest == ContainerTarManifest.from_dict(json.loads(m.to_json()), "ck.tar")
    cc = restore_config(cri.ContainerConfig(), ck, cri.ImageSpec(image="busybox"))
    assert CriuOptions.from_record(cc.annotations[contract.RESTORE_OPTIONS_ANNOTATION]).file_locks


@pytest.mark.parametrize(
    ("damage", "error", "says"),
    [
        (
            lambda root: (root / layout.ROOTFS_DIFF_TAR).write_bytes(b"DIFF"),
            DataLoss,
            "rootfs-diff.tar differs",
        ),
        (lambda root: (root / "extra").write_bytes(b""), DataLoss, "extra missing or extra"),
        (lambda root: (root / layout.ROOTFS_DIFF_TAR).unlink(), DataLoss, "rootfs-diff.tar missing or extra"),
        (lambda root: (root / MANIFEST_FILE).unlink(), DataLoss, "truncated"),
        (lambda root: (root / MANIFEST_FILE).write_text('{"files": 1}'), DataLoss, "malformed"),
        (
            lambda root: (root / MANIFEST_FILE).write_text('{"format": "other", "files": {}}'),
            FailedPrecondition,
            "not supported",
        ),
    ],
)
def test_load_imported_refuses_what_the_manifest_does_not_vouch_for(
    tmp_path: Path, damage: object, error: type, says: str
) -> None:
    files = _tree(tmp_path)
    (tmp_path / MANIFEST_FILE).write_bytes(_manifest_for(files).to_json())
    damage(tmp_path)  # type: ignore[operator]
    with pytest.raises(error, match=says):
        load_imported(tmp_path, tmp_path / "ck.tar", Steps())


def _tar(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        for rel, data in files.items():
            ti = tarfile.TarInfo(rel)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))


def test_inspect_verifies_with_the_same_manifest(tmp_path: Path) -> None:
    files = _tree(tmp_path / "tree")
    m = _manifest_for(files, pod={"name": "web", "namespace": "default"}, timings={"freeze_window": 0.25})
    good = tmp_path / "good.tar"
    _tar(good, {**files, MANIFEST_FILE: m.to_json()})
    info = inspect_container_tar(good, verify=True)
    assert info["verified"] and info["format"] == m.format and info["freeze_window_seconds"] == 0.25
    assert info["pod"]["name"] == "web" and info["options"] == {contract.FILE_LOCKS: "true"}
    bad = tmp_path / "bad.tar"  # a metadata member (parsed, then hashed again) changed
    _tar(bad, {**files, layout.SPEC_DUMP_FILE: b'{"process": {}}', MANIFEST_FILE: m.to_json()})
    assert inspect_container_tar(bad, verify=False)["format"] == m.format
    with pytest.raises(DataLoss, match="spec.dump differs from its manifest"):
        inspect_container_tar(bad, verify=True)
    other = tmp_path / "other.tar"  # containerd 2.x's own: no podshim manifest
    _tar(other, {**files, layout.CONFIG_DUMP_FILE: b'{"id": "c1"}'})
    assert inspect_container_tar(other, verify=False)["format"] == "(no podshim manifest)"
    with pytest.raises(FailedPrecondition, match="no podshim manifest"):
        inspect_container_tar(other, verify=True)


def test_status_dump_is_the_cri_status_as_containerd_writes_it() -> None:
    """status.dump holds the CRI ContainerStatus in Go's encoding/json form, which containerd's
    own restore of a container tar decodes: proto field names, enums and 64-bit integers as
    numbers (proto3 JSON's "CONTAINER_RUNNING" and "1733…" fail it), maps and nested messages as
    objects, bytes as base64, unset fields left out."""
    from shim.sandbox.view import go_json

    status = cri.ContainerStatus(
        id="c1",
        state=cri.CONTAINER_RUNNING,
        created_at=1733000000123456789,
        image=cri.ImageSpec(image="sha256:ab", user_specified_image="counter:1"),
        labels={"io.kubernetes.container.name": "counter"},
        mounts=[cri.Mount(container_path="/work", host_path="/h", readonly=True)],
    )
    assert go_json(status) == {
        "id": "c1",
        "state": 1,
        "created_at": 1733000000123456789,
        "image": {"image": "sha256:ab", "user_specified_image": "counter:1"},
        "labels": {"io.kubernetes.container.name": "counter"},
        "mounts": [{"container_path": "/work", "host_path": "/h", "readonly": True}],
    }
    assert go_json(cri.ExecSyncResponse(stdout=b"\xff\x00", exit_code=3)) == {
        "stdout": "/wA=",
        "exit_code": 3,
    }


def test_page_images_extracted_unhashed_are_checked_by_size_and_handed_to_podshim_runc(
    tmp_path: Path,
) -> None:
    """pages_later: the page images are copied without being hashed; load_imported checks their
    sizes (and every other member's sha256) against the manifest and gives their listed sha256
    to the restore's annotation, which podshim-runc checks while CRIU reads them. Nothing else is
    left unchecked: a member that merely looks like a page image elsewhere is hashed."""
    from shim.ops.restore_container import extract_archive

    files = {**_tree(tmp_path / "src"), "checkpoint/pages-1.img": b"\1" * 8192, "pages-2.img": b"x"}
    m = _manifest_for(files)
    good = tmp_path / "good.tar"
    _tar(good, {**files, MANIFEST_FILE: m.to_json()})
    written = extract_archive(good, tmp_path / "a", Steps(), pages_later=True)
    assert written["checkpoint/pages-1.img"].sha256 == "" and written["pages-2.img"].sha256
    # copied by the kernel (a plain tar): the same bytes
    assert (tmp_path / "a" / "checkpoint" / "pages-1.img").read_bytes() == files["checkpoint/pages-1.img"]
    half = tmp_path / "half.tar"  # cut inside the page image: truncated, whoever copies it
    half.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataLoss, match="truncated"):
        extract_archive(half, tmp_path / "h", Steps(), pages_later=True)
    ck = load_imported(tmp_path / "a", good, Steps(), None, written)
    assert ck.pages_later == {"checkpoint/pages-1.img": m.files["checkpoint/pages-1.img"].sha256}
    cc = restore_config(cri.ContainerConfig(), ck, cri.ImageSpec(image="busybox"))
    assert contract.parse_page_digests(cc.annotations[contract.PAGE_DIGESTS_ANNOTATION]) == ck.pages_later
    short = tmp_path / "short.tar"  # a page image of another size than listed: refused here
    _tar(short, {**files, "checkpoint/pages-1.img": b"\1" * 4096, MANIFEST_FILE: m.to_json()})
    written = extract_archive(short, tmp_path / "b", Steps(), pages_later=True)
    with pytest.raises(DataLoss, match="pages-1.img differs"):
        load_imported(tmp_path / "b", short, Steps(), None, written)
