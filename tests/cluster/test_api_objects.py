"""podshim's cluster API objects (deploy/) on a real API server: `kubectl apply -k deploy/`, the
PodCheckpoint CRD taking the KEP's manifests, its rules, selectors and columns, the roles, what a
node may write, and the restore policy (the `restore` verb, same-namespace names, no annotation
added or changed by an update); `kubectl podshim` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import ApiError, Client, KubeConfig
from lightkube.types import PatchType

from shim.kube import api
from testbed.cluster import ClusterBed

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RES = api.CRD_NAME
GHOST = "ghost-node"  # a node name no kubelet has: objects of "another node", pods that never run
NO_POD = "no-such-pod"  # a source pod no node runs: podshim's controller leaves these objects alone
HOLD = [{"name": "example.com/hold"}]  # a scheduling gate: a pod created here is never placed

KEP_EXAMPLE = """\
apiVersion: checkpoint.k8s.io/v1alpha1
kind: PodCheckpoint
metadata:
  name: my-checkpoint
spec:
  # Name of the running Pod to checkpoint.
  sourcePodName: my-app
  sourcePodUID: 7b2c1e4a-0e3a-4f1b-9c2d-2a5f6e8d1234
  # Optional timeout in seconds (0 = use container runtime default).
  timeoutSeconds: 30
"""
KEP_STATUS = {
    "nodeName": "node-1",
    "sourcePodUID": "7b2c1e4a-0e3a-4f1b-9c2d-2a5f6e8d1234",
    "checkpointLocation": {
        "type": "NodeLocal",
        "nodeLocal": {"path": "checkpoint-my-app_default-2026-03-10T20:38:11Z"},
    },
    "completionTime": "2026-03-10T20:38:12Z",
    "checkpointedPodTemplate": {
        "metadata": {"labels": {"app": "my-app"}, "annotations": {}},
        "spec": {"containers": [{"name": "main", "image": "my-app:latest"}]},
    },
    "checkpointedContainers": [{"name": "main", "image": "my-app:latest"}],
    "checkpointedInitContainers": [{"name": "setup", "image": "my-app-init:latest"}],
    "conditions": [
        {
            "type": "Ready",
            "status": "True",
            "reason": "CheckpointCompleted",
            "message": "checkpoint archive written successfully",
            "observedGeneration": 1,
            "lastTransitionTime": "2026-03-10T20:38:12Z",
        }
    ],
}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


def kubectl(
    cb: ClusterBed, *args: str, user: str = "admin", input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return cb.kubectl(*args, user=user, input=input, check=False)


def ok(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, res.stderr
    return res.stdout


def refused(res: subprocess.CompletedProcess[str], *words: str) -> str:
    assert res.returncode != 0, f"accepted: {res.stdout}"
    for w in words:
        assert w in res.stderr, res.stderr
    return res.stderr


def checkpoint(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": spec or {"sourcePodName": NO_POD},
    }


def create(
    cb: ClusterBed, obj: dict[str, Any], user: str = "admin", *extra: str
) -> subprocess.CompletedProcess[str]:
    return kubectl(cb, "create", "-f", "-", *extra, user=user, input=json.dumps(obj))


def set_status(
    cb: ClusterBed, name: str, ns: str, status: dict[str, Any], user: str = "admin"
) -> subprocess.CompletedProcess[str]:
    """A merge patch of the status subresource as ``user``, the request podshim's node makes (kubectl
    would read the subresource first, which the node has no right to)."""
    client = Client(KubeConfig.from_file(str(cb.kubeconfig[user])), trust_env=False)
    try:
        client.patch(
            api.PodCheckpoint.Status, name, {"status": status}, namespace=ns, patch_type=PatchType.MERGE
        )
    except ApiError as e:
        return subprocess.CompletedProcess([], 1, "", str(e.status.message))
    finally:
        client.close()
    return subprocess.CompletedProcess([], 0, "", "")


def get(cb: ClusterBed, name: str, ns: str) -> dict[str, Any]:
    return json.loads(ok(kubectl(cb, "get", RES, name, "-n", ns, "-o", "json")))


def pod(name: str, ns: str, restore_from: str | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": ns}
    if restore_from is not None:
        meta["annotations"] = {api.RESTORE_FROM_ANNOTATION: restore_from}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "app", "image": "busybox"}], "schedulingGates": HOLD, **spec},
    }


def ready(name: str, ns: str) -> dict[str, Any]:
    """A Ready status as a node writes it (on a node no kubelet runs)."""
    return {
        "nodeName": GHOST,
        "checkpointLocation": {"type": "NodeLocal", "nodeLocal": {"path": f"checkpoint-{name}_{ns}-x"}},
        "checkpointedPodTemplate": {
            "metadata": {"labels": {"app": "web", "pod-template-hash": "5d8f7"}},
            "spec": {"containers": [{"name": "app", "image": "busybox"}], "terminationGracePeriodSeconds": 0},
        },
        "conditions": [condition("True", api.COMPLETED)],
    }


def condition(status: str, reason: str) -> dict[str, Any]:
    return {
        "type": api.READY,
        "status": status,
        "reason": reason,
        "message": "",
        "lastTransitionTime": "2026-03-10T20:38:12Z",
    }


@pytest.fixture(scope="module")
def installed(cluster: ClusterBed) -> ClusterBed:
    """deploy/ applied, the CRD established (left installed: the cluster's API, which the other
    tests of the session use too)."""
    ok(kubectl(cluster, "apply", "-k", str(DEPLOY)))
    ok(kubectl(cluster, "wait", "--for=condition=Established", f"crd/{RES}", "--timeout=60s"))
    return cluster


@pytest.fixture(scope="module")
def namespaces(installed: ClusterBed) -> Iterator[tuple[str, str]]:
    a, b = unique("team-a"), unique("team-b")
    for ns in (a, b):
        ok(kubectl(installed, "create", "namespace", ns))
    yield a, b
    for ns in (a, b):
        kubectl(installed, "delete", "namespace", ns, "--wait=false")


# ---------------------------------------------------------------------------- the CRD


def test_apply_is_repeatable(installed: ClusterBed) -> None:
    out = ok(kubectl(installed, "apply", "-k", str(DEPLOY)))
    for obj in (
        f"customresourcedefinition.apiextensions.k8s.io/{RES}",
        "clusterrole.rbac.authorization.k8s.io/podcheckpoint-editor",
        f"validatingadmissionpolicy.admissionregistration.k8s.io/{api.RESTORE_POLICY}",
        f"validatingadmissionpolicybinding.admissionregistration.k8s.io/{api.RESTORE_POLICY}",
    ):
        assert f"{obj} unchanged" in out, out
    # the policies type-check against the resources they match: no warnings
    for policy in (api.RESTORE_POLICY, api.NODE_POLICY):

        def checked(name: str = policy) -> dict[str, Any] | None:
            doc = json.loads(ok(kubectl(installed, "get", "validatingadmissionpolicy", name, "-o", "json")))
            return doc if (doc.get("status") or {}).get("typeChecking") is not None else None

        doc = installed.wait_for(f"{policy} type-checked", checked, timeout=60)
        assert not doc["status"]["typeChecking"].get("expressionWarnings"), doc["status"]


def test_the_keps_manifest_applies_unchanged(installed: ClusterBed, namespaces: tuple[str, str]) -> None:
    ns = namespaces[0]
    ok(kubectl(installed, "apply", "-n", ns, "-f", "-", input=KEP_EXAMPLE))
    obj = get(installed, "my-checkpoint", ns)
    assert obj["spec"] == {
        "sourcePodName": "my-app",
        "sourcePodUID": "7b2c1e4a-0e3a-4f1b-9c2d-2a5f6e8d1234",
        "timeoutSeconds": 30,
    }
    # the KEP's example status, written through the status subresource, as the node does
    ok(set_status(installed, "my-checkpoint", ns, KEP_STATUS))
    assert get(installed, "my-checkpoint", ns)["status"] == KEP_STATUS
    # a status on the object itself is not the object's to set
    ok(
        kubectl(
            installed,
            "patch",
            RES,
            "my-checkpoint",
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"status":{"nodeName":"x"}}',
        )
    )
    assert get(installed, "my-checkpoint", ns)["status"]["nodeName"] == "node-1"


def test_the_kubelet_spelling_is_accepted(installed: ClusterBed, namespaces: tuple[str, str]) -> None:
    ns = namespaces[0]
    ok(create(installed, checkpoint("pr-spelling", ns, sourcePod={"name": "my-app", "uid": "u-1"})))
    assert get(installed, "pr-spelling", ns)["spec"] == {"sourcePod": {"name": "my-app", "uid": "u-1"}}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"timeoutSeconds": 30}, "spec.sourcePodName is required"),
        ({"sourcePodName": ""}, "spec.sourcePodName"),
        ({"sourcePodName": "a", "sourcePod": {"name": "b"}}, "name different pods"),
        ({"sourcePodName": "a", "sourcePodUID": "u1", "sourcePod": {"name": "a", "uid": "u2"}}, "differ"),
        ({"sourcePodName": "a", "timeoutSeconds": -1}, "spec.timeoutSeconds"),
        ({"sourcePod": {"uid": "u1"}}, "spec.sourcePod.name"),
    ],
)
def test_invalid_specs_are_refused(
    installed: ClusterBed, namespaces: tuple[str, str], spec: dict[str, Any], message: str
) -> None:
    refused(create(installed, checkpoint(unique("bad"), namespaces[0], **spec)), message)


def test_the_spec_is_immutable(installed: ClusterBed, namespaces: tuple[str, str]) -> None:
    ns = namespaces[0]
    ok(create(installed, checkpoint("fixed", ns, sourcePodName="a", timeoutSeconds=10)))
    for patch in (
        {"spec": {"sourcePodName": "b"}},
        {"spec": {"timeoutSeconds": 11}},
        {"spec": {"sourcePodUID": "u"}},
    ):
        refused(
            kubectl(installed, "patch", RES, "fixed", "-n", ns, "--type=merge", "-p", json.dumps(patch)),
            "spec is immutable",
        )
    # the rest of the object is the user's
    ok(kubectl(installed, "label", RES, "fixed", "-n", ns, "keep=yes"))
    assert get(installed, "fixed", ns)["spec"] == {"sourcePodName": "a", "timeoutSeconds": 10}


def test_field_selectors_and_printer_columns(installed: ClusterBed, namespaces: tuple[str, str]) -> None:
    ns = namespaces[1]
    ok(create(installed, checkpoint("of-x", ns, sourcePodName="x")))
    ok(create(installed, checkpoint("of-y", ns, sourcePodName="y")))
    ok(
        set_status(
            installed, "of-y", ns, {"nodeName": "node-7", "conditions": [condition("False", api.IN_PROGRESS)]}
        )
    )

    def names(selector: str) -> list[str]:
        out = ok(kubectl(installed, "get", RES, "-n", ns, "--field-selector", selector, "-o", "name"))
        return [n.rpartition("/")[2] for n in out.split()]

    assert names("spec.sourcePodName=x") == ["of-x"]
    assert names("status.nodeName=node-7") == ["of-y"]
    assert names("spec.sourcePodName!=x") == ["of-y"]
    refused(
        kubectl(installed, "get", RES, "-n", ns, "--field-selector", "spec.timeoutSeconds=1"),
        "field label not supported",
    )

    lines = ok(kubectl(installed, "get", RES, "-n", ns)).splitlines()
    assert lines[0].split() == ["NAME", "SOURCE", "POD", "NODE", "READY", "REASON", "AGE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["of-y"][1:5] == ["y", "node-7", "False", api.IN_PROGRESS]
    assert rows["of-x"][1] == "x"


# ---------------------------------------------------------------------------- the roles


def can(cb: ClusterBed, user: str, verb: str, resource: str, ns: str, *groups: str, sub: str = "") -> bool:
    where = ["-n", ns] if ns else []
    args = ["auth", "can-i", verb, resource, *where, f"--as={user}", *(f"--as-group={g}" for g in groups)]
    args += [f"--subresource={sub}"] if sub else []
    return kubectl(cb, *args).stdout.strip() == "yes"


def test_roles_aggregate_into_view_edit_admin(installed: ClusterBed, namespaces: tuple[str, str]) -> None:
    ns = namespaces[1]
    users = {role: unique(role) for role in ("view", "edit", "admin")}
    for role, user in users.items():
        ok(
            kubectl(
                installed,
                "create",
                "rolebinding",
                unique(role),
                f"--clusterrole={role}",
                f"--user={user}",
                "-n",
                ns,
            )
        )
    # the controller manager aggregates the roles: wait until it has
    installed.wait_for(
        "podcheckpoint roles aggregated",
        lambda: all(can(installed, u, "restore", RES, ns) for r, u in users.items() if r != "view"),
        timeout=60,
    )
    assert can(installed, users["view"], "list", RES, ns)
    for verb in ("restore", "create", "delete"):
        assert not can(installed, users["view"], verb, RES, ns)
    for role in ("edit", "admin"):
        for verb in ("get", "watch", "create", "delete", "restore"):
            assert can(installed, users[role], verb, RES, ns), (role, verb)
        # the status is the node's
        assert not can(installed, users[role], "patch", RES, ns, sub="status")
    # nobody's outside the namespace bound
    assert not can(installed, users["edit"], "restore", RES, namespaces[0])


def test_the_nodes_rights_are_only_these(installed: ClusterBed) -> None:
    node, groups = installed.node.user, ("system:nodes",)
    for verb in ("get", "list", "watch", "update", "patch"):
        assert can(installed, node, verb, RES, "any", *groups), verb
    assert can(installed, node, "patch", RES, "any", *groups, sub="status")
    for verb in ("create", "delete", "deletecollection", "restore"):
        assert not can(installed, node, verb, RES, "any", *groups), verb
    assert can(installed, node, "create", "events.events.k8s.io", "any", *groups)
    vap = "validatingadmissionpolicies.admissionregistration.k8s.io"
    assert can(installed, node, "get", f"{vap}/{api.RESTORE_POLICY}", "", *groups)
    assert not can(installed, node, "get", f"{vap}/podshim-node-checkpoints", "", *groups)
    assert not can(installed, node, "update", f"{vap}/{api.RESTORE_POLICY}", "", *groups)


# ---------------------------------------------------------------------------- what a node writes


def test_a_node_writes_its_own_checkpoints_only(installed: ClusterBed, namespaces: tuple[str, str]) -> None:
    ns, node = namespaces[1], installed.node_name
    as_node = "node"
    free, theirs, grab = unique("free"), unique("theirs"), unique("grab")
    for name in (free, theirs, grab):
        ok(create(installed, checkpoint(name, ns)))
    ok(set_status(installed, theirs, ns, {"nodeName": GHOST}))
    mine = {"nodeName": node, "conditions": [condition("False", api.IN_PROGRESS)]}

    # the policy is in force once a node's label change is refused (it takes effect asynchronously)
    def label_refused() -> bool:
        res = kubectl(installed, "label", RES, theirs, "-n", ns, "try=1", "--dry-run=server", user=as_node)
        return res.returncode != 0 and api.NODE_POLICY in res.stderr

    installed.wait_for("the node policy in force", label_refused, timeout=60)

    # status: unclaimed or its own, claimed for itself only
    ok(set_status(installed, free, ns, mine, user=as_node))
    ok(set_status(installed, free, ns, {"conditions": [condition("True", api.COMPLETED)]}, user=as_node))
    refused(
        set_status(installed, theirs, ns, mine, user=as_node),
        f"may not write the status of a PodCheckpoint of node {GHOST}",
    )
    refused(set_status(installed, grab, ns, {"nodeName": GHOST}, user=as_node), "only to its own name")
    refused(set_status(installed, free, ns, {"nodeName": None}, user=as_node), "only to its own name")

    # the object: its finalizer only, on its own checkpoints only
    add = json.dumps([{"op": "add", "path": "/metadata/finalizers", "value": [api.FINALIZER]}])
    ok(kubectl(installed, "patch", RES, free, "-n", ns, "--type=json", "-p", add, user=as_node))
    assert get(installed, free, ns)["metadata"]["finalizers"] == [api.FINALIZER]
    refused(
        kubectl(installed, "patch", RES, theirs, "-n", ns, "--type=json", "-p", add, user=as_node),
        "whose status.nodeName is",
    )
    other = json.dumps([{"op": "add", "path": "/metadata/finalizers/-", "value": "example.com/other"}])
    refused(
        kubectl(installed, "patch", RES, free, "-n", ns, "--type=json", "-p", other, user=as_node),
        "only its finalizer",
    )
    refused(kubectl(installed, "label", RES, free, "-n", ns, "x=y", user=as_node), "only its finalizer")
    refused(kubectl(installed, "annotate", RES, free, "-n", ns, "x=y", user=as_node), "only its finalizer")
    remove = json.dumps([{"op": "remove", "path": "/metadata/finalizers"}])
    ok(kubectl(installed, "patch", RES, free, "-n", ns, "--type=json", "-p", remove, user=as_node))

    # and never creates or deletes one
    refused(create(installed, checkpoint(unique("by-node"), ns), as_node), "forbidden")
    refused(kubectl(installed, "delete", RES, free, "-n", ns, user=as_node), "forbidden")
    # reads the restore policy, to know restores are guarded
    ok(kubectl(installed, "get", "validatingadmissionpolicy", api.RESTORE_POLICY, user=as_node))


# ---------------------------------------------------------------------------- the restore policy


@pytest.fixture(scope="module")
def people(installed: ClusterBed, namespaces: tuple[str, str]) -> dict[str, str]:
    """alice: edit in A (restore included, by aggregation), may create pods in B but not restore
    there; bob: may read checkpoints and create pods in A, nothing more. Returns their user names
    (each with a kubeconfig of its own)."""
    a, b = namespaces
    alice, bob = unique("alice"), unique("bob")
    for user in (alice, bob):
        installed.user_kubeconfig(user)
    ok(
        kubectl(
            installed, "create", "rolebinding", "alice-edit", "--clusterrole=edit", f"--user={alice}", "-n", a
        )
    )
    for ns, user in ((b, alice), (a, bob)):
        ok(
            kubectl(
                installed,
                "create",
                "role",
                "pods-only",
                "--verb=create,get",
                "--resource=pods",
                f"--resource={RES}",
                "-n",
                ns,
            )
        )
        ok(
            kubectl(
                installed,
                "create",
                "rolebinding",
                "pods-only",
                "--role=pods-only",
                f"--user={user}",
                "-n",
                ns,
            )
        )
    installed.wait_for("alice may restore in A", lambda: can(installed, alice, "restore", RES, a), timeout=60)
    # the restore policy is in force once bob's restore is refused
    installed.wait_for(
        "the restore policy in force",
        lambda: (
            "podshim-restore-from"
            in create(installed, pod(unique("probe"), a, "ck-a"), bob, "--dry-run=server").stderr
        ),
        timeout=60,
    )
    return {"alice": alice, "bob": bob}


def test_an_editor_restores_in_its_namespace(
    installed: ClusterBed, namespaces: tuple[str, str], people: dict[str, str]
) -> None:
    a, _ = namespaces
    ok(create(installed, pod(unique("r"), a, "ck-a"), people["alice"], "--dry-run=server"))


def test_create_pods_alone_does_not_restore(
    installed: ClusterBed, namespaces: tuple[str, str], people: dict[str, str]
) -> None:
    a, _ = namespaces
    refused(
        create(installed, pod(unique("r"), a, "ck-a"), people["bob"], "--dry-run=server"),
        f"ValidatingAdmissionPolicy '{api.RESTORE_POLICY}'",
        f'restoring from PodCheckpoint {a}/ck-a needs the "restore" verb',
        f"on podcheckpoints/ck-a in namespace {a}",
    )
    # the same pod without the annotation is bob's to create
    ok(create(installed, pod(unique("plain"), a), people["bob"], "--dry-run=server"))


def test_the_annotation_names_a_checkpoint_of_the_pods_namespace(
    installed: ClusterBed, namespaces: tuple[str, str], people: dict[str, str]
) -> None:
    a, b = namespaces
    alice = people["alice"]
    # edit in A does not reach B's checkpoints: not by naming them from A...
    refused(
        create(installed, pod(unique("r"), a, f"{b}/ck-b"), alice, "--dry-run=server"),
        "is not the name of a PodCheckpoint",
    )
    # ...nor by creating the pod in B, where alice may create pods but not restore
    refused(
        create(installed, pod(unique("r"), b, "ck-b"), alice, "--dry-run=server"),
        f"podcheckpoints/ck-b in namespace {b}",
    )


@pytest.mark.usefixtures("people")  # the restore policy in force
def test_a_controller_gets_no_restore_by_default(installed: ClusterBed, namespaces: tuple[str, str]) -> None:
    """A ReplicaSet's pods are created by its controller's service account, which has no `restore`:
    a template carrying the annotation makes no pods (the KEP's rule for workload controllers)."""
    a, _ = namespaces
    name = unique("rs")
    spec = pod(name, a)["spec"]
    template = {
        "metadata": {"labels": {"app": name}, "annotations": {api.RESTORE_FROM_ANNOTATION: "ck-a"}},
        "spec": spec,
    }
    rs = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": name, "namespace": a},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": template},
    }
    ok(create(installed, rs))
    try:

        def refusal() -> str | None:
            doc = installed.kubectl_json(
                "get",
                "events",
                "-n",
                a,
                "--field-selector",
                f"involvedObject.name={name},reason=FailedCreate",
            )
            messages = [str(e.get("message")) for e in doc.get("items") or []]
            return next((m for m in messages if api.RESTORE_POLICY in m), None)

        message = installed.wait_for(f"ReplicaSet {name} refused", refusal, timeout=60)
        assert 'needs the "restore" verb on podcheckpoints/ck-a' in message
        assert not installed.kubectl_json("get", "pods", "-n", a, "-l", f"app={name}")["items"]
    finally:
        ok(kubectl(installed, "delete", "replicaset", name, "-n", a))


@pytest.mark.usefixtures("people")  # the restore policy in force
def test_the_annotation_never_changes_after_create(
    installed: ClusterBed, namespaces: tuple[str, str]
) -> None:
    a, _ = namespaces
    plain, restored = unique("plain"), unique("restored")
    ok(create(installed, pod(plain, a)))
    ok(create(installed, pod(restored, a, "ck-a")))  # the admin may restore from anything
    try:
        message = "cannot be added, changed or removed"
        refused(
            kubectl(installed, "annotate", "pod", plain, "-n", a, f"{api.RESTORE_FROM_ANNOTATION}=ck-a"),
            message,
        )
        refused(
            kubectl(
                installed,
                "annotate",
                "pod",
                restored,
                "-n",
                a,
                "--overwrite",
                f"{api.RESTORE_FROM_ANNOTATION}=ck-b",
            ),
            message,
        )
        refused(
            kubectl(installed, "annotate", "pod", restored, "-n", a, f"{api.RESTORE_FROM_ANNOTATION}-"),
            message,
        )
        # other annotations of a restored pod stay the user's
        ok(kubectl(installed, "annotate", "pod", restored, "-n", a, "note=kept"))
        # a binding's annotations land on the pod: not this one
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": plain, "annotations": {api.RESTORE_FROM_ANNOTATION: "ck-a"}},
            "target": {"apiVersion": "v1", "kind": "Node", "name": installed.node_name},
        }
        status, body = installed.api(
            "POST", f"/api/v1/namespaces/{a}/pods/{plain}/binding?dryRun=All", binding
        )
        assert status == 403 and "a binding cannot set" in str(body), (status, body)
    finally:
        ok(kubectl(installed, "delete", "pod", plain, restored, "-n", a, "--wait=false"))


# ---------------------------------------------------------------------------- kubectl podshim


def plugin(cb: ClusterBed, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shim.kube.plugin", *args, f"--kubeconfig={cb.kubeconfig[user]}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_kubectl_podshim_as_a_user(
    installed: ClusterBed, namespaces: tuple[str, str], people: dict[str, str]
) -> None:
    a, _ = namespaces
    alice, bob = people["alice"], people["bob"]
    ck = unique("ready")
    ok(create(installed, checkpoint(ck, a, sourcePodName="web")))
    ok(set_status(installed, ck, a, ready(ck, a)))

    out = ok(plugin(installed, alice, "list", "-n", a))
    row = next(line.split() for line in out.splitlines() if line.startswith(ck))
    assert row[1:5] == ["web", GHOST, "True", api.COMPLETED]

    res = plugin(installed, alice, "checkpoint", NO_POD, "-n", a)
    assert (
        res.returncode == 1
        and res.stderr == f"error: pod {a}/{NO_POD} not found (check the name, or -n NAMESPACE)\n"
    )

    # bob may read the checkpoint and create pods, not restore
    res = plugin(installed, bob, "restore", ck, "-n", a, "--name", unique("by-bob"))
    assert res.returncode == 1 and f'needs the "restore" verb on podcheckpoints/{ck}' in res.stderr, (
        res.stderr
    )
    assert res.stderr.count("\n") == 1

    name = unique("web-restored")
    res = plugin(installed, alice, "restore", ck, "-n", a, "--name", name)
    assert res.returncode == 0, res.stderr
    try:
        restored = json.loads(ok(kubectl(installed, "get", "pod", name, "-n", a, "-o", "json")))
        assert restored["spec"]["nodeName"] == GHOST
        assert restored["metadata"]["annotations"][api.RESTORE_FROM_ANNOTATION] == ck
        assert restored["metadata"]["labels"] == {"app": "web"}
    finally:
        # bound to a node no kubelet runs: nothing would confirm a graceful deletion
        ok(kubectl(installed, "delete", "pod", name, "-n", a, "--force", "--grace-period=0"))


def test_kubectl_podshim_names_a_missing_checkpoint(
    installed: ClusterBed, namespaces: tuple[str, str]
) -> None:
    ns = namespaces[0]
    res = plugin(installed, "admin", "restore", "nope", "-n", ns)
    assert res.returncode == 1
    assert res.stderr == f"error: podcheckpoint {ns}/nope not found (kubectl podshim list, or -n NAMESPACE)\n"
