"""The crictl-style client commands of `podshim`: checkpointpod, restorepod, checkpoint, and the
pods / ps / inspectp passthroughs (plus `inspect_container`, the container half of `inspect`).

Conventions (crictl's): `-r/--runtime-endpoint` (default $CONTAINER_RUNTIME_ENDPOINT, else
podshim's socket), `--timeout` seconds, `-o json|yaml|table`. Exit codes: 0 success, 1 the
runtime (or the node) failed — the gRPC code name and message go to stderr —, 2 bad usage.
Errors never print a traceback. Long operations show elapsed time and bytes written on a
terminal (stderr) and stay quiet when stderr is not one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.cli import output
from shim.deadlines import CLI_LONG_TIMEOUT, CLI_SHORT_TIMEOUT

DEFAULT_ENDPOINT = "unix:///run/podshim/podshim.sock"
ENDPOINT_ENV = "CONTAINER_RUNTIME_ENDPOINT"
MAX_MESSAGE = 16 << 20
RESTORED_SUFFIX = "-restored"

# archive layout names (shim/archive/layout.py), repeated so the client imports no server code
MANIFEST_FILE = "manifest.json"
SANDBOX_STATUS_FILE = "sandbox/status.json"
CONFIG_DUMP_FILE = "config.dump"

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad arguments or input files: exit code 2."""


class CliError(Exception):
    """A failure on this side of the socket (archive unreadable, ambiguous id): exit code 1."""


# ---------------------------------------------------------------------------- argument types


def duration(value: str) -> float:
    """Seconds: `30`, `30s`, `1.5m`, `1h` (crictl writes durations with a unit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {value!r} (e.g. 30, 30s, 2m)")
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]
    seconds = float(m.group(1)) * scale
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"invalid duration {value!r}: must be positive")
    return seconds


def key_value(value: str) -> tuple[str, str]:
    """`k=v` of --option (the value may be empty, the key may not)."""
    key, sep, val = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key.strip(), val


def name_file(value: str) -> tuple[str, str]:
    """`NAME=FILE` of --container-config."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {value!r}")
    return name.strip(), path.strip()


# ---------------------------------------------------------------------------- options


def add_global_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """-r/--runtime-endpoint, --timeout, -o. On the main parser (defaults) and, with
    `suppress`, on each client subcommand so they work before or after the command name."""
    default: Any = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "-r",
        "--runtime-endpoint",
        metavar="ENDPOINT",
        default=default,
        help=f"CRI endpoint (default ${ENDPOINT_ENV}, else {DEFAULT_ENDPOINT})",
    )
    parser.add_argument(
        "--timeout",
        type=duration,
        metavar="SECONDS",
        default=default,
        help=f"deadline of the call (default {CLI_LONG_TIMEOUT:g}s for checkpointpod, restorepod and "
        f"checkpoint, {CLI_SHORT_TIMEOUT:g}s for the others)",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=output.FORMATS,
        default=default,
        help="output format (default: table for lists and operations, json for inspect*)",
    )


def endpoint(args: argparse.Namespace) -> str:
    return getattr(args, "runtime_endpoint", None) or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


def grpc_target(ep: str) -> str:
    """crictl accepts unix:///path, unix:/path, a bare /path and tcp://host:port."""
    if ep.startswith("unix:"):
        return ep
    if ep.startswith("/"):
        return f"unix://{ep}"
    if ep.startswith("tcp://"):
        return ep.removeprefix("tcp://")
    return ep


def timeout_of(args: argparse.Namespace, long: bool = False) -> float:
    t = getattr(args, "timeout", None)
    return float(t) if t else (CLI_LONG_TIMEOUT if long else CLI_SHORT_TIMEOUT)


def output_of(args: argparse.Namespace, default: str = "table") -> str:
    return getattr(args, "output", None) or default


def runtime_stub(args: argparse.Namespace) -> api_pb2_grpc.RuntimeServiceStub:
    channel = grpc.insecure_channel(
        grpc_target(endpoint(args)),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ],
    )
    return api_pb2_grpc.RuntimeServiceStub(channel)


# ---------------------------------------------------------------------------- error handling


def rpc_error_message(err: grpc.RpcError, ep: str) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if name == "UNAVAILABLE" and "failed to connect" in details:
        details = f"cannot reach the runtime at {ep} (is podshim running? see -r): {details}"
    elif name == "DEADLINE_EXCEEDED" and "Deadline Exceeded" in details:
        details = f"{details} (raise --timeout for long operations)"
    elif name == "UNIMPLEMENTED" and details in ("", "Method not found!", "unknown service"):
        details = f"the runtime at {ep} does not implement this call ({details or 'no details'})"
    return f"{name}: {details}"


Command = Callable[[argparse.Namespace], int]


def guarded(name: str) -> Callable[[Command], Command]:
    """Turn every failure of a client command into one line on stderr and its exit code."""

    def wrap(fn: Command) -> Command:
        @functools.wraps(fn)
        def run(args: argparse.Namespace) -> int:
            try:
                return fn(args)
            except grpc.RpcError as e:
                _err(name, rpc_error_message(e, endpoint(args)))
                return EXIT_RUNTIME
            except UsageError as e:
                _err(name, str(e))
                return EXIT_USAGE
            except CliError as e:
                _err(name, str(e))
                return EXIT_RUNTIME
            except KeyboardInterrupt:
                _err(name, "interrupted (the call was cancelled)")
                return EXIT_INTERRUPTED
            except BrokenPipeError:
                with contextlib.suppress(OSError):
                    sys.stdout = open(os.devnull, "w")  # silence the flush at exit
                return EXIT_OK
            except Exception as e:  # a bug: one line, never a traceback
                _err(name, f"unexpected error: {type(e).__name__}: {e}")
                return EXIT_RUNTIME

        return run

    return wrap


def _err(name: str, message: str) -> None:
    print(f"podshim {name}: {message}", file=sys.stderr)


def long_call(method: Any, request: Message, timeout: float, progress: output.Progress) -> Any:
    """Run a unary call, refreshing `progress` about 4 times a second until it ends.
    Ctrl-C cancels the call (the runtime then cleans up, as on a deadline)."""
    future = method.future(request, timeout=timeout)
    try:
        while True:
            try:
                return future.result(timeout=output.Progress.INTERVAL)
            except grpc.FutureTimeoutError:
                progress.update()
    except KeyboardInterrupt:
        future.cancel()
        raise
    finally:
        progress.clear()


# ---------------------------------------------------------------------------- id resolution


def resolve_pod(stub: api_pb2_grpc.RuntimeServiceStub, pod_id: str, timeout: float) -> str:
    """A unique prefix of a pod id (crictl style) → the full id; unknown ids go through as given
    so the runtime answers NOT_FOUND."""
    if len(pod_id) >= 64 or not pod_id:
        return pod_id
    items = stub.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=timeout).items
    return _unique(pod_id, [p.id for p in items], "pod")


def resolve_container(stub: api_pb2_grpc.RuntimeServiceStub, cid: str, timeout: float) -> str:
    if len(cid) >= 64 or not cid:
        return cid
    items = stub.ListContainers(cri.ListContainersRequest(), timeout=timeout).containers
    return _unique(cid, [c.id for c in items], "container")


def _unique(prefix: str, ids: Iterable[str], kind: str) -> str:
    matches = sorted({i for i in ids if i.startswith(prefix)})
    if len(matches) > 1:
        shown = ", ".join(output.short_id(m) for m in matches[:5])
        raise CliError(f"{kind} id prefix {prefix!r} is ambiguous ({shown}): give more characters")
    return matches[0] if matches else prefix


# ---------------------------------------------------------------------------- pods / ps / inspect*

_POD_STATES = {"ready": cri.SANDBOX_READY, "notready": cri.SANDBOX_NOTREADY}
_CONTAINER_STATES = {
    "created": cri.CONTAINER_CREATED,
    "running": cri.CONTAINER_RUNNING,
    "exited": cri.CONTAINER_EXITED,
    "unknown": cri.CONTAINER_UNKNOWN,
}


def _pod_state(state: int) -> str:
    return "Ready" if state == cri.SANDBOX_READY else "NotReady"


def _container_state(state: int) -> str:
    return cri.ContainerState.Name(state).removeprefix("CONTAINER_").capitalize()


@guarded("pods")
def cmd_pods(args: argparse.Namespace) -> int:
    stub = runtime_stub(args)
    flt = cri.PodSandboxFilter()
    if args.state:
        flt.state.state = _POD_STATES[args.state]
    if args.id:
        flt.id = resolve_pod(stub, args.id, timeout_of(args))
    for k, v in args.label or []:
        flt.label_selector[k] = v
    items = list(stub.ListPodSandbox(cri.ListPodSandboxRequest(filter=flt), timeout=timeout_of(args)).items)
    if args.name:
        items = [p for p in items if re.search(args.name, p.metadata.name)]
    if args.namespace:
        items = [p for p in items if re.search(args.namespace, p.metadata.namespace)]
    items.sort(key=lambda p: p.created_at, reverse=True)
    if args.quiet:
        for p in items:
            print(p.id)
        return EXIT_OK

    def as_table(_data: Any) -> str:
        short = (lambda s: s) if args.no_trunc else output.short_id
        rows = [
            [
                short(p.id),
                output.ago(p.created_at),
                _pod_state(p.state),
                p.metadata.name,
                p.metadata.namespace,
                p.metadata.attempt,
                p.runtime_handler or "(default)",
            ]
            for p in items
        ]
        return output.table(["POD ID", "CREATED", "STATE", "NAME", "NAMESPACE", "ATTEMPT", "RUNTIME"], rows)

    output.render({"items": [output.message_dict(p) for p in items]}, output_of(args), as_table)
    return EXIT_OK


@guarded("ps")
def cmd_ps(args: argparse.Namespace) -> int:
    stub = runtime_stub(args)
    t = timeout_of(args)
    flt = cri.ContainerFilter()
    if args.state:
        flt.state.state = _CONTAINER_STATES[args.state]
    elif not args.all:
        flt.state.state = cri.CONTAINER_RUNNING
    if args.pod:
        flt.pod_sandbox_id = resolve_pod(stub, args.pod, t)
    if args.id:
        flt.id = resolve_container(stub, args.id, t)
    containers = list(stub.ListContainers(cri.ListContainersRequest(filter=flt), timeout=t).containers)
    if args.name:
        containers = [c for c in containers if re.search(args.name, c.metadata.name)]
    containers.sort(key=lambda c: c.created_at, reverse=True)
    if args.quiet:
        for c in containers:
            print(c.id)
        return EXIT_OK

    def as_table(_data: Any) -> str:
        pods = {p.id: p for p in stub.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=t).items}
        short = (lambda s: s) if args.no_trunc else output.short_id
        rows = []
        for c in containers:
            image = c.image.image or c.image_ref
            if image.startswith("sha256:") and not args.no_trunc:
                image = image.removeprefix("sha256:")[:13]
            pod = pods.get(c.pod_sandbox_id)
            rows.append(
                [
                    short(c.id),
                    image,
                    output.ago(c.created_at),
                    _container_state(c.state),
                    c.metadata.name,
                    c.metadata.attempt,
                    short(c.pod_sandbox_id),
                    pod.metadata.name if pod else "unknown",
                ]
            )
        return output.table(
            ["CONTAINER", "IMAGE", "CREATED", "STATE", "NAME", "ATTEMPT", "POD ID", "POD"], rows
        )

    output.render({"containers": [output.message_dict(c) for c in containers]}, output_of(args), as_table)
    return EXIT_OK


def _verbose_info(info: Any) -> dict[str, Any]:
    """The verbose `info` map with its JSON values decoded (crictl's inspect output)."""
    out: dict[str, Any] = {}
    for k, v in sorted(info.items()):
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def _render_many(objs: list[dict[str, Any]], fmt: str, as_table: Callable[[dict[str, Any]], str]) -> None:
    if fmt == "table":
        print("\n\n".join(as_table(o) for o in objs))
    else:
        output.render(objs[0] if len(objs) == 1 else objs, fmt)


@guarded("inspectp")
def cmd_inspectp(args: argparse.Namespace) -> int:
    stub = runtime_stub(args)
    t = timeout_of(args)
    objs = []
    for pod_id in args.pod_ids:
        resp = stub.PodSandboxStatus(
            cri.PodSandboxStatusRequest(pod_sandbox_id=resolve_pod(stub, pod_id, t), verbose=True), timeout=t
        )
        objs.append({"status": output.message_dict(resp.status), "info": _verbose_info(resp.info)})

    def as_table(o: dict[str, Any]) -> str:
        s, md = o["status"], o["status"].get("metadata", {})
        ip = s.get("network", {}).get("ip", "")
        rows = [
            ["ID", s.get("id", "")],
            ["Name", md.get("name", "")],
            ["Namespace", md.get("namespace", "")],
            ["UID", md.get("uid", "")],
            ["Attempt", md.get("attempt", 0)],
            ["State", s.get("state", "")],
            ["Created", output.timestamp(s.get("createdAt", 0))],
            ["IP", ip],
            ["Runtime handler", s.get("runtimeHandler", "") or "(default)"],
        ]
        return output.table(["FIELD", "VALUE"], rows)

    _render_many(objs, output_of(args, "json"), as_table)
    return EXIT_OK


def _inspect_container(args: argparse.Namespace, ids: list[str]) -> int:
    stub = runtime_stub(args)
    t = timeout_of(args)
    objs = []
    for cid in ids:
        resp = stub.ContainerStatus(
            cri.ContainerStatusRequest(container_id=resolve_container(stub, cid, t), verbose=True), timeout=t
        )
        objs.append({"status": output.message_dict(resp.status), "info": _verbose_info(resp.info)})

    def as_table(o: dict[str, Any]) -> str:
        s, md = o["status"], o["status"].get("metadata", {})
        rows = [
            ["ID", s.get("id", "")],
            ["Name", md.get("name", "")],
            ["Attempt", md.get("attempt", 0)],
            ["State", s.get("state", "")],
            ["Created", output.timestamp(s.get("createdAt", 0))],
            ["Started", output.timestamp(s.get("startedAt", 0))],
            ["Image", s.get("image", {}).get("image", "")],
            ["Image ref", s.get("imageRef", "")],
            ["Exit code", s.get("exitCode", 0)],
            ["Log path", s.get("logPath", "")],
        ]
        return output.table(["FIELD", "VALUE"], rows)

    _render_many(objs, output_of(args, "json"), as_table)
    return EXIT_OK


def inspect_container(args: argparse.Namespace, container_ids: list[str] | str | None = None) -> int:
    """`podshim inspect ID…` for containers: ContainerStatus (verbose) as JSON (default), YAML or
    a table. For the `inspect` command, which inspects an archive when its argument is an
    existing path and calls this otherwise. The ids come from `container_ids`, else from the
    first of args.container_ids / ids / id / paths / path / target that is set. Uses args'
    runtime_endpoint, timeout and output when present. Returns the exit code."""
    ids: list[str] | str | None = container_ids
    if ids is None:
        for attr in ("container_ids", "ids", "id", "paths", "path", "target"):
            if getattr(args, attr, None):
                ids = getattr(args, attr)
                break
    if not ids:
        _err("inspect", "no container id given")
        return EXIT_USAGE
    id_list = [ids] if isinstance(ids, str) else [str(i) for i in ids]
    return guarded("inspect")(lambda a: _inspect_container(a, id_list))(args)


# ---------------------------------------------------------------------------- checkpointpod


@guarded("checkpointpod")
def cmd_checkpointpod(args: argparse.Namespace) -> int:
    stub = runtime_stub(args)
    timeout = timeout_of(args, long=True)
    pod_id = resolve_pod(stub, args.pod_id, min(timeout, CLI_SHORT_TIMEOUT))
    containers = [resolve_container(stub, c, min(timeout, CLI_SHORT_TIMEOUT)) for c in args.containers or []]
    path = Path(os.path.abspath(args.path))
    created = _make_output_dir(path)
    req = cri.CheckpointPodRequest(
        pod_sandbox_id=pod_id,
        output_path=str(path),
        container_ids=containers,
        options=dict(args.options or []),
        post_checkpoint_state=(
            cri.POST_CHECKPOINT_STATE_STOPPED if args.stopped else cri.POST_CHECKPOINT_STATE_RUNNING
        ),
    )
    progress = output.Progress(f"checkpointpod {output.short_id(pod_id)}", watch=path)
    ok = False
    try:
        long_call(stub.CheckpointPod, req, timeout, progress)
        ok = True
    finally:
        if not ok:
            _remove_created(created)
    result = {
        "podSandboxId": pod_id,
        "outputPath": str(path),
        "seconds": round(progress.elapsed(), 3),
        "bytes": output.tree_bytes(path) or 0,
    }
    output.render(result, output_of(args), lambda r: r["outputPath"])
    return EXIT_OK


def _make_output_dir(path: Path) -> list[Path]:
    """Create the output directory (0700) when missing; return what was created, deepest last."""
    if path.exists() or path.is_symlink():
        return []
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        path.mkdir(mode=0o700, parents=True)
    except OSError as e:
        raise CliError(f"cannot create {path}: {e.strerror}") from None
    return list(reversed(missing))


def _remove_created(created: list[Path]) -> None:
    for p in reversed(created):
        with contextlib.suppress(OSError):
            p.rmdir()  # only when empty: never removes what the runtime left


# ---------------------------------------------------------------------------- checkpoint (container)


@guarded("checkpoint")
def cmd_checkpoint(args: argparse.Namespace) -> int:
    stub = runtime_stub(args)
    timeout = timeout_of(args, long=True)
    cid = resolve_container(stub, args.container_id, min(timeout, CLI_SHORT_TIMEOUT))
    location = os.path.abspath(args.export) if args.export else ""
    req = cri.CheckpointContainerRequest(container_id=cid, location=location, timeout=int(timeout))
    watch = Path(location) if location else None
    progress = output.Progress(f"checkpoint {output.short_id(cid)}", watch=watch)
    long_call(stub.CheckpointContainer, req, timeout, progress)
    result: dict[str, Any] = {"containerId": cid, "location": location}
    result["seconds"] = round(progress.elapsed(), 3)
    if watch is not None:
        result["bytes"] = output.tree_bytes(watch) or 0
    output.render(result, output_of(args), lambda r: r["containerId"])
    return EXIT_OK


# ---------------------------------------------------------------------------- restorepod


def load_document(path: str, what: str) -> dict[str, Any]:
    """A JSON or YAML object from a file (by extension; unknown extensions try both)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"{what} {path}: {e.strerror}") from None
    suffix = Path(path).suffix.lower()
    data: Any = None
    try:
        if suffix in (".yaml", ".yml"):
            data = _yaml_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            try:
                data = json.loads(text)
            except ValueError:
                data = _yaml_load(text)
    except ValueError as e:
        raise UsageError(f"{what} {path}: not valid JSON/YAML: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path}: expected an object at the top level")
    return data


def _yaml_load(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e).replace("\n", " ")) from None


def parse_message(data: dict[str, Any], msg: Message, what: str, strict: bool = True) -> Message:
    try:
        return json_format.ParseDict(data, msg, ignore_unknown_fields=not strict)
    except json_format.ParseError as e:
        raise UsageError(f"{what}: {e}") from None


def read_archive_manifest(archive: Path) -> dict[str, Any]:
    path = archive / MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CliError(
            f"{path}: not found (not a complete podshim checkpoint; pass --config and "
            "--container-config to let the runtime judge)"
        ) from None
    except PermissionError:
        raise CliError(f"{path}: permission denied (checkpoints are root-only; run as root)") from None
    except (OSError, ValueError) as e:
        raise CliError(f"{path}: unreadable: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("sandbox"), dict):
        raise CliError(f"{path}: not a podshim manifest (no sandbox)")
    return data


def _replace_identity(value: str, old: dict[str, str], new: dict[str, str]) -> str:
    """Swap the old pod's uid (also in systemd's underscore form) and name in kubelet-style
    paths (`/var/log/pods/<ns>_<name>_<uid>`, `/kubepods/pod<uid>`)."""
    if old["uid"]:
        value = value.replace(old["uid"], new["uid"])
        value = value.replace(old["uid"].replace("-", "_"), new["uid"].replace("-", "_"))
    if old["name"]:
        value = value.replace(f"_{old['name']}_{new['uid']}", f"_{new['name']}_{new['uid']}")
    return value


def derive_pod_config(
    manifest: dict[str, Any], name: str | None = None, uid: str | None = None
) -> cri.PodSandboxConfig:
    """The checkpointed PodSandboxConfig as a new pod: new uid, name `<name>-restored` (unless
    given), and the uid/name swapped in its log directory, cgroup parent and kubelet labels so
    the restored pod shares nothing with the original."""
    raw = manifest["sandbox"].get("config") or {}
    config = parse_message(raw, cri.PodSandboxConfig(), "manifest sandbox.config", strict=False)
    assert isinstance(config, cri.PodSandboxConfig)
    md = config.metadata
    old = {"uid": md.uid, "name": md.name}
    new = {"uid": uid or str(uuid.uuid4()), "name": name or f"{md.name or 'pod'}{RESTORED_SUFFIX}"}
    md.uid, md.name, md.attempt = new["uid"], new["name"], 0
    log_dir = config.log_directory
    if log_dir:
        swapped = _replace_identity(log_dir, old, new)
        config.log_directory = swapped if swapped != log_dir else f"{log_dir.rstrip('/')}{RESTORED_SUFFIX}"
    if config.linux.cgroup_parent:
        config.linux.cgroup_parent = _replace_identity(config.linux.cgroup_parent, old, new)
    for kv in (config.labels, config.annotations):
        for k, v in list(kv.items()):
            if v == old["uid"] and old["uid"]:
                kv[k] = new["uid"]
            elif k == "io.kubernetes.pod.name" and v == old["name"]:
                kv[k] = new["name"]
    return config


def checkpointed_containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        c
        for c in manifest.get("containers", [])
        if isinstance(c, dict) and c.get("checkpointed", True) and c.get("name")
    ]


def derive_container_config(archive: Path, entry: dict[str, Any]) -> cri.ContainerConfig:
    """A container's ContainerConfig as checkpointed (`containers/<name>/config.dump` field `config`)."""
    rel = entry.get("dir") or f"containers/{entry['name']}"
    path = archive / rel / CONFIG_DUMP_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CliError(f"{path}: unreadable: {getattr(e, 'strerror', None) or e}") from None
    cc = parse_message(record.get("config") or {}, cri.ContainerConfig(), str(path), strict=False)
    assert isinstance(cc, cri.ContainerConfig)
    if not cc.metadata.name:
        cc.metadata.name = entry["name"]
    return cc


def archived_runtime_handler(archive: Path) -> str:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return str(json.loads((archive / SANDBOX_STATUS_FILE).read_text()).get("runtime_handler") or "")
    return ""


def build_restore_request(args: argparse.Namespace) -> tuple[cri.RestorePodRequest, bool]:
    """The RestorePodRequest from the flags, deriving what they omit from the archive.
    Returns it and whether the pod config was derived."""
    archive = Path(os.path.abspath(args.path))
    given: dict[str, cri.ContainerConfig] = {}
    for name, file in args.container_configs or []:
        if name in given:
            raise UsageError(f"--container-config {name}: given twice")
        cc = parse_message(load_document(file, "--container-config"), cri.ContainerConfig(), file)
        assert isinstance(cc, cri.ContainerConfig)
        if cc.metadata.name and cc.metadata.name != name:
            raise UsageError(
                f"--container-config {name}={file}: the file's metadata.name is {cc.metadata.name!r}"
            )
        cc.metadata.name = name
        given[name] = cc

    manifest: dict[str, Any] | None = None

    def archived() -> dict[str, Any]:
        nonlocal manifest
        if manifest is None:
            manifest = read_archive_manifest(archive)
        return manifest

    derived = args.config is None
    if args.config is not None:
        config = parse_message(load_document(args.config, "--config"), cri.PodSandboxConfig(), args.config)
        assert isinstance(config, cri.PodSandboxConfig)
        if args.pod_name:
            config.metadata.name = args.pod_name
    else:
        config = derive_pod_config(archived(), name=args.pod_name)

    # Containers without --container-config get their checkpointed config. With --config and
    # some --container-config, an unreadable archive is left for the runtime to judge.
    entries: list[dict[str, Any]] | None = None
    try:
        entries = checkpointed_containers(archived())
    except CliError:
        if derived or not given:
            raise
    if entries is None:
        configs = list(given.values())
    else:
        names = {e["name"] for e in entries}
        unknown = sorted(set(given) - names)
        if unknown:
            raise UsageError(
                f"--container-config {unknown[0]}: no such container in the checkpoint "
                f"(it has {', '.join(sorted(names)) or 'none'})"
            )
        configs = [given.get(e["name"]) or derive_container_config(archive, e) for e in entries]

    handler = args.runtime_handler
    if handler is None:
        handler = archived_runtime_handler(archive) if manifest is not None else ""
    options = dict(args.options or [])
    if args.start:
        options["start"] = "true"
    req = cri.RestorePodRequest(
        checkpoint_path=str(archive),
        config=config,
        runtime_handler=handler,
        options=options,
        container_configs=configs,
    )
    return req, derived


@guarded("restorepod")
def cmd_restorepod(args: argparse.Namespace) -> int:
    if bool(args.path) == bool(args.from_ref):
        raise UsageError("give the checkpoint directory PATH or --from REF (one of them)")
    if not args.from_ref:
        return _restorepod(args)
    from shim.cli import distribution  # docs/architecture.md §10 (Checkpoints through a registry)

    pulled, created = distribution.pull_for_restore(args)
    args.path = str(pulled)
    ok = False
    try:
        rc = _restorepod(args)
        ok = rc == EXIT_OK
        return rc
    finally:
        if not ok and created and not args.print_request:
            distribution.remove_pulled(pulled)


def _restorepod(args: argparse.Namespace) -> int:
    req, derived = build_restore_request(args)
    fmt = output_of(args)
    if args.print_request:
        output.render(output.message_dict(req), "json" if fmt == "table" else fmt)
        return EXIT_OK
    log_dir = req.config.log_directory
    if derived and log_dir.startswith("/") and not os.path.exists(log_dir):
        try:
            os.makedirs(log_dir, mode=0o755, exist_ok=True)  # the kubelet's job, done for it here
        except OSError as e:
            raise CliError(f"cannot create the pod log directory {log_dir}: {e.strerror}") from None
    stub = runtime_stub(args)
    timeout = timeout_of(args, long=True)
    progress = output.Progress(f"restorepod {os.path.basename(req.checkpoint_path) or '/'}")
    resp = long_call(stub.RestorePod, req, timeout, progress)
    md = req.config.metadata
    result = {
        "podSandboxId": resp.pod_sandbox_id,
        "name": md.name,
        "namespace": md.namespace,
        "uid": md.uid,
        "restoredContainers": [
            {"name": c.name, "containerId": c.container_id} for c in resp.restored_containers
        ],
        "started": bool(args.start),
        "seconds": round(progress.elapsed(), 3),
    }

    def as_table(r: dict[str, Any]) -> str:
        state = "Running" if r["started"] else "Created"
        rows = [
            [r["podSandboxId"], f"{r['namespace']}/{r['name']}", c["containerId"], c["name"], state]
            for c in r["restoredContainers"]
        ] or [[r["podSandboxId"], f"{r['namespace']}/{r['name']}", "", "", ""]]
        return output.table(["POD ID", "POD", "CONTAINER ID", "CONTAINER", "STATE"], rows)

    output.render(result, fmt, as_table)
    return EXIT_OK


# ---------------------------------------------------------------------------- registration


def _client_parser(sub: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(name, **kw)
    add_global_options(p, suppress=True)
    return p


def register(sub: Any) -> None:
    """Add the client commands (all but `inspect`, which the archive inspector owns and which
    falls back to `inspect_container`)."""
    p = _client_parser(
        sub,
        "checkpointpod",
        help="checkpoint a pod's running containers (CheckpointPod)",
        description="Checkpoint a pod in one consistent cut into PATH (created 0700 if missing; "
        "it must be empty and inside one of podshim's checkpoint.allowed_roots).",
    )
    p.add_argument("pod_id", metavar="POD-ID", help="pod sandbox id (a unique prefix is enough)")
    p.add_argument("path", metavar="PATH", help="output directory")
    p.add_argument(
        "--stopped", action="store_true", help="stop the checkpointed containers (default: keep them running)"
    )
    p.add_argument(
        "--option",
        dest="options",
        action="append",
        type=key_value,
        metavar="KEY=VALUE",
        help="CheckpointPod option, repeatable (e.g. tcp-established=true, rootfs-compression=gzip)",
    )
    p.add_argument(
        "--container",
        dest="containers",
        action="append",
        metavar="ID",
        help="checkpoint only this container, repeatable (default: all running containers)",
    )
    p.set_defaults(func=cmd_checkpointpod)

    p = _client_parser(
        sub,
        "restorepod",
        help="restore a pod checkpoint into a new pod (RestorePod)",
        description="Restore the pod checkpoint at PATH into a new sandbox. Without --config the pod "
        "config is the checkpointed one with a new uid and the name '<name>-restored'; containers "
        "without --container-config get their checkpointed config (both read from PATH).",
    )
    p.add_argument("path", metavar="PATH", nargs="?", help="checkpoint directory (written by checkpointpod)")
    p.add_argument(
        "--from",
        dest="from_ref",
        metavar="REF",
        help="pull the checkpoint from this registry reference first (podshim pull), then restore it",
    )
    p.add_argument(
        "--pull-dir", metavar="DIR", help="with --from: pull into DIR (default: in an allowed root)"
    )
    from shim.cli import distribution  # the registry options of --from (shim/cli/distribution.py)

    distribution.add_pull_options(p)
    p.add_argument("--config", metavar="POD-CONFIG", help="PodSandboxConfig, JSON or YAML")
    p.add_argument(
        "--container-config",
        dest="container_configs",
        action="append",
        type=name_file,
        metavar="NAME=FILE",
        help="ContainerConfig (JSON or YAML) of the checkpointed container NAME, repeatable",
    )
    p.add_argument("--pod-name", help="name of the restored pod (default: checkpointed name + '-restored')")
    p.add_argument("--runtime-handler", metavar="H", help="runtime handler (default: the checkpointed pod's)")
    p.add_argument(
        "--option",
        dest="options",
        action="append",
        type=key_value,
        metavar="KEY=VALUE",
        help="RestorePod option, repeatable (e.g. start=true)",
    )
    p.add_argument("--start", action="store_true", help="also start the restored containers")
    p.add_argument(
        "--print-request",
        action="store_true",
        help="print the RestorePodRequest (JSON or -o yaml) instead of sending it",
    )
    p.set_defaults(func=cmd_restorepod)

    p = _client_parser(
        sub,
        "checkpoint",
        help="checkpoint one container (CheckpointContainer)",
        description="Checkpoint a container (KEP-2008), crictl style.",
    )
    p.add_argument("container_id", metavar="CONTAINER-ID", help="container id (a unique prefix is enough)")
    p.add_argument("--export", metavar="FILE", help="checkpoint archive to write (default: the runtime's)")
    p.set_defaults(func=cmd_checkpoint)

    p = _client_parser(sub, "pods", help="list pod sandboxes (ListPodSandbox)")
    p.add_argument("--id", help="only this pod (id or unique prefix)")
    p.add_argument("--name", help="only pods whose name matches this regular expression")
    p.add_argument("--namespace", help="only pods whose namespace matches this regular expression")
    p.add_argument("-s", "--state", choices=sorted(_POD_STATES), help="only pods in this state")
    p.add_argument("--label", action="append", type=key_value, metavar="KEY=VALUE", help="label selector")
    p.add_argument("-q", "--quiet", action="store_true", help="only ids")
    p.add_argument("--no-trunc", action="store_true", help="full ids")
    p.set_defaults(func=cmd_pods)

    p = _client_parser(sub, "ps", help="list containers (ListContainers)")
    p.add_argument("-a", "--all", action="store_true", help="all containers (default: running only)")
    p.add_argument("-p", "--pod", metavar="POD", help="only containers of this pod (id or unique prefix)")
    p.add_argument("--id", help="only this container (id or unique prefix)")
    p.add_argument("--name", help="only containers whose name matches this regular expression")
    p.add_argument("-s", "--state", choices=sorted(_CONTAINER_STATES), help="only containers in this state")
    p.add_argument("-q", "--quiet", action="store_true", help="only ids")
    p.add_argument("--no-trunc", action="store_true", help="full ids")
    p.set_defaults(func=cmd_ps)

    p = _client_parser(sub, "inspectp", help="status of pods (PodSandboxStatus, verbose)")
    p.add_argument("pod_ids", nargs="+", metavar="POD-ID", help="pod id (or unique prefix)")
    p.set_defaults(func=cmd_inspectp)
