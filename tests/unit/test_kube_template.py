"""shim/kube/template.py: the checkpointed Pod template and the restore's spec-equality check."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from shim.kube import api
from shim.kube.template import portable_spec, sanitise_template, spec_mismatch


def live_pod() -> dict[str, Any]:
    """A Pod as the API server returns it once scheduled and running (defaulted, admitted)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "web",
            "namespace": "team-a",
            "uid": "7b2c1e4a-0e3a-4f1b-9c2d-2a5f6e8d1234",
            "resourceVersion": "4242",
            "generation": 1,
            "creationTimestamp": "2026-03-10T20:38:11Z",
            "labels": {"app": "web", "pod-template-hash": "5d8f7"},
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": '{"apiVersion":"v1"}',
                api.RESTORE_FROM_ANNOTATION: "older-checkpoint",
                "kubernetes.io/config.seen": "2026-03-10T20:38:11Z",
                "team.example.com/owner": "alice",
            },
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8f7", "uid": "1"}
            ],
            "managedFields": [{"manager": "kubectl", "operation": "Update"}],
        },
        "spec": {
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example.com/web:v1",
                    "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
                    "volumeMounts": [
                        {
                            "name": "kube-api-access-x7k2p",
                            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                            "readOnly": True,
                        }
                    ],
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                    "imagePullPolicy": "IfNotPresent",
                }
            ],
            "volumes": [{"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": []}}],
            "nodeName": "node-1",
            "nodeSelector": {"kubernetes.io/hostname": "node-1", "disktype": "ssd"},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": ["node-1"]}
                                ]
                            }
                        ]
                    }
                },
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 1,
                            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}},
                        }
                    ]
                },
            },
            "ephemeralContainers": [{"name": "debugger", "image": "busybox"}],
            "restartPolicy": "Always",
            "dnsPolicy": "ClusterFirst",
            "schedulerName": "default-scheduler",
            "serviceAccountName": "default",
            "serviceAccount": "default",
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
            "priority": 0,
            "tolerations": [
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                }
            ],
        },
        "status": {
            "phase": "Running",
            "podIP": "10.88.0.5",
            "containerStatuses": [
                {"name": "app", "ready": True, "allocatedResources": {"cpu": "500m", "memory": "1Gi"}}
            ],
        },
    }


def test_template_keeps_labels_and_annotations_only_less_the_recorded_ones() -> None:
    t = sanitise_template(live_pod())
    assert set(t) == {"metadata", "spec"}
    assert t["metadata"] == {
        "labels": {"app": "web", "pod-template-hash": "5d8f7"},
        "annotations": {"team.example.com/owner": "alice"},
    }


def test_template_spec_drops_the_node_and_ephemeral_containers() -> None:
    spec = sanitise_template(live_pod())["spec"]
    assert "nodeName" not in spec
    assert "ephemeralContainers" not in spec
    assert spec["nodeSelector"] == {"disktype": "ssd"}
    # the term naming the node went, and with it the whole required node affinity
    assert "nodeAffinity" not in spec["affinity"]
    assert "podAntiAffinity" in spec["affinity"]
    # what the API server set for the source pod stays: a restored pod is created with it
    assert spec["volumes"][0]["name"] == "kube-api-access-x7k2p"
    assert spec["tolerations"][0]["tolerationSeconds"] == 300
    assert spec["priority"] == 0 and spec["enableServiceLinks"] is True


def test_template_does_not_touch_the_pod() -> None:
    pod = live_pod()
    before = copy.deepcopy(pod)
    sanitise_template(pod)
    assert pod == before


def test_template_of_a_minimal_pod() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    assert sanitise_template(pod) == {"metadata": {}, "spec": {"containers": [{"name": "c", "image": "i"}]}}


def test_only_the_node_naming_parts_of_node_affinity_go() -> None:
    pod = live_pod()
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "node-1"}
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}],
                        "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}],
                    },
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n"]}
                        ]
                    },
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}}
            ],
        }
    }
    spec = sanitise_template(pod)["spec"]
    assert "nodeSelector" not in spec
    node_affinity = spec["affinity"]["nodeAffinity"]
    assert node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
    }
    assert "preferredDuringSchedulingIgnoredDuringExecution" in node_affinity


def test_template_records_the_allocated_requests_under_a_pending_resize() -> None:
    pod = live_pod()
    pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "2"  # resized, not yet allocated
    spec = sanitise_template(pod)["spec"]
    assert spec["containers"][0]["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}
    # without a pending resize the spec's own spelling stays
    pod = live_pod()
    pod["status"]["containerStatuses"][0]["allocatedResources"] = {"cpu": "0.5", "memory": "1024Mi"}
    assert sanitise_template(pod)["spec"]["containers"][0]["resources"]["requests"] == {
        "cpu": "500m",
        "memory": "1Gi",
    }


def restored_spec() -> dict[str, Any]:
    """The spec of a Pod created from the template, after the API server's defaulting and binding."""
    spec = copy.deepcopy(sanitise_template(live_pod())["spec"])
    spec["nodeName"] = "node-1"
    spec["affinity"]["nodeAffinity"] = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}
            ]
        }
    }
    return spec


def test_a_pod_made_from_the_template_matches() -> None:
    template = sanitise_template(live_pod())["spec"]
    assert spec_mismatch(restored_spec(), template) is None
    # and the source pod itself matches its own template
    assert spec_mismatch(live_pod()["spec"], template) is None


def test_mismatch_names_the_first_differing_field() -> None:
    template = sanitise_template(live_pod())["spec"]
    spec = restored_spec()
    spec["containers"][0]["image"] = "registry.example.com/web:v2"
    assert spec_mismatch(spec, template) == "spec.containers[0].image"
    spec = restored_spec()
    spec["containers"].append({"name": "sidecar", "image": "s"})
    assert spec_mismatch(spec, template) == "spec.containers[1]"
    spec = restored_spec()
    spec["hostNetwork"] = True
    assert spec_mismatch(spec, template) == "spec.hostNetwork"
    spec = restored_spec()
    spec["securityContext"] = {"runAsUser": 1000}
    assert spec_mismatch(spec, template) == "spec.securityContext.runAsUser"
    spec = restored_spec()
    del spec["volumes"]
    assert spec_mismatch(spec, template) == "spec.volumes[0]"
    spec = restored_spec()
    spec["nodeSelector"]["disktype"] = "hdd"
    assert spec_mismatch(spec, template) == "spec.nodeSelector.disktype"
    spec = restored_spec()
    spec["nodeSelector"]["example.com/zone"] = "b"
    assert spec_mismatch(spec, template) == 'spec.nodeSelector["example.com/zone"]'


@pytest.mark.parametrize(
    ("pod_value", "template_value"),
    [("1Gi", "1024Mi"), ("500m", "0.5"), ("1", 1), ("2", "2000m")],
)
def test_quantities_compare_by_value(pod_value: Any, template_value: Any) -> None:
    template = sanitise_template(live_pod())["spec"]
    template["containers"][0]["resources"]["limits"] = {"memory": template_value}
    spec = restored_spec()
    spec["containers"][0]["resources"]["limits"] = {"memory": pod_value}
    assert spec_mismatch(spec, template) is None


def test_quantities_that_differ_are_named() -> None:
    template = sanitise_template(live_pod())["spec"]
    spec = restored_spec()
    spec["containers"][0]["resources"]["requests"]["memory"] = "2Gi"
    assert spec_mismatch(spec, template) == "spec.containers[0].resources.requests.memory"
    spec = restored_spec()
    spec["containers"][0]["resources"]["limits"] = {"example.com/gpu": "1"}
    assert spec_mismatch(spec, template) == 'spec.containers[0].resources.limits["example.com/gpu"]'


def test_absent_equals_empty_but_not_false() -> None:
    template = sanitise_template(live_pod())["spec"]
    spec = restored_spec()
    spec["initContainers"] = []
    spec["hostAliases"] = None
    spec["subdomain"] = ""
    assert spec_mismatch(spec, template) is None
    # automountServiceAccountToken: false is not "unset" (unset defers to the service account)
    spec["automountServiceAccountToken"] = False
    assert spec_mismatch(spec, template) == "spec.automountServiceAccountToken"


def test_node_placement_and_ephemeral_containers_are_ignored() -> None:
    template = sanitise_template(live_pod())["spec"]
    spec = restored_spec()
    spec["nodeName"] = "node-2"
    spec["nodeSelector"]["kubernetes.io/hostname"] = "node-2"
    spec["ephemeralContainers"] = [{"name": "dbg", "image": "busybox"}]
    assert spec_mismatch(spec, template) is None


def test_portable_spec_leaves_a_spec_without_placement_alone() -> None:
    spec = {"containers": [{"name": "c", "image": "i"}], "affinity": {"podAffinity": {}}}
    assert portable_spec(spec) == spec
