"""The `podshim` command: `serve` runs the shim; the other subcommands are a crictl-style client.
One module per command in shim/cli/commands/; shared machinery in base.py, gRPC in transport.py."""

from __future__ import annotations

import argparse
import sys

from shim.cli import base, commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="podshim",
        description="CRI runtime shim with Pod checkpoint/restore, in front of containerd or CRI-O.",
    )
    base.add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.register_all(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
