"""A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, v1.37.2)
with a kubelet registered as a node on podshim (testbed/cluster.py): the node is Ready, the
scheduler places pods on it, logs and exec go API server -> kubelet -> podshim, RBAC and the node
authorizer hold, and the API server can restart under a running cluster."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from testbed.bed import COUNTER_IMAGE, TestBed
from testbed.cluster import NAMESPACE, ClusterBed, pod_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]


def counter(name: str = "app", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": COUNTER_IMAGE,
        "imagePullPolicy": "Never",
        "args": ["--interval-ms", "200"],
        **extra,
    }


@pytest.fixture
def pods(cluster: ClusterBed) -> Iterator[list[str]]:
    """Append names of pods in `default`; they are deleted (and gone) after the test."""
    names: list[str] = []
    yield names
    for name in names:
        cluster.delete_pod(name)


def running_containers(bed: TestBed, pod: str) -> dict[str, str]:
    """{container name: id} of pod `pod`'s running containers, as the bed's podshim lists them."""
    rt = bed.runtime_stub(bed.podshim_socket)
    labels = {"io.kubernetes.pod.name": pod, "io.kubernetes.pod.namespace": NAMESPACE}
    listed = rt.ListContainers(
        cri.ListContainersRequest(filter=cri.ContainerFilter(label_selector=labels))
    ).containers
    return {c.metadata.name: c.id for c in listed if c.state == cri.CONTAINER_RUNNING}


def container_ids(pod: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["containerID"].split("://", 1)[1] for c in pod["status"]["containerStatuses"]}


def lease_renewed(cluster: ClusterBed, node: str) -> str:
    lease = cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}") or {}
    return str((lease.get("spec") or {}).get("renewTime") or "")


def test_the_node_is_ready_with_its_internal_ip(cluster: ClusterBed) -> None:
    node = cluster.get(f"/api/v1/nodes/{cluster.node_name}")
    assert node is not None
    assert cluster.node_ready(cluster.node_name)
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    ip = ipaddress.ip_address(addresses["InternalIP"])
    assert str(ip) == cluster.node.ip and not ip.is_loopback
    assert cluster.bed.subnet is not None and ip in cluster.bed.subnet, "the bed bridge's gateway"
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.37.2"
    assert info["containerRuntimeVersion"].startswith("containerd://"), "podshim answers as its upstream"
    assert cluster.kubelet.config()["containerRuntimeEndpoint"] == f"unix://{cluster.bed.podshim_socket}"
    # registered with its own credentials: the node authorizer lets it hold its Lease
    lease = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{cluster.node_name}"
    held = cluster.wait_for("the node's Lease", lambda: cluster.get(lease), timeout=60)
    assert held["spec"]["holderIdentity"] == cluster.node_name
    # the controller manager's node lifecycle controller lifts the not-ready taint of a Ready node
    cluster.wait_for(
        "the not-ready taint lifted",
        lambda: (
            not any(
                t["key"] == "node.kubernetes.io/not-ready"
                for t in (cluster.get(f"/api/v1/nodes/{cluster.node_name}") or {})
                .get("spec", {})
                .get("taints")
                or []
            )
        ),
    )


def test_a_pod_is_scheduled_runs_and_answers_logs_and_exec(cluster: ClusterBed, pods: list[str]) -> None:
    pods.append("counter")
    cluster.apply(pod_manifest("counter", [counter()]))
    pod = cluster.wait_pod_running("counter")
    assert pod["spec"]["nodeName"] == cluster.node_name, "the scheduler bound it"
    assert cluster.bed.subnet is not None
    assert ipaddress.ip_address(pod["status"]["podIP"]) in cluster.bed.subnet, "the bed's CNI network"
    assert running_containers(cluster.bed, "counter") == container_ids(pod), (
        "the kubelet ran it through podshim"
    )

    def logged() -> str | None:
        out = cluster.kubectl("logs", "counter", "-c", "app").stdout
        return out if "count=3" in out else None

    out = cluster.wait_for("the counter's log through the API server", logged, timeout=60)
    assert out.splitlines()[0].startswith(("ready", "count=")), out[:200]

    res = cluster.kubectl(
        "exec", "counter", "-c", "app", "--", "sh", "-c", "echo exec-$((6*7)); echo err >&2"
    )
    assert res.stdout.strip() == "exec-42"
    assert "err" in res.stderr
    failed = cluster.kubectl("exec", "counter", "-c", "app", "--", "sh", "-c", "exit 3", check=False)
    assert failed.returncode == 3, failed.stderr


def test_node_credentials_cannot_use_the_node_proxy(cluster: ClusterBed) -> None:
    path = f"/api/v1/nodes/{cluster.node_name}/proxy/healthz"
    # the admin can: the API server reaches the kubelet at its InternalIP and verifies its cert
    assert cluster.kubectl("get", "--raw", path).stdout.strip() == "ok"
    node = cluster.node.user
    got = cluster.kubectl("get", "--raw", path, user=node, check=False)
    assert got.returncode != 0 and 'cannot get resource "nodes/proxy"' in got.stderr, got.stderr
    posted = cluster.kubectl("create", "--raw", path, "-f", "-", user=node, input="{}", check=False)
    assert posted.returncode != 0 and 'cannot create resource "nodes/proxy"' in posted.stderr, posted.stderr
    # while the same credentials do what a node may: label its own Node object
    labelled = cluster.kubectl(
        "label", "node", cluster.node_name, "podshim.test/by-node=yes", user=node, check=False
    )
    assert labelled.returncode == 0, "a node may label itself"
    cluster.kubectl("label", "node", cluster.node_name, "podshim.test/by-node-")


def test_a_user_kubeconfig_gets_what_rbac_grants(cluster: ClusterBed) -> None:
    for ns in ("team-a", "team-b"):
        cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    try:
        cluster.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "pod-reader", "namespace": "team-a"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
            }
        )
        cluster.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "devs-read-pods", "namespace": "team-a"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
                "subjects": [
                    {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "team-a-devs"}
                ],
            }
        )
        cluster.user_kubeconfig("alice", groups=["team-a-devs"])
        cluster.user_kubeconfig("bob")
        # the RBAC authorizer sees the binding through its informer: a moment after the write
        cluster.wait_for(
            "alice may list team-a's pods",
            lambda: cluster.kubectl("get", "pods", "-n", "team-a", user="alice", check=False).returncode == 0,
            timeout=30,
        )
        who = json.loads(cluster.kubectl("auth", "whoami", "-o", "json", user="alice").stdout)
        assert who["status"]["userInfo"]["username"] == "alice"
        assert "team-a-devs" in who["status"]["userInfo"]["groups"]
        other = cluster.kubectl("get", "pods", "-n", "team-b", user="alice", check=False)
        assert other.returncode != 0 and 'User "alice" cannot list resource "pods"' in other.stderr, (
            other.stderr
        )
        bob = cluster.kubectl("get", "pods", "-n", "team-a", user="bob", check=False)
        assert bob.returncode != 0 and 'User "bob" cannot list resource "pods"' in bob.stderr, bob.stderr
        create = cluster.kubectl(
            "create", "configmap", "x", "-n", "team-a", "--from-literal=a=b", user="alice", check=False
        )
        assert create.returncode != 0 and "cannot create resource" in create.stderr, create.stderr
    finally:
        cluster.kubectl("delete", "namespace", "team-a", "team-b", "--wait=false", check=False)


def test_the_cluster_survives_an_api_server_restart(cluster: ClusterBed, pods: list[str]) -> None:
    cluster.kubectl("create", "configmap", "before-restart", "--from-literal=k=v")
    try:
        old_pid = cluster.apiserver_pid
        before = lease_renewed(cluster, cluster.node_name)
        cluster.restart_apiserver()
        assert cluster.apiserver_pid not in (None, old_pid)
        kept = cluster.kubectl_json("get", "configmap", "before-restart")
        assert kept["data"] == {"k": "v"}, "etcd kept the objects"
        # the kubelet reconnects and renews its Lease; the node stays Ready
        cluster.wait_for(
            "the node's Lease renewed after the restart",
            lambda: lease_renewed(cluster, cluster.node_name) not in ("", before),
            timeout=90,
        )
        assert cluster.node_ready(cluster.node_name)
        # the scheduler and the controller manager reconnect too: a new pod is placed and runs
        pods.append("after-restart")
        cluster.apply(pod_manifest("after-restart", [counter()]))
        pod = cluster.wait_pod_running("after-restart")
        assert pod["spec"]["nodeName"] == cluster.node_name
        assert running_containers(cluster.bed, "after-restart") == container_ids(pod)
    finally:
        cluster.kubectl("delete", "configmap", "before-restart", check=False)


def test_a_second_node_runs_its_pods_on_its_own_podshim(cluster: ClusterBed) -> None:
    node2 = cluster.add_node()
    try:
        assert node2.name != cluster.node_name and node2.ip != cluster.node.ip
        assert node2.bed.podshim_socket != cluster.bed.podshim_socket
        assert cluster.node_ready(node2.name)
        cluster.apply(
            pod_manifest("on-node-2", [counter()], nodeSelector={"kubernetes.io/hostname": node2.name})
        )
        try:
            pod = cluster.wait_pod_running("on-node-2")
            assert pod["spec"]["nodeName"] == node2.name
            assert running_containers(node2.bed, "on-node-2") == container_ids(pod)
            assert running_containers(cluster.bed, "on-node-2") == {}, "not on node 1"
            assert "count=" in cluster.kubectl("logs", "on-node-2").stdout
            # node 2's credentials may not touch node 1's object (the node authorizer)
            res = cluster.kubectl(
                "label", "node", cluster.node_name, "podshim.test/by=node-2", user=node2.user, check=False
            )
            assert res.returncode != 0 and "forbidden" in res.stderr.lower(), res.stderr
        finally:
            cluster.delete_pod("on-node-2")
    finally:
        cluster.remove_node(node2)
    assert cluster.get(f"/api/v1/nodes/{node2.name}") is None
    assert cluster.nodes == [cluster.node] and cluster.node_ready(cluster.node_name)
