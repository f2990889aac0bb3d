"""`podshim serve`: run the shim."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from shim.cli.base import CONFIG_ENV, DEFAULT_CONFIG_PATH

if TYPE_CHECKING:
    from shim import config as configmod


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the CRI shim",
        description=(
            "Serve the CRI on a unix socket: standard calls pass through to the upstream runtime; "
            "CheckpointPod, RestorePod and CheckpointContainer are handled by podshim. "
            "Settings come from the config file, then PODSHIM_<SECTION>_<KEY> environment "
            "variables (e.g. PODSHIM_UPSTREAM_ENDPOINT), then these flags."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        help=f"TOML config file (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH} if present)",
    )
    p.add_argument("--socket", help="listen socket path [server.socket] (default /run/podshim/podshim.sock)")
    p.add_argument(
        "--upstream",
        help="upstream CRI endpoint [upstream.endpoint] (default unix:///run/containerd/containerd.sock)",
    )
    p.add_argument("--state-dir", help="durable state: journal of operations [server.state_dir]")
    p.add_argument(
        "--checkpoint-root",
        action="append",
        dest="checkpoint_roots",
        metavar="DIR",
        help="allowed checkpoint root, repeatable [checkpoint.allowed_roots] "
        "(default /var/lib/kubelet/pod-checkpoints)",
    )
    p.add_argument("--runtime-binary", help="the real OCI runtime (runc or crun) [runtime.binary]")
    p.add_argument("--runtime-root", help="the OCI runtime's --root used by the upstream [runtime.root]")
    p.add_argument("--criu", help="CRIU binary [runtime.criu]")
    p.add_argument("--log-format", choices=["json", "console"], help="log format [log.format] (default json)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="[log.level]")
    p.add_argument(
        "--metrics-address", help="HOST:PORT for /metrics, empty disables [server.metrics_address]"
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> configmod.Config:
    from shim import config as configmod  # the daemon's modules load when it runs, not for the parser

    cfg = configmod.load(
        args.config,
        overrides={
            "socket": args.socket,
            "upstream_endpoint": args.upstream,
            "state_dir": args.state_dir,
            "allowed_roots": tuple(args.checkpoint_roots) if args.checkpoint_roots else None,
            "log_format": args.log_format,
            "log_level": args.log_level,
            "metrics_address": args.metrics_address,
        },
    )
    runtime = {"binary": args.runtime_binary, "root": args.runtime_root, "criu": args.criu}
    runtime = {k: v for k, v in runtime.items() if v is not None}
    if runtime:
        from dataclasses import replace

        cfg = replace(cfg, runtime=replace(cfg.runtime, **runtime))
    return cfg


def run(args: argparse.Namespace) -> int:
    import asyncio

    from shim import config as configmod
    from shim import logs

    try:
        cfg = config_from_args(args)
    except configmod.ConfigError as e:
        print(f"podshim: bad configuration: {e}", file=sys.stderr)
        return 2
    logs.configure(cfg.log_format, cfg.log_level)
    from shim.engine import Engine
    from shim.server import app

    try:
        asyncio.run(app.run(cfg, Engine))
    except KeyboardInterrupt:
        pass
    except app.StartupError as e:
        print(f"podshim: cannot start: {e}", file=sys.stderr)
        return 1
    return 0
