"""`podshim checkpointpod POD-ID PATH`: a pod checkpoint (CheckpointPod) into PATH.

With `--keep N`, PATH is a prefix: the checkpoint goes into `PATH-<UTC time>` and, once it is
complete, the older checkpoints of the same pod this command made under that prefix are removed
so that the newest N stay (periodic checkpoints outside the kubelet; shim/cli/keep.py says how a
directory is proved to be its own).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shim.cli import output
from shim.cli.base import (
    EXIT_OK,
    CliError,
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

if TYPE_CHECKING:
    from shim.cli.transport import RuntimeStub


def running_containers(stub: RuntimeStub, pod_id: str, timeout: float) -> list[str]:
    """The ids of the pod's running containers, oldest first: what `checkpointpod` checkpoints when
    no --container is given. The released API (k8s.io/cri-api v0.37.2) wants the caller to list
    them (an empty container_ids is INVALID_ARGUMENT), so the command lists them itself. None
    running: the pod's own status answers first (NOT_FOUND for an unknown pod), else a CliError,
    before anything is created."""
    from api.runtime.v1 import api_pb2 as cri

    running = cri.ContainerFilter(
        pod_sandbox_id=pod_id, state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING)
    )
    listed = stub.ListContainers(cri.ListContainersRequest(filter=running), timeout=timeout).containers
    # the state checked here too: what is sent is exactly the running ones, whatever the filter did
    ids = [c.id for c in sorted(listed, key=lambda c: c.created_at) if c.state == cri.CONTAINER_RUNNING]
    if ids:
        return ids
    st = stub.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id), timeout=timeout).status
    md = st.metadata
    raise CliError(
        f"pod {md.namespace}/{md.name} ({output.short_id(pod_id)}) has no running container to checkpoint "
        f"(the pod is {cri.PodSandboxState.Name(st.state)})"
    )


@guarded("checkpointpod")
def cmd_checkpointpod(args: argparse.Namespace) -> int:
    from api.runtime.v1 import api_pb2 as cri
    from shim.cli import keep

    stub = runtime_stub(args)
    timeout = timeout_of(args, long=True)
    short = min(timeout, CLI_SHORT_TIMEOUT)
    pod_id = resolve_pod(stub, args.pod_id, short)
    containers = [resolve_container(stub, c, short) for c in args.containers or []]
    if not containers:  # the command's default, filled in here: the API takes no empty list
        containers = running_containers(stub, pod_id, short)
    path = Path(os.path.abspath(args.path))
    if args.keep is not None:
        path = keep.keep_name(path)
        keep.begin(path, pod_id)  # before the directory: a run killed from here on is recognised
    try:
        created = make_output_dir(path)
    except BaseException:
        if args.keep is not None:
            keep.abandon(path)
        raise
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
            if args.keep is not None:
                keep.abandon(path)
    result: dict[str, Any] = {
        "podSandboxId": pod_id,
        "outputPath": str(path),
        "seconds": round(progress.elapsed(), 3),
        "bytes": output.tree_bytes(path) or 0,
    }
    if args.keep is not None:
        keep.complete(path, pod_id)
        pruned = keep.prune(Path(os.path.abspath(args.path)), pod_id, args.keep)
        result["removed"], result["skipped"] = pruned.removed, pruned.skipped
        for s in pruned.skipped:
            print(f"podshim checkpointpod: kept {s['path']}: {s['reason']}", file=sys.stderr)
    output.render(result, output_of(args), lambda r: r["outputPath"])
    return EXIT_OK


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
        "made so under PATH until the newest N are left (never a directory this command did not make "
        "complete; what it keeps is listed under `skipped`, with the reason)",
    )
    p.set_defaults(func=cmd_checkpointpod)
