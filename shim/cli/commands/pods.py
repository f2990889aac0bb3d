"""`podshim pods`: list pod sandboxes (ListPodSandbox), crictl style."""

from __future__ import annotations

import argparse
import re
from typing import Any

from shim.cli import output
from shim.cli.base import (
    EXIT_OK,
    client_parser,
    guarded,
    key_value,
    output_of,
    resolve_pod,
    runtime_stub,
    timeout_of,
)

# --state's values, each a PodSandboxState as SANDBOX_<VALUE>: names, so the parser needs no protobuf
_POD_STATES = ("ready", "notready")


def _pod_state(state: int) -> str:
    from api.runtime.v1 import api_pb2 as cri

    return "Ready" if state == cri.SANDBOX_READY else "NotReady"


@guarded("pods")
def cmd_pods(args: argparse.Namespace) -> int:
    from api.runtime.v1 import api_pb2 as cri

    stub = runtime_stub(args)
    flt = cri.PodSandboxFilter()
    if args.state:
        flt.state.CopyFrom(cri.PodSandboxStateValue(state=f"SANDBOX_{args.state.upper()}"))
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


def register(sub: Any) -> None:
    """Add the command to the `podshim` parser."""
    p = client_parser(sub, "pods", help="list pod sandboxes (ListPodSandbox)")
    p.add_argument("--id", help="only this pod (id or unique prefix)")
    p.add_argument("--name", help="only pods whose name matches this regular expression")
    p.add_argument("--namespace", help="only pods whose namespace matches this regular expression")
    p.add_argument("-s", "--state", choices=sorted(_POD_STATES), help="only pods in this state")
    p.add_argument("--label", action="append", type=key_value, metavar="KEY=VALUE", help="label selector")
    p.add_argument("-q", "--quiet", action="store_true", help="only ids")
    p.add_argument("--no-trunc", action="store_true", help="full ids")
    p.set_defaults(func=cmd_pods)
