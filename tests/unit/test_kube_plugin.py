"""shim/kube/plugin.py (`kubectl podshim`) against a fake of lightkube's sync Client: the objects it
sends, what it prints, its errors (one line, exit 1)."""

from __future__ import annotations

import copy
import itertools
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2
import pytest
from lightkube import ALL_NS, ApiError

from shim.kube import api, plugin

NS = "team-a"
Capture = pytest.CaptureFixture[str]
POD_UID = "7b2c1e4a-0e3a-4f1b-9c2d-2a5f6e8d1234"


def api_error(code: int, message: str, name: str | None = None, reason: str = "") -> ApiError:
    req = httpx2.Request("GET", "https://cluster.example/api")
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
    body |= {"code": code, "reason": reason or {403: "Forbidden", 404: "NotFound"}.get(code, "")}
    if name:
        body["details"] = {"name": name}
    return ApiError(request=req, response=httpx2.Response(code, json=body, request=req))


def kind_of(res: Any) -> str:
    return str(res._api_info.resource.kind)


class FakeClient:
    """Objects by (kind, namespace, name); create assigns names, versions and timestamps like the
    API server; watch plays the events queued for an object, then blocks until closed."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.created: list[dict[str, Any]] = []
        self.events: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
        self.watches: list[dict[str, Any]] = []
        self.lists: list[dict[str, Any]] = []
        self.errors: dict[str, ApiError | httpx2.HTTPError] = {}
        self.closed = threading.Event()
        self._version = itertools.count(100)
        self._suffix = itertools.count()

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        meta.setdefault("resourceVersion", str(next(self._version)))
        meta.setdefault("creationTimestamp", "2026-03-10T20:38:11Z")
        self.objects[(obj["kind"], meta.get("namespace", NS), meta["name"])] = obj
        return obj

    def get(self, res: Any, name: str, *, namespace: str | None = None) -> Any:
        if "get" in self.errors:
            raise self.errors["get"]
        obj = self.objects.get((kind_of(res), namespace or NS, name))
        if obj is None:
            raise api_error(404, f'{kind_of(res).lower()}s "{name}" not found', name=name)
        return res.from_dict(copy.deepcopy(obj))

    def create(self, obj: Any, namespace: str | None = None) -> Any:
        if "create" in self.errors:
            raise self.errors["create"]
        body = copy.deepcopy(obj.to_dict())
        self.created.append(copy.deepcopy(body))
        meta = body["metadata"]
        if "name" not in meta:
            meta["name"] = f"{meta.pop('generateName')}x{next(self._suffix)}"
        meta.setdefault("namespace", namespace)
        meta["uid"] = f"uid-{meta['name']}"
        return type(obj).from_dict(self.put(body))

    def list(self, res: Any, *, namespace: str | None = None, fields: Any = None) -> Iterator[Any]:
        self.lists.append({"kind": kind_of(res), "namespace": namespace, "fields": fields})
        if "list" in self.errors:
            raise self.errors["list"]
        for (kind, ns, _), obj in self.objects.items():
            if kind == kind_of(res) and namespace in (ALL_NS, ns):
                yield res.from_dict(copy.deepcopy(obj))

    def watch(
        self,
        res: Any,
        *,
        namespace: str | None = None,
        fields: Any = None,
        server_timeout: int | None = None,
        resource_version: str | None = None,
    ) -> Iterator[tuple[str, Any]]:
        self.watches.append({"kind": kind_of(res), "fields": fields, "resource_version": resource_version})
        name = fields["metadata.name"]
        for kind, obj in self.events.get((kind_of(res), name), []):
            yield kind, res.from_dict(copy.deepcopy(obj))
        self.closed.wait()  # a real watch stays open


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClient]:
    client = FakeClient()
    monkeypatch.setattr(plugin, "connect", lambda args: (client, args.namespace or NS))
    yield client
    client.closed.set()


def pod(name: str = "web", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": POD_UID},
        "spec": {"containers": [{"name": "app", "image": "web:v1"}], **spec},
        "status": {"phase": "Running"},
    }


def condition(status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {
        "type": api.READY,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-03-10T20:38:12Z",
    }


def checkpoint(name: str, source: str = "web", *, ready: bool = True, ns: str = NS) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [condition("False", api.IN_PROGRESS)]}
    if ready:
        status = {
            "nodeName": "node-1",
            "sourcePodUID": POD_UID,
            "checkpointLocation": {
                "type": api.LOCATION_NODE_LOCAL,
                "nodeLocal": {"path": f"checkpoint-{source}_{ns}-2026-03-10T20:38:11Z"},
            },
            "checkpointedPodTemplate": {
                "metadata": {
                    "labels": {"app": "web", "pod-template-hash": "5d8f7"},
                    "annotations": {"team.example.com/owner": "alice"},
                },
                "spec": {
                    "containers": [{"name": "app", "image": "web:v1", "futureField": {"kept": True}}],
                    "restartPolicy": "Always",
                },
            },
            "conditions": [condition("True", api.COMPLETED, "checkpoint archive written")],
        }
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": {"sourcePodName": source},
        "status": status,
    }


def with_status(obj: dict[str, Any], **status: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out.setdefault("status", {}).update(status)
    return out


# ---------------------------------------------------------------------------- checkpoint


def test_checkpoint_creates_a_pinned_object(fake: FakeClient, capsys: Capture) -> None:
    fake.put(pod())
    assert plugin.main(["checkpoint", "web", "--timeout", "30"]) == 0
    (sent,) = fake.created
    assert sent == {
        "apiVersion": "checkpoint.k8s.io/v1alpha1",
        "kind": "PodCheckpoint",
        "metadata": {"generateName": "web-", "namespace": NS},
        "spec": {"sourcePodName": "web", "sourcePodUID": POD_UID, "timeoutSeconds": 30},
    }
    assert capsys.readouterr().out == "podcheckpoint/web-x0 created\n"


def test_checkpoint_named_and_in_another_namespace(fake: FakeClient) -> None:
    fake.put(pod() | {"metadata": {"name": "web", "namespace": "team-b", "uid": "u2"}})
    assert plugin.main(["checkpoint", "web", "--name", "snap", "-n", "team-b"]) == 0
    assert fake.created[0]["metadata"] == {"name": "snap", "namespace": "team-b"}
    assert fake.created[0]["spec"] == {"sourcePodName": "web", "sourcePodUID": "u2"}


def test_checkpoint_of_a_missing_pod(fake: FakeClient, capsys: Capture) -> None:
    assert plugin.main(["checkpoint", "nope"]) == 1
    err = capsys.readouterr().err
    assert err == "error: pod team-a/nope not found (check the name, or -n NAMESPACE)\n"
    assert not fake.created


def test_checkpoint_without_the_right_to_read_pods_is_not_pinned(fake: FakeClient) -> None:
    fake.errors["get"] = api_error(403, 'pods "web" is forbidden')
    assert plugin.main(["checkpoint", "web"]) == 0
    assert fake.created[0]["spec"] == {"sourcePodName": "web"}


def test_checkpoint_waits_for_ready(fake: FakeClient, capsys: Capture) -> None:
    fake.put(pod())
    done = checkpoint("snap")
    fake.events[(api.KIND, "snap")] = [
        ("MODIFIED", with_status(done, conditions=[condition("False", api.IN_PROGRESS)])),
        ("MODIFIED", done),
    ]
    assert plugin.main(["checkpoint", "web", "--name", "snap", "--wait"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "podcheckpoint/snap created",
        "podcheckpoint/snap ready: node node-1, "
        "/var/lib/kubelet/pod-checkpoints/checkpoint-web_team-a-2026-03-10T20:38:11Z",
    ]
    # the watch starts at the version create returned: no change is missed
    (watch,) = fake.watches
    assert watch["fields"] == {"metadata.name": "snap"}
    assert watch["resource_version"] == fake.objects[(api.KIND, NS, "snap")]["metadata"]["resourceVersion"]


def test_checkpoint_wait_reports_a_failure(fake: FakeClient, capsys: Capture) -> None:
    fake.put(pod())
    failure = condition("False", api.FAILED, "criu dump: no space left")
    failed = with_status(checkpoint("snap", ready=False), conditions=[failure])
    fake.events[(api.KIND, "snap")] = [("MODIFIED", failed)]
    assert plugin.main(["checkpoint", "web", "--name", "snap", "--wait"]) == 1
    err = capsys.readouterr().err
    assert err == "error: podcheckpoint/snap failed: CheckpointFailed: criu dump: no space left\n"


def test_checkpoint_wait_gives_up_at_its_timeout(fake: FakeClient, capsys: Capture) -> None:
    fake.put(pod())
    assert plugin.main(["checkpoint", "web", "--name", "snap", "--wait", "--wait-timeout", "0.2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: podcheckpoint/snap is not Ready after 0.2s: does podshim run on the pod")
    assert err.count("\n") == 1


def test_checkpoint_where_the_crd_is_not_installed(fake: FakeClient, capsys: Capture) -> None:
    fake.put(pod())
    fake.errors["create"] = api_error(404, "the server could not find the requested resource")
    assert plugin.main(["checkpoint", "web"]) == 1
    err = capsys.readouterr().err
    assert "does not serve podcheckpoints.checkpoint.k8s.io" in err
    assert "kubectl apply -k" in err


def test_checkpoint_forbidden_names_the_role(fake: FakeClient, capsys: Capture) -> None:
    fake.put(pod())
    message = 'podcheckpoints.checkpoint.k8s.io is forbidden: User "bob" cannot create'
    fake.errors["create"] = api_error(403, message)
    assert plugin.main(["checkpoint", "web"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: creating a PodCheckpoint of pod team-a/web: {message}")
    assert err.rstrip().endswith("(the podcheckpoint-editor role in the namespace grants it)")


def test_unreachable_api_server(fake: FakeClient, capsys: Capture) -> None:
    fake.errors["get"] = httpx2.ConnectError("connection refused")
    assert plugin.main(["checkpoint", "web"]) == 1
    err = capsys.readouterr().err
    assert err == "error: reading pod team-a/web: cannot reach the API server: connection refused\n"


# ---------------------------------------------------------------------------- restore


def test_restore_creates_the_pod_from_the_template(fake: FakeClient, capsys: Capture) -> None:
    fake.put(checkpoint("snap"))
    assert plugin.main(["restore", "snap"]) == 0
    (sent,) = fake.created
    name = sent["metadata"]["name"]
    assert name.startswith("web-restored-") and len(name) == len("web-restored-") + 5
    assert set(name.removeprefix("web-restored-")) <= set(plugin.NAME_ALPHABET)
    assert sent == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            # the ReplicaSet's label goes: the source's ReplicaSet would adopt the pod
            "labels": {"app": "web"},
            "annotations": {"team.example.com/owner": "alice", api.RESTORE_FROM_ANNOTATION: "snap"},
        },
        # whole, fields lightkube's models do not know included
        "spec": {
            "containers": [{"name": "app", "image": "web:v1", "futureField": {"kept": True}}],
            "restartPolicy": "Always",
            "nodeName": "node-1",
        },
    }
    out = capsys.readouterr().out
    assert out == f"pod/{name} created on node node-1, restoring from podcheckpoint/snap\n"


def test_restore_named(fake: FakeClient) -> None:
    fake.put(checkpoint("snap"))
    assert plugin.main(["restore", "snap", "--name", "web-2"]) == 0
    assert fake.created[0]["metadata"]["name"] == "web-2"


def test_restore_from_a_checkpoint_not_ready(fake: FakeClient, capsys: Capture) -> None:
    fake.put(checkpoint("snap", ready=False))
    assert plugin.main(["restore", "snap"]) == 1
    assert capsys.readouterr().err == (
        "error: podcheckpoint/snap is not Ready (CheckpointInProgress: ): restore from a Ready one\n"
    )
    assert not fake.created


def test_restore_from_a_missing_checkpoint(fake: FakeClient, capsys: Capture) -> None:
    assert plugin.main(["restore", "snap"]) == 1
    assert capsys.readouterr().err == (
        "error: podcheckpoint team-a/snap not found (kubectl podshim list, or -n NAMESPACE)\n"
    )


def test_restore_refused_by_the_policy(fake: FakeClient, capsys: Capture) -> None:
    fake.put(checkpoint("snap"))
    message = (
        "pods \"web-2\" is forbidden: ValidatingAdmissionPolicy 'podshim-restore-from' with binding "
        "'podshim-restore-from' denied request: restoring from PodCheckpoint team-a/snap needs the "
        '"restore" verb'
    )
    fake.errors["create"] = api_error(403, message)
    assert plugin.main(["restore", "snap", "--name", "web-2"]) == 1
    err = capsys.readouterr().err
    assert err == f"error: creating pod team-a/web-2 from podcheckpoint/snap: {message}\n"


def test_restore_waits_for_running(fake: FakeClient, capsys: Capture) -> None:
    fake.put(checkpoint("snap"))
    restored = pod("web-2")
    fake.events[("Pod", "web-2")] = [
        ("MODIFIED", restored | {"status": {"phase": "Pending"}}),
        ("MODIFIED", restored),
    ]
    assert plugin.main(["restore", "snap", "--name", "web-2", "--wait"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "pod/web-2 running"


def test_restore_wait_names_the_nodes_refusal(fake: FakeClient, capsys: Capture) -> None:
    fake.put(checkpoint("snap"))
    fake.put(
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": "web-2.1", "namespace": NS, "creationTimestamp": "2026-03-10T20:40:00Z"},
            "involvedObject": {"kind": "Pod", "name": "web-2", "namespace": NS},
            "reason": api.DATA_MISSING,
            "message": "the checkpoint's archive is not on node-1",
            "type": "Warning",
        }
    )
    assert plugin.main(["restore", "snap", "--name", "web-2", "--wait", "--wait-timeout", "0.2"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "error: pod/web-2 is not Running after 0.2s (CheckpointDataMissing: the checkpoint's archive is not "
        "on node-1): kubectl describe pod web-2 -n team-a\n"
    )
    assert fake.lists[-1]["fields"] == {"involvedObject.name": "web-2", "type": "Warning"}


def test_restore_wait_reports_a_failed_pod(fake: FakeClient, capsys: Capture) -> None:
    fake.put(checkpoint("snap"))
    fake.events[("Pod", "web-2")] = [("MODIFIED", pod("web-2") | {"status": {"phase": "Failed"}})]
    assert plugin.main(["restore", "snap", "--name", "web-2", "--wait"]) == 1
    assert capsys.readouterr().err == "error: pod/web-2 ended Failed: kubectl describe pod web-2 -n team-a\n"


def test_restored_pod_without_labels() -> None:
    ck = checkpoint("snap")
    ck["status"]["checkpointedPodTemplate"]["metadata"] = {}
    body = plugin.restored_pod(ck, "p")
    annotations = {api.RESTORE_FROM_ANNOTATION: "snap"}
    assert body["metadata"] == {"name": "p", "namespace": NS, "annotations": annotations}


# ---------------------------------------------------------------------------- list


def test_list_shows_the_table(fake: FakeClient, capsys: Capture) -> None:
    fake.put(checkpoint("snap-b", source="db"))
    fake.put(checkpoint("snap-a", ready=False))
    fake.put(checkpoint("elsewhere", ns="team-b"))
    assert plugin.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "POD", "NODE", "READY", "REASON", "AGE"]
    assert lines[1].split()[:5] == ["snap-a", "web", "<none>", "False", "CheckpointInProgress"]
    assert lines[2].split()[:5] == ["snap-b", "db", "node-1", "True", "CheckpointCompleted"]
    assert len(lines) == 3
    assert fake.lists[-1]["namespace"] == NS


def test_list_all_namespaces(fake: FakeClient, capsys: Capture) -> None:
    fake.put(checkpoint("snap"))
    fake.put(checkpoint("other", ns="team-b"))
    assert plugin.main(["list", "-A"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["NAMESPACE", "NAME"]
    assert [line.split()[:2] for line in lines[1:]] == [["team-a", "snap"], ["team-b", "other"]]
    assert fake.lists[-1]["namespace"] == ALL_NS


def test_list_nothing(fake: FakeClient, capsys: Capture) -> None:
    assert plugin.main(["list"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "No podcheckpoints in namespace team-a.\n"


def test_list_reads_the_kubelet_spelling(fake: FakeClient, capsys: Capture) -> None:
    ck = checkpoint("snap")
    ck["spec"] = {"sourcePod": {"name": "web", "uid": POD_UID}}
    fake.put(ck)
    assert plugin.main(["list"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[1] == "web"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(5, "5s"), (119, "119s"), (330, "5m30s"), (3000, "50m"), (5 * 3600 + 1800, "5h30m"), (30 * 3600, "30h")],
)
def test_age_like_kubectl(seconds: int, shown: str) -> None:
    now = datetime(2026, 3, 10, 20, 0, tzinfo=UTC)
    created = (now - timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")
    assert plugin.human_age(created, now) == shown


def test_age_in_days_and_years() -> None:
    now = datetime(2026, 3, 10, tzinfo=UTC)
    assert plugin.human_age((now - timedelta(days=3, hours=4)).isoformat(), now) == "3d4h"
    assert plugin.human_age((now - timedelta(days=400)).isoformat(), now) == "400d"
    assert plugin.human_age((now - timedelta(days=1000)).isoformat(), now) == "2y"
    assert plugin.human_age(None, now) == "<unknown>"


# ---------------------------------------------------------------------------- kubeconfig


def kubeconfig(path: Path, namespace: str | None = None) -> Path:
    context: dict[str, Any] = {"cluster": "c", "user": "u"}
    if namespace:
        context["namespace"] = namespace
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "ctx", "context": context}],
                "current-context": "ctx",
            }
        )
    )
    return path


def test_kubeconfig_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = kubeconfig(tmp_path / "config", namespace="team-c")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'absent'}:{cfg}")
    assert plugin.kubeconfig_path(None) == cfg
    args = plugin.build_parser().parse_args(["list"])
    _, namespace = plugin.connect(args)
    assert namespace == "team-c"
    args = plugin.build_parser().parse_args(["list", "-n", "team-d"])
    assert plugin.connect(args)[1] == "team-d"


def test_kubeconfig_context_without_a_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = kubeconfig(tmp_path / "config")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    args = plugin.build_parser().parse_args(["list", "--kubeconfig", str(cfg)])
    assert plugin.connect(args)[1] == "default"


def test_no_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capture) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert plugin.main(["list"]) == 1
    assert capsys.readouterr().err == (
        f"error: no kubeconfig at {tmp_path}/.kube/config: set $KUBECONFIG or pass --kubeconfig\n"
    )
    assert plugin.main(["list", "--kubeconfig", str(tmp_path / "nope")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_unknown_context(tmp_path: Path, capsys: Capture) -> None:
    cfg = kubeconfig(tmp_path / "config")
    assert plugin.main(["list", "--kubeconfig", str(cfg), "--context", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: kubeconfig {cfg}: ") and err.count("\n") == 1


def test_bad_usage_exits_2(capsys: Capture) -> None:
    with pytest.raises(SystemExit) as e:
        plugin.main(["checkpoint", "web", "--timeout", "-3"])
    assert e.value.code == 2


def test_the_wait_outlasts_the_checkpoints_own_timeout(
    fake: FakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.put(pod())
    waits: list[float] = []

    def watch_until(*args: Any) -> dict[str, Any]:
        waits.append(args[-1] - plugin.time.monotonic())
        return checkpoint("snap")

    monkeypatch.setattr(plugin, "_watch_until", watch_until)
    for argv, at_least in ((["--timeout", "900"], 960), ([], 600), (["--wait-timeout", "5"], 5)):
        assert plugin.main(["checkpoint", "web", "--name", "snap", "--wait", *argv]) == 0
        assert at_least - 1 < waits.pop() <= at_least
