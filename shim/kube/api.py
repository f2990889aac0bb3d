"""KEP-5823's cluster API in one place: its group, version, names, fields, condition reasons and
events, and the names podshim adds (the restore annotation, its admission policy). The day the
KEP's built-in type lands, podshim follows with a change here."""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource

GROUP = "checkpoint.k8s.io"
VERSION = "v1alpha1"
KIND = "PodCheckpoint"
PLURAL = "podcheckpoints"
CRD_NAME = f"{PLURAL}.{GROUP}"
# podshim's CRD lists this category (deploy/crd.yaml): discovery tells it from the built-in type
CRD_CATEGORY = "podshim"

# Who serves PodCheckpoint (served_by)
SERVED_BY_PODSHIM = "podshim's CRD"
SERVED_BUILT_IN = "built-in"
NOT_SERVED = ""

PodCheckpoint = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)

# The Pod's `spec.restoreFrom` until the field exists: an annotation naming a PodCheckpoint of the
# Pod's namespace, guarded by podshim's admission policy (deploy/policies.yaml)
RESTORE_FROM_ANNOTATION = f"{GROUP}/restore-from"
# podshim removes the archive before the object goes
FINALIZER = f"{GROUP}/podshim-archive"

# The node's checkpoint root: status.checkpointLocation.nodeLocal.path is relative to it
CHECKPOINT_ROOT = "/var/lib/kubelet/pod-checkpoints"
LOCATION_NODE_LOCAL = "NodeLocal"

# The one condition and its reasons
READY = "Ready"
PENDING = "Pending"
IN_PROGRESS = "CheckpointInProgress"
COMPLETED = "CheckpointCompleted"
FAILED = "CheckpointFailed"
SOURCE_POD_REPLACED = "SourcePodReplaced"
TERMINAL_FALSE = frozenset({FAILED, SOURCE_POD_REPLACED})

# Events on the PodCheckpoint
EVENT_STARTED = "CheckpointStarted"
EVENT_SUCCEEDED = "CheckpointSucceeded"
EVENT_FAILED = "CheckpointFailed"

# Restore refusals (events on the Pod, and the error the kubelet shows) and success
NOT_READY = "CheckpointNotReady"
WRONG_NODE = "CheckpointWrongNode"
DATA_MISSING = "CheckpointDataMissing"
SPEC_MISMATCH = "PodSpecMismatch"
POLICY_MISSING = "RestorePolicyMissing"  # podshim's own: its admission policy is not enforcing
# podshim's own: the cluster serves PodCheckpoint itself, the kubelet restores (spec.restoreFrom)
BUILT_IN_API = "PodCheckpointBuiltIn"
RESTORE_SUCCEEDED = "RestoreSucceeded"

# podshim's admission policy and binding (deploy/policies.yaml): a restore needs the `restore` verb
RESTORE_POLICY = "podshim-restore-from"
# and the one that narrows what a node writes of PodCheckpoints (its own, their status and finalizer)
NODE_POLICY = "podshim-node-checkpoints"
RESTORE_VERB = "restore"


def source_pod_name(obj: dict[str, Any]) -> str:
    """spec.sourcePodName (the KEP), or spec.sourcePod.name (the kubelet's pull request)."""
    spec = obj.get("spec") or {}
    return str(spec.get("sourcePodName") or (spec.get("sourcePod") or {}).get("name") or "")


def source_pod_uid(obj: dict[str, Any]) -> str:
    """spec.sourcePodUID, or spec.sourcePod.uid; "" when the creator pinned none."""
    spec = obj.get("spec") or {}
    return str(spec.get("sourcePodUID") or (spec.get("sourcePod") or {}).get("uid") or "")


def timeout_seconds(obj: dict[str, Any]) -> int:
    """spec.timeoutSeconds; 0 (nil or 0): the runtime's default."""
    value = (obj.get("spec") or {}).get("timeoutSeconds") or 0
    return int(value) if isinstance(value, int) and value > 0 else 0


def ready_condition(obj: dict[str, Any]) -> dict[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == READY:
            return c
    return None


def is_terminal(obj: dict[str, Any]) -> bool:
    """Ready=True, or Ready=False with CheckpointFailed / SourcePodReplaced: nothing left to do."""
    c = ready_condition(obj)
    if c is None:
        return False
    return c.get("status") == "True" or (c.get("status") == "False" and c.get("reason") in TERMINAL_FALSE)


def is_ready(obj: dict[str, Any]) -> bool:
    c = ready_condition(obj)
    return c is not None and c.get("status") == "True"


def archive_path(obj: dict[str, Any]) -> str:
    """The absolute archive directory a Ready object's status names, "" when it names none (or a
    path that leaves the checkpoint root)."""
    loc = (obj.get("status") or {}).get("checkpointLocation") or {}
    rel = str((loc.get("nodeLocal") or {}).get("path") or "")
    if loc.get("type") != LOCATION_NODE_LOCAL or not rel or rel.startswith("/") or ".." in rel.split("/"):
        return ""
    return f"{CHECKPOINT_ROOT}/{rel}"


def archive_dir_name(pod: str, namespace: str, stamp: str) -> str:
    """checkpoint-<pod>_<namespace>-<timestamp>, the KEP's layout under the checkpoint root."""
    return f"checkpoint-{pod}_{namespace}-{stamp}"


# The group version's discovery document, which every authenticated client may read (served_by)
DISCOVERY_PATH = f"/apis/{GROUP}/{VERSION}"


def served_by_answer(resp: Any) -> str:
    """served_by of the API server's HTTP answer to DISCOVERY_PATH (404: the group version is not
    served); another error status raises."""
    if resp.status_code == 404:
        return NOT_SERVED
    resp.raise_for_status()
    return served_by(resp.json())


def served_by(resources: dict[str, Any] | None) -> str:
    """Who serves PodCheckpoint, from the discovery document of GROUP/VERSION (an APIResourceList,
    None when the group version is not served): podshim's CRD (it carries CRD_CATEGORY), a type
    that is not podshim's (built in, or another's definition: the kubelet acts on those objects,
    and podshim stands aside so that no object is acted on twice), or nothing."""
    for res in (resources or {}).get("resources") or []:
        if isinstance(res, dict) and res.get("name") == PLURAL:
            return SERVED_BY_PODSHIM if CRD_CATEGORY in (res.get("categories") or []) else SERVED_BUILT_IN
    return NOT_SERVED
