"""Command line for the test bed.

    python -m testbed up [--dir D] [--no-podshim] [--crun-binary PATH] [--runc-binary PATH]
        start a bed that keeps running after this command returns; prints
        PODSHIM_SOCKET=<path> and CONTAINERD_SOCKET=<path>
    python -m testbed env     print those two lines again
    python -m testbed down    stop the bed and remove everything it created

The running bed is recorded in /run/podshim-testbed/current.json ($PODSHIM_TESTBED_STATE_DIR
instead of /run/podshim-testbed: the tests' own `up`, beside a bed someone brought up).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from testbed import _sys
from testbed.bed import TestBed, TestBedError

STATE_DIR = Path(os.environ.get("PODSHIM_TESTBED_STATE_DIR", "/run/podshim-testbed"))
CURRENT = STATE_DIR / "current.json"


def _load() -> dict[str, Any] | None:
    try:
        return json.loads(CURRENT.read_text())
    except FileNotFoundError:
        return None


def _print_env(desc: dict[str, Any]) -> None:
    print(f"PODSHIM_SOCKET={desc['podshim_socket']}")
    print(f"CONTAINERD_SOCKET={desc['containerd_socket']}")
    sys.stdout.flush()


def _forget() -> None:
    CURRENT.unlink(missing_ok=True)
    try:
        STATE_DIR.rmdir()
    except OSError:
        pass


def cmd_up(args: argparse.Namespace) -> int:
    desc = _load()
    if desc is not None:
        pid = desc.get("containerd_pid")
        if pid and _sys.alive(pid):
            print(f"testbed: a bed is already up in {desc['base_dir']} (run `down` first)", file=sys.stderr)
            return 1
        print("testbed: cleaning up a dead bed first", file=sys.stderr)
        try:
            TestBed.attach(desc).stop()
        except TestBedError as e:
            print(f"testbed: {e}", file=sys.stderr)
            return 1
        _forget()
    bed = TestBed(
        args.dir,
        start_podshim=not args.no_podshim,
        runc_binary=args.runc_binary,
        crun_binary=args.crun_binary,
        timeout=args.timeout,
    )
    try:
        bed.start()
    except TestBedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = CURRENT.with_suffix(".tmp")
    tmp.write_text(json.dumps(bed.describe(), indent=2) + "\n")
    os.replace(tmp, CURRENT)
    # containerd and podshim run in their own sessions with their output in log files:
    # returning leaves them running.
    _print_env(bed.describe())
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    desc = _load()
    if desc is None:
        print("testbed: no bed is up", file=sys.stderr)
        return 1
    _print_env(desc)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    desc = _load()
    if desc is None:
        print("testbed: no bed is up", file=sys.stderr)
        return 0
    try:
        TestBed.attach(desc).stop()
    except TestBedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    _forget()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed", description="podshim's private test bed")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a bed in the background")
    up.add_argument("--dir", help="base directory (default /run/podshim-testbed-<random>)")
    up.add_argument("--no-podshim", action="store_true", help="containerd only")
    up.add_argument("--runc-binary", help="BinaryName of the runc handler")
    up.add_argument("--crun-binary", help="BinaryName of a crun handler (default: none)")
    up.add_argument("--timeout", type=float, default=60.0)
    up.set_defaults(func=cmd_up)
    sub.add_parser("env", help="print the sockets of the running bed").set_defaults(func=cmd_env)
    sub.add_parser("down", help="stop the bed and remove everything").set_defaults(func=cmd_down)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
