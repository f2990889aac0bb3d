"""bench/node: what podshim costs a node's ordinary containers (the "node tax").

Private containerds, no podshim in front (containerd alone: what every ordinary pod of a node
pays for the wrapper, whether or not podshim serves the CRI), same machine, same run:

* ``runc``: the runc handler's ``BinaryName`` is plain runc;
* ``podshim-runc``: the documented install, the compiled wrapper (native/podshim-runc.c);
* ``runc-2``, the floor: a second bed with plain runc, measured like the others, so the
  ``runc-2``/``runc`` ratios show what the machine's noise alone gives (``--no-floor``: without);
* ``python`` (with ``--python``), for reference: the Python hook as ``BinaryName``, i.e. what
  podshim-runc was before the compiled wrapper (slow: it makes the run several times longer).

Measured, after a warm-up, in rounds that alternate the beds (the order rotates per round):

1. pod start: RunPodSandbox + CreateContainer + StartContainer of one busybox container (until
   StartContainer returns); the pod is removed after each round, untimed;
2. ExecSync of ``/bin/true`` in a running container, the beds alternating call by call (GC off
   within a round);
3. the wrapper per runtime call, outside containerd, with the bed's podshim config: ``state ID``
   of a running container and ``create --bundle B ... ID`` with that container's real bundle,
   through podshim-runc vs directly, with /bin/true standing in for the runtime (PODSHIM_RUNTIME_
   BINARY), so the difference is the wrapper's own work (exec, config, config.json) without the
   runtime's noise; and ``state ID`` with the real runc, for scale. Calls alternate one by one.
   Wall time per call (median) and CPU time (the child's rusage from wait4: the wrapper and
   what it execs) per 100 calls.

Ends with ``RESULT pod_start_ratio=… exec_ratio=… wrapper_overhead_ms=…``: the p50 ratios
podshim-runc / runc, and the larger of the two per-call wall overheads with the stand-in
(state, create).
Targets: both ratios <= 1.05, overhead <= 2 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from bench.common import machine_summary, median, percentile, ratio, result_line, say, table
from testbed import pods
from testbed.bed import VENV_BIN, TestBed
from testbed.versions import REAL_RUNC

WRAPPER = VENV_BIN / "podshim-runc"
HOOK = VENV_BIN / "podshim-runc-hook"
STAND_IN = "/bin/true"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.node", description=__doc__.split("\n\n")[0])
    p.add_argument("--pod-rounds", type=int, default=20, help="pod starts per bed (default 20)")
    p.add_argument("--exec-rounds", type=int, default=20, help="ExecSync rounds (default 20)")
    p.add_argument("--exec-block", type=int, default=10, help="ExecSync calls per bed and round")
    p.add_argument("--call-rounds", type=int, default=10, help="wrapper call rounds (default 10)")
    p.add_argument("--call-block", type=int, default=15, help="calls per kind, target and round")
    p.add_argument("--python", action="store_true", help="add the Python-hook bed (the old wrapper)")
    p.add_argument("--no-floor", action="store_true", help="leave out the second plain-runc bed")
    return p.parse_args(argv)


def rotate(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def busybox(name: str) -> cri.ContainerConfig:
    return pods.container_config(name, image=pods.BUSYBOX_IMAGE, command=["sleep", "3600"], args=[])


# ---------------------------------------------------------------------------- CRI measurements


def pod_start(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, name: str) -> tuple[float, pods.Pod]:
    t0 = time.perf_counter()
    pod = pods.run_pod(rt, name, bed.pod_logs_dir, {"c": busybox("c")})
    return time.perf_counter() - t0, pod


def measure_pod_start(
    beds: dict[str, TestBed], stubs: dict[str, api_pb2_grpc.RuntimeServiceStub], rounds: int
) -> dict[str, list[float]]:
    names = list(beds)
    say("pod start warm-up: 2 per bed")
    for name in names:
        for i in range(2):
            _, pod = pod_start(stubs[name], beds[name], f"warm-{i}")
            pods.remove_pod(stubs[name], pod.id)
    out: dict[str, list[float]] = {n: [] for n in names}
    say(f"pod start: {rounds} rounds, beds alternating")
    for r in range(rounds):
        started = []
        for name in rotate(names, r):
            gc.collect()
            gc.disable()
            try:
                dt, pod = pod_start(stubs[name], beds[name], f"start-{r}")
            finally:
                gc.enable()
            out[name].append(dt)
            started.append((name, pod))
        for name, pod in started:
            pods.remove_pod(stubs[name], pod.id)
    return out


def measure_exec(
    stubs: dict[str, api_pb2_grpc.RuntimeServiceStub], cids: dict[str, str], rounds: int, block: int
) -> dict[str, list[float]]:
    names = list(stubs)

    def call(name: str) -> float:
        t0 = time.perf_counter()
        resp = stubs[name].ExecSync(
            cri.ExecSyncRequest(container_id=cids[name], cmd=["/bin/true"], timeout=30)
        )
        dt = time.perf_counter() - t0
        if resp.exit_code != 0:
            raise RuntimeError(f"ExecSync /bin/true in the {name} bed exited {resp.exit_code}")
        return dt

    say("ExecSync warm-up: 10 per bed")
    for name in names:
        for _ in range(10):
            call(name)
    out: dict[str, list[float]] = {n: [] for n in names}
    say(f"ExecSync /bin/true: {rounds} rounds x {block} calls per bed, the beds alternating call by call")
    for r in range(rounds):
        gc.collect()
        gc.disable()
        try:
            for i in range(block):
                for name in rotate(names, r * block + i):
                    out[name].append(call(name))
        finally:
            gc.enable()
    return out


# ---------------------------------------------------------------------------- the wrapper per call


def spawn(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run argv (stdout, stderr to /dev/null); (wall seconds, CPU seconds of the child)."""
    actions = [
        (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
        (os.POSIX_SPAWN_OPEN, 2, "/dev/null", os.O_WRONLY, 0),
    ]
    t0 = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, env, file_actions=actions)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_utime + usage.ru_stime


KINDS = {  # kind -> (label, the real runtime runs (else STAND_IN does))
    "state": ("state ID, runtime /bin/true", False),
    "create": ("create --bundle B ID, runtime /bin/true", False),
    "state-runc": ("state ID, runtime runc", True),
}


def measure_calls(
    bed: TestBed, cid: str, rounds: int, block: int, with_python: bool
) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    """Per (kind, target): (per-call wall seconds, per-round CPU seconds per call). Calls of the
    targets alternate one by one (the order rotates), so drift hits all alike."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PODSHIM_CONFIG": str(bed.podshim_config)}
    stand_in_env = {**env, "PODSHIM_RUNTIME_BINARY": STAND_IN}
    root = str(bed.runc_root)
    bundle = next(bed.containerd_state.glob(f"io.containerd.runtime.v*.task/{bed.namespace}/{cid}"))
    args = {
        "state": ["--root", root, "state", cid],
        "create": [
            *["--root", root, "--log", str(bed.base_dir / "bench-create.log"), "--log-format", "json"],
            *["create", "--bundle", str(bundle), "--pid-file", str(bed.base_dir / "bench.pid"), "bench-id"],
        ],
        "state-runc": ["--root", root, "state", cid],
    }
    targets = {"runc": "", "podshim-runc": str(WRAPPER)}
    if with_python:
        targets["python"] = str(HOOK)
    runs: dict[tuple[str, str], tuple[list[str], dict[str, str]]] = {}
    for kind, (_, real) in KINDS.items():
        for t, binary in targets.items():
            direct = str(REAL_RUNC) if real else STAND_IN
            runs[(kind, t)] = ([binary or direct, *args[kind]], env if real else stand_in_env)
    say(f"wrapper per call: warm-up, then {rounds} rounds x {block} calls per kind and target")
    for argv, e in runs.values():
        for _ in range(3):
            spawn(argv, e)
    out: dict[tuple[str, str], tuple[list[float], list[float]]] = {k: ([], []) for k in runs}
    names = list(targets)
    for r in range(rounds):
        for kind in KINDS:
            cpu = dict.fromkeys(names, 0.0)
            for i in range(block):
                for t in rotate(names, r * block + i):
                    argv, e = runs[(kind, t)]
                    w, c = spawn(argv, e)
                    out[(kind, t)][0].append(w)
                    cpu[t] += c
            for t in names:
                out[(kind, t)][1].append(cpu[t] / block)
    return out


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    print("bench/node: the node tax, containerd alone with runc vs podshim-runc as BinaryName", flush=True)
    print(machine_summary(), flush=True)
    for p in (WRAPPER, HOOK):
        if not p.exists():
            print(f"{p} is missing: run the set-up (make setup)", file=sys.stderr)
            return 1
    binaries = {"runc": Path(REAL_RUNC), "podshim-runc": WRAPPER}
    if not args.no_floor:
        binaries["runc-2"] = Path(REAL_RUNC)
    if args.python:
        binaries["python"] = HOOK
    with contextlib.ExitStack() as stack:
        beds: dict[str, TestBed] = {}
        for name, binary in binaries.items():
            say(f"starting the {name} bed (containerd alone, BinaryName {binary})")
            beds[name] = stack.enter_context(TestBed(start_podshim=False, runc_binary=binary))
        stubs = {n: pods.stubs(b.containerd_socket)[0] for n, b in beds.items()}
        starts = measure_pod_start(beds, stubs, args.pod_rounds)
        running = {
            n: pods.run_pod(stubs[n], "exec-target", b.pod_logs_dir, {"c": busybox("c")})
            for n, b in beds.items()
        }
        cids = {n: p.containers["c"] for n, p in running.items()}
        execs = measure_exec(stubs, cids, args.exec_rounds, args.exec_block)
        calls = measure_calls(
            beds["podshim-runc"], cids["podshim-runc"], args.call_rounds, args.call_block, args.python
        )
        for n, running_pod in running.items():
            pods.remove_pod(stubs[n], running_pod.id)
        say("stopping the beds")

    names = list(binaries)
    call_names = [n for n in names if n != "runc-2"]
    print()
    print(f"Pod start (RunPodSandbox + CreateContainer + StartContainer), ms, {args.pod_rounds} per bed")
    rows = []
    for n in names:
        s = [x * 1e3 for x in starts[n]]
        e = [x * 1e3 for x in execs[n]]
        rows.append([n, percentile(s, 50), percentile(s, 99), len(e), percentile(e, 50), percentile(e, 99)])
    print(table(["BinaryName", "start p50", "start p99", "exec n", "exec p50", "exec p99"], rows))

    print()
    print(f"Per runtime call, outside containerd ({args.call_rounds} rounds x {args.call_block} calls)")
    rows = []
    overhead: dict[str, float] = {}
    cpu_100: dict[str, float] = {}
    for kind, (label, _) in KINDS.items():
        base_wall = median(calls[(kind, "runc")][0]) * 1e3
        base_cpu = median(calls[(kind, "runc")][1])
        for n in call_names:
            wall = median(calls[(kind, n)][0]) * 1e3
            cpu = median(calls[(kind, n)][1])
            target = "direct" if n == "runc" else n
            rows.append([f"{label}: {target}", wall, wall - base_wall, cpu * 1e3, (cpu - base_cpu) * 100])
            if n == "podshim-runc" and kind in ("state", "create"):
                overhead[kind] = wall - base_wall
                cpu_100[kind] = (cpu - base_cpu) * 100
    print(table(["call", "wall p50 ms", "added ms", "CPU ms/call", "added CPU s/100 calls"], rows))
    print(
        f"(with {STAND_IN} standing in for the runtime, 'added' is the wrapper's own work; podshim-runc "
        f"costs {max(cpu_100.values()):.3f} CPU seconds per 100 runtime calls)"
    )
    print()
    print(f"run took {time.monotonic() - t_start:.0f} s")
    if "runc-2" in starts:
        floor_start = ratio(percentile(starts["runc-2"], 50), percentile(starts["runc"], 50))
        floor_exec = ratio(percentile(execs["runc-2"], 50), percentile(execs["runc"], 50))
        print(
            f"FLOOR runc-2/runc (plain runc in both): pod_start_ratio={floor_start:.3f} "
            f"exec_ratio={floor_exec:.3f}"
        )
    print("targets: pod_start_ratio <= 1.05, exec_ratio <= 1.05, wrapper_overhead_ms <= 2")
    print(
        result_line(
            pod_start_ratio=ratio(percentile(starts["podshim-runc"], 50), percentile(starts["runc"], 50)),
            exec_ratio=ratio(percentile(execs["podshim-runc"], 50), percentile(execs["runc"], 50)),
            wrapper_overhead_ms=max(overhead.values()),
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
