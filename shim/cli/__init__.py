"""The `podshim` command: `serve` runs the shim; the other subcommands are a crictl-style client.
One module per command in shim/cli/commands/; shared machinery in base.py, gRPC in transport.py,
the parser in parser.py, the command a line names in argv.py. The read-only commands run in a
child of the warm helper (warm.py) when one serves: this imports nothing until it knows which."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The command line's entry (the console script): through the warm helper when it serves the
    command, else parsed and run here."""
    if argv is None:
        argv = sys.argv[1:]
    from shim.cli import warm

    code = warm.run(argv)
    if code is not None:
        return code
    from shim.cli import parser

    return parser.run(argv)


if __name__ == "__main__":
    sys.exit(main())
