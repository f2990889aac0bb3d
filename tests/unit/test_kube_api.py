"""The cluster API's names and readers (shim/kube/api.py) and the archive a PodCheckpoint may
remove (shim/kube/controller.py): edge cases without a cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from shim.kube import api, controller


def obj(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "c", "namespace": "ns"}, "spec": spec or {}, "status": status or {}}


def ready(status: str, reason: str) -> dict[str, Any]:
    return {"conditions": [{"type": api.READY, "status": status, "reason": reason}]}


def test_both_spellings_of_the_source_pod() -> None:
    assert api.source_pod_name(obj({"sourcePodName": "web"})) == "web"
    assert api.source_pod_name(obj({"sourcePod": {"name": "web", "uid": "u1"}})) == "web"
    assert api.source_pod_uid(obj({"sourcePod": {"name": "web", "uid": "u1"}})) == "u1"
    assert api.source_pod_uid(obj({"sourcePodName": "web", "sourcePodUID": "u2"})) == "u2"
    assert api.source_pod_name(obj()) == "" and api.source_pod_uid(obj()) == ""


@pytest.mark.parametrize(
    ("status", "terminal", "is_ready"),
    [
        ({}, False, False),
        (ready("False", api.PENDING), False, False),
        (ready("False", api.IN_PROGRESS), False, False),
        (ready("True", api.COMPLETED), True, True),
        (ready("False", api.FAILED), True, False),
        (ready("False", api.SOURCE_POD_REPLACED), True, False),
    ],
)
def test_terminal_states(status: dict[str, Any], terminal: bool, is_ready: bool) -> None:
    assert api.is_terminal(obj(status=status)) is terminal
    assert api.is_ready(obj(status=status)) is is_ready


@pytest.mark.parametrize("rel", ["", "/etc", "../etc", "a/../../etc", "x/.."])
def test_a_location_leaving_the_checkpoint_root_names_no_archive(rel: str) -> None:
    loc = {"type": api.LOCATION_NODE_LOCAL, "nodeLocal": {"path": rel}}
    assert api.archive_path(obj(status={"checkpointLocation": loc})) == ""


def test_a_node_local_location_is_under_the_root() -> None:
    loc = {"type": api.LOCATION_NODE_LOCAL, "nodeLocal": {"path": "checkpoint-web_ns-1"}}
    assert (
        api.archive_path(obj(status={"checkpointLocation": loc}))
        == f"{api.CHECKPOINT_ROOT}/checkpoint-web_ns-1"
    )
    other = {"type": "Registry", "nodeLocal": {"path": "checkpoint-web_ns-1"}}
    assert api.archive_path(obj(status={"checkpointLocation": other})) == ""


def test_timeout_seconds() -> None:
    assert api.timeout_seconds(obj({"timeoutSeconds": 30})) == 30
    assert api.timeout_seconds(obj({"timeoutSeconds": 0})) == 0
    assert api.timeout_seconds(obj({"timeoutSeconds": "30"})) == 0
    assert api.timeout_seconds(obj()) == 0


def test_only_the_pods_own_archive_directory_may_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api, "CHECKPOINT_ROOT", str(tmp_path))
    own = tmp_path / api.archive_dir_name("web", "ns", "20261202T000000Z")
    own.mkdir()
    assert controller.owned_archive(str(own), "web", "ns") == own
    # another pod's, another namespace's, a link, a file, a nested dir, outside the root
    other = tmp_path / api.archive_dir_name("web2", "ns", "1")
    other.mkdir()
    link = tmp_path / api.archive_dir_name("web", "ns", "link")
    link.symlink_to(own)
    plain = tmp_path / api.archive_dir_name("web", "ns", "file")
    plain.write_text("x")
    nested = own / api.archive_dir_name("web", "ns", "2")
    nested.mkdir()
    outside = tmp_path.parent / api.archive_dir_name("web", "ns", "3")
    for p in (other, link, plain, nested, outside):
        assert controller.owned_archive(str(p), "web", "ns") is None, p
    assert controller.owned_archive(str(own), "web", "other-ns") is None
    assert controller.owned_archive("", "web", "ns") is None


def test_the_in_flight_markers_survive_and_go(tmp_path: Path) -> None:
    marks = controller.InFlight(tmp_path / "in-flight")
    marks.begin("uid-1", "ns", "c", "/x/checkpoint-web_ns-1")
    assert list(marks.left()) == [
        ("uid-1", {"namespace": "ns", "name": "c", "archive": "/x/checkpoint-web_ns-1"})
    ]
    marks.end("uid-1")
    marks.end("uid-1")  # twice: a crash between the two writes
    assert list(marks.left()) == []


def test_who_serves_podcheckpoint_from_discovery() -> None:
    ours = {"name": api.PLURAL, "kind": api.KIND, "categories": [api.CRD_CATEGORY]}
    status = {"name": f"{api.PLURAL}/status", "kind": api.KIND}
    built_in = {"name": api.PLURAL, "kind": api.KIND, "verbs": ["get", "list", "watch"]}
    assert api.served_by({"resources": [status, ours]}) == api.SERVED_BY_PODSHIM
    assert api.served_by({"resources": [built_in, status]}) == api.SERVED_BUILT_IN
    assert api.served_by({"resources": [{**built_in, "categories": ["all"]}]}) == api.SERVED_BUILT_IN
    assert api.served_by({"resources": [status]}) == api.NOT_SERVED
    assert api.served_by({}) == api.NOT_SERVED
    assert api.served_by(None) == api.NOT_SERVED


def test_the_crd_carries_podshims_category() -> None:
    crd = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "crd.yaml").read_text())
    assert crd["metadata"]["name"] == api.CRD_NAME
    assert api.CRD_CATEGORY in crd["spec"]["names"]["categories"]
