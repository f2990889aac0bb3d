"""The `podshim` command: `serve` runs the shim; the other subcommands are a crictl-style client."""

from __future__ import annotations

import argparse
import sys

from shim.cli import client, distribution, inspect, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="podshim",
        description="CRI runtime shim with Pod checkpoint/restore, in front of containerd or CRI-O.",
    )
    client.add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.register(sub)
    inspect.register(sub)
    client.register(sub)
    distribution.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
