"""bench/freeze_profile: where CheckpointPod's freeze window goes.

For a pod of N counter containers x M MiB (default 4 x 64 and 4 x 1024), one CheckpointPod through
a second podshim of the bed whose runc and CRIU are thin wrappers that record, in wall-clock time,
when each runc starts and ends (with its CPU seconds and those of its CRIU) and when each CRIU is
executed. Each container's ``dump.log`` (CRIU's timestamps are relative to its start) is then
placed on the same clock, so the timeline below is relative to the freeze:

* ``runc``: runc started (podshim's spawn) and ended; ``criu-ver``: runc's CRIU version check
  (a CRIU of its own); ``criu``: the dump's CRIU started;
* CRIU's phases from dump.log: ``kerndat`` (CRIU's kernel probe, up to "Dumping processes"),
  ``seize``, ``netlock`` (iptables-restore in the pod's netns: "Lock network" to the next line),
  ``tasks`` (parasite, memory pages, files), ``mnt…`` (mount namespaces, pstree, IPC, UTS),
  ``netns+ct`` (the external netns: its record and the conntrack tables, read through netlink),
  ``unlock`` ("Unlock network" to the next line), ``end`` (CRIU's last line);
* what podshim does between freeze and the first runc, and between the last runc and the thaw,
  and each container's rootfs diff (from the manifest).

The same containers are then dumped alone, one after the other, by plain runc (the bench's raw
floor) through the same wrappers, so each phase can be compared with its cost when nothing else
runs. ``--no-podshim`` / ``--no-raw`` leave one side out; ``--keep DIR`` keeps every dump.log.

Through the window (and through the raw dumps), the page cache as the kernel's writeback sees it:
/proc/vmstat's dirty and writeback pages against its two thresholds every 20 ms, the
pages dirtied and written back; the writeback podshim started during the dumps (its log;
docs/design/checkpoint-pod.md (The freeze window)); CRIU's memwrite per dump; and, with tracefs at
/sys/kernel/tracing, every pause balance_dirty_pages imposed on a writer (trace event
writeback:balance_dirty_pages, in a private trace instance), summed per CRIU. The window's
CLOCK_MONOTONIC bounds are printed for ``perf record -k mono`` profiles (``perf report --time``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    bench_bed,
    checkpoint_pod,
    counter_config,
    finish,
    machine_summary,
    podshim_events,
    read_criu_stats,
    remove_pod,
    remove_tree,
    runtime_stub,
    start_counter_pod,
    sync_disk,
    table,
)
from testbed.bed import TestBed
from testbed.versions import CRIU, REAL_RUNC

# dump.log markers -> phase boundaries (the first line matching each, in order)
MARKERS = (
    ("kerndat", re.compile(r"Dumping processes \(pid")),  # end of CRIU's start-up and kernel probe
    ("seize", re.compile(r"SEIZE \d+ .*success|Seized task")),
    ("netlock", re.compile(r"Lock network")),
    ("tasks", re.compile(r"Dumping task \(pid|Dumping core \(pid|dump_one_task|Obtaining task stat")),
    ("mnt", re.compile(r"Dumping mountpoints|Dumping mnt ns|mnt: Dumping")),
    ("netns", re.compile(r"Dump NET namespace info")),  # links, then conntrack (nf_ct) tables
    ("netns_end", re.compile(r"Namespaces dump complete")),
    ("unlock", re.compile(r"Unlock network")),
    ("finished", re.compile(r"Dumping finished successfully")),
)
TS = re.compile(r"^\((\d+)\.(\d+)\) ")


def _ts(line: str) -> float | None:
    m = TS.match(line)
    return int(m.group(1)) + int(m.group(2)) / 1e6 if m else None


def parse_dump_log(path: Path) -> dict[str, float]:
    """Seconds since CRIU's start of each marker's first line; `<name>_next`: the line after it
    (how long that step took); `last`: the last timestamped line."""
    out: dict[str, float] = {}
    lines = path.read_text(errors="replace").splitlines()
    pending: str | None = None
    last = 0.0
    for line in lines:
        t = _ts(line)
        if t is None:
            continue
        last = t
        if pending is not None and not re.search(r"Running network-(un)?lock scripts|^\(\S+\) \tRPC$", line):
            out[f"{pending}_next"] = t  # the first line after the lock's scripts: the lock's end
            pending = None
        for name, pat in MARKERS:
            if name not in out and pat.search(line):
                out[name] = t
                if name in ("netlock", "unlock"):
                    pending = name
                break
    out["last"] = last
    return out


RUNC_WRAPPER = """#!/bin/bash
# bench/freeze_profile: records when this runc ran (wall clock) and its CPU seconds
s=$(date +%s.%N)
{real} "$@"
rc=$?
e=$(date +%s.%N)
times > {log}.$$  # in this shell: a pipe's subshell would have no children
t=$(tail -1 {log}.$$)
rm -f {log}.$$
id="${{@: -1}}"
echo "runc $s $e $rc $id $t" >> {log}
exit $rc
"""
CRIU_WRAPPER = """#!/bin/bash
# bench/freeze_profile: records when CRIU was executed and for which runc
s=$(date +%s.%N)
id=$(tr '\\0' ' ' < /proc/$PPID/cmdline | awk '{{print $NF}}')
echo "criu $s $$ $id $*" >> {log}
exec {real} "$@"
"""


def _times_cpu(text: str) -> float:
    """bash `times`' children line ("0m0.010s 0m0.020s") -> seconds."""
    total = 0.0
    for m in re.finditer(r"(\d+)m([\d.]+)s", text):
        total += int(m.group(1)) * 60 + float(m.group(2))
    return total


@dataclass
class Run:
    """One container's dump on the wall clock."""

    name: str
    cid: str
    runc_start: float = 0.0
    runc_end: float = 0.0
    cpu: float = 0.0
    criu_starts: list[float] = field(default_factory=list)
    criu_pids: list[int] = field(default_factory=list)
    log: dict[str, float] = field(default_factory=dict)
    diff: float = float("nan")

    @property
    def criu_start(self) -> float:
        return self.criu_starts[-1] if self.criu_starts else float("nan")

    def at(self, marker: str) -> float:
        v = self.log.get(marker)
        return self.criu_start + v if v is not None else float("nan")


def read_wrapper_log(log: Path, ids: dict[str, str]) -> dict[str, Run]:
    runs = {cid: Run(name, cid) for name, cid in ids.items()}
    for line in log.read_text().splitlines():
        f = line.split()
        if f[0] == "runc" and f[4] in runs:
            r = runs[f[4]]
            r.runc_start, r.runc_end, r.cpu = float(f[1]), float(f[2]), _times_cpu(" ".join(f[5:]))
        elif f[0] == "criu" and f[3] in runs:
            runs[f[3]].criu_starts.append(float(f[1]))
            runs[f[3]].criu_pids.append(int(f[2]))
    return runs


def phase_row(r: Run, zero: float) -> list[Any]:
    """Start/end of the run on the freeze clock, and the length of each phase."""
    lg = r.log

    def d(a: str, b: str) -> float:
        return lg[b] - lg[a] if a in lg and b in lg else float("nan")

    unlock_end = lg.get("unlock_next", lg.get("last", float("nan")))
    return [
        r.name,
        r.runc_start - zero,
        r.criu_start - zero,
        r.at("kerndat") - zero,
        r.at("finished") - zero if "finished" in lg else r.at("last") - zero,
        r.runc_end - zero,
        r.criu_start - r.runc_start,
        lg.get("kerndat", float("nan")),
        d("kerndat", "seize"),
        d("netlock", "netlock_next"),
        d("tasks", "mnt") if "mnt" in lg else d("tasks", "unlock"),
        d("mnt", "netns"),
        d("netns", "netns_end"),
        unlock_end - lg["unlock"] if "unlock" in lg else float("nan"),
        r.runc_end - (r.criu_start + lg.get("last", 0.0)),
        r.cpu,
        r.diff,
    ]


HEADERS = [
    "container",
    "runc@",
    "criu@",
    "probed@",
    "criu end@",
    "runc end@",
    "runc→criu",
    "kerndat",
    "seize",
    "netlock",
    "tasks",
    "mnt…",
    "netns+ct",
    "unlock",
    "criu→exit",
    "cpu s",
    "rootfs diff",
]


def wrappers(base: Path) -> tuple[Path, Path, Path]:
    log = base / "profile-wrappers.log"
    runc, criu = base / "runc-profile", base / "criu-profile"
    runc.write_text(RUNC_WRAPPER.format(real=REAL_RUNC, log=log))
    criu.write_text(CRIU_WRAPPER.format(real=CRIU, log=log))
    runc.chmod(0o755)
    criu.chmod(0o755)
    log.write_text("")
    return log, runc, criu


VMSTAT_KEYS = (
    "nr_dirty",
    "nr_writeback",
    "nr_dirty_threshold",
    "nr_dirty_background_threshold",
    "nr_dirtied",
    "nr_written",
)
PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def read_vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, _, v = line.partition(" ")
        if k in VMSTAT_KEYS:
            out[k] = int(v)
    return out


class DirtySampler:
    """/proc/vmstat's dirty-page counters every 20 ms while a dump runs (page-cache pressure):
    nr_dirty + nr_writeback against the kernel's thresholds, which balance_dirty_pages compares
    them with (it starts throttling writers half-way between the two thresholds)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), read_vmstat()))
            self._stop.wait(0.02)

    def __enter__(self) -> DirtySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, zero: float, end: float) -> str:
        inside = [(t - zero, v) for t, v in self.samples if zero <= t <= end]
        if not inside:
            return "page cache: no sample inside the window"

        def mib(v: dict[str, int], k: str) -> int:
            return round(v.get(k, 0) * PAGE_MIB)

        def dirty(v: dict[str, int]) -> int:
            return mib(v, "nr_dirty") + mib(v, "nr_writeback")

        peak_t, peak = max(inside, key=lambda x: dirty(x[1]))
        first, last = inside[0][1], inside[-1][1]
        bg, hard = mib(peak, "nr_dirty_background_threshold"), mib(peak, "nr_dirty_threshold")
        picks = inside[:: max(1, len(inside) // 10)]
        return (
            f"page cache inside the window (vmstat, MiB): dirty+writeback at the freeze {dirty(first)}, "
            f"peak {dirty(peak)} at {peak_t:.2f}s (thresholds: background {bg}, hard {hard}, throttling "
            f"from ~{(bg + hard) // 2}); dirtied {mib(last, 'nr_dirtied') - mib(first, 'nr_dirtied')}, "
            f"written back {mib(last, 'nr_written') - mib(first, 'nr_written')} during the window; "
            "(t, dirty, writeback): "
            + " ".join(f"({t:.1f},{mib(v, 'nr_dirty')},{mib(v, 'nr_writeback')})" for t, v in picks)
        )


TRACEFS = Path("/sys/kernel/tracing")
BDP_RE = re.compile(
    r"^\s*(?P<comm>.+?)-(?P<pid>\d+)\s+\[\d+\].*?\s(?P<ts>\d+\.\d+): balance_dirty_pages: .*?"
    r"\bpaused=(?P<paused>\d+) pause=(?P<pause>-?\d+)"
)


class ThrottleTrace:
    """The kernel's dirty-page throttling of writers (tracefs event writeback:balance_dirty_pages,
    one per pause a writing task takes), in a private trace instance on the monotonic clock.
    Absent (no tracefs mounted at /sys/kernel/tracing, or no such event): `available` is False."""

    def __init__(self) -> None:
        self.dir = TRACEFS / "instances" / f"podshim-freeze-profile-{os.getpid()}"
        self.available = (TRACEFS / "events/writeback/balance_dirty_pages").exists()
        self.events: list[tuple[float, str, int, int]] = []  # (monotonic s, comm, pid, pause ms)

    def __enter__(self) -> ThrottleTrace:
        if self.available:
            self.dir.mkdir()
            (self.dir / "trace_clock").write_text("mono")
            (self.dir / "buffer_size_kb").write_text("8192")
            (self.dir / "events/writeback/balance_dirty_pages/enable").write_text("1")
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.available:
            return
        (self.dir / "events/writeback/balance_dirty_pages/enable").write_text("0")
        for line in (self.dir / "trace").read_text(errors="replace").splitlines():
            m = BDP_RE.match(line)
            if m and int(m.group("pause")) > 0:
                ts, pid, pause = float(m.group("ts")), int(m.group("pid")), int(m.group("pause"))
                self.events.append((ts, m.group("comm"), pid, pause))
        self.dir.rmdir()

    def summary(self, zero_mono: float, end_mono: float, pids: dict[int, str]) -> str:
        if not self.available:
            return "dirty throttling: no tracefs at /sys/kernel/tracing (mount -t tracefs nodev it to see it)"
        inside = [e for e in self.events if zero_mono <= e[0] <= end_mono]
        per: dict[str, list[int]] = {}
        for _, comm, pid, pause in inside:
            per.setdefault(pids.get(pid, f"{comm}-{pid}"), []).append(pause)
        if not per:
            return "dirty throttling inside the window: none (no balance_dirty_pages pause)"
        first = min(e[0] for e in inside) - zero_mono
        return (
            f"dirty throttling inside the window (balance_dirty_pages pauses, first at {first:.2f}s): "
            + "; ".join(f"{who} {len(p)} pauses {sum(p) / 1e3:.3f}s" for who, p in sorted(per.items()))
        )


def _sysctl(name: str) -> str:
    try:
        return Path(f"/proc/sys/vm/{name}").read_text().strip()
    except OSError:
        return "?"


def profile_podshim(bed: TestBed, pod: Any, tag: str, keep: Path | None) -> str:
    base = Path(bed.base_dir)
    wlog, runc, criu = wrappers(base)
    work = base / f"profile-{tag}"
    work.mkdir()
    with bed.extra_podshim(work, runtime={"binary": str(runc), "criu": str(criu)}) as (sock, plog):
        rt = runtime_stub(sock)
        out = Path(bed.checkpoint_root) / f"profile-{tag}"
        sync_disk()
        since = plog.stat().st_size if plog.exists() else 0
        mono_offset = time.time() - time.monotonic()  # wall = monotonic + offset
        with DirtySampler() as dirty, ThrottleTrace() as throttle:
            wall, m = checkpoint_pod(rt, pod.id, out, 900)
        time.sleep(0.2)  # the log lines are written
        ev = podshim_events(plog, since)
    runs = read_wrapper_log(wlog, pod.containers)
    for r in runs.values():
        r.log = parse_dump_log(out / "containers" / r.name / "dump.log")
        r.diff = m["criu_stats"].get(r.name, {}).get("rootfs_diff_seconds", float("nan"))
        if keep:
            (keep / tag).mkdir(parents=True, exist_ok=True)
            shutil.copy(out / "containers" / r.name / "dump.log", keep / tag / f"{r.name}.dump.log")
    stats = {n: m["criu_stats"].get(n, {}) for n in pod.containers}
    remove_tree(out)
    # the freeze instant: "pod frozen" is logged right after the cut is in place
    zero = ev["frozen_log"] - ev.get("cut", 0.0)
    order = sorted(runs.values(), key=lambda r: r.runc_start)
    rows = [phase_row(r, zero) for r in order]
    first_runc = min(r.runc_start for r in runs.values()) - zero
    last_runc = max(r.runc_end for r in runs.values()) - zero
    thaw = ev.get("thawed", float("nan")) - zero
    lines = [
        f"podshim, {tag}: freeze window {m['timings']['freeze_window']:.3f}s (call {wall:.3f}s); "
        f"seconds on the freeze clock (0 = pod frozen; @ = instant, others = durations)",
        table(HEADERS, rows),
        f"podshim between freeze and first runc: {first_runc:.3f}s; last runc end -> thaw "
        f"logged: {thaw - last_runc:.3f}s; window {ev.get('window', float('nan')):.3f}s; CLOCK_MONOTONIC "
        f"{zero - mono_offset:.3f} to {zero + thaw - mono_offset:.3f} (perf -k mono)",
        dirty.summary(zero, zero + thaw),
        f"writeback started by podshim during the dumps: {ev['ahead_mib']} MiB"
        if "ahead_mib" in ev
        else "writeback started by podshim during the dumps: none (the kernel's own only)",
        f"archive phase after the thaw {m['timings'].get('archive', float('nan')):.3f}s, total "
        f"{m['timings'].get('total', float('nan')):.3f}s",
        throttle.summary(zero - mono_offset, zero + thaw - mono_offset, criu_pids(runs)),
        "CRIU stats (ms): " + stats_line(stats),
    ]
    return "\n".join(lines)


def stats_line(stats: dict[str, dict[str, Any]]) -> str:
    return "; ".join(
        f"{n}: freezing {s.get('freezing_time', 0) / 1e3:.0f} frozen {s.get('frozen_time', 0) / 1e3:.0f} "
        f"memdump {s.get('memdump_time', 0) / 1e3:.0f} memwrite {s.get('memwrite_time', 0) / 1e3:.0f}"
        for n, s in stats.items()
    )


def criu_pids(runs: dict[str, Run]) -> dict[int, str]:
    """pid -> "<container> criu" of every CRIU the wrappers saw (the dump's and runc's probe)."""
    return {pid: f"{r.name} criu" for r in runs.values() for pid in r.criu_pids}


def profile_raw(bed: TestBed, pod: Any, tag: str, keep: Path | None) -> str:
    base = Path(bed.base_dir)
    wlog, runc, criu = wrappers(base)
    out = Path(bed.checkpoint_root) / f"profile-raw-{tag}"
    sync_disk()
    start = time.time()
    mono_offset = start - time.monotonic()
    with DirtySampler() as dirty, ThrottleTrace() as throttle:
        for name, cid in pod.containers.items():
            images, work = out / name / "images", out / name / "work"
            images.mkdir(parents=True, mode=0o700)
            work.mkdir(parents=True, mode=0o700)
            argv = [str(runc), "--root", str(bed.runc_root), "--criu", str(criu), "checkpoint"]
            argv += ["--leave-running", "--image-path", str(images), "--work-path", str(work), cid]
            res = subprocess.run(argv, capture_output=True, text=True, timeout=900)
            if res.returncode != 0:
                raise RuntimeError(f"raw dump of {name} failed: {res.stderr.strip()}")
    end = time.time()
    runs = read_wrapper_log(wlog, pod.containers)
    stats = {n: read_criu_stats(out / n / "work" / "stats-dump", "dump") for n in pod.containers}
    for r in runs.values():
        r.log = parse_dump_log(out / r.name / "work" / "dump.log")
        if keep:
            (keep / tag).mkdir(parents=True, exist_ok=True)
            shutil.copy(out / r.name / "work" / "dump.log", keep / tag / f"{r.name}.raw.dump.log")
    remove_tree(out)
    rows = [phase_row(r, r.runc_start) for r in sorted(runs.values(), key=lambda r: r.runc_start)]
    return "\n".join(
        [
            f"raw runc, {tag}, one after the other (each on its own clock: 0 = its runc started)",
            table(HEADERS, rows),
            "all raw dumps: " + dirty.summary(start, end),
            throttle.summary(start - mono_offset, end - mono_offset, criu_pids(runs)),
            "CRIU stats (ms): " + stats_line(stats),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.freeze_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--containers", type=int, default=4)
    p.add_argument("--mem", default="64,1024", help="MiB per container, comma-separated")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--no-podshim", action="store_true")
    p.add_argument("--no-raw", action="store_true")
    p.add_argument("--keep", type=Path, default=None, help="copy every dump.log here")
    args = p.parse_args(argv)
    print("bench/freeze_profile: the freeze window of CheckpointPod, phase by phase", flush=True)
    print(machine_summary(), flush=True)
    print(f"uptime: {os.getloadavg()}", flush=True)
    with bench_bed() as bed:
        rt = runtime_stub(bed.podshim_socket)
        for mem in [int(x) for x in args.mem.split(",") if x]:
            configs = {f"c{i}": counter_config(f"c{i}", mem) for i in range(args.containers)}
            pod = start_counter_pod(rt, bed, f"prof-{args.containers}x{mem}", configs)
            time.sleep(1.0)
            try:
                for r in range(args.repeat):
                    tag = f"{args.containers}x{mem}-{r}"
                    if not args.no_podshim:
                        print(profile_podshim(bed, pod, tag, args.keep), flush=True)
                        print(flush=True)
                    if not args.no_raw:
                        print(profile_raw(bed, pod, tag, args.keep), flush=True)
                        print(flush=True)
            finally:
                remove_pod(rt, pod.id)
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
