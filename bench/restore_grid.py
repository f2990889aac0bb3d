"""bench/restore_grid: warm start in constant time? The restore grid (``make bench-restore``).

For each size of ``--grid-mem`` (256,1024,4096 MiB) one counter pod (``--interval-ms 10``) is
checkpointed with CheckpointPod, then every repeat measures, in alternating order, six cells:

* mode **eager**: RestorePod + StartContainer (as a kubelet does);
* mode **lazy**: the same with the RestorePod option ``lazy-pages=true`` (its pages arrive from
  a CRIU lazy-pages daemon through userfaultfd); present only when podshim takes the option:
  the bench tries it once on a small archive first and says why when it does not;
* mode **runc** (the floor): a plain ``runc restore --detach`` of a copy of the same CRIU images
  into a prepared bundle joined to the running source pod's namespaces (bench/restore.py part 2);
* mode **runc-lazy** (the lazy floor): the same after starting a plain ``criu lazy-pages`` daemon
  on the copy (counted), with ``runc restore --lazy-pages``;

each with a **warm** page cache (every file of the archive, or of the copy, read just before) and
**cold** (``sync; echo 3 > /proc/sys/vm/drop_caches`` just before). For each cell:

* *first output*: from the first request (RestorePod, or runc restore) until the restored
  counter's first new ``count=`` line (in the new pod's CRI log; on runc's stdout pipe for runc);
* *fully resident*: until the counter's full pattern check passes: as soon as the first line is
  seen the bench sends the counter SIGUSR1, which makes it read every word of its memory (faulting
  in any page still missing) and print ``verify ok``; the time of that check on the resident
  source (*check ref*, measured before the checkpoint) is shown beside it;
* *first count*: the value the restored counter resumed at (beside it the source's last count
  before the freeze, the line before the longest pause of its log during CheckpointPod: resuming
  means last + 1);
* *restore*: RestorePod + StartContainer (podshim), the ``runc restore`` call (runc).

Plus, per repeat, a RunPodSandbox of an empty pod straight to containerd (*sandbox*: pause + CNI,
what a restore into a new pod pays on top of the runc floor; as in part 4 of bench/restore.py),
and ``--repeat`` cold starts of a 1 GiB (``--cold-mem``) counter with a ``--init-seconds`` (10) s
initialisation: RunPodSandbox + CreateContainer + StartContainer until its first output line
(what a warm start avoids).

Figures are medians over the repeats. The RESULT values (printed by bench/restore.py):

* ``lazy_first_output_4g_s``: lazy, warm cache, first output at 4096 MiB;
* ``lazy_slope_s_per_gib``: least-squares slope of lazy warm first output over the grid's sizes;
* ``eager_overhead_ratio``: eager warm RestorePod + StartContainer / (runc restore + sandbox), the
  worst over the sizes (bench/restore.py prints part 4's figure instead when part 4 ran);
* ``warm_start_ratio_lazy``: lazy warm first output at 1024 MiB / the cold start's first output.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from bench.common import (
    COUNT_RE,
    READY_RE,
    RESTORE_WORK_DIR,
    VERIFY_RE,
    CriLog,
    checkpoint_pod,
    counter_config,
    disk_free_mib,
    median,
    meminfo_mib,
    ratio,
    read_criu_stats,
    remove_pod,
    remove_tree,
    restore_phases,
    runc_argv,
    runtime_stub,
    say,
    start_counter_pod,
    table,
    task_dir,
    worst,
)
from bench.raw_restore import (
    PipeLines,
    RawBundle,
    build_raw_bundle,
    delete_raw,
    fresh_bundle,
    sandbox_alone,
    start_lazy_daemon,
)
from testbed import pods
from testbed.bed import TestBed

MODES = ("eager", "lazy", "runc", "runc-lazy")
CACHES = ("warm", "cold")
LAZY_OPTION = {"lazy-pages": "true"}
INTERVAL_MS = 10  # the grid's counters print every 10 ms: first output resolves to ~10 ms
WAIT_S = 300.0  # the longest wait for one line (a cold 4 GiB check on a busy VM stays far below)
BIG = 4096  # MiB: sizes from here on run `big_repeat` times (bench/restore.py --big-repeat)
TARGETS = {
    "lazy_first_output_4g_s": 0.3,
    "lazy_slope_s_per_gib": 0.03,
    "eager_overhead_ratio": 1.3,
    "warm_start_ratio_lazy": 0.05,
}


# ---------------------------------------------------------------------------- results (pure)


@dataclass
class Sample:
    restore_s: float  # RestorePod + StartContainer, or the runc restore call
    call_s: float  # RestorePod alone (nan for runc)
    first_s: float  # request -> first new count line
    resident_s: float  # request -> `verify ok`
    count: int  # the value the counter resumed at
    criu_restore_s: float  # CRIU's restore_time (stats-restore)
    verify_s: float = math.nan  # RestorePod's archive verification (its `verify` phase in podshim's log)


@dataclass
class Cell:
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def med(self, attr: str) -> float:
        return median([getattr(s, attr) for s in self.samples])

    def counts(self) -> str:
        values = sorted({s.count for s in self.samples})
        if not values:
            return ""
        return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"


@dataclass
class SizeResult:
    mem: int
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    sandbox: list[float] = field(default_factory=list)
    check_ref: list[float] = field(default_factory=list)  # the pattern check on the resident source
    last_count: int = -1  # the source's last count line before the checkpoint
    checkpoint_s: float = math.nan
    skipped: str = ""  # why the size did not run at all

    def cell(self, mode: str, cache: str) -> Cell:
        return self.cells.setdefault((mode, cache), Cell())


@dataclass
class GridResult:
    sizes: list[SizeResult] = field(default_factory=list)
    lazy: str = ""  # "" when the lazy-pages option works, else why the lazy cells are absent
    cold_start: list[float] = field(default_factory=list)
    cold_mem: int = 1024
    init_seconds: int = 10
    repeat: int = 3
    seconds: float = math.nan
    loads: list[str] = field(default_factory=list)  # /proc/loadavg at start and end


def lsq_slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of y over x; NaN points are left out, NaN when fewer than two x differ."""
    pts = [(x, y) for x, y in points if not (math.isnan(x) or math.isnan(y))]
    if len({x for x, _ in pts}) < 2:
        return math.nan
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def overhead_ratio(s: SizeResult, cache: str = "warm") -> float:
    """eager RestorePod + StartContainer / (plain runc restore + a plain RunPodSandbox)."""
    eager, raw = s.cell("eager", cache), s.cell("runc", cache)
    if not eager.samples or not raw.samples or not s.sandbox:
        return math.nan
    return ratio(eager.med("restore_s"), raw.med("restore_s") + median(s.sandbox))


def summarize(g: GridResult) -> dict[str, float]:
    """The RESULT values (see the module's doc); NaN where the grid lacks the cells."""
    lazy_first = {s.mem: s.cell("lazy", "warm").med("first_s") for s in g.sizes if not s.skipped}
    at_4g = lazy_first.get(4096, math.nan)
    at_1g = lazy_first.get(1024, math.nan)
    return {
        "lazy_first_output_4g_s": at_4g,
        "lazy_slope_s_per_gib": lsq_slope([(mem / 1024, v) for mem, v in lazy_first.items()]),
        "eager_overhead_ratio": worst([overhead_ratio(s) for s in g.sizes if not s.skipped]),
        "warm_start_ratio_lazy": ratio(at_1g, median(g.cold_start)),
    }


def grid_rows(g: GridResult) -> list[list[object]]:
    rows: list[list[object]] = []
    for s in g.sizes:
        if s.skipped:
            rows.append([f"{s.mem} MiB", "", "", f"skipped: {s.skipped}", "", "", "", "", "", "", ""])
            continue
        for cache in CACHES:
            for mode in MODES:
                c = s.cell(mode, cache)
                if mode == "lazy" and g.lazy:
                    rows.append([f"{s.mem} MiB", cache, mode, "n/a", "", "", "", "", "", "", ""])
                    continue
                rows.append(
                    [
                        f"{s.mem} MiB",
                        cache,
                        mode,
                        f"{len(c.samples)}" + (f" ({len(c.errors)} failed)" if c.errors else ""),
                        c.med("call_s"),
                        c.med("verify_s"),
                        c.med("restore_s"),
                        c.med("first_s"),
                        c.med("resident_s"),
                        c.med("criu_restore_s"),
                        f"{c.counts()} ({s.last_count})" if c.samples else "",
                    ]
                )
    return rows


GRID_HEADERS = [
    "size",
    "cache",
    "mode",
    "n",
    "RestorePod",
    "verify",
    "restore",
    "first output",
    "fully resident",
    "CRIU",
    "first count (last)",
]


def size_rows(g: GridResult) -> list[list[object]]:
    rows: list[list[object]] = []
    for s in g.sizes:
        if s.skipped:
            continue
        rows.append(
            [
                f"{s.mem} MiB",
                s.checkpoint_s,
                median(s.check_ref),
                median(s.sandbox),
                overhead_ratio(s, "warm"),
                overhead_ratio(s, "cold"),
                ratio(s.cell("lazy", "warm").med("first_s"), s.cell("eager", "warm").med("first_s")),
                ratio(s.cell("lazy", "warm").med("first_s"), s.cell("runc-lazy", "warm").med("first_s")),
            ]
        )
    return rows


SIZE_HEADERS = [
    "size",
    "CheckpointPod",
    "check ref",
    "sandbox",
    "eager ovh warm",
    "eager ovh cold",
    "lazy/eager",
    "lazy/runc-lazy",
]


def report(g: GridResult) -> str:
    """The grid's tables and notes (the RESULT line is printed by the caller)."""
    out = [
        f"Restore grid, seconds (medians of up to {g.repeat} repeats per cell; 'n' = samples), "
        f"{g.seconds:.0f} s in all; load at start / end: {' / '.join(g.loads)}",
        table(GRID_HEADERS, grid_rows(g)),
        "restore = RestorePod + StartContainer (eager, lazy) or the runc restore call (runc; runc-lazy: with"
        "\nthe start of its criu lazy-pages); first output / fully resident = from the first request until"
        "\nthe restored counter's first new count line / until its full pattern check (SIGUSR1, sent at the"
        "\nfirst line) printed 'verify ok'; CRIU = restore_time from stats-restore; first count = the value"
        "\nit resumed at (the source's last count before the freeze); verify = RestorePod's check of the"
        "\narchive's checksums (its 'verify' phase in podshim's log; it overlaps the new sandbox).",
    ]
    if g.lazy:
        out.append(f"lazy cells: n/a: {g.lazy}")
    out += [
        "",
        table(SIZE_HEADERS, size_rows(g)),
        "check ref = the pattern check on the resident source (its CPU cost, inside 'fully resident');"
        "\nsandbox = RunPodSandbox of an empty pod; eager ovh = eager restore / (runc restore + sandbox);"
        "\nlazy/eager, lazy/runc-lazy = first output, warm cache.",
        "",
        f"Cold start: {g.cold_mem} MiB counter with {g.init_seconds} s of initialisation, RunPodSandbox .. "
        f"first output: median {median(g.cold_start):.3f} s of {len(g.cold_start)} "
        f"({', '.join(f'{v:.3f}' for v in g.cold_start)})",
    ]
    for s in g.sizes:
        for (mode, cache), c in s.cells.items():
            for e in c.errors:
                out.append(f"failed: {s.mem} MiB {mode} {cache}: {e}")
    return "\n".join(out)


def targets_line(values: dict[str, float]) -> str:
    """The grid's targets beside the RESULT values."""
    return "targets: " + ", ".join(
        f"{k} <= {t}" + ("" if math.isnan(values.get(k, math.nan)) else f" ({values[k]:.3f})")
        for k, t in TARGETS.items()
    )


# ---------------------------------------------------------------------------- the machine


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def drop_caches() -> None:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``: the next restore reads its images from disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def warm_files(root: Path) -> int:
    """Read every regular file under ``root`` (into the page cache); returns the bytes read."""
    buf = bytearray(1 << 20)
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return total


def container_pid(bed: TestBed, cid: str) -> int:
    """The host pid of a container's init, from runc's state (the bed's runc root)."""
    state = json.loads((Path(bed.runc_root) / cid / "state.json").read_text())
    return int(state["init_process_pid"])


def prepare_cache(cache: str, warm_root: Path) -> None:
    if cache == "cold":
        drop_caches()
    else:
        warm_files(warm_root)
        os.sync()


# ---------------------------------------------------------------------------- podshim's restore


def podshim_cell(
    rt: api_pb2_grpc.RuntimeServiceStub,
    bed: TestBed,
    archive: Path,
    configs: dict[str, cri.ContainerConfig],
    name: str,
    lazy: bool,
    cache: str,
) -> Sample:
    """RestorePod (+ lazy-pages=true) and StartContainer; the first new count line; SIGUSR1 at once
    and the counter's `verify ok`. The restored pod is removed before returning."""
    new = pods.pod_config(name, bed.pod_logs_dir)
    cname = next(iter(configs))
    log = CriLog(Path(new.log_directory) / configs[cname].log_path)
    prepare_cache(cache, archive)
    t0 = time.perf_counter()
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(archive),
            config=new,
            container_configs=list(configs.values()),
            options=LAZY_OPTION if lazy else {},
        ),
        timeout=600,
    )
    try:
        t1 = time.perf_counter()
        for c in resp.restored_containers:
            rt.StartContainer(cri.StartContainerRequest(container_id=c.container_id), timeout=600)
        t2 = time.perf_counter()
        seen, line = log.wait(COUNT_RE, WAIT_S)
        cid = next(c.container_id for c in resp.restored_containers if c.name == cname)
        os.kill(container_pid(bed, cid), signal.SIGUSR1)
        verified, vline = log.wait(VERIFY_RE, WAIT_S)
        if b"verify ok" not in vline:
            raise RuntimeError(
                f"the restored counter's pattern check failed: {vline.decode(errors='replace')}"
            )
        m = COUNT_RE.search(line)
        stats = read_criu_stats(task_dir(bed, cid) / RESTORE_WORK_DIR / "stats-restore", "restore")
        return Sample(
            restore_s=t2 - t0,
            call_s=t1 - t0,
            first_s=seen - t0,
            resident_s=verified - t0,
            count=int(m.group(1)) if m else -1,
            criu_restore_s=stats.get("restore_time", 0) / 1e6 if stats else math.nan,
            verify_s=restore_phases(bed, resp.pod_sandbox_id).get("verify", math.nan),
        )
    finally:
        remove_pod(rt, resp.pod_sandbox_id)


# ---------------------------------------------------------------------------- plain runc restore


def raw_cell(bed: TestBed, rb: RawBundle, index: int, cache: str, lazy: bool = False) -> Sample:
    """A plain ``runc restore --detach`` of the copied images into a fresh bundle (bench/restore.py
    part 2), then SIGUSR1 at the first count line; killed and deleted afterwards. ``lazy``: first a
    plain ``criu lazy-pages`` daemon on the images (counted), then ``runc restore --lazy-pages``
    with the daemon's work dir; the daemon must have ended by itself (every page delivered) once
    the pattern check passed."""
    raw_id, bundle, work = fresh_bundle(bed, rb, index, "benchgrid")
    argv = runc_argv(
        bed, "restore", "--detach", *(["--lazy-pages"] if lazy else []), "--image-path", str(rb.images),
        "--work-path", str(work), "--bundle", str(bundle), raw_id,
    )  # fmt: skip
    daemon: subprocess.Popen[bytes] | None = None
    r_fd, w_fd = os.pipe()
    reader = PipeLines(r_fd)
    rb.runs.append(raw_id)
    stderr = open(work / "runc-stderr.log", "wb")  # runc's and the restored stderr
    try:
        prepare_cache(cache, rb.images)
        t0 = time.perf_counter()
        if lazy:
            daemon = start_lazy_daemon(rb.images, work)
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=w_fd, stderr=stderr, timeout=600)
        t1 = time.perf_counter()
        os.close(w_fd)
        w_fd = -1
        if proc.returncode != 0:
            tail = (work / "restore.log").read_text(errors="replace").splitlines()[-6:]
            err = (work / "runc-stderr.log").read_text(errors="replace").strip()[-400:]
            raise RuntimeError(f"runc restore failed ({proc.returncode}): {err} | {' | '.join(tail)}")
        reader.got_first.wait(WAIT_S)
        if reader.first is None:
            raise RuntimeError(f"the runc-restored counter printed no count line within {WAIT_S:.0f}s")
        os.kill(container_pid(bed, raw_id), signal.SIGUSR1)
        reader.got_verify.wait(WAIT_S)
        if reader.verify is None or b"verify ok" not in reader.verify[1]:
            got = reader.verify[1].decode(errors="replace") if reader.verify else "nothing"
            raise RuntimeError(f"the runc-restored counter's pattern check: {got}")
        if daemon is not None:
            try:
                code = daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                raise RuntimeError(f"criu lazy-pages did not end by itself after the check (exit {code})")
        m = COUNT_RE.search(reader.first[1])
        stats = read_criu_stats(work / "stats-restore", "restore")
        return Sample(
            restore_s=t1 - t0,
            call_s=math.nan,
            first_s=reader.first[0] - t0,
            resident_s=reader.verify[0] - t0,
            count=int(m.group(1)) if m else -1,
            criu_restore_s=stats.get("restore_time", 0) / 1e6 if stats else math.nan,
        )
    finally:
        if w_fd >= 0:
            os.close(w_fd)
        stderr.close()
        delete_raw(bed, raw_id)
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        os.close(r_fd)
        reader.thread.join(timeout=5)
        remove_tree(bundle)
        remove_tree(work)


# ---------------------------------------------------------------------------- the grid


def describe(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


def probe_lazy(
    rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, archive: Path, configs: dict[str, cri.ContainerConfig]
) -> str:
    """Try a lazy restore of a small archive: "" when it works, else why not (the answer's code and
    message). Never a figure: the lazy cells only run when this passed."""
    try:
        podshim_cell(rt, bed, archive, configs, "grid-lazy-probe", lazy=True, cache="warm")
    except (grpc.RpcError, RuntimeError, TimeoutError, OSError) as e:
        return f"RestorePod with lazy-pages=true: {describe(e)}"
    return ""


def source_check(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, pod: pods.Pod, cname: str) -> float:
    """Seconds of the counter's pattern check on the resident source (SIGUSR1 until `verify ok`)."""
    log = CriLog(pod.log_path(cname), from_end=True)
    t0 = time.perf_counter()
    os.kill(container_pid(bed, pod.containers[cname]), signal.SIGUSR1)
    seen, line = log.wait(VERIFY_RE, WAIT_S)
    if b"verify ok" not in line:
        raise RuntimeError(f"the source counter's pattern check failed: {line.decode(errors='replace')}")
    return seen - t0


def count_before_freeze(lines: Sequence[bytes]) -> int:
    """The count of the line before the longest pause between two count lines (the freeze of a
    counter printing every few ms); the last count when there is no pause; -1 without counts."""
    ticks = [(int(m.group(1)), float(m.group(2))) for line in lines if (m := COUNT_RE.search(line))]
    if not ticks:
        return -1
    if len(ticks) == 1:
        return ticks[0][0]
    gaps = [(ticks[i + 1][1] - ticks[i][1], i) for i in range(len(ticks) - 1)]
    return ticks[max(gaps)[1]][0]


def cold_start(
    rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, mem: int, init_seconds: int, index: int
) -> float:
    """RunPodSandbox + CreateContainer + StartContainer of a counter with an `init_seconds`
    initialisation, until its first output line (`ready`)."""
    cc = counter_config("app", mem, INTERVAL_MS, init_seconds)
    config = pods.pod_config(f"grid-cold-{index}", bed.pod_logs_dir)
    log = CriLog(Path(config.log_directory) / cc.log_path)
    os.sync()
    t0 = time.perf_counter()
    pod_id = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    try:
        cid = rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config), timeout=300
        ).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=300)
        seen, _ = log.wait(READY_RE, init_seconds * 4 + WAIT_S)
        return seen - t0
    finally:
        remove_pod(rt, pod_id)


def run_size(
    rt: api_pb2_grpc.RuntimeServiceStub,
    bed: TestBed,
    mem: int,
    repeat: int,
    lazy: bool,
) -> SizeResult:
    res = SizeResult(mem)
    direct = runtime_stub(bed.containerd_socket)  # the sandbox reference: straight to containerd
    need = mem * 3 + 1024
    if meminfo_mib() < need:
        res.skipped = f"{meminfo_mib()} MiB of memory available, {need} needed"
        say(f"grid {mem} MiB skipped: {res.skipped}")
        return res
    if disk_free_mib(bed.checkpoint_root) < mem * 2 + 2048:
        res.skipped = f"{disk_free_mib(bed.checkpoint_root)} MiB of disk free, {mem * 2 + 2048} needed"
        say(f"grid {mem} MiB skipped: {res.skipped}")
        return res
    say(f"grid {mem} MiB: starting the source counter (load {load()})")
    configs = {"counter": counter_config("counter", mem, INTERVAL_MS)}
    source = start_counter_pod(rt, bed, f"grid-src-{mem}", configs)
    archive = Path(bed.checkpoint_root) / f"grid-{mem}"
    rb: RawBundle | None = None
    try:
        pods.wait_count(source.log_path("counter"), 3, timeout=60)
        for _ in range(2):
            res.check_ref.append(source_check(rt, bed, source, "counter"))
        src_log = source.log_path("counter")
        offset = src_log.stat().st_size
        res.checkpoint_s, _m = checkpoint_pod(rt, source.id, archive)
        with open(src_log, "rb") as f:
            f.seek(offset)
            res.last_count = count_before_freeze(f.read().split(b"\n"))
        say(f"  CheckpointPod {res.checkpoint_s:.3f}s (last count {res.last_count}); pattern check on the "
            f"source {median(res.check_ref):.3f}s")  # fmt: skip
        rb = build_raw_bundle(bed, archive, source.containers["counter"], "counter")
        # Not counted: the first restore of a size after the checkpoint was 2-4x slower inside
        # CRIU here (4 GiB: restore_time 17-21 s, then 5-8 s), whichever mode came first.
        w = raw_cell(bed, rb, 99, "warm")
        say(f"  warm-up (plain runc restore, not counted): first output {w.first_s:.3f}s")
        order = [(mode, cache) for cache in CACHES for mode in MODES if lazy or mode != "lazy"]
        for r in range(repeat):
            for i, (mode, cache) in enumerate(order if r % 2 == 0 else order[::-1]):
                try:
                    if mode.startswith("runc"):
                        s = raw_cell(bed, rb, r * 10 + i, cache, lazy=mode == "runc-lazy")
                    else:
                        s = podshim_cell(
                            rt, bed, archive, configs, f"grid-{mem}-{mode}-{cache}-{r}", mode == "lazy", cache
                        )
                except (grpc.RpcError, RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
                    res.cell(mode, cache).errors.append(describe(e))
                    say(f"  rep {r + 1} {mode:5} {cache}: FAILED {describe(e)}")
                    continue
                res.cell(mode, cache).samples.append(s)
                say(
                    f"  rep {r + 1} {mode:5} {cache}: restore {s.restore_s:.3f}s, first output "
                    f"{s.first_s:.3f}s (count={s.count}), fully resident {s.resident_s:.3f}s, "
                    f"CRIU {s.criu_restore_s:.3f}s"
                )
            res.sandbox.append(sandbox_alone(direct, bed, f"grid-sandbox-{mem}-{r}"))
    finally:
        remove_pod(rt, source.id)
        if rb is not None:
            remove_tree(rb.base)
        remove_tree(archive)
    return res


def run(
    rt: api_pb2_grpc.RuntimeServiceStub,
    bed: TestBed,
    sizes: Sequence[int],
    repeat: int,
    cold_mem: int,
    init_seconds: int,
    big_repeat: int | None = None,
) -> GridResult:
    """The grid: `repeat` repeats per cell, `big_repeat` (default `repeat`) at 4096 MiB and more."""
    g = GridResult(cold_mem=cold_mem, init_seconds=init_seconds, repeat=repeat, loads=[load()])
    big_repeat = repeat if big_repeat is None else big_repeat
    start = time.perf_counter()
    say("grid: is lazy restore there? a lazy RestorePod of a 16 MiB counter")
    configs = {"counter": counter_config("counter", 16, INTERVAL_MS)}
    probe_src = start_counter_pod(rt, bed, "grid-probe-src", configs)
    archive = Path(bed.checkpoint_root) / "grid-probe"
    try:
        pods.wait_count(probe_src.log_path("counter"), 3, timeout=60)
        checkpoint_pod(rt, probe_src.id, archive)
        g.lazy = probe_lazy(rt, bed, archive, configs)
    finally:
        remove_pod(rt, probe_src.id)
        remove_tree(archive)
    say("  lazy restore works: lazy cells included" if not g.lazy else f"  no lazy cells: {g.lazy}")
    for mem in sizes:
        g.sizes.append(run_size(rt, bed, mem, big_repeat if mem >= BIG else repeat, not g.lazy))
    say(f"grid: cold start of a {cold_mem} MiB counter with {init_seconds}s of initialisation")
    for i in range(repeat):
        try:
            g.cold_start.append(cold_start(rt, bed, cold_mem, init_seconds, i))
        except (grpc.RpcError, TimeoutError) as e:
            say(f"  cold start {i + 1}: FAILED {describe(e)}")
            continue
        say(f"  cold start {i + 1}: first output after {g.cold_start[-1]:.3f}s")
    g.seconds = time.perf_counter() - start
    g.loads.append(load())
    return g
