"""`podshim doctor`'s checks of the cluster API (docs/cluster.md): the API server reachable with
the node's credentials, the PodCheckpoint API served, and each right the node needs (a
SelfSubjectAccessReview per verb)."""

from __future__ import annotations

from collections.abc import Callable

import httpx2
from lightkube import ApiError, Client, KubeConfig
from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
from lightkube.resources.authorization_v1 import SelfSubjectAccessReview

from shim.config import Config
from shim.deadlines import DOCTOR_RPC_TIMEOUT
from shim.kube import api, client

Result = tuple[str, str, str]  # status ("ok", "warn", "fail"), check, detail

# (verb, group, resource, subresource, name): what the node does (deploy/rbac-node.yaml)
NODE_RIGHTS: tuple[tuple[str, str, str, str, str], ...] = (
    *((v, api.GROUP, api.PLURAL, "", "") for v in ("get", "list", "watch")),
    *((v, api.GROUP, api.PLURAL, "status", "") for v in ("update", "patch")),
    ("patch", api.GROUP, api.PLURAL, "", ""),  # the finalizer
    *((v, "", "pods", "", "") for v in ("get", "list", "watch")),
    ("create", "", "events", "", ""),
    ("get", "admissionregistration.k8s.io", "validatingadmissionpolicies", "", api.RESTORE_POLICY),
    ("get", "admissionregistration.k8s.io", "validatingadmissionpolicybindings", "", api.RESTORE_POLICY),
)


def check_cluster(cfg: Config) -> list[Result]:
    check = "cluster API"
    if not client.enabled(cfg):
        return [("warn", check, f"off: [kubernetes] kubeconfig {cfg.kubernetes_kubeconfig!r} names no file")]
    try:
        kc = Client(
            KubeConfig.from_file(cfg.kubernetes_kubeconfig),
            timeout=httpx2.Timeout(DOCTOR_RPC_TIMEOUT),
            trust_env=False,
        )
    except Exception as e:  # noqa: BLE001 - a malformed kubeconfig: say so
        return [("fail", check, f"kubeconfig {cfg.kubernetes_kubeconfig}: {e}")]
    node = client.node_name(cfg)
    results: list[Result] = []
    try:
        allowed = _reviewer(kc)
        missing = [_right(v, r, s, n) for v, g, r, s, n in NODE_RIGHTS if not allowed(v, g, r, s, n)]
    except Exception as e:  # noqa: BLE001 - unreachable, refused, a timeout
        return [("fail", check, f"the API server of {cfg.kubernetes_kubeconfig} does not answer: {_why(e)}")]
    results.append(("ok", check, f"node {node}: the API server answers"))
    if missing:
        fix = "kubectl apply -k /usr/share/podshim/deploy"
        results.append(("fail", "cluster rights", f"node {node} may not {', '.join(missing)}: {fix}"))
    else:
        results.append(("ok", "cluster rights", f"node {node} has each right it needs ({len(NODE_RIGHTS)})"))
    results.append(_served(kc))
    return results


INSTALL = "kubectl apply -k /usr/share/podshim/deploy"


def _served(kc: Client) -> Result:
    check = "PodCheckpoint API"
    try:
        # lightkube has no call for a discovery document (see Kube.api_served_by)
        by = api.served_by_answer(kc._client._client.get(api.DISCOVERY_PATH))  # noqa: SLF001
    except Exception as e:  # noqa: BLE001 - refused, a timeout
        return ("fail", check, f"cannot read the discovery of {api.GROUP}/{api.VERSION}: {_why(e)}")
    if by == api.SERVED_BY_PODSHIM:
        return ("ok", check, f"{api.GROUP}/{api.VERSION} {api.PLURAL} served by {by}")
    if by == api.SERVED_BUILT_IN:
        return (
            "ok",
            check,
            f"{api.GROUP}/{api.VERSION} {api.PLURAL} is the cluster's own type: the kubelet acts on "
            "PodCheckpoints; podshim stands aside and serves the kubelet's CheckpointPod/RestorePod",
        )
    return ("fail", check, f"{api.CRD_NAME} is not served: {INSTALL}")


def _reviewer(kc: Client) -> Callable[[str, str, str, str, str], bool]:
    def allowed(verb: str, group: str, resource: str, sub: str, name: str) -> bool:
        review = SelfSubjectAccessReview(
            spec=SelfSubjectAccessReviewSpec(
                resourceAttributes=ResourceAttributes(
                    verb=verb, group=group, resource=resource, subresource=sub or None, name=name or None
                )
            )
        )
        answer = kc.create(review)
        return bool(answer.status and answer.status.allowed)

    return allowed


def _right(verb: str, resource: str, sub: str, name: str) -> str:
    what = f"{resource}/{sub}" if sub else resource
    return f"{verb} {what} {name}".strip()


def _why(e: BaseException) -> str:
    if isinstance(e, ApiError):
        return f"{e.status.code}: {e.status.message}"
    return f"{type(e).__name__}: {e}"
