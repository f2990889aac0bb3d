"""``python -m conformance``: run the checkpoint conformance suite against a CRI endpoint."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from conformance import suite as _tests  # noqa: F401 - registers the tests
from conformance.cri import (
    DEFAULT_COUNT_PATTERN,
    DEFAULT_IMAGE,
    CgroupLayout,
    Runtime,
    SetupError,
    Workload,
    rpc_error_text,
)
from conformance.runner import (
    REGISTRY,
    Result,
    Settings,
    Suite,
    TestCase,
    run,
    select,
    summary,
    write_junit,
)

DEFAULT_CHECKPOINT_ROOT = "/var/lib/kubelet/pod-checkpoints"
DEFAULT_CGROUP_ROOT = {"cgroupfs": "/podshim-conformance", "systemd": "podshim_conformance"}
EXIT_FAILED, EXIT_SETUP, EXIT_INTERRUPTED = 1, 2, 130


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Conformance tests for the CRI checkpoint RPCs (CheckpointPod, RestorePod, "
        "CheckpointContainer) against any CRI endpoint on this host. Tests of RPCs the runtime "
        "does not implement are skipped. Exit code: 0 no failure, 1 failures, 2 could not run.",
    )
    p.add_argument(
        "-r",
        "--runtime-endpoint",
        default=os.environ.get("CONTAINER_RUNTIME_ENDPOINT", ""),
        help="CRI endpoint, unix:///path/to.sock (default: $CONTAINER_RUNTIME_ENDPOINT)",
    )
    p.add_argument("--junit", type=Path, help="write a JUnit XML report to this file")
    p.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help=f"workload image (default {DEFAULT_IMAGE}, which prints count=N lines); it must print "
        "increasing numbers, one per line",
    )
    p.add_argument("--command", help="the workload's command (shell words), e.g. '/bin/sh -c'")
    p.add_argument(
        "--args",
        help="the workload's args (shell words); default: the counter's args for the default image, "
        "none otherwise",
    )
    p.add_argument(
        "--count-pattern",
        default=DEFAULT_COUNT_PATTERN,
        help="regex whose group 1 is the number in a line of the workload's output "
        f"(default {DEFAULT_COUNT_PATTERN!r})",
    )
    p.add_argument(
        "--checkpoint-root",
        type=Path,
        default=Path(DEFAULT_CHECKPOINT_ROOT),
        help=f"directory the runtime accepts checkpoint paths in (default {DEFAULT_CHECKPOINT_ROOT})",
    )
    p.add_argument(
        "--log-root",
        type=Path,
        help="where pod log directories go (default: a temporary directory under /var/tmp)",
    )
    p.add_argument(
        "--cgroup-driver",
        choices=("auto", "cgroupfs", "systemd"),
        default="auto",
        help="cgroup driver of the runtime (auto: from the RuntimeConfig RPC, else cgroupfs)",
    )
    p.add_argument(
        "--cgroup-root",
        help="pods' cgroup parent: a cgroupfs path (default /podshim-conformance) or, for systemd, "
        "a slice name prefix (default podshim_conformance)",
    )
    p.add_argument("--runtime-handler", default="", help="runtime handler for the suite's pods")
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="deadline in seconds of each CheckpointPod/RestorePod/CheckpointContainer call (default 120)",
    )
    p.add_argument("--focus", help="only run tests whose id matches this regex")
    p.add_argument("--skip", help="do not run tests whose id matches this regex")
    p.add_argument("--list", action="store_true", help="list the tests and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    return p


def endpoint_target(endpoint: str) -> str:
    if endpoint.startswith("unix://"):
        return endpoint
    if endpoint.startswith("/"):
        return "unix://" + endpoint
    raise SetupError(f"--runtime-endpoint {endpoint!r}: expected unix:///path/to/socket")


def workload_from(args: argparse.Namespace) -> Workload:
    if args.args is not None:
        wargs = shlex.split(args.args)
    elif args.image == DEFAULT_IMAGE and args.command is None:
        wargs = None
    else:
        wargs = []
    w = Workload(image=args.image, command=shlex.split(args.command or ""), count_pattern=args.count_pattern)
    if wargs is not None:
        w.args = wargs
    return w


class Resources:
    """Host paths the run creates (and removes at the end)."""

    def __init__(self) -> None:
        self.remove_trees: list[Path] = []
        self.remove_empty_dirs: list[Path] = []  # deepest first

    def make_dirs(self, path: Path) -> None:
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.remove_empty_dirs.extend(missing)

    def close(self) -> None:
        for t in self.remove_trees:
            shutil.rmtree(t, ignore_errors=True)
        for d in self.remove_empty_dirs:
            with contextlib.suppress(OSError):
                d.rmdir()


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cases = select(REGISTRY, args.focus, args.skip)
    if args.list:
        for c in cases:
            print(f"{c.id:48} needs {', '.join(c.requires):34} {c.doc}")
        return 0
    if not args.runtime_endpoint:
        parser().error("--runtime-endpoint is required (or set CONTAINER_RUNTIME_ENDPOINT)")
    with contextlib.suppress(ValueError):  # only possible in the main thread
        signal.signal(signal.SIGTERM, _terminate)  # clean up as on Ctrl-C
    started = time.monotonic()
    res = Resources()
    runtime: Runtime | None = None
    pulled = False
    properties = {"endpoint": args.runtime_endpoint, "image": args.image}
    try:
        endpoint = endpoint_target(args.runtime_endpoint)
        run_id = secrets.token_hex(4)
        if args.log_root:
            log_root = args.log_root / f"podshim-conformance-{run_id}"
            res.make_dirs(log_root)
            res.remove_trees.append(log_root)
        else:
            log_root = Path(tempfile.mkdtemp(prefix=f"podshim-conformance-{run_id}-", dir="/var/tmp"))
            res.remove_trees.append(log_root)
        runtime = Runtime(endpoint, workload_from(args), None, log_root, run_id, args.runtime_handler)
        try:
            v = runtime.version()
        except grpc.RpcError as e:
            raise SetupError(f"cannot reach a CRI runtime at {endpoint}: {rpc_error_text(e)}") from None
        name = f"{v.runtime_name} {v.runtime_version}"
        properties["runtime"] = name
        driver = runtime.detect_cgroup_driver() if args.cgroup_driver == "auto" else args.cgroup_driver
        cgroups = CgroupLayout(driver, args.cgroup_root or DEFAULT_CGROUP_ROOT[driver])
        runtime.cgroups = cgroups
        pre_existing_cgroup_root = cgroups.existing_dirs(cgroups.root) if driver == "cgroupfs" else []

        settings = Settings(args.checkpoint_root.absolute(), args.timeout, args.verbose)
        s = Suite(runtime, settings)
        s.runtime_label = name
        try:
            s.probe()
        except grpc.RpcError as e:
            raise SetupError(f"probing {endpoint} failed: {rpc_error_text(e)}") from None
        w = runtime.workload
        print("podshim conformance: CheckpointPod / RestorePod (KEP-5823), CheckpointContainer (KEP-2008)")
        print(f"  endpoint     {endpoint}")
        print(f"  runtime      {name} (CRI {v.runtime_api_version})")
        print(f"  image        {w.image}  command {w.command or '(image default)'}  args {w.args}")
        print(f"  checkpoints  {settings.checkpoint_root}")
        print(f"  cgroups      {driver}, pods under {cgroups.root}")
        for rpc, why in s.available.items():
            print(f"  {rpc:<20} {'available' if why is None else 'not available: ' + why}")
        print(flush=True)

        runnable = [c for c in cases if all(s.available.get(r) is None for r in c.requires)]
        if runnable:
            pulled = runtime.ensure_image()
            res.make_dirs(settings.checkpoint_root)
        try:
            results = run(s, cases)
        finally:
            if driver == "cgroupfs" and not pre_existing_cgroup_root:
                for d in cgroups.existing_dirs(cgroups.root):
                    with contextlib.suppress(OSError):
                        d.rmdir()
    except SetupError as e:
        print(f"conformance: {e}", file=sys.stderr)
        if args.junit:
            setup = TestCase("setup", "runtime", lambda t: None, (), "")
            failed = Result(setup, "failed", 0.0, str(e), str(e))
            write_junit(args.junit, [failed], time.monotonic() - started, properties)
        return EXIT_SETUP
    except KeyboardInterrupt:
        print("conformance: interrupted; removed what the suite had created", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if runtime is not None:
            if pulled:
                runtime.remove_image()
            runtime.close()
        res.close()
    seconds = time.monotonic() - started
    print()
    print(summary(results, seconds))
    if args.junit:
        write_junit(args.junit, results, seconds, properties)
        print(f"JUnit report: {args.junit}")
    return EXIT_FAILED if any(r.outcome == "failed" for r in results) else 0
