"""`kubectl podshim`: KEP-5823's checkpoint and restore from a user's seat, with the user's own
kubeconfig and rights (docs/design/index.md (The cluster API)).

    kubectl podshim checkpoint POD [--name N] [--timeout S] [--wait [--wait-timeout S]]
    kubectl podshim restore CHECKPOINT [--name NEW] [--wait [--wait-timeout S]]
    kubectl podshim list [-A]

Errors are one line on stderr, exit code 1; bad usage exits 2."""

from __future__ import annotations

import argparse
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, cast

import httpx2
from lightkube import ALL_NS, ApiError, Client, ConfigError, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Event

from shim.deadlines import PLUGIN_PICKUP_MARGIN, PLUGIN_WAIT
from shim.kube import api

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
# The longest single watch request: the server ends it, the wait goes on with a fresh one
WATCH_SLICE = 60
# kube's generateName alphabet (no vowels, no look-alikes)
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
# The labels by which a workload controller claims pods: a restored Pod carrying them would be
# adopted by the source Pod's ReplicaSet or Job and deleted as one replica too many
CONTROLLER_LABELS = frozenset(
    {
        "pod-template-hash",
        "controller-revision-hash",
        "statefulset.kubernetes.io/pod-name",
        "apps.kubernetes.io/pod-index",
        "controller-uid",
        "job-name",
        "batch.kubernetes.io/controller-uid",
        "batch.kubernetes.io/job-name",
        "batch.kubernetes.io/job-completion-index",
    }
)


# Pods as plain dicts, not lightkube's models: a model drops the fields it does not know (a newer
# cluster's), and a restored Pod must carry its template whole to match it
RawPod = create_namespaced_resource("", "v1", "Pod", "pods")


class PluginError(Exception):
    """One line for stderr, naming what to fix; exit code 1."""


class KubeClient(Protocol):
    """What the plugin uses of lightkube's sync Client (the seam the unit tests fake)."""

    def get(self, res: Any, name: str, *, namespace: str | None = None) -> Any: ...
    def create(self, obj: Any, namespace: str | None = None) -> Any: ...
    def list(self, res: Any, *, namespace: str | None = None, fields: Any = None) -> Iterator[Any]: ...
    def watch(
        self,
        res: Any,
        *,
        namespace: str | None = None,
        fields: Any = None,
        server_timeout: int | None = None,
        resource_version: str | None = None,
    ) -> Iterator[tuple[str, Any]]: ...


# ---------------------------------------------------------------------------- the cluster


def kubeconfig_path(flag: str | None) -> Path:
    """--kubeconfig, else the first file of $KUBECONFIG, else ~/.kube/config (kubectl's order)."""
    if flag:
        path = Path(flag).expanduser()
        if not path.is_file():
            raise PluginError(f"--kubeconfig {flag}: no such file")
        return path
    env = os.environ.get("KUBECONFIG", "")
    for part in env.split(os.pathsep):
        if part and Path(part).expanduser().is_file():
            return Path(part).expanduser()
    path = Path("~/.kube/config").expanduser()
    if not path.is_file():
        where = f"$KUBECONFIG ({env})" if env else str(path)
        raise PluginError(f"no kubeconfig at {where}: set $KUBECONFIG or pass --kubeconfig")
    return path


def connect(args: argparse.Namespace) -> tuple[KubeClient, str]:
    """A client on the user's kubeconfig (and --context) and the namespace to work in: -n, else
    the context's, else "default"."""
    path = kubeconfig_path(args.kubeconfig)
    try:
        config = KubeConfig.from_file(str(path))
        single = config.get(context_name=args.context)
        if single is None:
            raise PluginError(f"kubeconfig {path}: no current context: pass --context")
        client = Client(config=single, field_manager="kubectl-podshim")
    except (ConfigError, OSError, ValueError) as e:
        raise PluginError(f"kubeconfig {path}: {e}") from None
    return cast(KubeClient, client), args.namespace or single.namespace


def to_dict(obj: Any) -> dict[str, Any]:
    """A plain dict of a lightkube object (its generic resources are dicts already)."""
    out: dict[str, Any] = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    return out


def _code(e: Exception) -> int | None:
    return getattr(getattr(e, "status", None), "code", None)


def _api_error(e: Exception, what: str, hint: str = "") -> PluginError:
    """An ApiError as one line: what was being done, the server's reason, what to do about it."""
    status = getattr(e, "status", None)
    code = getattr(status, "code", None)
    message = getattr(status, "message", None) or str(e)
    details = getattr(status, "details", None)
    if code == 404 and not getattr(details, "name", None):
        return PluginError(
            f"{what}: the cluster does not serve {api.CRD_NAME}: install podshim's cluster API "
            "(kubectl apply -k /usr/share/podshim/deploy)"
        )
    return PluginError(f"{what}: {message}{f' ({hint})' if hint and code == 403 else ''}")


def _call(what: str, fn: Callable[[], Any], hint: str = "") -> Any:
    """fn(), lightkube's and httpx's errors turned into a PluginError saying `what` failed."""
    try:
        return fn()
    except ApiError as e:
        raise _api_error(e, what, hint) from None
    except httpx2.HTTPError as e:
        raise PluginError(f"{what}: cannot reach the API server: {e}") from None


# ---------------------------------------------------------------------------- object helpers


def _condition(obj: dict[str, Any]) -> tuple[str, str, str]:
    c = api.ready_condition(obj) or {}
    return str(c.get("status") or ""), str(c.get("reason") or ""), str(c.get("message") or "")


def _location(obj: dict[str, Any]) -> str:
    node = (obj.get("status") or {}).get("nodeName") or "?"
    return f"node {node}, {api.archive_path(obj) or 'no location recorded'}"


def human_age(created: str | None, now: datetime | None = None) -> str:
    """kubectl's AGE (its HumanDuration): 45s, 5m30s, 3h, 5h30m, 2d, 3d4h, 400d, 3y."""
    if not created:
        return "<unknown>"
    try:
        then = datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return "<unknown>"
    s = max(0, int(((now or datetime.now(UTC)) - then).total_seconds()))
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if h < 3:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if d < 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    if d < 365 * 2:
        return f"{d}d"
    return f"{d // 365}y"


def _watch_until(
    client: KubeClient,
    res: Any,
    name: str,
    namespace: str,
    first: dict[str, Any],
    done: Callable[[dict[str, Any]], bool],
    deadline: float,
) -> dict[str, Any] | None:
    """Watches one object from `first` (its resourceVersion: no change is missed) until `done`
    holds, returning the object; None at the deadline. lightkube's watch resumes by itself when the
    server ends it (and starts afresh on 410 Gone), so it runs in a thread and the deadline is kept
    here, on the queue of its events."""
    if done(first):
        return first
    events: queue.Queue[tuple[str, Any] | BaseException | None] = queue.Queue()

    def pump() -> None:
        try:
            for event in client.watch(
                res,
                namespace=namespace,
                fields={"metadata.name": name},
                server_timeout=WATCH_SLICE,
                resource_version=(first.get("metadata") or {}).get("resourceVersion"),
            ):
                events.put(event)
            events.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            events.put(e)

    # A daemon: at the deadline the command returns and the process ends with the watch open
    threading.Thread(target=pump, name=f"watch-{name}", daemon=True).start()
    while (left := deadline - time.monotonic()) > 0:
        try:
            event = events.get(timeout=left)
        except queue.Empty:
            return None
        if event is None:
            return None
        if isinstance(event, BaseException):
            raise event
        kind, item = event
        if kind == "DELETED":
            raise PluginError(f"{res.__name__.lower()}/{name} was deleted while waiting")
        obj = to_dict(item)
        if done(obj):
            return obj
    return None


# ---------------------------------------------------------------------------- commands


def _get(client: KubeClient, res: Any, name: str, namespace: str, kind: str) -> dict[str, Any] | None:
    """The object, None when the user may not read it; a missing one is a PluginError."""
    try:
        return to_dict(client.get(res, name, namespace=namespace))
    except ApiError as e:
        details = getattr(getattr(e, "status", None), "details", None)
        if _code(e) == 404 and getattr(details, "name", None):
            hint = "kubectl podshim list" if kind == "podcheckpoint" else "check the name"
            raise PluginError(f"{kind} {namespace}/{name} not found ({hint}, or -n NAMESPACE)") from None
        if _code(e) == 403:
            return None
        raise _api_error(e, f"reading {kind} {namespace}/{name}") from None
    except httpx2.HTTPError as e:
        raise PluginError(f"reading {kind} {namespace}/{name}: cannot reach the API server: {e}") from None


def cmd_checkpoint(client: KubeClient, namespace: str, args: argparse.Namespace) -> int:
    # Pinned to the pod's UID when the user may read the pod (the KEP's advice to callers): a pod
    # re-created under the same name meanwhile fails the checkpoint instead of being checkpointed
    pod = _get(client, RawPod, args.pod, namespace, "pod")
    spec: dict[str, Any] = {"sourcePodName": args.pod}
    uid = ((pod or {}).get("metadata") or {}).get("uid")
    if uid:
        spec["sourcePodUID"] = uid
    if args.timeout is not None:
        spec["timeoutSeconds"] = args.timeout
    meta: dict[str, Any] = {"name": args.name} if args.name else {"generateName": f"{args.pod}-"}
    meta["namespace"] = namespace
    body = {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "metadata": meta, "spec": spec}
    created = to_dict(
        _call(
            f"creating a PodCheckpoint of pod {namespace}/{args.pod}",
            lambda: client.create(api.PodCheckpoint.from_dict(body), namespace=namespace),
            hint="the podcheckpoint-editor role in the namespace grants it",
        )
    )
    name = created["metadata"]["name"]
    print(f"podcheckpoint/{name} created")
    if not args.wait:
        return EXIT_OK
    # By default the wait outlasts the checkpoint's own deadline, with a margin for the node to
    # pick the object up and write its status
    wait = args.wait_timeout or max(PLUGIN_WAIT, (args.timeout or 0) + PLUGIN_PICKUP_MARGIN)
    deadline = time.monotonic() + wait
    final = _call(
        f"waiting for podcheckpoint/{name}",
        lambda: _watch_until(client, api.PodCheckpoint, name, namespace, created, api.is_terminal, deadline),
    )
    if final is None:
        raise PluginError(
            f"podcheckpoint/{name} is not Ready after {wait:g}s: does podshim run on the pod's "
            f"node? (kubectl describe podcheckpoint {name} -n {namespace})"
        )
    status, reason, message = _condition(final)
    if status == "True":
        print(f"podcheckpoint/{name} ready: {_location(final)}")
        return EXIT_OK
    raise PluginError(f"podcheckpoint/{name} failed: {reason}: {message}")


def restored_pod(checkpoint: dict[str, Any], name: str) -> dict[str, Any]:
    """The Pod a Ready checkpoint restores into: its template's labels (less a controller's, so no
    ReplicaSet or Job adopts it), annotations and spec, on the checkpoint's node, naming the
    checkpoint in the restore annotation."""
    status = checkpoint.get("status") or {}
    template = status.get("checkpointedPodTemplate") or {}
    tmeta = template.get("metadata") or {}
    meta: dict[str, Any] = {"name": name, "namespace": checkpoint["metadata"]["namespace"]}
    labels = {k: v for k, v in (tmeta.get("labels") or {}).items() if k not in CONTROLLER_LABELS}
    if labels:
        meta["labels"] = labels
    annotations = dict(tmeta.get("annotations") or {})
    annotations[api.RESTORE_FROM_ANNOTATION] = checkpoint["metadata"]["name"]
    meta["annotations"] = annotations
    spec = dict(template.get("spec") or {})
    spec["nodeName"] = status["nodeName"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def cmd_restore(client: KubeClient, namespace: str, args: argparse.Namespace) -> int:
    checkpoint = _get(client, api.PodCheckpoint, args.checkpoint, namespace, "podcheckpoint")
    if checkpoint is None:
        raise PluginError(
            f"reading podcheckpoint {namespace}/{args.checkpoint}: forbidden "
            "(the podcheckpoint-editor role in the namespace grants reading and restoring)"
        )
    status, reason, message = _condition(checkpoint)
    if status != "True":
        state = f"{reason}: {message}" if reason else "no Ready condition yet"
        raise PluginError(f"podcheckpoint/{args.checkpoint} is not Ready ({state}): restore from a Ready one")
    st = checkpoint.get("status") or {}
    if not st.get("nodeName") or not (st.get("checkpointedPodTemplate") or {}).get("spec"):
        raise PluginError(
            f"podcheckpoint/{args.checkpoint} records no node or no pod template: "
            "restore from one a node completed"
        )
    name = args.name or f"{api.source_pod_name(checkpoint)}-restored-{random_suffix()}"
    body = restored_pod(checkpoint, name)
    created = to_dict(
        _call(
            f"creating pod {namespace}/{name} from podcheckpoint/{args.checkpoint}",
            lambda: client.create(RawPod.from_dict(body), namespace=namespace),
        )
    )
    print(f"pod/{name} created on node {st['nodeName']}, restoring from podcheckpoint/{args.checkpoint}")
    if not args.wait:
        return EXIT_OK

    def settled(pod: dict[str, Any]) -> bool:
        return (pod.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed")

    deadline = time.monotonic() + args.wait_timeout
    final = _call(
        f"waiting for pod/{name}",
        lambda: _watch_until(client, RawPod, name, namespace, created, settled, deadline),
    )
    if final is None:
        # A restore the node refuses leaves the pod Pending; its events name the reason
        raise PluginError(
            f"pod/{name} is not Running after {args.wait_timeout:g}s"
            f"{_last_warning(client, name, namespace)}: kubectl describe pod {name} -n {namespace}"
        )
    phase = (final.get("status") or {}).get("phase")
    if phase != "Running":
        raise PluginError(f"pod/{name} ended {phase}: kubectl describe pod {name} -n {namespace}")
    print(f"pod/{name} running")
    return EXIT_OK


def _last_warning(client: KubeClient, pod: str, namespace: str) -> str:
    """ " (<reason>: <message>)" of the pod's latest Warning event, "" when none can be read."""
    try:
        warnings = [
            to_dict(e)
            for e in client.list(
                Event, namespace=namespace, fields={"involvedObject.name": pod, "type": "Warning"}
            )
        ]
    except (ApiError, httpx2.HTTPError):
        return ""
    if not warnings:
        return ""

    def when(e: dict[str, Any]) -> str:
        meta = e.get("metadata") or {}
        return str(e.get("lastTimestamp") or e.get("eventTime") or meta.get("creationTimestamp") or "")

    last = max(warnings, key=when)
    return f" ({last.get('reason')}: {last.get('message')})"


def random_suffix(n: int = 5) -> str:
    return "".join(secrets.choice(NAME_ALPHABET) for _ in range(n))


def cmd_list(client: KubeClient, namespace: str, args: argparse.Namespace) -> int:
    everywhere = bool(args.all_namespaces)
    items = [
        to_dict(o)
        for o in _call(
            "listing podcheckpoints",
            lambda: list(client.list(api.PodCheckpoint, namespace=ALL_NS if everywhere else namespace)),
        )
    ]
    if not items:
        where = "any namespace" if everywhere else f"namespace {namespace}"
        print(f"No podcheckpoints in {where}.", file=sys.stderr)
        return EXIT_OK
    header = ["NAME", "POD", "NODE", "READY", "REASON", "AGE"]
    if everywhere:
        header.insert(0, "NAMESPACE")
    rows = [header]
    now = datetime.now(UTC)
    for obj in sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])):
        status, reason, _ = _condition(obj)
        row = [
            obj["metadata"]["name"],
            api.source_pod_name(obj) or "<none>",
            (obj.get("status") or {}).get("nodeName") or "<none>",
            status or "<none>",
            reason or "<none>",
            human_age(obj["metadata"].get("creationTimestamp"), now),
        ]
        if everywhere:
            row.insert(0, obj["metadata"].get("namespace", ""))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("   ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return EXIT_OK


# ---------------------------------------------------------------------------- the command line


def _seconds(value: str) -> float:
    try:
        seconds = float(value.removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seconds {value!r}") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"invalid seconds {value!r}: must be positive")
    return seconds


def _timeout_seconds(value: str) -> int:
    try:
        seconds = int(value.removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid whole seconds {value!r}") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"invalid seconds {value!r}: 0 or more")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl podshim",
        description="Pod checkpoint and restore (KEP-5823's PodCheckpoint) on nodes that run podshim.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", help="kubeconfig file (default $KUBECONFIG, else ~/.kube/config)")
    common.add_argument("--context", help="kubeconfig context (default: its current context)")
    common.add_argument("-n", "--namespace", help="namespace (default: the context's, else default)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("checkpoint", parents=[common], help="checkpoint a running pod")
    p.add_argument("pod", metavar="POD")
    p.add_argument("--name", help="the PodCheckpoint's name (default: generated, POD-xxxxx)")
    p.add_argument(
        "--timeout",
        type=_timeout_seconds,
        metavar="S",
        help="spec.timeoutSeconds: the longest the checkpoint may take (default: the runtime's)",
    )
    p.add_argument("--wait", action="store_true", help="wait until the checkpoint is Ready or failed")
    p.add_argument(
        "--wait-timeout",
        type=_seconds,
        metavar="S",
        help="(default 600, or --timeout and a minute if longer)",
    )
    p.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("restore", parents=[common], help="create a pod restored from a Ready checkpoint")
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--name", help="the new pod's name (default: SOURCE-restored-xxxxx)")
    p.add_argument("--wait", action="store_true", help="wait until the pod is Running")
    p.add_argument("--wait-timeout", type=_seconds, default=PLUGIN_WAIT, metavar="S", help="(default 600)")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("list", parents=[common], help="list checkpoints")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="in every namespace")
    p.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        client, namespace = connect(args)
        return int(args.func(client, namespace, args))
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
