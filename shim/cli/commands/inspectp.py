"""`podshim inspectp`: pods' status (PodSandboxStatus, verbose); and the container half of
`podshim inspect` (ContainerStatus, verbose), which the archive inspector falls back to."""

from __future__ import annotations

import argparse
from typing import Any

from shim.cli import output
from shim.cli.base import (
    EXIT_OK,
    EXIT_USAGE,
    client_parser,
    guarded,
    output_of,
    render_many,
    report,
    resolve_container,
    resolve_pod,
    runtime_stub,
    timeout_of,
    verbose_info,
)


@guarded("inspectp")
def cmd_inspectp(args: argparse.Namespace) -> int:
    from api.runtime.v1 import api_pb2 as cri

    stub = runtime_stub(args)
    t = timeout_of(args)
    objs = []
    for pod_id in args.pod_ids:
        resp = stub.PodSandboxStatus(
            cri.PodSandboxStatusRequest(pod_sandbox_id=resolve_pod(stub, pod_id, t), verbose=True), timeout=t
        )
        objs.append({"status": output.message_dict(resp.status), "info": verbose_info(resp.info)})

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

    render_many(objs, output_of(args, "json"), as_table)
    return EXIT_OK


def _inspect_container(args: argparse.Namespace, ids: list[str]) -> int:
    from api.runtime.v1 import api_pb2 as cri

    stub = runtime_stub(args)
    t = timeout_of(args)
    objs = []
    for cid in ids:
        resp = stub.ContainerStatus(
            cri.ContainerStatusRequest(container_id=resolve_container(stub, cid, t), verbose=True), timeout=t
        )
        objs.append({"status": output.message_dict(resp.status), "info": verbose_info(resp.info)})

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

    render_many(objs, output_of(args, "json"), as_table)
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
        report("inspect", "no container id given")
        return EXIT_USAGE
    id_list = [ids] if isinstance(ids, str) else [str(i) for i in ids]
    return guarded("inspect")(lambda a: _inspect_container(a, id_list))(args)


def register(sub: Any) -> None:
    """Add the command to the `podshim` parser."""
    p = client_parser(sub, "inspectp", help="status of pods (PodSandboxStatus, verbose)")
    p.add_argument("pod_ids", nargs="+", metavar="POD-ID", help="pod id (or unique prefix)")
    p.set_defaults(func=cmd_inspectp)
