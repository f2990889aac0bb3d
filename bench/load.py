"""bench/load: proxied CRI latency under load, with and without a 1 GiB CheckpointPod.

16 client processes (spawned, one gRPC channel each) call ListPodSandbox and ContainerStatus
alternately through podshim's socket, each paced at one call per ``--interval-ms`` (a schedule,
not a closed loop: a stalled call is followed by the calls it delayed, so a stall shows in the
latencies instead of hiding as fewer calls). Phases alternate, per round: *idle* (the load alone,
``--idle-seconds``) and *during* (the load while podshim checkpoints a pod holding 1 GiB of
resident memory, from the call to its return). Requests are pre-serialized and responses not
decoded, so the client's own cost is a small constant in both phases.

Prints per-phase tables (calls, errors, calls/s, p50/p90/p99/max per method) and ends with
``RESULT p99_idle_ms=… p99_during_checkpoint_ms=…`` over all proxied calls of the phase.
Target (reported, not enforced): p99 <= 50 ms during the checkpoint.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import secrets
import sys
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from bench.common import (
    bench_bed,
    checkpoint_pod,
    counter_config,
    disk_free_mib,
    machine_summary,
    meminfo_mib,
    percentile,
    remove_pod,
    remove_tree,
    result_line,
    runtime_stub,
    say,
    start_counter_pod,
    sync_disk,
    table,
)
from testbed._cri import target

SERVICE = "/runtime.v1.RuntimeService/"
TARGET_P99_MS = 50.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16, help="client processes (default 16)")
    p.add_argument(
        "--interval-ms",
        type=float,
        default=50.0,
        help="per-client call interval (default 50: 320 calls/s in all, below the proxy's capacity "
        "on a 2-core VM, so the figures show the checkpoint's effect rather than CPU saturation)",
    )
    p.add_argument("--mem-mib", type=int, default=1024, help="resident memory of the checkpointed pod")
    p.add_argument("--rounds", type=int, default=3, help="idle + during rounds (default 3)")
    p.add_argument("--idle-seconds", type=float, default=6.0, help="length of an idle phase")
    p.add_argument("--pods", type=int, default=4, help="other pods present for ListPodSandbox")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- clients


def _client(
    tgt: str,
    requests: dict[str, bytes],
    interval: float,
    commands: Any,
    results: Any,
    stop: Event,
    seed: int,
) -> None:
    """One client process: its own channel; per command, one phase of paced calls."""
    rng = random.Random(seed)
    channel = grpc.insecure_channel(tgt)
    calls: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {
        m: channel.unary_unary(SERVICE + m) for m in requests
    }
    methods = list(requests)
    for m, fn in calls.items():  # connect before the first phase
        fn(requests[m], timeout=10)
    results.put(("ready", {}, 0))
    clock = time.perf_counter
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        phase, duration = cmd
        lat: dict[str, list[float]] = {m: [] for m in methods}
        errors = 0
        i = rng.randrange(len(methods))
        start = clock()
        due = start + rng.random() * interval  # staggered: no synchronized bursts
        end = start + duration if duration else None
        while (clock() < end) if end is not None else not stop.is_set():
            now = clock()
            if due > now:
                time.sleep(due - now)
            m = methods[i % len(methods)]
            i += 1
            t0 = clock()
            try:
                calls[m](requests[m], timeout=10)
            except grpc.RpcError:
                errors += 1
            lat[m].append((clock() - t0) * 1e3)
            due += interval
        results.put((phase, lat, errors))
    channel.close()


class Load:
    """The client processes, driven phase by phase."""

    def __init__(self, tgt: str, requests: dict[str, bytes], clients: int, interval: float) -> None:
        ctx = mp.get_context("spawn")  # no fork after gRPC started: each client builds its own
        self.commands = [ctx.Queue() for _ in range(clients)]
        self.results = ctx.Queue()
        self.stop = ctx.Event()
        self.procs = [
            ctx.Process(
                target=_client,
                args=(tgt, requests, interval, self.commands[i], self.results, self.stop, i),
                daemon=True,
            )
            for i in range(clients)
        ]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self.results.get(timeout=120)

    def begin(self, phase: str, duration: float = 0.0) -> None:
        """Start a phase: timed, or (duration 0) until `end()`."""
        self.stop.clear()
        for q in self.commands:
            q.put((phase, duration))

    def end(self, timeout: float = 120.0) -> tuple[dict[str, list[float]], int]:
        self.stop.set()
        merged: dict[str, list[float]] = {}
        errors = 0
        for _ in self.procs:
            _phase, lat, errs = self.results.get(timeout=timeout)
            errors += errs
            for m, v in lat.items():
                merged.setdefault(m, []).extend(v)
        return merged, errors

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------------- main


def _row(label: str, v: list[float], errors: int, seconds: float) -> list[Any]:
    return [
        label,
        len(v),
        errors,
        len(v) / seconds if seconds else float("nan"),
        percentile(v, 50),
        percentile(v, 90),
        percentile(v, 99),
        max(v) if v else float("nan"),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"bench/load: {args.clients} proxied clients (ListPodSandbox + ContainerStatus, one call per "
        f"{args.interval_ms:g} ms each) with and without a {args.mem_mib} MiB CheckpointPod",
        flush=True,
    )
    print(machine_summary(), flush=True)
    phases: dict[str, dict[str, list[float]]] = {"idle": {}, "during": {}}
    errors = {"idle": 0, "during": 0}
    seconds = {"idle": 0.0, "during": 0.0}
    ckpt_rows: list[list[Any]] = []
    with bench_bed() as bed:
        rt = runtime_stub(bed.podshim_socket)
        say(f"starting {args.pods} small pods and a {args.mem_mib} MiB counter pod")
        small = [
            start_counter_pod(rt, bed, f"load-{i}", {"counter": counter_config("counter", 8, 1000)})
            for i in range(args.pods)
        ]
        big = start_counter_pod(rt, bed, "load-big", {"counter": counter_config("counter", args.mem_mib)})
        free = disk_free_mib(bed.checkpoint_root)
        say(f"memory available {meminfo_mib()} MiB, checkpoint disk free {free} MiB")
        requests = {
            "ListPodSandbox": cri.ListPodSandboxRequest().SerializeToString(),
            "ContainerStatus": cri.ContainerStatusRequest(
                container_id=small[0].containers["counter"]
            ).SerializeToString(),
        }
        say(f"spawning {args.clients} client processes")
        load = Load(target(bed.podshim_socket), requests, args.clients, args.interval_ms / 1e3)
        try:
            load.begin("warm-up", 2.0)
            load.end()
            for r in range(args.rounds):
                sync_disk()
                say(f"round {r + 1}/{args.rounds}: idle for {args.idle_seconds:g}s")
                t0 = time.perf_counter()
                load.begin("idle", args.idle_seconds)
                lat, errs = load.end()
                seconds["idle"] += time.perf_counter() - t0
                errors["idle"] += errs
                for m, v in lat.items():
                    phases["idle"].setdefault(m, []).extend(v)

                out = Path(bed.checkpoint_root) / f"load-{secrets.token_hex(4)}"
                say(f"round {r + 1}/{args.rounds}: CheckpointPod of {args.mem_mib} MiB under load")
                t0 = time.perf_counter()
                load.begin("during")
                try:
                    wall, manifest = checkpoint_pod(rt, big.id, out)
                finally:
                    lat, errs = load.end()
                seconds["during"] += time.perf_counter() - t0
                errors["during"] += errs
                for m, v in lat.items():
                    phases["during"].setdefault(m, []).extend(v)
                timings = manifest.get("timings", {})
                ckpt_rows.append(
                    [
                        f"round {r + 1}",
                        wall,
                        timings.get("freeze_window", float("nan")),
                        timings.get("total", 0.0),
                    ]
                )
                remove_tree(out)
        finally:
            load.close()
            for pod in [*small, big]:
                remove_pod(rt, pod.id)

    print()
    print(f"CheckpointPod of {args.mem_mib} MiB under load, seconds")
    print(table(["", "call wall", "freeze window", "total (manifest)"], ckpt_rows))
    rows = []
    p99: dict[str, float] = {}
    for phase in ("idle", "during"):
        for m, v in sorted(phases[phase].items()):
            rows.append(_row(f"{phase:6s} {m}", v, 0, seconds[phase]))
        every = [x for v in phases[phase].values() for x in v]
        rows.append(_row(f"{phase:6s} all", every, errors[phase], seconds[phase]))
        p99[phase] = percentile(every, 99)
    print()
    load_text = f"{args.clients} clients x 1 call / {args.interval_ms:g} ms"
    print(f"Proxied latency, ms ({load_text}, {args.rounds} rounds)")
    print(table(["phase / method", "calls", "errors", "calls/s", "p50", "p90", "p99", "max"], rows))
    print()
    print(f"target: p99 <= {TARGET_P99_MS:g} ms during the checkpoint (reported, not enforced)")
    print(result_line(p99_idle_ms=p99["idle"], p99_during_checkpoint_ms=p99["during"]), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    sys.exit(main())
