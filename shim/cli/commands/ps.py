"""`podshim ps`: list containers (ListContainers), crictl style."""

from __future__ import annotations

import argparse
import re
from typing import Any

from shim.cli import output
from shim.cli.base import (
    EXIT_OK,
    client_parser,
    guarded,
    output_of,
    resolve_container,
    resolve_pod,
    runtime_stub,
    timeout_of,
)

# --state's values, each a ContainerState as CONTAINER_<VALUE>: names, so the parser needs no protobuf
_CONTAINER_STATES = ("created", "running", "exited", "unknown")


def _container_state(state: int) -> str:
    from api.runtime.v1 import api_pb2 as cri

    return cri.ContainerState.Name(state).removeprefix("CONTAINER_").capitalize()


@guarded("ps")
def cmd_ps(args: argparse.Namespace) -> int:
    from api.runtime.v1 import api_pb2 as cri

    stub = runtime_stub(args)
    t = timeout_of(args)
    flt = cri.ContainerFilter()
    if args.state:
        flt.state.CopyFrom(cri.ContainerStateValue(state=f"CONTAINER_{args.state.upper()}"))
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


def register(sub: Any) -> None:
    """Add the command to the `podshim` parser."""
    p = client_parser(sub, "ps", help="list containers (ListContainers)")
    p.add_argument("-a", "--all", action="store_true", help="all containers (default: running only)")
    p.add_argument("-p", "--pod", metavar="POD", help="only containers of this pod (id or unique prefix)")
    p.add_argument("--id", help="only this container (id or unique prefix)")
    p.add_argument("--name", help="only containers whose name matches this regular expression")
    p.add_argument("-s", "--state", choices=sorted(_CONTAINER_STATES), help="only containers in this state")
    p.add_argument("-q", "--quiet", action="store_true", help="only ids")
    p.add_argument("--no-trunc", action="store_true", help="full ids")
    p.set_defaults(func=cmd_ps)
