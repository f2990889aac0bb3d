"""The `podshim` command: `serve` runs the shim; the other subcommands are a crictl-style client.
One module per command in shim/cli/commands/; shared machinery in base.py, gRPC in transport.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shim.cli import base, commands

# base.add_global_options' options that take a value, which is then no command name
_VALUE_OPTIONS = ("-r", "--runtime-endpoint", "--timeout", "-o", "--output")
_LONG_OPTIONS = ("--runtime-endpoint", "--timeout", "--output", "--help")


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


def command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` names: its first word that is neither an option nor a global option's
    value. None when there is none, or when -h/--help or `--` comes first (`podshim -h` lists every
    command), or an option might be an abbreviation of a global one taking a value."""
    words = iter(argv)
    for word in words:
        if word == "--" or word.startswith("-h"):
            return None
        if word in _VALUE_OPTIONS:
            next(words, None)
        elif word.startswith("--"):
            if "=" not in word and any(o.startswith(word) for o in _LONG_OPTIONS):
                return None  # argparse's prefix matching: `--time 5` is --timeout, `--he` --help
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
