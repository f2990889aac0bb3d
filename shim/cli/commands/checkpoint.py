"""`podshim checkpoint CONTAINER-ID`: one container's checkpoint (CheckpointContainer, KEP-2008),
crictl style."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from shim.cli import output
from shim.cli.base import (
    EXIT_OK,
    client_parser,
    guarded,
    output_of,
    resolve_container,
    runtime_stub,
    timeout_of,
)
from shim.cli.transport import long_call
from shim.deadlines import CLI_SHORT_TIMEOUT


@guarded("checkpoint")
def cmd_checkpoint(args: argparse.Namespace) -> int:
    from api.runtime.v1 import api_pb2 as cri

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


def register(sub: Any) -> None:
    """Add the command to the `podshim` parser."""
    p = client_parser(
        sub,
        "checkpoint",
        help="checkpoint one container (CheckpointContainer)",
        description="Checkpoint a container (KEP-2008), crictl style.",
    )
    p.add_argument("container_id", metavar="CONTAINER-ID", help="container id (a unique prefix is enough)")
    p.add_argument("--export", metavar="FILE", help="checkpoint archive to write (default: the runtime's)")
    p.set_defaults(func=cmd_checkpoint)
