"""`podshim node setup`: wire this node's containerd for podshim (shim/node/setup.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from shim.cli.base import CONFIG_ENV, DEFAULT_CONFIG_PATH, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE

WRAPPER = "podshim-runc"


def register(sub: Any) -> None:
    node = sub.add_parser("node", help="set up this node (containerd) for podshim")
    nsub = node.add_subparsers(dest="node_command", required=True, metavar="COMMAND")
    p = nsub.add_parser(
        "setup",
        help="write containerd's drop-in for podshim (like `nvidia-ctk runtime configure`)",
        description=(
            "Detect containerd's version and config schema, write the drop-in that runs podshim-runc "
            "for the runtime handlers (BinaryName, container_annotations, CriuPath on 1.x, "
            "restrict_oom_score_adj where containerd lacks CAP_SYS_RESOURCE), make the main config "
            "import it, and print what else to change (the kubelet's endpoint). Idempotent; every "
            "changed file is backed up first. Restarts nothing."
        ),
    )
    p.add_argument("--containerd", default="containerd", help="containerd binary (default: on PATH)")
    p.add_argument("--config", default="/etc/containerd/config.toml", help="containerd's main config")
    p.add_argument("--drop-in", default="/etc/containerd/conf.d/podshim.toml", help="the file to write")
    p.add_argument(
        "--runtime",
        action="append",
        dest="handlers",
        metavar="HANDLER",
        help="runtime handler to wire, repeatable (default: containerd's default handler)",
    )
    p.add_argument(
        "--podshim-runc",
        help="BinaryName to set (default: podshim-runc next to this podshim)",
    )
    p.add_argument(
        "--podshim-config",
        help=f"podshim's config (default ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH})",
    )
    p.add_argument(
        "--restrict-oom-score-adj",
        choices=["auto", "true", "false"],
        default="auto",
        help="set restrict_oom_score_adj (auto: when containerd lacks CAP_SYS_RESOURCE)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be written, change nothing")
    p.add_argument("--undo", action="store_true", help="remove the drop-in and the import node setup added")
    p.set_defaults(func=run_setup)


def _default_wrapper() -> str:
    """podshim-runc installed next to this podshim (the package's /opt/podshim/bin)."""
    here = Path(os.path.realpath(sys.argv[0])).parent
    for d in (here, Path(sys.executable).parent):
        if (d / WRAPPER).is_file():
            return str(d / WRAPPER)
    import shutil

    return shutil.which(WRAPPER) or f"/opt/podshim/bin/{WRAPPER}"


def run_setup(args: argparse.Namespace) -> int:
    from shim import config as configmod
    from shim.node import setup
    from shim.node.containerd import ContainerdError, detect

    config_path, drop_in = Path(args.config), Path(args.drop_in)
    try:
        if args.undo:
            plan = setup.plan_undo(config_path, drop_in)
        else:
            cfg = configmod.load(args.podshim_config, check_files=False)
            ctd = detect(args.containerd)
            print(
                f"containerd {ctd.version} ({args.containerd}): config version {ctd.schema}, runtimes in "
                f'plugins."{ctd.cri_plugin}"'
            )
            restrict = {"auto": None, "true": True, "false": False}[args.restrict_oom_score_adj]
            plan = setup.plan_setup(
                ctd,
                config_path,
                drop_in,
                cfg,
                args.podshim_runc or _default_wrapper(),
                args.handlers or [],
                restrict,
            )
    except (configmod.ConfigError, ContainerdError) as e:
        print(f"podshim node setup: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, configmod.ConfigError) else EXIT_RUNTIME
    for problem in plan.problems:
        print(f"podshim node setup: {problem}", file=sys.stderr)
    if plan.problems:
        return EXIT_RUNTIME
    if args.dry_run:
        for c in plan.to_write:
            _show(c)
    else:
        try:
            for line in setup.apply(plan):
                print(line)
        except OSError as e:
            print(f"podshim node setup: {e}", file=sys.stderr)
            return EXIT_RUNTIME
    if not plan.to_write:
        print("nothing to change: containerd's config already says so")
    elif args.dry_run:
        print("dry run: nothing was written")
    elif not args.undo:
        print(
            "then: restart containerd (systemctl restart containerd), start podshim "
            "(systemctl enable --now podshim), and run `podshim doctor`"
        )
    for note in plan.notes:
        print(f"note: {note}")
    return EXIT_OK


def _show(change: Any) -> None:
    """A change of --dry-run: a new file in full, a changed one as a unified diff."""
    import difflib

    if change.old is None or change.new is None:
        print(f"--- {change.path}: {'would remove' if change.new is None else 'would write'} ({change.why})")
        if change.new is not None:
            print(change.new, end="" if change.new.endswith("\n") else "\n")
        return
    diff = difflib.unified_diff(
        change.old.splitlines(keepends=True),
        change.new.splitlines(keepends=True),
        f"{change.path} (now)",
        f"{change.path} ({change.why})",
    )
    print("".join(diff), end="")
