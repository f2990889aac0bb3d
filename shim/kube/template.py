"""The checkpointed Pod template (KEP-5823's status.checkpointedPodTemplate) and the spec-equality
check a restore Pod must pass against it: `sanitise_template` and `spec_mismatch`
(docs/design/index.md (The cluster API))."""

from __future__ import annotations

import copy
from typing import Any

from lightkube.utils.quantity import parse_quantity

from shim.kube import api

HOSTNAME_LABEL = "kubernetes.io/hostname"
# kubectl's record of the last applied manifest: it would make a restored Pod's next `kubectl apply`
# diff against the source Pod's manifest
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
# The kubelet's annotations of a static Pod's mirror: a Pod created through the API with them would
# be taken for a mirror
MIRROR_PREFIX = "kubernetes.io/config."
DROPPED_ANNOTATIONS = frozenset({LAST_APPLIED, api.RESTORE_FROM_ANNOTATION})
# Maps of resource quantities (a container's, the Pod's, a RuntimeClass's overhead)
QUANTITY_MAPS = frozenset({"requests", "limits", "overhead"})


def sanitise_template(pod: dict[str, Any]) -> dict[str, Any]:
    """A PodTemplateSpec of the Pod: metadata with its labels and annotations only (less kubectl's
    last-applied record, the restore annotation and mirror-pod annotations), and its spec without
    the node it was placed on and without ephemeral containers, with the resource requests the node
    allocated (status.containerStatuses[].allocatedResources: the state that was running, should a
    resize be pending)."""
    meta = pod.get("metadata") or {}
    out_meta: dict[str, Any] = {}
    labels = dict(meta.get("labels") or {})
    if labels:
        out_meta["labels"] = labels
    annotations = {
        k: v
        for k, v in (meta.get("annotations") or {}).items()
        if k not in DROPPED_ANNOTATIONS and not k.startswith(MIRROR_PREFIX)
    }
    if annotations:
        out_meta["annotations"] = annotations
    spec = portable_spec(pod.get("spec") or {})
    _apply_allocated(spec, pod.get("status") or {})
    return {"metadata": out_meta, "spec": spec}


def portable_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a Pod spec without what names its node (nodeName, a kubernetes.io/hostname
    nodeSelector, required node affinity on metadata.name or the hostname label) and without
    ephemeral containers. Terms left empty go, and so do the maps and lists left empty."""
    out = copy.deepcopy(spec)
    out.pop("nodeName", None)
    out.pop("ephemeralContainers", None)
    selector = out.get("nodeSelector")
    if isinstance(selector, dict):
        selector.pop(HOSTNAME_LABEL, None)
        if not selector:
            del out["nodeSelector"]
    affinity = out.get("affinity")
    if isinstance(affinity, dict):
        node_affinity = affinity.get("nodeAffinity")
        if isinstance(node_affinity, dict):
            _drop_node_naming_terms(node_affinity)
            if not node_affinity:
                del affinity["nodeAffinity"]
        if not affinity:
            del out["affinity"]
    return out


def _names_node(requirement: Any, field: bool) -> bool:
    if not isinstance(requirement, dict):
        return False
    key = requirement.get("key")
    return key == "metadata.name" if field else key == HOSTNAME_LABEL


def _drop_node_naming_terms(node_affinity: dict[str, Any]) -> None:
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if not isinstance(required, dict):
        return
    terms = []
    for term in required.get("nodeSelectorTerms") or []:
        if not isinstance(term, dict):
            terms.append(term)
            continue
        term = dict(term)
        for name, field in (("matchFields", True), ("matchExpressions", False)):
            if name in term:
                kept = [r for r in term[name] or [] if not _names_node(r, field)]
                if kept:
                    term[name] = kept
                else:
                    del term[name]
        # A term of only the node's name said "this node": without it, no constraint at all
        if term:
            terms.append(term)
    if terms:
        required["nodeSelectorTerms"] = terms
    else:
        del node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]


def _apply_allocated(spec: dict[str, Any], status: dict[str, Any]) -> None:
    for list_name, status_name in (
        ("containers", "containerStatuses"),
        ("initContainers", "initContainerStatuses"),
    ):
        allocated: dict[str, dict[str, Any]] = {
            str(s.get("name")): s["allocatedResources"]
            for s in status.get(status_name) or []
            if isinstance(s, dict) and isinstance(s.get("allocatedResources"), dict)
        }
        for container in spec.get(list_name) or []:
            quantities = allocated.get(str(container.get("name"))) if isinstance(container, dict) else None
            if not quantities:
                continue
            resources = container.setdefault("resources", {})
            requests = resources.setdefault("requests", {})
            for resource, quantity in quantities.items():
                if not _same_quantity(requests.get(resource), quantity):
                    requests[resource] = quantity


def spec_mismatch(pod_spec: dict[str, Any], template_spec: dict[str, Any]) -> str | None:
    """The dotted path of the first field where a Pod's spec differs from the template's (e.g.
    "spec.containers[0].image"), None when they match. Ignored: the node placement (see
    portable_spec) and ephemeral containers. An absent field equals an empty or null one (the API
    server omits empty fields); resource quantities compare by value ("1Gi" is "1024Mi")."""
    return _first_difference(portable_spec(pod_spec), portable_spec(template_spec), "spec", False)


def _is_empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _same_quantity(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if not isinstance(a, str | int | float) or not isinstance(b, str | int | float):
        return False
    try:
        return parse_quantity(str(a)) == parse_quantity(str(b))
    except ValueError:
        return False


def _child(path: str, key: str) -> str:
    # A key with a dot (a label, a resource name like example.com/gpu) stays one step of the path
    return f'{path}["{key}"]' if "." in key else f"{path}.{key}"


def _first_difference(pod: Any, template: Any, path: str, quantities: bool) -> str | None:
    if isinstance(pod, dict) or isinstance(template, dict):
        if _is_empty(pod) or _is_empty(template):
            pod, template = pod or {}, template or {}
    elif isinstance(pod, list) or isinstance(template, list):
        if _is_empty(pod) or _is_empty(template):
            pod, template = pod or [], template or []
    if isinstance(pod, dict) and isinstance(template, dict):
        # The template's order first (the API server's: containers before the rest), then what only
        # the Pod has
        for k in [*template, *(k for k in pod if k not in template)]:
            a, b = pod.get(k), template.get(k)
            if _is_empty(a) and _is_empty(b):
                continue
            found = _first_difference(a, b, _child(path, str(k)), quantities or k in QUANTITY_MAPS)
            if found:
                return found
        return None
    if isinstance(pod, list) and isinstance(template, list):
        for i in range(max(len(pod), len(template))):
            if i >= len(pod) or i >= len(template):
                return f"{path}[{i}]"
            found = _first_difference(pod[i], template[i], f"{path}[{i}]", quantities)
            if found:
                return found
        return None
    if quantities or path.endswith(".sizeLimit"):
        return None if _same_quantity(pod, template) else path
    return None if pod == template else path
