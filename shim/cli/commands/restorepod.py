"""`podshim restorepod PATH`: a pod checkpoint into a new pod (RestorePod), deriving what the flags
omit from the archive (the pod config with a new uid and name, each container's checkpointed
config); `--from REF` pulls it from a registry first (shim/cli/commands/distribution.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from shim.cli import output
from shim.cli.base import (
    EXIT_OK,
    CliError,
    UsageError,
    client_parser,
    guarded,
    key_value,
    name_file,
    output_of,
    runtime_stub,
    timeout_of,
)
from shim.cli.transport import long_call

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from api.runtime.v1 import api_pb2 as cri

RESTORED_SUFFIX = "-restored"
# archive layout names (shim/archive/layout.py), repeated so the client imports no server code
MANIFEST_FILE = "manifest.json"
SANDBOX_STATUS_FILE = "sandbox/status.json"
CONFIG_DUMP_FILE = "config.dump"
# the kubelet's keys naming a pod (pkg/kubelet/types) and a container's termination-message file
POD_NAME_KEY = "io.kubernetes.pod.name"
TERMINATION_MESSAGE_PATH_KEY = "io.kubernetes.container.terminationMessagePath"


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
    from google.protobuf import json_format

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
    import uuid

    from api.runtime.v1 import api_pb2 as cri

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
    _rename_in(config.labels, old, new)
    _rename_in(config.annotations, old, new)
    return config


def _rename_in(kv: Any, old: dict[str, str], new: dict[str, str]) -> None:
    """Labels or annotations that name the old pod (its uid, its name under the kubelet's key,
    a value holding the uid) name the new one."""
    for k, v in list(kv.items()):
        if k == POD_NAME_KEY and v == old["name"]:
            kv[k] = new["name"]
        elif old["uid"] and old["uid"] in v:
            kv[k] = _replace_identity(v, old, new)


class PodFile(NamedTuple):  # not a dataclass: the parser's start-up spares loading dataclasses
    """A per-pod file or directory the kubelet made for the old pod (under `<root-dir>/pods/<uid>`:
    its etc-hosts, a container's termination log, a volume's directory), at the new pod's path."""

    old: str
    new: str
    empty: bool  # a termination-message file starts empty


def move_to_new_pod(cc: cri.ContainerConfig, old: dict[str, str], new: dict[str, str]) -> list[PodFile]:
    """A checkpointed container's config for the new pod (docs/design/restore-pod.md (RestorePod)):
    labels and annotations that name the old pod name the new one, and every mount of a file of
    the old pod (a host path holding its uid) mounts the new pod's instead. Returns those files,
    which restorepod makes (make_pod_files) before it sends the request: nothing is shared with
    the old pod."""
    _rename_in(cc.labels, old, new)
    _rename_in(cc.annotations, old, new)
    if not old["uid"]:
        return []
    term = cc.annotations.get(TERMINATION_MESSAGE_PATH_KEY, "/dev/termination-log")
    files = []
    for m in cc.mounts:
        swapped = _replace_identity(m.host_path, old, new)
        if swapped != m.host_path:
            files.append(PodFile(m.host_path, swapped, empty=m.container_path == term))
            m.host_path = swapped
    return files


def make_pod_files(files: list[PodFile]) -> None:
    """The new pod's per-pod files, the kubelet's job done for it here: a file is a copy of the old
    pod's (its /etc/hosts) or, for a termination log or when the old one is gone, empty; a
    directory (a volume) is made empty (volume contents are not part of a checkpoint)."""
    import shutil

    for f in files:
        if os.path.lexists(f.new):
            continue
        try:
            os.makedirs(os.path.dirname(f.new), mode=0o750, exist_ok=True)
            if os.path.isdir(f.old):
                os.mkdir(f.new, mode=0o750)
            elif f.empty or not os.path.isfile(f.old):
                with open(f.new, "x"):
                    pass
                os.chmod(f.new, 0o666)  # as the kubelet's termination-log files
            else:
                shutil.copy2(f.old, f.new)
        except OSError as e:
            raise CliError(f"cannot make the new pod's file {f.new}: {e.strerror or e}") from None


def checkpointed_containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        c
        for c in manifest.get("containers", [])
        if isinstance(c, dict) and c.get("checkpointed", True) and c.get("name")
    ]


def derive_container_config(archive: Path, entry: dict[str, Any]) -> cri.ContainerConfig:
    """A container's ContainerConfig as checkpointed (`containers/<name>/config.dump` field
    `config`), still naming the old pod (move_to_new_pod)."""
    from google.protobuf import json_format

    from shim.archive import config_dump

    rel = entry.get("dir") or f"containers/{entry['name']}"
    path = archive / rel / CONFIG_DUMP_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CliError(f"{path}: unreadable: {getattr(e, 'strerror', None) or e}") from None
    try:
        cc = config_dump.container_config(record.get("config") or {})
    except json_format.ParseError as e:
        raise CliError(f"{path}: {e}") from None
    if not cc.metadata.name:
        cc.metadata.name = entry["name"]
    return cc


def archived_runtime_handler(archive: Path) -> str:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return str(json.loads((archive / SANDBOX_STATUS_FILE).read_text()).get("runtime_handler") or "")
    return ""


class Derived(NamedTuple):
    """What restorepod derived from the archive."""

    pod_config: bool  # the pod config (its log directory is then made here)
    pod_files: list[PodFile]  # the new pod's per-pod files the derived container configs mount


def build_restore_request(args: argparse.Namespace) -> tuple[cri.RestorePodRequest, Derived]:
    """The RestorePodRequest from the flags, deriving what they omit from the archive."""
    from api.runtime.v1 import api_pb2 as cri

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
    configs: list[cri.ContainerConfig] = []
    files: list[PodFile] = []
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
        sandbox_md = archived()["sandbox"].get("metadata") or {}
        old = {"uid": str(sandbox_md.get("uid") or ""), "name": str(sandbox_md.get("name") or "")}
        new = {"uid": config.metadata.uid, "name": config.metadata.name}
        for e in entries:
            if e["name"] in given:
                configs.append(given[e["name"]])
                continue
            cc = derive_container_config(archive, e)
            if old != new:
                files.extend(move_to_new_pod(cc, old, new))
            configs.append(cc)

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
    return req, Derived(derived, files)


@guarded("restorepod")
def cmd_restorepod(args: argparse.Namespace) -> int:
    if bool(args.path) == bool(args.from_ref):
        raise UsageError("give the checkpoint directory PATH or --from REF (one of them)")
    if not args.from_ref:
        return _restorepod(args)
    from shim.cli.commands import distribution  # docs/design/distribution.md (Checkpoints through a registry)

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
    make_pod_files(derived.pod_files)
    log_dir = req.config.log_directory
    if derived.pod_config and log_dir.startswith("/") and not os.path.exists(log_dir):
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


def register(sub: Any) -> None:
    """Add the command to the `podshim` parser."""
    p = client_parser(
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
    from shim.cli.commands import distribution  # the registry options of --from

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
