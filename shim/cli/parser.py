"""The `podshim` command line parsed and run in this process: the parser of every command, or of
the one a command line names (its module alone imported)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from shim.cli import base, commands
from shim.cli.argv import command_of


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; given a command line that names one, of that command only (its
    module alone imported), which parses that line as the whole parser would."""
    parser = argparse.ArgumentParser(
        prog="podshim",
        description="CRI runtime shim with Pod checkpoint/restore, in front of containerd or CRI-O.",
    )
    base.add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = command_of(argv) if argv is not None else None
    if command is None or not commands.register_command(sub, command):
        commands.register_all(sub)  # an unknown name: argparse's error lists them all
    return parser


def run(argv: list[str]) -> int:
    """Parse `argv` and run its command here; its exit code."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
