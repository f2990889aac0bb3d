"""`podshim doctor`: check this node end to end, one line per check (shim/node/doctor.py)."""

from __future__ import annotations

import argparse
from typing import Any

from shim.cli.base import CONFIG_ENV, DEFAULT_CONFIG_PATH, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE


def register(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check that this node can checkpoint and restore",
        description=(
            "Check CRIU (kernel features, podshim's patches, a dump and restore), userfaultfd, the cgroup "
            "layout, runc/crun, containerd's wiring, podshim serving, the kubelet's endpoint and checkpoint "
            "directory, the allowed roots, free space and the state dir's mode. One line per check "
            "(ok, warn, FAIL with what to do); exit code 0 only when a restore will work."
        ),
    )
    p.add_argument(
        "--config",
        help=f"podshim's config (default ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH})",
    )
    p.add_argument(
        "--kubelet-pid",
        type=int,
        action="append",
        metavar="PID",
        help="check this kubelet process (repeatable; default: the kubelets of this root file system)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shim import config as configmod
    from shim.node import doctor

    try:
        cfg = configmod.load(args.config, check_files=False)
    except configmod.ConfigError as e:
        print(f"FAIL podshim config: {e}")
        return EXIT_USAGE
    return EXIT_OK if doctor.run(cfg, args.kubelet_pid) else EXIT_RUNTIME
