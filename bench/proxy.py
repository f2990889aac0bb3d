"""bench/proxy: what podshim's proxy adds to a unary CRI call.

* Latency: ListPodSandbox (with a few pods present), ContainerStatus (of a running container)
  and Version, podshim vs containerd direct, after warm-up, in interleaved blocks (the order of
  the two targets alternates per round, so drift and background noise hit both alike).
  Requests are pre-serialized and responses not decoded (bytes in, bytes out), so the client's
  own cost is the same small constant on both sides. GC is off inside a block.
* Throughput (calls/s) of ListPodSandbox at 1 and 16 concurrent clients, podshim vs direct:
  each client is its own process with its own channel (so the client GIL does not cap both
  sides alike), all released by one barrier; trials alternate the target order.

``podshim`` is podshim as it runs on a node: podshim-front (native/front/) serves the socket,
ListPodSandbox and ContainerStatus go from it straight to containerd, Version through the
daemon. Measured in the same rounds beside it:

* ``python``: a second podshim with ``[server] front = false``, the daemon serving the socket
  itself (every call through Python gRPC, as before the front);
* ``gofloor``: podshim-front alone, forwarding every method to containerd (no daemon, no routing
  to it): what the front's gRPC stack costs on this machine;
* ``floor``: the smallest Python gRPC passthrough (bench/grpc_floor.py: bytes forwarded, nothing
  else): what grpcio itself costs.

Ends with ``RESULT p50_added_ms=… p99_added_ms=… throughput_ratio_16=… p50_added_vs_gofloor=…
throughput_vs_gofloor=… python_p50_added_ms=… python_throughput_ratio_16=… gofloor_p50_added_ms=…
gofloor_throughput_ratio_16=… floor_p50_added_ms=… floor_throughput_ratio_16=…``: the latency
figures are the worst (largest) over the three methods (Version, which podshim's front answers
while its daemon is connected, included); the two ``_vs_gofloor`` are podshim's over gofloor's
of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import os
import subprocess
import sys
import time
from multiprocessing.synchronize import Barrier
from typing import Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from bench.common import (
    bench_bed,
    counter_config,
    machine_summary,
    median,
    percentile,
    ratio,
    record,
    remove_pod,
    result_line,
    runtime_stub,
    say,
    start_counter_pod,
    table,
    worst,
)
from testbed._cri import target
from testbed.bed import VENV_BIN

SERVICE = "/runtime.v1.RuntimeService/"
TARGETS = ("podshim", "direct", "python", "gofloor", "floor")
FLOORS = ("python", "gofloor", "floor")  # measured beside podshim, each against direct


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--pods", type=int, default=4, help="pods present for ListPodSandbox (default 4)")
    p.add_argument("--warmup", type=int, default=300, help="warm-up calls per method and target")
    p.add_argument("--rounds", type=int, default=60, help="interleaved rounds (default 60)")
    p.add_argument("--block", type=int, default=40, help="calls per block (default 40)")
    p.add_argument("--clients", default="1,16", help="concurrency levels for throughput (default 1,16)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per throughput trial")
    p.add_argument("--trials", type=int, default=4, help="throughput trials per target (default 4)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- latency


def measure_latency(
    targets: dict[str, str], requests: dict[str, bytes], args: argparse.Namespace
) -> dict[tuple[str, str], list[float]]:
    """Per (method, target): per-call latencies in seconds."""
    channels = {name: grpc.insecure_channel(t) for name, t in targets.items()}
    calls: dict[tuple[str, str], grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {
        (m, name): ch.unary_unary(SERVICE + m) for m in requests for name, ch in channels.items()
    }
    say(f"latency warm-up: {args.warmup} calls per method and target")
    for (m, _name), fn in calls.items():
        for _ in range(args.warmup):
            fn(requests[m], timeout=10)
    samples: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
    say(f"latency: {args.rounds} rounds x {args.block} calls per method and target, interleaved")
    clock = time.perf_counter
    for r in range(args.rounds):
        order = TARGETS[r % len(TARGETS) :] + TARGETS[: r % len(TARGETS)]
        for m in requests:
            req = requests[m]
            for name in order:
                fn = calls[(m, name)]
                out = samples[(m, name)]
                gc.collect()
                gc.disable()
                try:
                    for _ in range(args.block):
                        t0 = clock()
                        fn(req, timeout=10)
                        out.append(clock() - t0)
                finally:
                    gc.enable()
    for ch in channels.values():
        ch.close()
    return samples


# ---------------------------------------------------------------------------- throughput


def _client(
    targets: dict[str, str],
    method: str,
    request: bytes,
    barrier: Barrier,
    commands: Any,
    results: Any,
) -> None:
    """One client process: its own channels, runs one trial per command, after the barrier."""
    channels = {name: grpc.insecure_channel(t) for name, t in targets.items()}
    calls: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {
        name: ch.unary_unary(SERVICE + method) for name, ch in channels.items()
    }
    for fn in calls.values():  # connect before the first trial
        fn(request, timeout=10)
    results.put(("ready", 0, 0, 0.0))
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        name, duration = cmd
        fn = calls[name]
        barrier.wait()
        n = errs = 0
        start = time.perf_counter()
        end = start + duration
        now = start
        while now < end:
            try:
                fn(request, timeout=10)
            except grpc.RpcError:
                errs += 1
            n += 1
            now = time.perf_counter()
        results.put((name, n, errs, now - start))
    for ch in channels.values():
        ch.close()


def measure_throughput(
    targets: dict[str, str], request: bytes, clients: int, args: argparse.Namespace
) -> dict[str, list[float]]:
    """calls/s of ListPodSandbox per target, one value per trial."""
    ctx = mp.get_context("spawn")  # no fork after gRPC started: each client builds its own
    barrier = ctx.Barrier(clients)
    commands = ctx.Queue()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_client,
            args=(targets, "ListPodSandbox", request, barrier, commands, results),
            daemon=True,
        )
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            results.get(timeout=120)

        def trial(name: str, duration: float) -> tuple[float, int]:
            for _ in procs:
                commands.put((name, duration))
            got = [results.get(timeout=duration + 120) for _ in procs]
            rate = sum(n / el for _, n, _, el in got if el > 0)
            return rate, sum(e for _, _, e, _ in got)

        for name in TARGETS:  # warm-up
            trial(name, 1.0)
        rates: dict[str, list[float]] = {name: [] for name in TARGETS}
        for t in range(args.trials):
            for name in TARGETS[t % len(TARGETS) :] + TARGETS[: t % len(TARGETS)]:
                rate, errs = trial(name, args.duration)
                rates[name].append(rate)
                say(f"  {clients:2d} client(s) {name:7s} trial {t + 1}: {rate:8.0f} calls/s ({errs} errors)")
        return rates
    finally:
        for _ in procs:
            commands.put(None)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(x) for x in args.clients.split(",") if x.strip()]
    print("bench/proxy: podshim vs containerd direct, unary CRI calls", flush=True)
    print(machine_summary(), flush=True)
    with bench_bed() as bed:
        rt = runtime_stub(bed.podshim_socket)
        say(f"starting {args.pods} counter pods")
        pod_ids = []
        cid = ""
        for i in range(args.pods):
            pod = start_counter_pod(rt, bed, f"proxy-{i}", {"counter": counter_config("counter", 8, 1000)})
            pod_ids.append(pod.id)
            cid = cid or pod.containers["counter"]
        floor_socket = str(bed.base_dir / "grpc-floor.sock")
        gofloor_socket = str(bed.base_dir / "go-floor.sock")
        floors = [
            [sys.executable, "-m", "bench.grpc_floor", floor_socket, str(bed.containerd_socket)],
            [
                str(VENV_BIN / "podshim-front"),
                f"--listen={gofloor_socket}",
                f"--upstream=unix://{bed.containerd_socket}",
            ],
        ]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for cmd in floors]
        python_dir = bed.base_dir / "python-podshim"
        python_dir.mkdir()
        with contextlib.ExitStack() as stack:
            for cmd, proc in zip(floors, procs, strict=True):
                stack.callback(proc.wait, 10)
                stack.callback(proc.terminate)
                assert proc.stdout is not None
                said = proc.stdout.readline().strip()
                if said != "ready":
                    raise RuntimeError(f"{cmd[0]}: {said or 'exited'}")
            python_socket, _log = stack.enter_context(bed.extra_podshim(python_dir, server={"front": False}))
            targets = {
                "podshim": target(bed.podshim_socket),
                "direct": target(bed.containerd_socket),
                "python": target(python_socket),
                "gofloor": target(gofloor_socket),
                "floor": target(floor_socket),
            }
            requests = {
                "ListPodSandbox": cri.ListPodSandboxRequest().SerializeToString(),
                "ContainerStatus": cri.ContainerStatusRequest(container_id=cid).SerializeToString(),
                "Version": cri.VersionRequest(version="v1").SerializeToString(),
            }
            lat = measure_latency(targets, requests, args)
            rates: dict[int, dict[str, list[float]]] = {}
            for c in levels:
                say(f"throughput: ListPodSandbox, {c} client process(es), {args.trials} x {args.duration}s")
                rates[c] = measure_throughput(targets, requests["ListPodSandbox"], c, args)
        for pid in pod_ids:
            remove_pod(rt, pid)

    # the latency distribution per method and target, for the page's plot (bench/report.py)
    record(
        "latency_ms",
        [
            {"method": m, "target": t, "q": q, "ms": percentile(lat[(m, t)], q) * 1e3}
            for m in requests
            for t in ("direct", "podshim", *FLOORS)
            if lat.get((m, t))
            for q in (1, 5, 10, 25, 50, 75, 90, 95, 99)
        ],
    )
    rows = []
    p50_added: list[float] = []
    p99_added: list[float] = []
    floor_added: dict[str, list[float]] = {f: [] for f in FLOORS}
    for m in requests:
        d, s = lat[(m, "direct")], lat[(m, "podshim")]
        d50, d99 = percentile(d, 50) * 1e3, percentile(d, 99) * 1e3
        s50, s99 = percentile(s, 50) * 1e3, percentile(s, 99) * 1e3
        p50_added.append(s50 - d50)
        p99_added.append(s99 - d99)
        row = [m, len(s), d50, s50, s50 - d50, d99, s99, s99 - d99]
        for f in FLOORS:
            f50 = percentile(lat[(m, f)], 50) * 1e3
            floor_added[f].append(f50 - d50)
            row.append(f50 - d50)
        rows.append(row)
    print()
    print(f"Latency per call, ms ({args.rounds} interleaved rounds x {args.block} calls, after warm-up)")
    heads = ["method", "n", "direct p50", "shim p50", "added p50", "direct p99", "shim p99", "added p99"]
    print(table(heads + [f"{f} added p50" for f in FLOORS], rows))
    rows = []
    ratios: dict[str, dict[int, float]] = {name: {} for name in ("podshim", *FLOORS)}
    for c in levels:
        direct = median(rates[c]["direct"])
        row = [f"ListPodSandbox x{c}", direct]
        for name in ratios:
            ratios[name][c] = ratio(median(rates[c][name]), direct)
            row += [median(rates[c][name]), ratios[name][c]]
        rows.append(row)
    print()
    print(f"Throughput, calls/s (median of {args.trials} trials of {args.duration}s; client processes)")
    heads = ["workload", "direct"] + [h for name in ratios for h in (name, f"{name}/direct")]
    print(table(heads, rows))
    print(
        "python: podshim with [server] front = false; gofloor: podshim-front alone, every method to "
        "containerd; floor: the smallest Python gRPC passthrough (bench/grpc_floor.py); same run"
    )
    print()
    print("targets: p50 added <= 1.1 x gofloor's, p99 added <= 1 ms, throughput at 16 >= 0.95 x gofloor's")
    beside: dict[str, float] = {}
    for f in FLOORS:
        beside[f"{f}_p50_added_ms"] = worst(floor_added[f])
        beside[f"{f}_throughput_ratio_16"] = ratios[f].get(16, float("nan"))
    print(
        result_line(
            p50_added_ms=worst(p50_added),
            p99_added_ms=worst(p99_added),
            throughput_ratio_16=ratios["podshim"].get(16, float("nan")),
            p50_added_vs_gofloor=ratio(worst(p50_added), beside["gofloor_p50_added_ms"]),
            throughput_vs_gofloor=ratio(
                ratios["podshim"].get(16, float("nan")), beside["gofloor_throughput_ratio_16"]
            ),
            **beside,
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    sys.exit(main())
