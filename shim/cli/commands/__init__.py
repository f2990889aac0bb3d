"""The commands of `podshim`, one module each (pip's layout): `register_all` adds them to the parser
in the order `podshim --help` lists them. Each module's `register(sub)` adds its subcommand(s).
`register_command` adds only the module of the one command a command line names, the others not
even imported: all that parsing that line needs, and a faster start."""

from __future__ import annotations

import importlib
from typing import Any

# Each module (shim/cli/commands/<name>.py) in `podshim --help` order, with the commands it adds.
MODULES: dict[str, tuple[str, ...]] = {
    "serve": ("serve",),
    "inspect": ("inspect",),
    "checkpointpod": ("checkpointpod",),
    "restorepod": ("restorepod",),
    "migrate": ("migrate",),
    "checkpoint": ("checkpoint",),
    "pods": ("pods",),
    "ps": ("ps",),
    "inspectp": ("inspectp",),
    "distribution": ("push", "pull"),
    "node": ("node",),
    "doctor": ("doctor",),
}


def _register(sub: Any, module: str) -> None:
    importlib.import_module(f"{__name__}.{module}").register(sub)


def register_all(sub: Any) -> None:
    for module in MODULES:
        _register(sub, module)


def register_command(sub: Any, command: str) -> bool:
    """Add the module that adds `command`; False (nothing added) when none does."""
    for module, names in MODULES.items():
        if command in names:
            _register(sub, module)
            return True
    return False
