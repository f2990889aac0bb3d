"""bench/kubelet: what a full node costs, under a real kubelet.

    python -m bench.kubelet [--pods 100] [--probed 0.5] [--window 60] [--rounds 1]

A kubelet v1.37 (testbed/kubelet.py: standalone, static pods) gets N static pods at once, each a
pause sandbox plus one small busybox container (``sleep``), an exec liveness and readiness probe
every 10 s on the given fraction of them. The same batch runs, each in a fresh bed, the order
rotating each round, with the kubelet pointed at

* ``podshim``: podshim as on a node, podshim-front serving its socket (docs/design/proxy.md
  (The proxy)); its CPU and RSS are the daemon's and the front's together;
* ``direct``: containerd;
* ``python`` (``--modes``): podshim with ``[server] front = false``, the daemon serving the socket;
* ``gofloor`` (``--modes``): podshim-front alone, every call forwarded to containerd, no daemon:
  the floor of a proxy on this gRPC stack.

Measured per run:

* pod start: from the moment a pod's manifest is written to the moment containerd lists its
  container RUNNING (containerd is asked directly, every 0.1 s, in both modes), p50 and p99 of the
  batch;
* then, after 15 s to settle, over a window of W seconds with every pod running: CPU seconds per
  minute and RSS of podshim, of containerd (the daemon; its shims listed apart) and of the kubelet,
  and the probes' mean latency (the kubelet's ``prober_probe_duration_seconds``, sum / count over
  the window; it includes the exec through the runtime).

Ends with ``RESULT podshim_cpu_vs_containerd=… podshim_rss_mib=… pod_start_ratio=…`` and, for each
further mode run, ``<mode>_cpu_vs_containerd=…``: podshim's CPU over containerd's in the podshim
runs (medians over rounds), podshim's largest RSS, and the pod start p50 through podshim over the
p50 straight at containerd. Targets: ≤ 0.10, ≤ 100 MiB, ≤ 1.05. On a quiet machine:
``make bench-kubelet`` (N=100, 2 rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from api.runtime.v1 import api_pb2 as cri
from bench.common import machine_summary, median, percentile, ratio, result_line, say, table
from testbed.bed import BUSYBOX_IMAGE, VENV_BIN
from testbed.kubelet import Kubelet, KubeletBed, pod_manifest

MIB = 1 << 20
MODES = ("podshim", "direct", "python", "gofloor")
PROBE_RE = re.compile(r"^prober_probe_duration_seconds_(sum|count)\{([^}]*)\} ([0-9.e+-]+)$", re.M)


@dataclass
class Run:
    mode: str
    starts: list[float] = field(default_factory=list)  # seconds, per pod
    cpu_per_min: dict[str, float] = field(default_factory=dict)  # process -> CPU s per minute
    rss_mib: dict[str, float] = field(default_factory=dict)
    probe_ms: float = math.nan
    probes: int = 0


def manifests(n: int, probed: float, period: int) -> list[dict[str, Any]]:
    out = []
    every = max(1, round(1 / probed)) if probed > 0 else 0
    for i in range(n):
        c: dict[str, Any] = {
            "name": "app",
            "image": BUSYBOX_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["sleep", "86400"],
        }
        if every and i % every == 0:
            probe = {"exec": {"command": ["true"]}, "periodSeconds": period, "timeoutSeconds": 5}
            c["livenessProbe"] = dict(probe, failureThreshold=3)
            c["readinessProbe"] = dict(probe)
        out.append(pod_manifest(f"bench-{i:03d}", [c]))
    return out


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def rss_mib(procs: list[psutil.Process]) -> float:
    return sum(p.memory_info().rss for p in procs) / MIB


def podshim_processes(pid: int) -> list[psutil.Process]:
    """podshim's daemon and its podshim-front."""
    daemon = psutil.Process(pid)
    return [daemon, *(c for c in daemon.children() if c.name() == "podshim-front")]


def start_gofloor(
    kb: KubeletBed, config: dict[str, Any], stack: contextlib.ExitStack
) -> subprocess.Popen[bytes]:
    """The bed without podshim, podshim-front alone in front of containerd, the kubelet on it;
    each stopped by ``stack``."""
    kb.bed.start_podshim = False
    stack.callback(kb.stop)
    kb.bed.start()
    sock = kb.bed.base_dir / "go-floor.sock"
    front = subprocess.Popen(
        [
            str(VENV_BIN / "podshim-front"),
            f"--listen={sock}",
            f"--upstream=unix://{kb.bed.containerd_socket}",
        ],
        stdout=subprocess.PIPE,
    )
    stack.callback(front.wait, 10)
    stack.callback(front.terminate)
    assert front.stdout is not None
    if front.stdout.readline().strip() != b"ready":
        raise RuntimeError("podshim-front did not start")
    kb.kubelet = Kubelet(kb.bed, endpoint=sock, config=config)
    kb.kubelet.start()
    return front


def shims(containerd_socket: str) -> list[psutil.Process]:
    """containerd's runc shims (they outlive their parent: they are found by their argv, whose
    -address is containerd's socket)."""
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if p.info.get("name", "").startswith("containerd-shim") and any(containerd_socket in a for a in cmd):
            out.append(p)
    return out


def probe_totals(kb: KubeletBed) -> tuple[float, float]:
    """(sum of seconds, count) of every probe the kubelet ran so far."""
    status, body = kb.kubelet.api("GET", "/metrics/probes")
    if status != 200:
        return math.nan, 0.0
    total = count = 0.0
    for kind, _labels, value in PROBE_RE.findall(body.decode(errors="replace")):
        if kind == "sum":
            total += float(value)
        else:
            count += float(value)
    return total, count


def one_run(mode: str, specs: list[dict[str, Any]], window: float, timeout: float) -> Run:
    run = Run(mode)
    say(f"{mode}: a fresh bed and kubelet")
    # the kubelet's defaults but for the pod count (the test bed's kubelet syncs every 10 s)
    config = {"maxPods": len(specs) + 20, "syncFrequency": "1m"}
    kb = KubeletBed(via_podshim=mode in ("podshim", "python"), config=config)
    if mode == "python":
        kb.bed.extra_env["PODSHIM_SERVER_FRONT"] = "false"
    with contextlib.ExitStack() as stack:
        if mode == "gofloor":
            floor = start_gofloor(kb, config, stack)
        else:
            stack.enter_context(kb)
        direct = kb.bed.runtime_stub(kb.bed.containerd_socket)
        written: dict[str, float] = {}
        for spec in specs:
            kb.kubelet.add_static_pod(spec)
            written[kb.kubelet.full_name(spec["metadata"]["name"])] = time.monotonic()
        seen: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while len(seen) < len(specs) and time.monotonic() < deadline:
            f = cri.ContainerFilter(state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING))
            now = time.monotonic()
            for c in direct.ListContainers(cri.ListContainersRequest(filter=f), timeout=30).containers:
                pod = c.labels.get("io.kubernetes.pod.name", "")
                if pod in written and pod not in seen:
                    seen[pod] = now
            time.sleep(0.1)
        if len(seen) < len(specs):
            raise RuntimeError(f"{mode}: {len(specs) - len(seen)} pods not running after {timeout} s")
        run.starts = [seen[p] - written[p] for p in written]
        say(f"{mode}: {len(specs)} pods running; p50 start {percentile(run.starts, 50):.2f} s; settling 15 s")
        time.sleep(15)
        assert kb.bed.containerd_pid is not None and kb.kubelet.pid is not None
        procs = {
            "podshim": (
                [psutil.Process(floor.pid)]
                if mode == "gofloor"
                else podshim_processes(kb.bed.podshim_pid or 0)
            )
            if mode != "direct"
            else [],
            "containerd": [psutil.Process(kb.bed.containerd_pid)],
            "kubelet": [psutil.Process(kb.kubelet.pid)],
        }
        shim_procs = shims(str(kb.bed.containerd_socket))
        before = {k: cpu_seconds(p) for k, p in procs.items()}
        shims_before = cpu_seconds(shim_procs)
        probes_before = probe_totals(kb)
        t0 = time.monotonic()
        peak = {k: 0.0 for k in procs}
        while time.monotonic() - t0 < window:
            for k, p in procs.items():
                peak[k] = max(peak[k], rss_mib(p))
            time.sleep(1)
        elapsed = time.monotonic() - t0
        for k, p in procs.items():
            run.cpu_per_min[k] = (cpu_seconds(p) - before[k]) * 60 / elapsed
            run.rss_mib[k] = peak[k]
        run.cpu_per_min["shims"] = (cpu_seconds(shim_procs) - shims_before) * 60 / elapsed
        probes_after = probe_totals(kb)
        run.probes = int(probes_after[1] - probes_before[1])
        if run.probes:
            run.probe_ms = (probes_after[0] - probes_before[0]) / run.probes * 1000
        say(f"{mode}: window done; removing the bed")
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kubelet", description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=100)
    p.add_argument("--probed", type=float, default=0.5, help="fraction of pods with exec probes")
    p.add_argument("--probe-period", type=int, default=10)
    p.add_argument("--window", type=float, default=60.0, help="seconds of steady state measured")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument(
        "--modes",
        default="podshim,direct",
        help="what the kubelet is pointed at, each round, rotating: podshim, direct, python, gofloor",
    )
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not {"podshim", "direct"} <= set(modes) or not set(modes) <= set(MODES):
        p.error(f"--modes: podshim and direct, and any of {', '.join(MODES[2:])}")
    print(machine_summary())
    specs = manifests(args.pods, args.probed, args.probe_period)
    runs: list[Run] = []
    for r in range(args.rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            runs.append(one_run(mode, specs, args.window, args.start_timeout))

    rows = []
    for run in runs:
        rows.append(
            [
                run.mode,
                percentile(run.starts, 50),
                percentile(run.starts, 99),
                run.cpu_per_min["podshim"] if run.mode != "direct" else math.nan,
                run.cpu_per_min["containerd"],
                run.cpu_per_min["shims"],
                run.cpu_per_min["kubelet"],
                run.rss_mib["podshim"] if run.mode != "direct" else math.nan,
                run.rss_mib["containerd"],
                run.probe_ms,
                run.probes,
            ]
        )
    probed = f"{args.probed:.0%} probed every {args.probe_period} s"
    print(f"\n{args.pods} static pods ({probed}), window {args.window:.0f} s")
    print(
        table(
            [
                "kubelet on",
                "start p50 s",
                "start p99 s",
                "podshim (or floor) cpu s/min",
                "containerd cpu s/min",
                "shims cpu s/min",
                "kubelet cpu s/min",
                "podshim rss MiB",
                "containerd rss MiB",
                "probe ms",
                "probes",
            ],
            rows,
        )
    )

    def cpu_ratio(mode: str) -> float:
        return median(
            [ratio(r.cpu_per_min["podshim"], r.cpu_per_min["containerd"]) for r in runs if r.mode == mode]
        )

    def start_p50(mode: str) -> float:
        return median([percentile(r.starts, 50) for r in runs if r.mode == mode])

    ours = [r for r in runs if r.mode == "podshim"]
    others = {f"{m}_cpu_vs_containerd": cpu_ratio(m) for m in modes if m not in ("podshim", "direct")}
    print(
        result_line(
            podshim_cpu_vs_containerd=cpu_ratio("podshim"),
            podshim_rss_mib=max((r.rss_mib["podshim"] for r in ours), default=math.nan),
            pod_start_ratio=ratio(start_p50("podshim"), start_p50("direct")),
            **others,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
