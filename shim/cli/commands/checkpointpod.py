"""`podshim checkpointpod POD-ID PATH`: a pod checkpoint (CheckpointPod) into PATH.

With `--keep N`, PATH is a prefix: the checkpoint goes into `PATH-<UTC time>` and, once it is
complete, the older checkpoints of the same pod this command made under that prefix are removed
so that the newest N stay (periodic checkpoints outside the kubelet). Its own are recognised by
the name, by a marker it writes beside each (`.<name>.podshim-keep`, naming the pod) only once
the checkpoint is complete, and by a complete manifest of that pod: a directory anything else
wrote (the kubelet's, a copy, a partial checkpoint) is never removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from shim.cli import output
from shim.cli.base import (
    EXIT_OK,
    client_parser,
    guarded,
    key_value,
    make_output_dir,
    output_of,
    remove_created,
    resolve_container,
    resolve_pod,
    runtime_stub,
    timeout_of,
)
from shim.cli.transport import long_call
from shim.deadlines import CLI_SHORT_TIMEOUT


@guarded("checkpointpod")
def cmd_checkpointpod(args: argparse.Namespace) -> int:
    stub = runtime_stub(args)
    timeout = timeout_of(args, long=True)
    pod_id = resolve_pod(stub, args.pod_id, min(timeout, CLI_SHORT_TIMEOUT))
    containers = [resolve_container(stub, c, min(timeout, CLI_SHORT_TIMEOUT)) for c in args.containers or []]
    path = Path(os.path.abspath(args.path))
    if args.keep is not None:
        path = keep_name(path)
    created = make_output_dir(path)
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
            remove_created(created)
    result: dict[str, Any] = {
        "podSandboxId": pod_id,
        "outputPath": str(path),
        "seconds": round(progress.elapsed(), 3),
        "bytes": output.tree_bytes(path) or 0,
    }
    if args.keep is not None:
        mark_kept(path, pod_id)
        result["removed"] = prune(Path(os.path.abspath(args.path)), pod_id, args.keep)
    output.render(result, output_of(args), lambda r: r["outputPath"])
    return EXIT_OK


KEEP_MARKER = ".{}.podshim-keep"  # beside a kept checkpoint: {"pod": id}, written once it is complete
_STAMP = r"\d{8}T\d{6}\.\d{6}Z"


def keep_name(prefix: Path) -> Path:
    """`<prefix>-<UTC time to the µs>`: sorts by time, one per call."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
    return prefix.with_name(f"{prefix.name}-{stamp}")


def mark_kept(path: Path, pod_id: str) -> None:
    marker = path.with_name(KEEP_MARKER.format(path.name))
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pod": pod_id}, f)


def _ours(d: Path, pod_id: str) -> bool:
    """A complete checkpoint of `pod_id` that `--keep` made: its marker names the pod, and so does
    its manifest (podshim's format)."""
    try:
        marker = json.loads(d.with_name(KEEP_MARKER.format(d.name)).read_text())
        doc = json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("pod") == pod_id
        and isinstance(doc, dict)
        and str(doc.get("format", "")).startswith("podshim.checkpoint.")
        and (doc.get("sandbox") or {}).get("id") == pod_id
        and d.is_dir()
        and not d.is_symlink()
    )


def prune(prefix: Path, pod_id: str, keep: int) -> list[str]:
    """Remove all but the newest `keep` of this pod's kept checkpoints under `prefix`; returns them."""
    pattern = re.compile(re.escape(prefix.name) + "-" + _STAMP)
    try:
        names = sorted(n for n in os.listdir(prefix.parent) if pattern.fullmatch(n))
    except OSError:
        return []
    mine = [prefix.parent / n for n in names if _ours(prefix.parent / n, pod_id)]
    removed = []
    for d in mine[: max(0, len(mine) - keep)]:
        shutil.rmtree(d)  # fd-based: a symlink put in its place is refused, never followed
        d.with_name(KEEP_MARKER.format(d.name)).unlink(missing_ok=True)
        removed.append(str(d))
    return removed


def _keep_count(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("--keep needs at least 1")
    return n


def register(sub: Any) -> None:
    """Add the command to the `podshim` parser."""
    p = client_parser(
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
    p.add_argument(
        "--keep",
        type=_keep_count,
        metavar="N",
        help="PATH is a prefix: checkpoint into PATH-<UTC time>, then remove this pod's older checkpoints "
        "made so under PATH until the newest N are left (never a directory this command did not make)",
    )
    p.set_defaults(func=cmd_checkpointpod)
