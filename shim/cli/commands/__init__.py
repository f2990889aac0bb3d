"""The commands of `podshim`, one module each (pip's layout): `register_all` adds them to the parser
in the order `podshim --help` lists them. Each module's `register(sub)` adds its subcommand(s)."""

from __future__ import annotations

from typing import Any

from shim.cli.commands import (
    checkpoint,
    checkpointpod,
    distribution,
    doctor,
    inspect,
    inspectp,
    migrate,
    node,
    pods,
    ps,
    restorepod,
    serve,
)

COMMANDS = (
    serve,
    inspect,
    checkpointpod,
    restorepod,
    migrate,
    checkpoint,
    pods,
    ps,
    inspectp,
    distribution,
    node,
    doctor,
)


def register_all(sub: Any) -> None:
    for module in COMMANDS:
        module.register(sub)
