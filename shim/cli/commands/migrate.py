"""`podshim migrate POD-ID PATH --to HOST:PORT --to-endpoint ENDPOINT --from-name NAME`: live
migration of a pod to another node for an operator (docs/design/migration.md (Live migration)).

It drives both sides through CRI: RestorePod on the destination's podshim (`--to-endpoint`) with
`lazy-migration-from=NAME` (this node's name in its certificate), the pod and container configs
read from the running pod here; at the same time CheckpointPod on this node's podshim with
`lazy-migration=HOST:PORT` (the destination's migration listener). Both answer once the pod runs
there; this node's answers once every page arrived and the pod here is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shim.cli import output, transport
from shim.cli.base import (
    EXIT_OK,
    CliError,
    client_parser,
    guarded,
    make_output_dir,
    output_of,
    remove_created,
    resolve_pod,
    runtime_stub,
    timeout_of,
)
from shim.cli.transport import long_call, rpc_error_message
from shim.cli.transport import runtime_stub as stub_for
from shim.deadlines import CLI_SHORT_TIMEOUT

if TYPE_CHECKING:
    from api.runtime.v1 import api_pb2 as cri

# the options' names (shim/migration/source.py, destination.py), repeated: the CLI imports no
# server code
SOURCE_OPTION = "lazy-migration"
DESTINATION_OPTION = "lazy-migration-from"


def pod_request(
    stub: Any, pod_id: str, timeout: float
) -> tuple[cri.PodSandboxConfig, str, list[cri.ContainerConfig], list[str]]:
    """The running pod's sandbox config, runtime handler and its running containers' configs, as
    its runtime reports them (verbose status): what the destination's RestorePod is given; and
    those containers' ids, the CheckpointPod's container_ids (the released API takes no empty
    list), so that what is checkpointed is what the configs name."""
    from api.runtime.v1 import api_pb2 as cri
    from shim.cli.commands.restorepod import parse_message

    st = stub.PodSandboxStatus(
        cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True), timeout=timeout
    )
    info = _info(st.info)
    config = parse_message(info.get("config") or {}, cri.PodSandboxConfig(), "the pod's config", strict=False)
    assert isinstance(config, cri.PodSandboxConfig)
    handler = st.status.runtime_handler or str(info.get("runtimeHandler") or "")
    listed = stub.ListContainers(
        cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=pod_id)), timeout=timeout
    ).containers
    configs, ids = [], []
    for c in sorted(listed, key=lambda c: c.created_at):
        if c.state != cri.CONTAINER_RUNNING:
            continue
        cst = stub.ContainerStatus(
            cri.ContainerStatusRequest(container_id=c.id, verbose=True), timeout=timeout
        )
        cc = parse_message(
            _info(cst.info).get("config") or {},
            cri.ContainerConfig(),
            f"container {c.metadata.name}",
            strict=False,
        )
        assert isinstance(cc, cri.ContainerConfig)
        cc.metadata.attempt = 0
        configs.append(cc)
        ids.append(c.id)
    if not configs:
        raise CliError(f"pod {output.short_id(pod_id)} has no running container to migrate")
    return config, handler, configs, ids


def _info(info: Any) -> dict[str, Any]:
    try:
        data = json.loads(info.get("info", "{}"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


@guarded("migrate")
def cmd_migrate(args: argparse.Namespace) -> int:
    from api.runtime.v1 import api_pb2 as cri

    stub = runtime_stub(args)
    timeout = timeout_of(args, long=True)
    pod_id = resolve_pod(stub, args.pod_id, min(timeout, CLI_SHORT_TIMEOUT))
    config, handler, configs, ids = pod_request(stub, pod_id, min(timeout, CLI_SHORT_TIMEOUT))
    if args.log_directory:
        config.log_directory = args.log_directory
    path = Path(os.path.abspath(args.path))
    created = make_output_dir(path)
    dest_path = args.to_path or str(path)
    restore = cri.RestorePodRequest(
        checkpoint_path=dest_path,
        config=config,
        runtime_handler=handler,
        container_configs=configs,
        options={DESTINATION_OPTION: args.from_name},
    )
    checkpoint = cri.CheckpointPodRequest(
        pod_sandbox_id=pod_id, output_path=str(path), container_ids=ids, options={SOURCE_OPTION: args.to}
    )
    dest = stub_for(args.to_endpoint)
    answer: dict[str, Any] = {}
    started = time.monotonic()

    def run_restore() -> None:
        try:
            answer["restore"] = dest.RestorePod(restore, timeout=timeout)
            answer["running"] = time.monotonic() - started
        except transport.RpcError as e:
            answer["error"] = rpc_error_message(e, args.to_endpoint)

    import threading

    t = threading.Thread(target=run_restore, daemon=True)
    t.start()
    progress = output.Progress(f"migrate {output.short_id(pod_id)} to {args.to}", watch=path)
    ok = False
    try:
        long_call(stub.CheckpointPod, checkpoint, timeout, progress)
        ok = True
    finally:
        t.join(timeout)
        if not ok:
            remove_created(created)
    if "error" in answer:
        raise CliError(f"the destination's RestorePod failed: {answer['error']}")
    resp = answer["restore"]
    result = {
        "podSandboxId": pod_id,
        "destination": args.to,
        "destinationPodSandboxId": resp.pod_sandbox_id,
        "containers": [{"name": c.name, "containerId": c.container_id} for c in resp.restored_containers],
        "runningAfter": round(answer.get("running", 0.0), 3),
        "seconds": round(progress.elapsed(), 3),
    }

    def as_table(r: dict[str, Any]) -> str:
        rows = [
            [r["destination"], r["destinationPodSandboxId"], c["containerId"], c["name"]]
            for c in r["containers"]
        ]
        return output.table(["DESTINATION", "POD ID", "CONTAINER ID", "CONTAINER"], rows)

    output.render(result, output_of(args), as_table)
    return EXIT_OK


def register(sub: Any) -> None:
    """Add the command to the `podshim` parser."""
    p = client_parser(
        sub,
        "migrate",
        help="move a running pod to another node (live migration)",
        description="Migrate a pod to another node with lazy pages: it stops here for the time of a "
        "dump without its memory and runs on there while its memory follows. PATH (on this node, inside "
        "podshim's checkpoint.allowed_roots) receives the archive of the pod's state without its "
        "memory; --to-path is where the destination writes it (default: the same path).",
    )
    p.add_argument("pod_id", metavar="POD-ID", help="pod sandbox id (a unique prefix is enough)")
    p.add_argument("path", metavar="PATH", help="this node's output directory")
    p.add_argument("--to", required=True, metavar="HOST:PORT", help="the destination's migration listener")
    p.add_argument(
        "--to-endpoint", required=True, metavar="ENDPOINT", help="the destination podshim's CRI endpoint"
    )
    p.add_argument(
        "--from-name", required=True, metavar="NAME", help="this node's name in its migration certificate"
    )
    p.add_argument("--to-path", metavar="PATH", help="the destination's directory for the archive")
    p.add_argument("--log-directory", metavar="DIR", help="the pod's log directory on the destination")
    p.set_defaults(func=cmd_migrate)
