"""Command line for the test bed: `make up` / `make down` (docs/design/testbed.md (critest and
crictl)).

    python -m testbed up [--name N] [--dir D] [--no-podshim] [--no-mirror] [--crun-binary PATH]
                         [--runc-binary PATH]
        start a bed that keeps running after this command returns; prints
        PODSHIM_SOCKET=<path>, CONTAINERD_SOCKET=<path>, CHECKPOINT_ROOT=<path> (podshim's allowed
        root) and, unless --no-mirror, REGISTRY_MIRROR=<127.0.0.1:port>: a loopback registry
        holding critest's images, from which the bed's containerd pulls every registry's images
    python -m testbed up --cluster [--name N] [--dir D] [--no-mirror] ...
        the same with a Kubernetes control plane (testbed/cluster.py): etcd, kube-apiserver,
        kube-controller-manager, kube-scheduler and a kubelet registered as a node, its runtime
        the bed's podshim; prints KUBECONFIG=<the admin's kubeconfig> and NODE_NAME=<the node>
        first, then the sockets (no CHECKPOINT_ROOT: podshim keeps its stock roots, paths in the
        node's mount namespace, as under a kubelet)
    python -m testbed env [--name N]     print those lines again
    python -m testbed down [--name N]    stop the bed (and its registry), remove everything

Beds are per checkout and per name (default "default"): each is recorded in
<checkout>/.testbed/up/<name>.json ($PODSHIM_TESTBED_STATE_DIR instead of <checkout>/.testbed/up),
so two checkouts (or two names) run beds side by side without touching each other.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from testbed import _sys
from testbed.bed import REPO, TestBed, TestBedError
from testbed.cluster import ClusterBed
from testbed.registry import Registry, RegistryError
from testbed.tools import ToolMissing

STATE_DIR = Path(os.environ.get("PODSHIM_TESTBED_STATE_DIR") or REPO / ".testbed" / "up")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def state_file(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def load(name: str) -> dict[str, Any] | None:
    """The record of bed `name` of this checkout, or None."""
    try:
        return dict(json.loads(state_file(name).read_text()))
    except FileNotFoundError:
        return None


def bed_env(record: dict[str, Any]) -> dict[str, str]:
    """What `up` and `env` print: the bed's sockets, its checkpoint root, its registry mirror."""
    bed = record["bed"]
    env: dict[str, str] = {}
    cluster = record.get("cluster")
    if cluster:
        env["KUBECONFIG"] = cluster["kubeconfig"]["admin"]
        env["NODE_NAME"] = cluster["nodes"][0]["name"]
    env["PODSHIM_SOCKET"] = bed["podshim_socket"]
    env["CONTAINERD_SOCKET"] = bed["containerd_socket"]
    if not cluster:
        env["CHECKPOINT_ROOT"] = str(Path(bed["base_dir"]) / "checkpoints")
    if record.get("registry"):
        env["REGISTRY_MIRROR"] = record["registry"]["host"]
    return env


def _print_env(record: dict[str, Any]) -> None:
    for k, v in bed_env(record).items():
        print(f"{k}={v}")
    sys.stdout.flush()


def _stop(record: dict[str, Any]) -> None:
    """Stop a recorded bed and its registry (by their pids), remove their files."""
    try:
        if record.get("registry"):
            Registry.stop_described(record["registry"])
    finally:
        if record.get("cluster"):
            ClusterBed.stop_described(record["cluster"])
        else:
            TestBed.attach(record["bed"]).stop()


def cmd_up(args: argparse.Namespace) -> int:
    if args.cluster and args.no_podshim:
        print("testbed: --cluster runs its node on podshim (no --no-podshim)", file=sys.stderr)
        return 2
    record = load(args.name)
    if record is not None:
        pid = record["bed"].get("containerd_pid")
        if pid and _sys.alive(pid):
            print(
                f"testbed: bed {args.name!r} is already up in {record['bed']['base_dir']} (run `down` first)",
                file=sys.stderr,
            )
            return 1
        print(f"testbed: cleaning up the dead bed {args.name!r} first", file=sys.stderr)
        try:
            _stop(record)
        except (TestBedError, RegistryError) as e:
            print(f"testbed: {e}", file=sys.stderr)
            return 1
        state_file(args.name).unlink()
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    registry = None
    if not args.no_mirror:
        from conformance.critest import serve_images  # builds and pushes critest's images

        registry = serve_images(STATE_DIR)
    options: dict[str, Any] = {
        "runc_binary": args.runc_binary,
        "crun_binary": args.crun_binary,
        "timeout": args.timeout,
        "registry_mirror": registry.host if registry else None,
    }
    cluster = ClusterBed(args.dir, bed_options=options) if args.cluster else None
    bed = None if cluster else TestBed(args.dir, start_podshim=not args.no_podshim, **options)
    try:
        if cluster is not None:
            cluster.start()
        else:
            assert bed is not None
            bed.start()
    except (TestBedError, ToolMissing) as e:
        if registry is not None:
            registry.stop()
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    record = {
        "name": args.name,
        "bed": cluster.bed.describe() if cluster else bed.describe() if bed else {},
        "cluster": cluster.describe() if cluster else None,
        "registry": registry.describe() if registry else None,
    }
    tmp = state_file(args.name).with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, state_file(args.name))
    # containerd, podshim, the registry (and the control plane and kubelet) run in their own
    # sessions with their output in log files: returning leaves them running.
    _print_env(record)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    record = load(args.name)
    if record is None:
        print(f"testbed: no bed {args.name!r} is up in this checkout", file=sys.stderr)
        return 1
    _print_env(record)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    record = load(args.name)
    if record is None:
        print(f"testbed: no bed {args.name!r} is up in this checkout", file=sys.stderr)
        return 0
    try:
        _stop(record)
    except (TestBedError, RegistryError) as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    state_file(args.name).unlink()
    return 0


def _name(value: str) -> str:
    if not NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r}: letters, digits, '.', '_', '-' (at most 63)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed", description="podshim's private test bed")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a bed in the background")
    up.add_argument("--dir", help="base directory (default /run/podshim-testbed-<random>)")
    up.add_argument("--no-podshim", action="store_true", help="containerd only")
    up.add_argument(
        "--cluster", action="store_true", help="with a Kubernetes control plane and a registered kubelet"
    )
    up.add_argument("--no-mirror", action="store_true", help="no registry mirror (critest cannot run)")
    up.add_argument("--runc-binary", help="BinaryName of the runc handler")
    up.add_argument("--crun-binary", help="BinaryName of a crun handler (default: none)")
    up.add_argument("--timeout", type=float, default=60.0)
    up.set_defaults(func=cmd_up)
    sub.add_parser("env", help="print the sockets of the running bed").set_defaults(func=cmd_env)
    sub.add_parser("down", help="stop the bed and remove everything").set_defaults(func=cmd_down)
    for p in sub.choices.values():
        p.add_argument("--name", type=_name, default="default", help="the bed's name in this checkout")
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
