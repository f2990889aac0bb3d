"""bench/kubelet: what a full node costs (issue 22 item 11), under a real kubelet.

    python -m bench.kubelet [--pods 100] [--probed 0.5] [--window 60] [--rounds 1]

A kubelet v1.37 (testbed/kubelet.py: standalone, static pods) gets N static pods at once, each a
pause sandbox plus one small busybox container (``sleep``), an exec liveness and readiness probe
every 10 s on the given fraction of them. The same batch runs with the kubelet pointed at podshim
and, alternating (the order swaps each round), straight at containerd, each in a fresh bed.

Measured per run:

* pod start: from the moment a pod's manifest is written to the moment containerd lists its
  container RUNNING (containerd is asked directly, every 0.1 s, in both modes), p50 and p99 of the
  batch;
* then, after 15 s to settle, over a window of W seconds with every pod running: CPU seconds per
  minute and RSS of podshim, of containerd (the daemon; its shims listed apart) and of the kubelet,
  and the probes' mean latency (the kubelet's ``prober_probe_duration_seconds``, sum / count over
  the window; it includes the exec through the runtime).

Ends with ``RESULT podshim_cpu_vs_containerd=… podshim_rss_mib=… pod_start_ratio=…``: podshim's
CPU over containerd's in the podshim runs (medians over rounds), podshim's largest RSS, and the
pod start p50 through podshim over the p50 straight at containerd.
Targets: ≤ 0.10, ≤ 100 MiB, ≤ 1.05. On a quiet machine: ``make bench-kubelet`` (N=100, 2 rounds).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from api.runtime.v1 import api_pb2 as cri
from bench.common import machine_summary, median, percentile, ratio, result_line, say, table
from testbed.bed import BUSYBOX_IMAGE
from testbed.kubelet import KubeletBed, pod_manifest

MIB = 1 << 20
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


def cpu_seconds(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def shims(containerd_pid: int) -> list[psutil.Process]:
    """containerd's runc shims (they outlive their parent: they are found by their argv)."""
    out = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if p.info.get("name", "").startswith("containerd-shim") and any(
            str(containerd_pid) in a for a in cmd
        ):
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
    with KubeletBed(via_podshim=mode == "podshim", config=config) as kb:
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
        procs = {
            "podshim": psutil.Process(kb.bed.podshim_pid),
            "containerd": psutil.Process(kb.bed.containerd_pid),
            "kubelet": psutil.Process(kb.kubelet.pid),
        }
        shim_procs = shims(str(kb.bed.containerd_socket))
        before = {k: cpu_seconds(p) for k, p in procs.items()}
        shims_before = sum(cpu_seconds(p) for p in shim_procs)
        probes_before = probe_totals(kb)
        t0 = time.monotonic()
        peak = {k: 0.0 for k in procs}
        while time.monotonic() - t0 < window:
            for k, p in procs.items():
                peak[k] = max(peak[k], p.memory_info().rss / MIB)
            time.sleep(1)
        elapsed = time.monotonic() - t0
        for k, p in procs.items():
            run.cpu_per_min[k] = (cpu_seconds(p) - before[k]) * 60 / elapsed
            run.rss_mib[k] = peak[k]
        run.cpu_per_min["shims"] = (sum(cpu_seconds(p) for p in shim_procs) - shims_before) * 60 / elapsed
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
    args = p.parse_args(argv)
    print(machine_summary())
    specs = manifests(args.pods, args.probed, args.probe_period)
    runs: list[Run] = []
    for r in range(args.rounds):
        order = ["podshim", "direct"] if r % 2 == 0 else ["direct", "podshim"]
        for mode in order:
            runs.append(one_run(mode, specs, args.window, args.start_timeout))

    rows = []
    for run in runs:
        rows.append(
            [
                run.mode,
                percentile(run.starts, 50),
                percentile(run.starts, 99),
                run.cpu_per_min["podshim"] if run.mode == "podshim" else math.nan,
                run.cpu_per_min["containerd"],
                run.cpu_per_min["shims"],
                run.cpu_per_min["kubelet"],
                run.rss_mib["podshim"] if run.mode == "podshim" else math.nan,
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
                "podshim cpu s/min",
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
    ours = [r for r in runs if r.mode == "podshim"]
    theirs = [r for r in runs if r.mode == "direct"]
    cpu_ratio = median([ratio(r.cpu_per_min["podshim"], r.cpu_per_min["containerd"]) for r in ours])
    start_ratio = ratio(
        median([percentile(r.starts, 50) for r in ours]), median([percentile(r.starts, 50) for r in theirs])
    )
    print(
        result_line(
            podshim_cpu_vs_containerd=cpu_ratio,
            podshim_rss_mib=max((r.rss_mib["podshim"] for r in ours), default=math.nan),
            pod_start_ratio=start_ratio,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
