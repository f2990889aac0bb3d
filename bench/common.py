"""Shared helpers of the benchmarks: statistics, tables, the bed, counter pods, CRI logs, runc, and
what a restore leaves (the container's task dir, podshim's logged restore phases)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim import contract
from testbed import pods
from testbed.bed import NAMESPACE, TestBed
from testbed.versions import CRIU, REAL_RUNC

READY_RE = re.compile(rb"\bready mem_mib=\d+")
COUNT_RE = re.compile(rb"\bcount=(\d+) ts=(\d+\.\d+)")
VERIFY_RE = re.compile(rb"\bverify (ok|FAILED)\b[^\n]*")
MIB = 1 << 20
RESTORE_WORK_DIR = contract.WORK_DIR  # podshim-runc's CRIU work dir inside the container bundle


# ---------------------------------------------------------------------------- output


def say(msg: str) -> None:
    """A progress line (prefixed with '#', so tables and the RESULT line stand out)."""
    print(f"# {time.strftime('%H:%M:%S')} {msg}", flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned. The run's results
    file keeps it too, as rows of header -> value (`write_results`)."""
    RUN.tables.append({"headers": [str(h) for h in headers], "rows": [_row(headers, r) for r in rows]})
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        pairs = enumerate(zip(r, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def result_line(**values: float) -> str:
    """The RESULT line; run as `python -m bench.<name>`, it also writes bench/results/<name>.json."""
    parts = []
    for k, v in values.items():
        parts.append(f"{k}=" + ("n/a" if math.isnan(v) else f"{v:.3f}"))
    RUN.result.update(values)
    name = running_bench()
    if name:
        write_results(name)
    return "RESULT " + " ".join(parts)


# ---------------------------------------------------------------------------- results as data

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCHEMA = 1
LOADED_PER_CPU = 0.5  # a run whose 1-minute load passed this per core at its start is marked loaded
LOADED_END_PER_CPU = 1.5  # ... or this at its end (which holds the bench's own work too)

# Each bench's targets, RESULT key -> (op, value): reported beside the figures, never enforced.
TARGETS: dict[str, dict[str, tuple[str, float]]] = {
    "proxy": {
        "p50_added_vs_gofloor": ("<=", 1.1),
        "p99_added_ms": ("<=", 1.0),
        "throughput_vs_gofloor": (">=", 0.95),
    },
    "checkpoint": {"freeze_vs_floor": ("<=", 1.3), "total_vs_durable_floor": ("<=", 1.1)},
    "restore": {
        "warm_start_ratio": ("<=", 0.15),
        "lazy_first_output_4g_s": ("<=", 0.3),
        "lazy_slope_s_per_gib": ("<=", 0.03),
        "eager_overhead_ratio": ("<=", 1.3),
        "warm_start_ratio_lazy": ("<=", 0.05),
    },
    "load": {"p99_during_checkpoint_ms": ("<=", 50.0)},
    "node": {"pod_start_ratio": ("<=", 1.05), "exec_ratio": ("<=", 1.05), "wrapper_overhead_ms": ("<=", 2.0)},
    "distribution": {"push_vs_curl": ("<=", 1.1), "pull_vs_curl": ("<=", 1.15)},
    "migrate": {
        "migrate_downtime_4g_s": ("<=", 1.0),
        "downtime_slope_s_per_gib": ("<=", 0.05),
        "total_vs_tls_floor": ("<=", 1.3),
        "total_vs_memory_floor": ("<=", 1.3),
    },
    "kubelet": {
        "podshim_cpu_vs_containerd": ("<=", 0.10),
        "podshim_rss_mib": ("<=", 100.0),
        "pod_start_ratio": ("<=", 1.05),
    },
    "cluster": {"api_checkpoint_overhead_s": ("<=", 0.3), "api_restore_overhead_s": ("<=", 0.3)},
    "peers": {
        "pause_vs_best_peer": ("<=", 1.0),
        "checkpoint_vs_best_peer": ("<=", 1.0),
        "restore_vs_best_peer": ("<=", 1.0),
        "lazy_restore_vs_best_peer": ("<=", 0.5),
        "tar_restore_vs_containerd": ("<=", 1.0),
        "cli_startup_s": ("<=", 0.08),
    },
    "front_kill": {"plain_span_max_s": ("<=", 0.5)},  # seconds of UNAVAILABLE per kill
}


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


class Run:
    """What one bench run has to write: the tables it printed, named rows it recorded, its RESULT
    values, the command line, and the load when it started (this module's import)."""

    def __init__(self) -> None:
        self.load_start = loadavg()
        self.argv = list(sys.argv[1:])
        self.tables: list[dict[str, Any]] = []
        self.series: dict[str, list[dict[str, Any]]] = {}
        self.result: dict[str, float] = {}


RUN = Run()


def record(name: str, rows: Sequence[dict[str, Any]]) -> None:
    """Rows of a named series for the results file (what a plot needs beyond the tables)."""
    RUN.series[name] = [{k: _json_value(v) for k, v in r.items()} for r in rows]


def finish() -> None:
    """Write the results file of a bench that prints no RESULT line (its tables alone)."""
    name = running_bench()
    if name:
        write_results(name)


def running_bench() -> str | None:
    """`name` when `python -m bench.<name>` runs; None otherwise (tests, imports)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    mod = getattr(spec, "name", "") or ""
    return mod.removeprefix("bench.") if mod.startswith("bench.") else None


def _json_value(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) or math.isinf(v) else v
    if v is None or isinstance(v, bool | int | str):
        return v
    return str(v)


def _row(headers: Sequence[str], row: Sequence[Any]) -> dict[str, Any]:
    return {str(h): _json_value(v) for h, v in zip(headers, row, strict=False)}


def machine_facts() -> dict[str, Any]:
    """The machine a run measured: cores, kernel, memory, cgroup mode."""
    cgroup = "v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "v1"
    return {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "mem_total_mib": meminfo_mib("MemTotal"),
        "mem_available_mib": meminfo_mib(),
        "cgroup": cgroup,
    }


def git_commit() -> dict[str, Any]:
    """HEAD's commit and whether shim/ api/ testbed/ bench/ had uncommitted changes."""
    repo = Path(__file__).resolve().parent.parent
    head = _first_line(["git", "-C", str(repo), "rev-parse", "HEAD"])
    dirty = _first_line(
        ["git", "-C", str(repo), "status", "--porcelain", "--", "shim", "api", "testbed", "bench"]
    )
    return {"commit": head, "dirty": dirty != "unknown"}


def results_doc(
    bench: str,
    run: Run,
    *,
    now: datetime,
    machine: dict[str, Any],
    code: dict[str, Any],
    load_end: list[float],
) -> dict[str, Any]:
    """The results file's content: one run of one bench."""
    targets = TARGETS.get(bench, {})
    figures = []
    for k, v in run.result.items():
        fig: dict[str, Any] = {"figure": k, "value": _json_value(float(v))}
        if k in targets:
            fig["op"], fig["target"] = targets[k]
        figures.append(fig)
    return {
        "schema": SCHEMA,
        "bench": bench,
        "date": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": code.get("commit"),
        "dirty": bool(code.get("dirty")),
        "argv": run.argv,
        "machine": machine,
        "load": {"start": run.load_start, "end": load_end},
        "result": {k: _json_value(float(v)) for k, v in run.result.items()},
        "targets": {k: {"op": op, "value": t} for k, (op, t) in targets.items()},
        "figures": figures,
        "tables": run.tables,
        "series": run.series,
    }


def write_results(bench: str, run: Run | None = None, out_dir: Path | None = None) -> Path:
    """Write (overwrite) `<out_dir>/<bench>.json` with this run's results; returns its path."""
    doc = results_doc(
        bench,
        run or RUN,
        now=datetime.now(UTC),
        machine=machine_facts(),
        code=git_commit(),
        load_end=loadavg(),
    )
    out = (out_dir or RESULTS_DIR) / f"{bench}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    tmp.replace(out)
    return out


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def worst(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else math.nan


# ---------------------------------------------------------------------------- the machine


def meminfo_mib(key: str = "MemAvailable") -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024
    return 0


def disk_free_mib(path: str | os.PathLike[str]) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // MIB


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return next((line.strip() for line in out.splitlines() if line.strip()), "unknown")


def machine_summary() -> str:
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return (
        f"host: {os.cpu_count()} cpus, {meminfo_mib('MemTotal')} MiB RAM "
        f"({meminfo_mib()} MiB available), load {load}, kernel {platform.release()}; "
        f"runc {_first_line([str(REAL_RUNC), '--version']).removeprefix('runc version ')}, "
        f"criu {_first_line([str(CRIU), '--version']).removeprefix('Version: ')}\n{code_summary()}"
    )


def code_summary() -> str:
    """Which podshim was measured: HEAD, and whether shim/ had uncommitted changes then."""
    repo = Path(__file__).resolve().parent.parent
    head = _first_line(["git", "-C", str(repo), "log", "-1", "--format=%h %s"])[:72]
    dirty = _first_line(["git", "-C", str(repo), "status", "--porcelain", "--", "shim", "api", "testbed"])
    return f"code: HEAD {head}" + (
        " (+ uncommitted changes under shim/api/testbed)" if dirty != "unknown" else ""
    )


class CpuTimes:
    """What the machine's cores did in a window: /proc/stat's CPU line (all cores) sampled every
    `interval` seconds by a thread while in the `with` block; `window(t0, t1)` gives the core-seconds
    of each state between the samples around two CLOCK_MONOTONIC instants. Idle and iowait are
    cores with nothing to run (iowait: while a task that last ran there waits for the disk),
    steal is time the host gave the vCPU to someone else (docs/design/checkpoint-pod.md (The freeze
    window))."""

    FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.samples: list[tuple[float, list[int]]] = []
        self._tick = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-times", daemon=True)

    @staticmethod
    def read() -> list[int]:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.read()))
            if self._stop.wait(self.interval):
                self.samples.append((time.monotonic(), self.read()))
                return

    def __enter__(self) -> CpuTimes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Core-seconds per state from the last sample at or before `t0` to the first at or after
        `t1` (`span`: those samples' distance, seconds); {} without samples around the window."""
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after:
            return {}
        (a_t, a), (b_t, b) = before[-1], after[0]
        out = {k: (b[i] - a[i]) / self._tick for i, k in enumerate(self.FIELDS)}
        out["span"] = b_t - a_t
        return out


def cpu_line(w: dict[str, float]) -> str:
    """`CpuTimes.window` as "busy X idle Y iowait Z steal W of N core-s"."""
    if not w:
        return "n/a"
    busy = w["user"] + w["nice"] + w["system"] + w["irq"] + w["softirq"]
    total = busy + w["idle"] + w["iowait"] + w["steal"]
    return (
        f"busy {busy:.2f} idle {w['idle']:.2f} iowait {w['iowait']:.2f} steal {w['steal']:.2f} "
        f"of {total:.2f} core-s"
    )


def podshim_events(log: Path, since: int = 0) -> dict[str, Any]:
    """podshim's own log lines of one checkpoint, those past byte `since` of its `log`, on the wall
    clock: "pod frozen" (`frozen_log`, its `cut` seconds), each "container dumped", the MiB
    "images written back during the dumps", "pod thawed" (`thawed`, its freeze `window`)."""
    ev: dict[str, Any] = {"dumped": {}}
    for line in log.read_bytes()[since:].splitlines():
        try:
            rec = json.loads(line)
            t = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError):
            continue
        e = rec.get("event")
        if e == "pod frozen":
            ev["frozen_log"] = t
            ev["cut"] = float(rec.get("cut_seconds", 0.0))
        elif e == "container dumped":
            ev["dumped"][rec.get("container", "")] = t
        elif e == "images written back during the dumps":
            ev["ahead_mib"] = rec.get("mib", 0)
        elif e == "pod thawed":
            ev["thawed"] = t
            ev["window"] = rec.get("freeze_window", 0.0)
    return ev


def freeze_bounds(log: Path, since: int) -> tuple[float, float] | None:
    """The freeze window of the CheckpointPod logged in podshim's `log` past byte `since`, on
    CLOCK_MONOTONIC: ("pod frozen" minus its cut_seconds, "pod thawed"); None if not logged."""
    ev = podshim_events(log, since)
    if "frozen_log" not in ev or "thawed" not in ev:
        return None
    offset = time.time() - time.monotonic()
    return ev["frozen_log"] - ev["cut"] - offset, ev["thawed"] - offset


def sync_disk() -> None:
    """Flush dirty pages so one measurement's writeback does not land in the next one."""
    os.sync()


def remove_tree(path: str | os.PathLike[str]) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- bed and pods


@contextlib.contextmanager
def bench_bed(**options: Any) -> Iterator[TestBed]:
    """A private containerd + podshim for one benchmark run (removed at the end); `options` go to
    TestBed (e.g. containerd="2.2")."""
    say("starting the test bed (private containerd + podshim)")
    with TestBed(**options) as bed:
        say(f"bed at {bed.base_dir}: podshim {bed.podshim_socket}, containerd {bed.containerd_socket}")
        yield bed
        say("stopping the test bed")


def runtime_stub(socket: str | Path) -> api_pb2_grpc.RuntimeServiceStub:
    return pods.stubs(socket)[0]


def counter_config(
    name: str, mem_mib: int, interval_ms: int = 100, init_seconds: int = 0
) -> cri.ContainerConfig:
    args = ["--mem-mib", str(mem_mib), "--interval-ms", str(interval_ms)]
    if init_seconds:
        args += ["--init-seconds", str(init_seconds)]
    return pods.container_config(name, args=args)


class CriLog:
    """Follows a CRI log file (``<RFC3339> stdout F <text>`` lines) from a byte offset."""

    def __init__(self, path: Path, from_end: bool = False) -> None:
        self.path = path
        self.offset = 0
        self._buf = b""
        if from_end:
            with contextlib.suppress(FileNotFoundError):
                self.offset = path.stat().st_size

    def _new_lines(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return lines

    def wait(
        self, pattern: re.Pattern[bytes], timeout: float, interval: float = 0.005
    ) -> tuple[float, bytes]:
        """Poll until a new line matches; returns (perf_counter when seen, the line)."""
        deadline = time.perf_counter() + timeout
        while True:
            for line in self._new_lines():
                if pattern.search(line):
                    return time.perf_counter(), line
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no line matching {pattern.pattern!r} in {self.path} within {timeout}s")
            time.sleep(interval)


def start_counter_pod(
    rt: api_pb2_grpc.RuntimeServiceStub,
    bed: TestBed,
    name: str,
    configs: dict[str, cri.ContainerConfig],
    timeout: float = 300.0,
) -> pods.Pod:
    """Run a pod of counter containers (as the kubelet would) and wait until each is ready."""
    pod = pods.run_pod(rt, name, bed.pod_logs_dir, configs)
    for cname in configs:
        CriLog(pod.log_path(cname)).wait(READY_RE, timeout)
    return pod


def remove_pod(rt: api_pb2_grpc.RuntimeServiceStub, pod_id: str) -> None:
    try:
        pods.remove_pod(rt, pod_id)
    except grpc.RpcError as e:
        say(f"warning: removing pod {pod_id[:13]} failed: {e.code()}: {e.details()}")


def checkpoint_pod(
    rt: api_pb2_grpc.RuntimeServiceStub, pod_id: str, out: Path, timeout: float = 900.0
) -> tuple[float, dict[str, Any]]:
    """CheckpointPod into a fresh ``out`` (0700); returns (wall seconds of the call, manifest)."""
    out.mkdir(mode=0o700, parents=True)
    req = pods.checkpoint_request(rt, pod_id, out)  # its running containers, listed before the clock
    start = time.perf_counter()
    rt.CheckpointPod(req, timeout=timeout)
    wall = time.perf_counter() - start
    return wall, json.loads((out / "manifest.json").read_text())


def runc_argv(bed: TestBed, *args: str) -> list[str]:
    """Plain runc on the bed's runc root (the containers containerd runs), with CRIU 4.1."""
    return [str(REAL_RUNC), "--root", str(bed.runc_root), "--criu", str(CRIU), *args]


def read_criu_stats(path: Path, kind: str) -> dict[str, int]:
    """CRIU's ``stats-dump``/``stats-restore`` entry (``kind`` = dump or restore), via pycriu."""
    try:
        import pycriu

        with open(path, "rb") as f:
            img = pycriu.images.load(f)
        return {k: int(v) for k, v in img["entries"][0].get(kind, {}).items()}
    except Exception:  # missing file, no pycriu, unknown format: the figure is just absent
        return {}


def task_dir(bed: TestBed, cid: str) -> Path:
    return Path(bed.containerd_state) / "io.containerd.runtime.v2.task" / NAMESPACE / cid


def restore_phases(bed: TestBed, pod_id: str) -> dict[str, float]:
    """The per-phase seconds podshim logged for the RestorePod that created `pod_id` (its
    "restore done" line, `phases`), {} when it logged none."""
    try:
        lines = bed.podshim_log.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        if '"restore done"' in line and pod_id in line:
            try:
                phases = json.loads(line).get("phases") or {}
            except ValueError:
                return {}
            return {k: float(v) for k, v in phases.items() if isinstance(v, int | float)}
    return {}
