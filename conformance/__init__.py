"""Conformance suite for the CRI checkpoint RPCs: CheckpointPod and RestorePod (KEP-5823) and
CheckpointContainer (KEP-2008), in the style of critest.

Run it against any CRI endpoint on the same host::

    python -m conformance --runtime-endpoint unix:///run/podshim/podshim.sock [--junit FILE]

It creates its own pods (kubelet-like configs), checkpoints and restores them, and removes
everything it created. A runtime that does not implement an RPC gets every test that needs it
skipped with a message saying so (a probe call answered UNIMPLEMENTED). See ``--help``.
"""

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from conformance.cli import main as _main

    return _main(argv)
