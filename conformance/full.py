"""`make conformance`: every conformance suite through podshim, offline (docs/design/testbed.md
(critest and crictl)).

    python -m conformance.full [--endpoint unix:///…] [--direct-endpoint unix:///…]
                               [--checkpoint-root DIR] [--mirror HOST:PORT] [--parallel N]

Without --endpoint it starts its own bed (containerd + podshim) with a loopback registry mirror of
critest's images, and removes both after. With --endpoint it runs against that endpoint; when the
endpoint is a bed `make up` started in this checkout, its containerd (for the direct run), its
checkpoint root and its registry mirror are read from the bed's record. Then:

1. critest v1.37.0 (its whole default suite) through podshim, and straight at containerd;
2. podshim's checkpoint conformance suite (`python -m conformance`);
3. a crictl v1.37.0 tour through podshim (pods, containers, exec, logs, stats, checkpoint --export).

It ends with one line `RESULT critest_podshim_failed=N critest_direct_failed=N
critest_regressions=N checkpoint_suite_failed=N crictl_tour_failed=N` (regressions: specs that
pass straight at containerd and fail through podshim) and exits 1 when there is a regression or a
failure of the checkpoint suite or the tour. critest's specs that fail offline everywhere are
listed in docs/testing.md (Conformance).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from conformance import critest
from conformance.crictl_tour import tour

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Target:
    endpoint: str
    direct: str  # "" when unknown: no direct run
    checkpoint_root: Path
    mirror: str
    cgroup_parent: str  # for the tour's pod ("" : the runtime's default)


@contextlib.contextmanager
def own_bed(workdir: Path) -> Iterator[Target]:
    """A bed with a registry mirror of critest's images (crun handler as the test suite's)."""
    from testbed.bed import TestBed  # noqa: PLC0415 - only this path needs root and containerd

    registry = critest.serve_images(workdir)
    try:
        with TestBed(registry_mirror=registry.host) as bed:
            yield Target(
                f"unix://{bed.podshim_socket}",
                f"unix://{bed.containerd_socket}",
                bed.checkpoint_root,
                registry.host,
                bed.cgroup_root,
            )
    finally:
        registry.stop()


def given_endpoint(args: argparse.Namespace) -> Target:
    """The target of --endpoint, completed from a `make up` record of this checkout naming it."""
    from testbed.__main__ import STATE_DIR, bed_env  # noqa: PLC0415

    known: dict[str, str] = {}
    for record_file in sorted(STATE_DIR.glob("*.json")):
        record = json.loads(record_file.read_text())
        env = bed_env(record)
        if args.endpoint.removeprefix("unix://") == env["PODSHIM_SOCKET"]:
            known = {**env, "CGROUP_ROOT": record["bed"].get("cgroup_root", "")}
            break
    mirror = args.mirror or known.get("REGISTRY_MIRROR", "")
    if not mirror:
        raise SystemExit(
            "conformance: no registry mirror for critest's images: give --mirror (a loopback registry the "
            "endpoint's containerd mirrors every registry to), or start the bed with `make up`"
        )
    return Target(
        args.endpoint,
        args.direct_endpoint or (f"unix://{known['CONTAINERD_SOCKET']}" if known else ""),
        Path(args.checkpoint_root or known.get("CHECKPOINT_ROOT") or "/var/lib/kubelet/pod-checkpoints"),
        mirror,
        known.get("CGROUP_ROOT", ""),
    )


def checkpoint_suite(target: Target, workdir: Path) -> tuple[int, str]:
    """podshim's checkpoint conformance suite; (failed, its summary line)."""
    argv = [sys.executable, "-m", "conformance", "--runtime-endpoint", target.endpoint]
    argv += [
        "--checkpoint-root",
        str(target.checkpoint_root),
        "--junit",
        str(workdir / "checkpoint-suite.xml"),
    ]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1200)
    (workdir / "checkpoint-suite.log").write_text(res.stdout + res.stderr)
    m = re.search(r"(\d+) passed, (\d+) failed, (\d+) skipped", res.stdout)
    if m is None:
        return 1, f"did not run (exit {res.returncode}): {(res.stderr or res.stdout).strip()[-300:]}"
    for line in res.stdout.splitlines():
        if line.startswith("FAIL"):
            print(f"    {line}")
    return int(m.group(2)), m.group(0)


def confirm(target: Target, workdir: Path, suspects: list[str]) -> list[str]:
    """The suspects (failed through podshim in the parallel run, passed straight at containerd)
    that fail again through podshim when run alone: the regressions. A spec that passes alone
    failed on the load of the parallel run (e.g. the OOM spec's 60 s wait on a busy 2-core VM);
    it is named, not counted."""
    regressions = []
    for i, name in enumerate(suspects):
        text = name.removeprefix("[It] ").replace("[k8s.io] ", "")
        again = critest.run(
            target.endpoint, target.mirror, workdir / f"critest-confirm-{i}", focus=re.escape(text)
        )
        if again.failed or not again.passed:
            regressions.append(name)
        else:
            print(f"    failed in the parallel run, passed alone through podshim: {name}")
    return regressions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.full", description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", help="podshim's endpoint (default: a bed of its own)")
    p.add_argument("--direct-endpoint", help="the upstream's endpoint, for the direct critest run")
    p.add_argument("--checkpoint-root", help="a directory the endpoint accepts checkpoint paths in")
    p.add_argument("--mirror", help="HOST:PORT of the registry mirror holding critest's images")
    p.add_argument("--parallel", type=int, default=3, help="critest's ginkgo processes (default 3)")
    p.add_argument("--keep", help="keep the reports and logs in this directory")
    args = p.parse_args(argv)

    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="podshim-conformance-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            target = given_endpoint(args) if args.endpoint else stack.enter_context(own_bed(workdir))
            return run_all(target, workdir, args.parallel)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def run_all(target: Target, workdir: Path, parallel: int) -> int:
    print(f"==> critest through podshim ({target.endpoint})", flush=True)
    ours = critest.run(target.endpoint, target.mirror, workdir / "critest-podshim", parallel=parallel)
    print(f"    {ours.summary()}")
    for name, why in sorted(ours.failed.items()):
        print(f"    FAIL {name}: {why}")
    theirs = None
    if target.direct:
        print(f"==> critest straight at containerd ({target.direct})", flush=True)
        theirs = critest.run(target.direct, target.mirror, workdir / "critest-direct", parallel=parallel)
        print(f"    {theirs.summary()}")
        for name, why in sorted(theirs.failed.items()):
            print(f"    FAIL {name}: {why}")
    suspects = sorted(n for n in ours.failed if theirs is not None and n in theirs.passed)
    regressions = confirm(target, workdir, suspects)
    for name in regressions:
        print(f"    REGRESSION (passes straight at containerd, fails through podshim alone too): {name}")

    print("==> podshim's checkpoint conformance suite", flush=True)
    suite_failed, suite_line = checkpoint_suite(target, workdir)
    print(f"    {suite_line}")

    print("==> crictl tour through podshim", flush=True)
    steps = tour(
        target.endpoint,
        workdir / "crictl-tour",
        cgroup_parent=target.cgroup_parent,
        checkpoint_root=target.checkpoint_root,
    )
    for s in steps:
        print(f"    {'PASS' if s.ok else 'FAIL'} crictl {s.name}{': ' + s.detail if s.detail else ''}")
    tour_failed = sum(not s.ok for s in steps)

    direct_failed = str(len(theirs.failed)) if theirs is not None else "n/a"
    print(
        f"RESULT critest_podshim_failed={len(ours.failed)} critest_direct_failed={direct_failed} "
        f"critest_regressions={len(regressions)} checkpoint_suite_failed={suite_failed} "
        f"crictl_tour_failed={tour_failed}",
        flush=True,
    )
    return 1 if regressions or suite_failed or tour_failed else 0


if __name__ == "__main__":
    sys.exit(main())
