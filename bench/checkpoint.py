"""bench/checkpoint: CheckpointPod vs plain ``runc checkpoint`` of the same containers.

For pods of N counter containers x M MiB resident memory each (default 1,2,4 x 64,256,1024, and
2 x 4096: 8 GiB, `--cells`; `--only 4x1024 --repeat 9`: that cell alone), in one run, per repeat:

* podshim: CheckpointPod of the whole pod; from the archive's manifest.json ``timings`` the
  freeze window and total (plus the wall time of the call as the client saw it);
* raw (the floor): the same containers dumped one after the other with
  ``runc --root <bed runc root> --criu /usr/local/sbin/criu checkpoint --leave-running
  --image-path X --work-path Y <id>``, each dump timed.

Both write to the bed's checkpoint root (one filesystem). Before each measurement the previous
output is deleted and the disk synced, and the order (podshim first / raw first) alternates
between repeats and cells, so neither side inherits the other's page cache or writeback. Each
cell starts with one raw arm that is not counted, so that every counted arm, the first one
included, follows the removal of another's output: this VM hands freed memory back to its host,
and the first arm after the pod started met memory the host had taken back (docs/design/checkpoint-pod.md
(The freeze window)). Each repeat also gives the CPU seconds of the dumps: podshim's runc
and CRIU (manifest timings.dump_cpu), the raw runc and CRIU, and the containers' own (CRIU's
parasite runs in them).

In every cell with more containers than cores (`--parallel-floor`: in every cell), also the same
plain runc dumps started all at once (the pod's cut without podshim: N CRIUs sharing the cores,
the page cache and the disk, as podshim's do; run first in each repeat), a floor of its own beside
the two below: the table's `raw at once` and `freeze/at once`, RESULT's `freeze_vs_raw_at_once`
(worst cell). Each repeat also reports how many MiB of page images podshim wrote back during its
dumps (its log), and what the machine's cores did in podshim's freeze window and in the raw dumps'
at once (/proc/stat: busy, idle, iowait, and steal, the host's; docs/design/checkpoint-pod.md (The
freeze window)).

Per cell: freeze_window / slowest single raw dump, and total / (sum of raw dumps + 0.2 s)
(per repeat, then the median over repeats).

Two floors of this machine are measured in the same run, to tell podshim's overhead from what
no implementation could avoid here:

* CPU floor of the freeze window: the raw dumps' CPU time (user + sys of runc and CRIU) divided
  by the cores. N parallel dumps cannot end before it, whatever the slowest single dump took.
  The freeze floor of a cell is max(slowest raw dump, CPU floor).
* durable floor of the total: the raw dumps plus a ``sync`` right after them (the time the disk
  takes to hold what they wrote), + 0.2 s. CheckpointPod's archive is fsynced before it is marked
  complete; a raw ``runc checkpoint`` leaves its images in the page cache.

Targets (reported, not enforced): freeze window <= 1.3 x the freeze floor and total <=
1.1 x the durable floor in every cell. Ends with ``RESULT freeze_vs_floor=…
total_vs_durable_floor=…`` (worst cell of each); the table also gives freeze / slowest raw dump
and total / (raw sum + 0.2 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from api.runtime.v1 import api_pb2_grpc
from bench.common import (
    CpuTimes,
    bench_bed,
    checkpoint_pod,
    counter_config,
    cpu_line,
    disk_free_mib,
    freeze_bounds,
    machine_summary,
    median,
    meminfo_mib,
    remove_pod,
    remove_tree,
    result_line,
    runc_argv,
    runtime_stub,
    say,
    start_counter_pod,
    sync_disk,
    table,
    worst,
)
from testbed import pods
from testbed.bed import TestBed

RAW_SLACK = 0.2  # seconds allowed on top of the sum of raw dumps
FREEZE_TARGET = 1.3  # freeze window / max(slowest raw dump, CPU floor)
TOTAL_TARGET = 1.1  # total / (raw dumps + sync + 0.2 s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--containers", default="1,2,4", help="containers per pod (default 1,2,4)")
    p.add_argument("--mem", default="64,256,1024", help="MiB resident per container (default 64,256,1024)")
    p.add_argument(
        "--cells",
        default="2x4096",
        help="cells beyond the grid, NxMiB comma-separated (default 2x4096: 8 GiB; '' for none)",
    )
    p.add_argument(
        "--only",
        default="",
        help="these cells alone, NxMiB comma-separated (e.g. 4x1024), instead of the grid and --cells",
    )
    p.add_argument(
        "--parallel-floor",
        action="store_true",
        help="dump the containers with plain runc all at once (the same cut without podshim) in every "
        "cell, not only in those with more containers than cores",
    )
    p.add_argument("--repeat", type=int, default=3, help="repeats per cell (default 3)")
    p.add_argument("--timeout", type=float, default=900.0, help="CheckpointPod deadline, seconds")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _cells(text: str) -> list[tuple[int, int]]:
    """`2x4096,1x512` -> [(2, 4096), (1, 512)]."""
    return [(int(n), int(m)) for n, _, m in (x.strip().partition("x") for x in text.split(",") if x.strip())]


@dataclass
class Sample:
    """One repeat of one cell."""

    order: str
    freeze: float  # manifest timings.freeze_window
    total: float  # manifest timings.total
    wall: float  # CheckpointPod call as the client saw it
    dump: float  # manifest timings.dump (parallel dumps + diffs, pod frozen)
    archive: float  # manifest timings.archive (stats, checksums, fsync, manifest)
    raw: list[float] = field(default_factory=list)  # per container, in order
    raw_cpu: float = 0.0  # CPU seconds (user + sys) of all raw dumps
    raw_flush: float = 0.0  # the sync right after the raw dumps
    parallel: float = float("nan")  # plain runc dumps of all containers at once (--parallel-floor)
    ahead_mib: int = 0  # page images podshim wrote back during its dumps (its log)
    dump_cpu: float = float("nan")  # CPU seconds of podshim's runc/CRIU (manifest timings.dump_cpu)
    dumpee_cpu: float = float("nan")  # the containers' own CPU seconds during podshim's checkpoint
    raw_dumpee_cpu: float = float("nan")  # ... during the raw dumps (CRIU's parasite runs in them)
    window_cores: dict[str, float] = field(default_factory=dict)  # /proc/stat in the freeze window
    parallel_cores: dict[str, float] = field(default_factory=dict)  # ... in the raw dumps at once

    @property
    def cpu_floor(self) -> float:
        """The raw dumps' CPU seconds over the cores."""
        return self.raw_cpu / (os.cpu_count() or 1)

    @property
    def freeze_floor(self) -> float:
        return max(max(self.raw), self.cpu_floor)

    @property
    def freeze_vs_floor(self) -> float:
        return self.freeze / self.freeze_floor

    @property
    def total_vs_durable_floor(self) -> float:
        return self.total / (sum(self.raw) + self.raw_flush + RAW_SLACK)

    @property
    def freeze_vs_parallel(self) -> float:
        return self.freeze / self.parallel

    def idle(self, cores: dict[str, float]) -> float:
        """Core-seconds with nothing to run (idle + iowait) in one of the windows."""
        return cores["idle"] + cores["iowait"] if cores else float("nan")

    @property
    def freeze_ratio(self) -> float:
        return self.freeze / max(self.raw)

    @property
    def total_ratio(self) -> float:
        return self.total / (sum(self.raw) + RAW_SLACK)


def raw_dumps(
    bed: TestBed, container_ids: list[str], base: Path, parallel: bool = False
) -> tuple[list[float], float, float]:
    """Plain runc checkpoints of the containers, one after the other (`parallel`: all started at
    once): wall seconds of each, CPU seconds of all, and the seconds of a sync right after them."""
    times = [0.0] * len(container_ids)
    procs = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    for i, cid in enumerate(container_ids):
        images, work = base / f"c{i}" / "images", base / f"c{i}" / "work"
        images.mkdir(parents=True, mode=0o700)
        work.mkdir(parents=True, mode=0o700)
        argv = runc_argv(
            bed,
            "checkpoint",
            "--leave-running",
            "--image-path",
            str(images),
            "--work-path",
            str(work),
            cid,
        )
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append((i, cid, proc, work, start))
        if not parallel:
            _raw_done(procs[-1], times)
    if parallel:
        for p in procs:
            _raw_done(p, times, begin)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    start = time.perf_counter()
    sync_disk()
    return times, cpu, time.perf_counter() - start


def _raw_done(
    p: tuple[int, str, subprocess.Popen[str], Path, float], times: list[float], since: float | None = None
) -> None:
    """Wait for one raw dump; its wall seconds (from `since`, else from its own start) into `times`."""
    i, cid, proc, work, start = p
    try:
        _, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    times[i] = time.perf_counter() - (start if since is None else since)
    if proc.returncode != 0:
        tail = (work / "dump.log").read_text(errors="replace").splitlines()[-5:] if work.exists() else []
        raise RuntimeError(f"runc checkpoint {cid[:13]} failed: {err.strip()} {tail}")


def ahead_mib(log: Path, since: int) -> tuple[int, int]:
    """MiB of page images podshim wrote back during its dumps, from its `log` lines past byte
    `since` (0 when it left that to the kernel); and the log's size now."""
    data = log.read_bytes()[since:]
    mib = 0
    for line in data.splitlines():
        if b"images written back during the dumps" in line:
            with contextlib.suppress(ValueError, KeyError):
                mib = int(json.loads(line)["mib"])
    return mib, since + len(data)


def container_pids(bed: TestBed, container_ids: list[str]) -> list[int]:
    """The init pid of each container (plain `runc state`)."""
    pids = []
    for cid in container_ids:
        out = subprocess.run(runc_argv(bed, "state", cid), capture_output=True, text=True, check=True)
        pids.append(int(json.loads(out.stdout)["pid"]))
    return pids


def dumpee_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the containers' processes have used so far: during a dump,
    CRIU's parasite code runs in them (the vmsplice of their pages), outside CRIU's own CPU."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def prime(bed: TestBed, pod: pods.Pod) -> None:
    """One raw arm, not counted, before a cell's first: every counted arm then follows the removal
    of another arm's output, the first one too (this VM hands freed memory back to its host, and
    writing into memory it took back costs several times the CPU: docs/design/checkpoint-pod.md (The
    freeze window))."""
    base = Path(bed.checkpoint_root) / f"prime-{secrets.token_hex(4)}"
    raw_dumps(bed, list(pod.containers.values()), base)
    remove_tree(base)


def measure_once(
    rt: api_pb2_grpc.RuntimeServiceStub,
    bed: TestBed,
    pod: pods.Pod,
    tag: str,
    podshim_first: bool,
    timeout: float,
    parallel_floor: bool = False,
) -> Sample:
    ids = list(pod.containers.values())
    pids = container_pids(bed, ids)
    root = Path(bed.checkpoint_root)
    result: dict[str, Any] = {}

    def podshim() -> None:
        out = root / f"podshim-{tag}"
        sync_disk()
        log_at = Path(bed.podshim_log).stat().st_size
        before = dumpee_cpu(pids)
        with CpuTimes() as cores:
            wall, m = checkpoint_pod(rt, pod.id, out, timeout)
        result["podshim_dumpee"] = dumpee_cpu(pids) - before
        bounds = freeze_bounds(Path(bed.podshim_log), log_at)
        result["window_cores"] = cores.window(*bounds) if bounds else {}
        result["podshim"] = (wall, m["timings"], ahead_mib(Path(bed.podshim_log), log_at)[0])
        remove_tree(out)

    def raw() -> None:
        base = root / f"raw-{tag}"
        sync_disk()
        before = dumpee_cpu(pids)
        result["raw"] = raw_dumps(bed, ids, base)
        result["raw_dumpee"] = dumpee_cpu(pids) - before
        remove_tree(base)

    def parallel() -> None:
        base = root / f"par-{tag}"
        sync_disk()
        with CpuTimes() as cores:
            start = time.monotonic()
            result["parallel"] = max(raw_dumps(bed, ids, base, parallel=True)[0])
        result["parallel_cores"] = cores.window(start, start + result["parallel"])
        remove_tree(base)

    steps = [podshim, raw] if podshim_first else [raw, podshim]
    if parallel_floor:
        # first: each measured arm then follows the removal of one other arm's output, as without
        # it (between them, it left the second arm behind twice the memory just freed, which this
        # VM hands back to its host: the sequential floor's fourth 1 GiB dump took 1.5-4.7 s)
        steps.insert(0, parallel)
    for step in steps:
        step()
    sync_disk()
    wall, t, ahead = result["podshim"]
    return Sample(
        order="podshim-first" if podshim_first else "raw-first",
        freeze=t["freeze_window"],
        total=t["total"],
        wall=wall,
        dump=t.get("dump", float("nan")),
        archive=t.get("archive", float("nan")),
        raw=result["raw"][0],
        raw_cpu=result["raw"][1],
        raw_flush=result["raw"][2],
        parallel=result.get("parallel", float("nan")),
        ahead_mib=ahead,
        dump_cpu=t.get("dump_cpu", float("nan")),
        dumpee_cpu=result["podshim_dumpee"],
        raw_dumpee_cpu=result["raw_dumpee"],
        window_cores=result["window_cores"],
        parallel_cores=result.get("parallel_cores", {}),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_start = time.monotonic()
    counts, mems = _ints(args.containers), _ints(args.mem)
    cells = [(n, m) for m in mems for n in counts]
    cells += [c for c in _cells(args.cells) if c not in cells]
    if args.only:
        cells = _cells(args.only)
    print("bench/checkpoint: CheckpointPod vs sequential plain runc checkpoint", flush=True)
    print(machine_summary(), flush=True)
    results: dict[tuple[int, int], list[Sample]] = {}
    failures: dict[tuple[int, int], str] = {}
    with bench_bed() as bed:
        rt = runtime_stub(bed.podshim_socket)
        say("warm-up: a 1 x 64 MiB pod, one podshim checkpoint and one raw dump (not counted)")
        pod = start_counter_pod(rt, bed, "ckpt-warmup", {"c0": counter_config("c0", 64)})
        measure_once(rt, bed, pod, "warmup", True, args.timeout)
        remove_pod(rt, pod.id)

        for idx, (n, mem) in enumerate(cells):
            key = (n, mem)
            # the pod itself + one output's page cache at a time + room for the rest of the host
            if meminfo_mib() < n * mem * 2 + 1024:
                failures[key] = f"skipped: only {meminfo_mib()} MiB available"
            elif disk_free_mib(bed.checkpoint_root) < n * mem * 3:
                failures[key] = f"skipped: only {disk_free_mib(bed.checkpoint_root)} MiB free on the disk"
            if key in failures:
                say(f"cell {n} x {mem} MiB {failures[key]}")
                continue
            say(f"cell {n} x {mem} MiB: starting the pod")
            configs = {f"c{i}": counter_config(f"c{i}", mem) for i in range(n)}
            try:
                pod = start_counter_pod(rt, bed, f"ckpt-{n}x{mem}", configs)
            except (grpc.RpcError, TimeoutError) as e:
                failures[key] = f"pod did not start: {e}"
                say(f"cell {n} x {mem} MiB: {failures[key]}")
                continue
            time.sleep(1.0)  # let the fill's writeback and the pod start settle
            samples = []
            try:
                prime(bed, pod)
                # N dumps on fewer cores: the same dumps started at once are a floor of their own
                at_once = args.parallel_floor or n > (os.cpu_count() or 1)
                for r in range(args.repeat):
                    podshim_first = (idx + r) % 2 == 0
                    tag = f"{n}x{mem}-{r}-{secrets.token_hex(2)}"
                    s = measure_once(rt, bed, pod, tag, podshim_first, args.timeout, at_once)
                    samples.append(s)
                    say(
                        f"  {n} x {mem} MiB rep {r + 1} ({s.order}): podshim freeze {s.freeze:.3f}s "
                        f"dump {s.dump:.3f}s (cpu {s.dump_cpu:.3f} + in the containers {s.dumpee_cpu:.3f}) "
                        f"archive {s.archive:.3f}s "
                        f"total {s.total:.3f}s "
                        f"(call {s.wall:.3f}s; written back during the dumps {s.ahead_mib} MiB); "
                        f"raw {' + '.join(f'{x:.3f}' for x in s.raw)} s; "
                        f"(cpu {s.raw_cpu:.3f} + in the containers {s.raw_dumpee_cpu:.3f}, "
                        f"sync {s.raw_flush:.3f}"
                        + (f", all at once {s.parallel:.3f}" if at_once else "")
                        + f"); ratios freeze {s.freeze_ratio:.2f} total {s.total_ratio:.2f} "
                        f"vs floors {s.freeze_vs_floor:.2f} {s.total_vs_durable_floor:.2f}"
                        + (f" vs at once {s.freeze_vs_parallel:.2f}" if at_once else "")
                        + f"; cores in the window: {cpu_line(s.window_cores)}"
                        + (f"; in the raw dumps at once: {cpu_line(s.parallel_cores)}" if at_once else "")
                    )
            except (grpc.RpcError, RuntimeError, subprocess.TimeoutExpired) as e:
                detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                failures[key] = f"failed: {detail}"
                say(f"cell {n} x {mem} MiB {failures[key]}")
            finally:
                remove_pod(rt, pod.id)
            if samples:
                results[key] = samples

    rows: list[list[Any]] = []
    freeze_ratios, total_ratios, freeze_floor_ratios, total_floor_ratios = [], [], [], []
    parallel_ratios = []
    width = 25
    for n, mem in cells:
        samples = results.get((n, mem), [])
        if not samples:
            rows.append([f"{n} x {mem} MiB", *(["n/a"] * (width - 1))])
            continue
        pr = median([s.freeze_vs_parallel for s in samples])
        parallel_ratios.append(pr)
        extra: list[Any] = [
            median([s.parallel for s in samples]),
            pr,
            median([s.idle(s.window_cores) for s in samples]),
            median([s.window_cores.get("steal", float("nan")) for s in samples]),
            median([s.idle(s.parallel_cores) for s in samples]),
        ]
        fr = median([s.freeze_ratio for s in samples])
        tr = median([s.total_ratio for s in samples])
        ff = median([s.freeze_vs_floor for s in samples])
        tf = median([s.total_vs_durable_floor for s in samples])
        freeze_ratios.append(fr)
        total_ratios.append(tr)
        freeze_floor_ratios.append(ff)
        total_floor_ratios.append(tf)
        rows.append(
            [
                f"{n} x {mem} MiB",
                len(samples),
                median([s.freeze for s in samples]),
                median([s.dump for s in samples]),
                median([s.dump_cpu for s in samples]),
                median([s.archive for s in samples]),
                median([s.total for s in samples]),
                median([s.wall for s in samples]),
                median([max(s.raw) for s in samples]),
                median([sum(s.raw) for s in samples]),
                median([s.cpu_floor for s in samples]),
                median([s.freeze_floor for s in samples]),
                median([s.raw_flush for s in samples]),
                median([s.raw_dumpee_cpu for s in samples]),
                median([s.dumpee_cpu for s in samples]),
                int(median([s.ahead_mib for s in samples])),
                fr,
                tr,
                ff,
                tf,
                *extra,
            ]
        )
    print()
    print(f"CheckpointPod vs sequential raw runc checkpoint, seconds (median of {args.repeat} repeats)")
    print(
        table(
            [
                "pod",
                "n",
                "freeze",
                "dump",
                "dump cpu",
                "archive",
                "total",
                "call",
                "raw slowest",
                "raw sum",
                "cpu floor",
                "freeze floor",
                "raw sync",
                "raw in ctrs",
                "in ctrs",
                "ahead MiB",
                "freeze/slowest",
                "total/(sum+0.2)",
                "freeze/floor",
                "total/(sum+sync+0.2)",
                "raw at once",
                "freeze/at once",
                "idle",
                "steal",
                "at once idle",
            ],
            rows,
        )
    )
    print(
        "freeze, dump, archive, total: podshim's manifest timings (dump = all containers in parallel "
        "while frozen;\narchive = CRIU stats + sha256 + fsync + manifest after the thaw); call: "
        "CheckpointPod wall time at the client; dump cpu: CPU seconds of podshim's runc and CRIU "
        "during the dumps.\n"
        f"cpu floor: raw dumps' CPU seconds / {os.cpu_count()} cores; freeze floor: max(raw slowest, "
        "cpu floor); raw sync: flushing the raw dumps to disk (podshim's total includes that flush).\n"
        "raw in ctrs / in ctrs: the containers' own CPU seconds during the raw dumps / podshim's (CRIU's "
        "parasite runs in them; not in the cpu floor).\n"
        "ahead MiB: page images podshim wrote back during its dumps (0: left to the kernel; "
        "docs/design/checkpoint-pod.md (The freeze window));\n"
        "raw at once: the same plain runc dumps started together (the slowest's end; cells with more "
        "containers than cores, or --parallel-floor); idle, steal: core-seconds of podshim's freeze "
        "window\nwith nothing to run (idle + iowait) and taken by the host (/proc/stat); at once idle: "
        "the same in the raw dumps at once."
    )
    for key, why in failures.items():
        print(f"cell {key[0]} x {key[1]} MiB: {why}")
    print()
    print(
        f"worst cell, against the raw dumps: freeze/slowest {worst(freeze_ratios):.3f}, "
        f"total/(sum+0.2) {worst(total_ratios):.3f}"
    )
    print(
        f"targets (every cell): freeze/floor <= {FREEZE_TARGET}, "
        f"total/(sum+sync+0.2) <= {TOTAL_TARGET}; run time {time.monotonic() - run_start:.0f}s"
    )
    figures = {
        "freeze_vs_floor": worst(freeze_floor_ratios),
        "total_vs_durable_floor": worst(total_floor_ratios),
    }
    if any(not math.isnan(r) for r in parallel_ratios):
        figures["freeze_vs_raw_at_once"] = worst(parallel_ratios)
    print(result_line(**figures), flush=True)
    return 1 if failures and not results else 0


if __name__ == "__main__":
    sys.exit(main())
