"""The node's connection to the API server (lightkube's asyncio client), and the few requests
podshim makes with it, each bounded by a timeout: no CRI call ever waits on the API server."""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime
from typing import Any

import httpx2
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.generic_resource import create_global_resource
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Pod
from lightkube.types import PatchType

from shim import logs
from shim.config import Config
from shim.deadlines import KUBE_REQUEST_TIMEOUT
from shim.kube import api

log = logs.get("shim.kube.client")

FIELD_MANAGER = "podshim"

ValidatingAdmissionPolicy = create_global_resource(
    "admissionregistration.k8s.io", "v1", "ValidatingAdmissionPolicy", "validatingadmissionpolicies"
)
ValidatingAdmissionPolicyBinding = create_global_resource(
    "admissionregistration.k8s.io",
    "v1",
    "ValidatingAdmissionPolicyBinding",
    "validatingadmissionpolicybindings",
)


def node_name(config: Config) -> str:
    """`[kubernetes] node_name`, else the host name in lower case (the kubelet's default)."""
    return config.kubernetes_node_name or socket.gethostname().lower()


def enabled(config: Config) -> bool:
    """The cluster API is served when the kubeconfig names a readable file."""
    path = config.kubernetes_kubeconfig
    return bool(path) and os.path.isfile(path)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kube:
    def __init__(self, config: Config) -> None:
        self.node = node_name(config)
        self.client = AsyncClient(
            KubeConfig.from_file(config.kubernetes_kubeconfig),
            timeout=httpx2.Timeout(KUBE_REQUEST_TIMEOUT),
            field_manager=FIELD_MANAGER,
            trust_env=False,
        )

    async def close(self) -> None:
        await self.client.close()

    async def api_served_by(self) -> str:
        """Who serves PodCheckpoint (api.served_by), from the API's discovery, which every
        authenticated client may read."""
        # lightkube has no call for a discovery document: its HTTP client, configured with the
        # node's credentials, asks for it
        http = self.client._client._client  # noqa: SLF001
        return api.served_by_answer(await http.get(api.DISCOVERY_PATH))

    async def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod, None when it does not exist (or the node may not read it)."""
        try:
            return (await self.client.get(Pod, name, namespace=namespace)).to_dict()
        except ApiError as e:
            if e.status.code in (403, 404):
                return None
            raise

    async def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj = await self.client.get(api.PodCheckpoint, name, namespace=namespace)
        except ApiError as e:
            if e.status.code == 404:
                return None
            raise
        return dict(obj.to_dict())

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self.client.patch(
            api.PodCheckpoint.Status,
            name,
            {"status": status},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )

    async def _finalizers(self, namespace: str, name: str, add: bool) -> None:
        obj = await self.get_checkpoint(namespace, name)
        if obj is None:
            return
        have = list((obj.get("metadata") or {}).get("finalizers") or [])
        want = [f for f in have if f != api.FINALIZER] + ([api.FINALIZER] if add else [])
        if want == have:
            return
        # a JSON patch tested against the list read: a concurrent change fails it (and is retried)
        # instead of being overwritten
        ops: list[dict[str, Any]] = (
            [{"op": "test", "path": "/metadata/finalizers", "value": have}] if have else []
        )
        ops.append({"op": "add" if not have else "replace", "path": "/metadata/finalizers", "value": want})
        await self.client.patch(api.PodCheckpoint, name, ops, namespace=namespace, patch_type=PatchType.JSON)

    async def add_finalizer(self, namespace: str, name: str) -> None:
        await self._finalizers(namespace, name, add=True)

    async def remove_finalizer(self, namespace: str, name: str) -> None:
        await self._finalizers(namespace, name, add=False)

    async def event(
        self,
        obj: dict[str, Any],
        reason: str,
        message: str,
        warning: bool = False,
        kind: str = api.KIND,
        api_version: str = f"{api.GROUP}/{api.VERSION}",
    ) -> None:
        """An event on the object (a failure to write it is logged, never raised: the status
        carries the outcome)."""
        md = obj.get("metadata") or {}
        now = _now()
        ev = Event(
            metadata=ObjectMeta(generateName=f"{md.get('name')}.", namespace=md.get("namespace")),
            involvedObject=ObjectReference(
                apiVersion=api_version,
                kind=kind,
                name=md.get("name"),
                namespace=md.get("namespace"),
                uid=md.get("uid"),
            ),
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=EventSource(component="podshim", host=self.node),
            reportingComponent="podshim",
            reportingInstance=self.node,
            firstTimestamp=now,  # type: ignore[arg-type]
            lastTimestamp=now,  # type: ignore[arg-type]
            count=1,
        )
        try:
            await self.client.create(ev)  # the namespace is the event's own
        except Exception as e:  # noqa: BLE001 - an event is a courtesy
            log.warning("cannot write an event", reason=reason, error=str(e))

    async def restore_policy_enforcing(self) -> str:
        """ "" when podshim's admission policy and its binding are installed and deny; else what to
        install (a restore is refused meanwhile: the policy is what keeps any pod creator from
        another workload's memory)."""
        try:
            policy = (await self.client.get(ValidatingAdmissionPolicy, api.RESTORE_POLICY)).to_dict()
            binding = (await self.client.get(ValidatingAdmissionPolicyBinding, api.RESTORE_POLICY)).to_dict()
        except ApiError as e:
            if e.status.code == 404:
                return (
                    f"the ValidatingAdmissionPolicy {api.RESTORE_POLICY!r} and its binding are not "
                    "installed: kubectl apply -k /usr/share/podshim/deploy"
                )
            return f"cannot read the admission policy {api.RESTORE_POLICY!r}: {e.status.message}"
        spec = binding.get("spec") or {}
        if spec.get("policyName") != api.RESTORE_POLICY or "Deny" not in (
            spec.get("validationActions") or []
        ):
            return f"the ValidatingAdmissionPolicyBinding {api.RESTORE_POLICY!r} does not deny: reinstall it"
        if (policy.get("spec") or {}).get("failurePolicy", "Fail") != "Fail":
            return f"the ValidatingAdmissionPolicy {api.RESTORE_POLICY!r} must have failurePolicy Fail"
        return ""
