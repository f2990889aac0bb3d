"""bench/peers: podshim beside what a user would pick instead, Podman and containerd's own CRI checkpoint.

One bed on containerd 2.2 (`TestBed(containerd="2.2", restore_via_create=True)`), its podshim with
``container_checkpoint = "always"`` (its own CheckpointContainer, not containerd's), and a Podman
(Debian's 4.3) with a private ``--root``/``--runroot``/``--tmpdir`` in the bed, the bed's runc as
``--runtime`` and the bed's CRIU first on its PATH (Podman and runc run the ``criu`` PATH names).
Podman runs the same counter image, loaded from the bed's image tarball into its private store.
Every workload is the project's counter (`counter_config`), printing a count and a timestamp
every ``INTERVAL_MS`` ms, with ``--sizes`` MiB resident (default 4, 1024 and 4096; a size the
machine's free memory cannot hold four times over is skipped).

Per size, one counter pod through podshim and one Podman container are the sources; each repeat
(``--repeat``, default 3) runs every peer's operations on them, the order of the peers rotated
by one each repeat, a ``sync`` between peers:

* podshim: CheckpointPod + RestorePod (eager; and lazy, ``lazy-pages=true``, when a probe
  restore shows the bed takes it) of the same archive; CheckpointContainer (podshim's own) + its
  tar restored through CreateContainer into a new pod;
* Podman: ``container checkpoint --leave-running --export T --compress none`` + ``container
  restore --import T`` (after removing the source: the restored container is the next source);
  and in place: ``container checkpoint --leave-running`` + (the container killed)
  ``container restore``;
* containerd: CRI CheckpointContainer sent straight to containerd's socket + its restore through
  CreateContainer with the tar as the image (``enable_experimental_restore_via_create``).

Per operation: the pause (the largest gap between the source's printed timestamps around the
checkpoint call, ``largest_gap``), the checkpoint's wall time, the restore's wall time from its
first request until the restored counter's first new count line, and the archive's size. Each
client's start-up is measured apart (``podman --version``, ``crictl version`` at containerd,
``podshim pods -q`` with its warm helper serving and, apart, its first call, which starts the
helper; ``STARTUP_RUNS`` each; the helpers are started in a directory of the bed's and stopped at
the end): the CLIs' fixed cost is not part of the operations, which call gRPC in-process for
podshim and containerd and run ``podman`` once per operation. Medians over repeats. Ends with
``RESULT pause_vs_best_peer=… checkpoint_vs_best_peer=… restore_vs_best_peer=…
lazy_restore_vs_best_peer=… tar_restore_vs_containerd=… cli_startup_s=… cli_first_call_s=…``
(``summarize``: the worst of the ``RESULT_SIZES_MIB`` sizes of podshim's CheckpointPod/RestorePod
over the best peer's same operation; the tar restore is podshim's CheckpointContainer tar through
CreateContainer over containerd's; cli_startup_s is ``podshim pods`` warm, cli_first_call_s its
first call).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from bench import restore_grid
from bench.common import (
    COUNT_RE,
    READY_RE,
    CriLog,
    bench_bed,
    checkpoint_pod,
    counter_config,
    machine_summary,
    median,
    meminfo_mib,
    ratio,
    record,
    remove_pod,
    remove_tree,
    result_line,
    runtime_stub,
    say,
    start_counter_pod,
    sync_disk,
    table,
    worst,
)
from bench.migrate import entries
from shim.cli import warm
from testbed import pods
from testbed.bed import COUNTER_IMAGE, VENV_BIN, TestBed
from testbed.tools import ToolMissing, go_tool

INTERVAL_MS = 10  # the counters print every 10 ms: a pause resolves to ~10 ms
WAIT_S = 300.0  # the longest wait for one line or one call
STARTUP_RUNS = 5
RESULT_SIZES_MIB = (1024, 4096)  # the sizes the RESULT ratios hold podshim to
CLI_WARM = "podshim pods (warm helper)"
CLI_FIRST = "podshim pods (first call)"
PEERS = ("podshim", "podman", "containerd")

# the operations, by peer; a checkpoint op and the restore of its archive share a row
POD = "podshim CheckpointPod + RestorePod"
POD_LAZY = "podshim RestorePod lazy"
CTR = "podshim CheckpointContainer + CreateContainer"
PODMAN_EXPORT = "podman checkpoint --export + restore --import"
PODMAN_IN_PLACE = "podman checkpoint + restore in place"
CONTAINERD = "containerd CheckpointContainer + CreateContainer"
OPS = {
    "podshim": (POD, POD_LAZY, CTR),
    "podman": (PODMAN_EXPORT, PODMAN_IN_PLACE),
    "containerd": (CONTAINERD,),
}
PEER_OPS = (PODMAN_EXPORT, PODMAN_IN_PLACE, CONTAINERD)  # what podshim's figures are held against


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4,1024,4096", help="MiB resident per counter (default 4,1024,4096)")
    p.add_argument("--repeat", type=int, default=3, help="repeats, the peers' order rotated each (3)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- the pure parts


def rotation(peers: Sequence[str], r: int) -> list[str]:
    """The peers' order in repeat `r`: rotated left by `r`, so each goes first in turn."""
    k = r % len(peers) if peers else 0
    return [*peers[k:], *peers[:k]]


def largest_gap(stamps: Sequence[float], t0: float, t1: float) -> float:
    """The pause a checkpoint between wall-clock `t0` and `t1` caused: the largest gap between two
    consecutive printed timestamps, from the last one at or before `t0` to the first one at or
    after `t1`; NaN without a stamp on both sides."""
    s = sorted(stamps)
    before = [x for x in s if x <= t0]
    after = [x for x in s if x >= t1]
    if not before or not after:
        return math.nan
    window = [x for x in s if before[-1] <= x <= after[0]]
    return max(b - a for a, b in zip(window, window[1:], strict=False))


def best_peer(med: dict[str, dict[str, float]], metric: str) -> float:
    """The smallest median of `metric` among the peers' operations (NaN if none measured it)."""
    vals = [med[op][metric] for op in PEER_OPS if op in med and not math.isnan(med[op][metric])]
    return min(vals) if vals else math.nan


def summarize(
    medians: dict[int, dict[str, dict[str, float]]], cli_startup_s: float, cli_first_call_s: float
) -> dict[str, float]:
    """The RESULT figures from the medians per size and operation ({"pause", "checkpoint",
    "restore", ...}): podshim over the best peer's same operation, the worst of the sizes in
    RESULT_SIZES_MIB (a small one's fixed costs are in its table, not the verdict)."""

    def over(op: str, metric: str, against: Callable[[dict[str, dict[str, float]]], float]) -> float:
        cells = [
            ratio(m[op][metric], against(m))
            for mem, m in medians.items()
            if op in m and mem in RESULT_SIZES_MIB
        ]
        return worst(cells)

    def containerd_restore(m: dict[str, dict[str, float]]) -> float:
        return m[CONTAINERD]["restore"] if CONTAINERD in m else math.nan

    return {
        "pause_vs_best_peer": over(POD, "pause", lambda m: best_peer(m, "pause")),
        "checkpoint_vs_best_peer": over(POD, "checkpoint", lambda m: best_peer(m, "checkpoint")),
        "restore_vs_best_peer": over(POD, "restore", lambda m: best_peer(m, "restore")),
        "lazy_restore_vs_best_peer": over(POD_LAZY, "restore", lambda m: best_peer(m, "restore")),
        "tar_restore_vs_containerd": over(CTR, "restore", containerd_restore),
        "cli_startup_s": cli_startup_s,
        "cli_first_call_s": cli_first_call_s,
    }


# ---------------------------------------------------------------------------- measurements


@dataclass
class Sample:
    pause: float = math.nan  # the source's largest gap around the checkpoint, seconds
    checkpoint: float = math.nan  # the checkpoint call's wall time
    restore: float = math.nan  # the restore's first request until the first new count line
    archive_mib: float = math.nan
    order: str = ""


@dataclass
class Results:
    samples: dict[int, dict[str, list[Sample]]] = field(default_factory=dict)
    errors: dict[tuple[int, str], str] = field(default_factory=dict)
    lazy: str = ""  # "" when the bed takes lazy-pages=true, else why not
    startup: dict[str, list[float]] = field(default_factory=dict)

    def add(self, mem: int, op: str, s: Sample) -> None:
        self.samples.setdefault(mem, {}).setdefault(op, []).append(s)

    def medians(self) -> dict[int, dict[str, dict[str, float]]]:
        out: dict[int, dict[str, dict[str, float]]] = {}
        for mem, ops in self.samples.items():
            out[mem] = {
                op: {k: median([getattr(s, k) for s in ss if not math.isnan(getattr(s, k))]) for k in METRICS}
                for op, ss in ops.items()
            }
        return out


METRICS = ("pause", "checkpoint", "restore", "archive_mib")


def size_mib(path: Path) -> float:
    """A file's or a directory tree's bytes, in MiB; NaN when there is neither."""
    if not path.exists():
        return math.nan
    if path.is_file():
        return path.stat().st_size / (1 << 20)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / (1 << 20)


def wait_stamp_after(log: Path, t1: float, timeout: float = WAIT_S) -> None:
    """Until the counter printed a timestamp at or after wall-clock `t1` (the end of a pause)."""
    pods.wait_for(
        lambda: any(ts >= t1 for _, ts in entries(log)), timeout, 0.01, f"a count after {t1} in {log}"
    )


def pause_of(log: Path, t0: float, t1: float) -> float:
    wait_stamp_after(log, t1)
    return largest_gap([ts for _, ts in entries(log)], t0, t1)


def first_count_after(log: Path, t0: float, timeout: float = WAIT_S) -> float:
    """perf_counter when the log first shows a count line printed at or after wall-clock `t0` (a
    restored container may write to its source's log file, whose older lines are older than t0)."""
    deadline = time.perf_counter() + timeout
    while True:
        if any(ts >= t0 for _, ts in entries(log)):
            return time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no count line after {t0} in {log} within {timeout}s")
        time.sleep(0.005)


def timed_checkpoint(log: Path, call: Callable[[], Any]) -> tuple[float, float, Any]:
    """(pause, wall seconds, what `call` returned) of one checkpoint of the counter logging to `log`."""
    t0, p0 = time.time(), time.perf_counter()
    out = call()
    wall, t1 = time.perf_counter() - p0, time.time()
    return pause_of(log, t0, t1), wall, out


def startup(argv: list[str], runs: int = STARTUP_RUNS, env: dict[str, str] | None = None) -> list[float]:
    """Wall seconds of `runs` runs of a client's no-op (`env` added to the environment)."""
    times = []
    environ = {**os.environ, **(env or {})}
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, timeout=60, env=environ)
        times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------- podshim and containerd


def tar_restore(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, tar: Path, name: str, mem: int) -> float:
    """RunPodSandbox + CreateContainer with the checkpoint tar as the image + StartContainer on
    `rt` (podshim's or containerd's socket), until the restored counter's first count line; the
    pod is removed afterwards."""
    cc = counter_config("counter", mem, INTERVAL_MS)
    cc.image.image = str(tar)
    config = pods.pod_config(name, bed.pod_logs_dir)
    log = Path(config.log_directory) / cc.log_path
    sync_disk()
    t0 = time.perf_counter()
    pod_id = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=WAIT_S).pod_sandbox_id
    try:
        cid = rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config),
            timeout=WAIT_S,
        ).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=WAIT_S)
        seen, _ = CriLog(log).wait(COUNT_RE, WAIT_S)
        return seen - t0
    finally:
        remove_pod(rt, pod_id)


def container_checkpoint(rt: api_pb2_grpc.RuntimeServiceStub, cid: str, tar: Path) -> None:
    rt.CheckpointContainer(
        cri.CheckpointContainerRequest(container_id=cid, location=str(tar)), timeout=WAIT_S
    )


def podshim_ops(
    rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, pod: pods.Pod, mem: int, tag: str, lazy: bool
) -> dict[str, Sample]:
    configs = {"counter": counter_config("counter", mem, INTERVAL_MS)}
    log = pod.log_path("counter")
    root = Path(bed.checkpoint_root)
    out: dict[str, Sample] = {}
    archive = root / f"pod-{tag}"
    try:
        pause, wall, _ = timed_checkpoint(log, lambda: checkpoint_pod(rt, pod.id, archive, WAIT_S))
        s = Sample(pause=pause, checkpoint=wall, archive_mib=size_mib(archive))
        s.restore = restore_grid.podshim_cell(rt, bed, archive, configs, f"pe-{tag}", False, "warm").first_s
        out[POD] = s
        if lazy:
            cell = restore_grid.podshim_cell(rt, bed, archive, configs, f"pl-{tag}", True, "warm")
            out[POD_LAZY] = Sample(restore=cell.first_s)
    finally:
        remove_tree(archive)
    tar = root / f"ctr-{tag}.tar"
    try:
        cid = pod.containers["counter"]
        pause, wall, _ = timed_checkpoint(log, lambda: container_checkpoint(rt, cid, tar))
        s = Sample(pause=pause, checkpoint=wall, archive_mib=size_mib(tar))
        s.restore = tar_restore(rt, bed, tar, f"pc-{tag}", mem)
        out[CTR] = s
    finally:
        tar.unlink(missing_ok=True)
    return out


def containerd_ops(bed: TestBed, pod: pods.Pod, mem: int, tag: str) -> dict[str, Sample]:
    """containerd's own CheckpointContainer and restore through CreateContainer, on its socket."""
    direct = runtime_stub(bed.containerd_socket)
    tar = Path(bed.checkpoint_root) / f"cd-{tag}.tar"
    try:
        cid = pod.containers["counter"]
        pause, wall, _ = timed_checkpoint(
            pod.log_path("counter"), lambda: container_checkpoint(direct, cid, tar)
        )
        s = Sample(pause=pause, checkpoint=wall, archive_mib=size_mib(tar))
        s.restore = tar_restore(direct, bed, tar, f"cd-{tag}", mem)
        return {CONTAINERD: s}
    finally:
        tar.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- Podman


class Podman:
    """Podman with a private store and state under `base`, the bed's runc and CRIU."""

    def __init__(self, bed: TestBed, base: Path) -> None:
        self.base = base
        self.bed = bed
        for d in ("root", "runroot", "tmp"):
            (base / d).mkdir(parents=True, exist_ok=True)
        conf, storage = base / "containers.conf", base / "storage.conf"
        conf.write_text('[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n')
        storage.write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{base}/root"\nrunroot = "{base}/runroot"\n'
        )
        self.env = dict(os.environ)
        # podman, runc and go-criu run the `criu` PATH names: the bed's first
        self.env["PATH"] = f"{bed.criu.parent}:{self.env.get('PATH', '')}"
        self.env["CONTAINERS_CONF"] = str(conf)  # neither the host's containers.conf nor its storage
        self.env["CONTAINERS_STORAGE_CONF"] = str(storage)
        # podman's default rlimits are above what root may set without CAP_SYS_RESOURCE (this
        # machine's case), and podman itself runs with RLIMIT_NPROC at most 32768 here: runc's init
        # cannot set more than its parent has
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
        self.ulimits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]

    def argv(self, *args: str) -> list[str]:
        b = self.base
        return [
            "podman",
            "--root",
            str(b / "root"),
            "--runroot",
            str(b / "runroot"),
            "--tmpdir",
            str(b / "tmp"),
            "--runtime",
            str(self.bed.real_runc),
            "--storage-driver",
            "overlay",
            "--cgroup-manager",
            "cgroupfs",
            "--events-backend",
            "file",
            *args,
        ]

    def __call__(self, *args: str, timeout: float = WAIT_S) -> str:
        res = subprocess.run(self.argv(*args), capture_output=True, text=True, env=self.env, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args[:3])} failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout

    def load_counter(self) -> None:
        """The bed's counter image (its OCI tarball) into the private store, under its name."""
        listing = json.loads((self.bed.image_cache / "images.json").read_text())
        tar = next(self.bed.image_cache / e["file"] for e in listing if e["name"] == COUNTER_IMAGE)
        self("load", "-i", str(tar))
        if COUNTER_IMAGE not in self("images", "--format", "{{.Repository}}:{{.Tag}}"):
            raise RuntimeError(f"podman load of {tar} did not name {COUNTER_IMAGE}")

    def log(self, name: str) -> Path:
        """The container's k8s-file log (CRI's line format): podman's default path, in its
        userdata dir, which a restore keeps (a path given to `run` a restore from --import drops)."""
        return Path(self("inspect", "--format", "{{.HostConfig.LogConfig.Path}}", name).strip())

    def run_counter(self, name: str, mem: int) -> None:
        args = counter_config("c", mem, INTERVAL_MS).args
        self(
            "run",
            "-d",
            "--name",
            name,
            "--network",
            "none",
            "--log-driver",
            "k8s-file",
            # in the bed's cgroup subtree, which the bed removes when it stops
            "--cgroup-parent",
            f"{self.bed.cgroup_root}/podman",
            *self.ulimits,
            COUNTER_IMAGE,
            *args,
        )
        CriLog(self.log(name)).wait(READY_RE, WAIT_S)

    def running(self, name: str) -> bool:
        with contextlib.suppress(RuntimeError):
            return self("inspect", "--format", "{{.State.Running}}", name).strip() == "true"
        return False

    def remove_all(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self("rm", "-af", "-t", "0")
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self("system", "reset", "--force")
        # what the store left mounted below the base dir
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for m in sorted((m for m in mounts if m.startswith(str(self.base) + "/")), reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        remove_tree(self.base)


def podman_ops(pm: Podman, name: str, mem: int, tag: str) -> dict[str, Sample]:
    """Export + import (the source removed in between: the restored container is the source
    afterwards), then in place (checkpoint left running, the container killed, restored)."""
    out: dict[str, Sample] = {}
    log = pm.log(name)
    tar = Path(pm.bed.checkpoint_root) / f"podman-{tag}.tar"
    try:
        pause, wall, _ = timed_checkpoint(
            log,
            lambda: pm(
                "container", "checkpoint", "--leave-running", "--export", str(tar), "--compress", "none", name
            ),
        )
        s = Sample(pause=pause, checkpoint=wall, archive_mib=size_mib(tar))
        pm("rm", "-f", "-t", "0", name)
        sync_disk()
        t0, p0 = time.time(), time.perf_counter()
        pm("container", "restore", "--import", str(tar))
        s.restore = first_count_after(log, t0) - p0
        out[PODMAN_EXPORT] = s
    finally:
        tar.unlink(missing_ok=True)
    log = pm.log(name)
    static = Path(pm("inspect", "--format", "{{.StaticDir}}", name).strip())
    pause, wall, _ = timed_checkpoint(log, lambda: pm("container", "checkpoint", "--leave-running", name))
    s = Sample(pause=pause, checkpoint=wall, archive_mib=size_mib(static / "checkpoint"))
    pm("kill", name)
    pm("wait", name)
    sync_disk()
    t0, p0 = time.time(), time.perf_counter()
    pm("container", "restore", name)
    s.restore = first_count_after(log, t0) - p0
    out[PODMAN_IN_PLACE] = s
    return out


# ---------------------------------------------------------------------------- the run


def describe(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


def measure_startup(pm: Podman, bed: TestBed, res: Results) -> None:
    res.startup["podman --version"] = startup(pm.argv("--version"))
    try:
        crictl = go_tool("crictl")
        endpoint = f"unix://{bed.containerd_socket}"
        res.startup["crictl version (containerd)"] = startup([str(crictl), "-r", endpoint, "version"])
    except ToolMissing as e:
        say(f"crictl start-up not measured: {e}")
    podshim = [str(VENV_BIN / "podshim"), "-r", f"unix://{bed.podshim_socket}", "pods", "-q"]
    helpers = Path(bed.base_dir) / "cli-warm"
    helpers.mkdir(mode=0o700, exist_ok=True)
    try:
        first = []
        for i in range(STARTUP_RUNS):  # each in a directory no helper serves yet
            where = helpers / f"first-{i}"
            where.mkdir(mode=0o700)
            first += startup(podshim, 1, {warm.DIR_ENV: str(where)})
            _wait_helper(where)  # its start-up not beside the next call, and its pid file there to stop it
            warm.stop_helpers(str(where))
        res.startup[CLI_FIRST] = first
        env = {warm.DIR_ENV: str(helpers)}
        startup(podshim, 1, env)  # starts the helper
        _wait_helper(helpers)
        res.startup[CLI_WARM] = startup(podshim, STARTUP_RUNS, env)
    finally:
        for where in [helpers, *helpers.glob("first-*")]:
            warm.stop_helpers(str(where))


def _wait_helper(where: Path) -> None:
    """Until the CLI's warm helper in `where` serves (its pid file written once it does)."""
    pods.wait_for(lambda: any(where.glob("*.sock.pid")), 30, what=f"the CLI's warm helper in {where}")


def run_size(
    rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, pm: Podman, mem: int, repeat: int, res: Results
) -> None:
    cri_pod = start_counter_pod(
        rt, bed, f"peers-{mem}", {"counter": counter_config("counter", mem, INTERVAL_MS)}, WAIT_S
    )
    name = f"peers-{mem}-{secrets.token_hex(2)}"
    try:
        pm.run_counter(name, mem)
        for r in range(repeat):
            order = rotation(PEERS, r)
            for peer in order:
                tag = f"{mem}-{r}-{secrets.token_hex(2)}"
                sync_disk()
                try:
                    if peer == "podshim":
                        got = podshim_ops(rt, bed, cri_pod, mem, tag, not res.lazy)
                    elif peer == "podman":
                        if not pm.running(name):  # an earlier repeat's failure left no source
                            pm("rm", "-f", "-t", "0", name)
                            pm.run_counter(name, mem)
                        got = podman_ops(pm, name, mem, tag)
                    else:
                        got = containerd_ops(bed, cri_pod, mem, tag)
                except (grpc.RpcError, RuntimeError, TimeoutError, subprocess.SubprocessError, OSError) as e:
                    res.errors[(mem, peer)] = describe(e)
                    say(f"  {mem} MiB rep {r + 1} {peer} failed: {describe(e)}")
                    continue
                for op, s in got.items():
                    s.order = " > ".join(order)
                    res.add(mem, op, s)
                    figures = ", ".join(
                        f"{k} {'n/a' if math.isnan(v := getattr(s, k)) else f'{v:.3f}'}" for k in METRICS
                    )
                    say(f"  {mem} MiB rep {r + 1} ({s.order}) {op}: {figures}")
    finally:
        remove_pod(rt, cri_pod.id)
        with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
            pm("rm", "-f", "-t", "0", name)


def report(res: Results, sizes: list[int]) -> dict[str, float]:
    med = res.medians()
    rows: list[list[Any]] = []
    for mem in sizes:
        for peer in PEERS:
            for op in OPS[peer]:
                m, n = med.get(mem, {}).get(op), len(res.samples.get(mem, {}).get(op, []))
                cells = [m[k] for k in METRICS] if m else [math.nan] * len(METRICS)
                rows.append([f"{mem} MiB", op, n, *cells])
    print()
    print("Checkpoint and restore beside the peers, seconds (medians)")
    print(table(["size", "operation", "n", "pause s", "checkpoint s", "restore s", "archive MiB"], rows))
    print(
        "pause: the largest gap between the source counter's timestamps around the checkpoint call "
        f"(it prints every {INTERVAL_MS} ms);\ncheckpoint: the call's wall time; restore: from the "
        "restore's first request until the restored counter's first new line;\narchive: the "
        "checkpoint's bytes (Podman in place: its checkpoint dir; lazy: RestorePod of CheckpointPod's "
        "archive)."
    )
    record(
        "peers",
        [{"mib": mem, "operation": op, **vals} for mem, ops in med.items() for op, vals in ops.items()],
    )
    su = [[k, median(v), min(v), max(v)] for k, v in res.startup.items()]
    print()
    print(f"Client start-up, seconds ({STARTUP_RUNS} runs each)")
    print(table(["client no-op", "median", "min", "max"], su))
    if res.lazy:
        print(f"lazy: n/a: {res.lazy}")
    for (mem, peer), why in res.errors.items():
        print(f"{mem} MiB {peer}: {why}")
    return summarize(med, median(res.startup.get(CLI_WARM, [])), median(res.startup.get(CLI_FIRST, [])))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    print("bench/peers: podshim beside Podman and containerd's own CRI checkpoint", flush=True)
    print(machine_summary(), flush=True)
    print(f"podman: {shutil.which('podman') or 'not installed'}; load {os.getloadavg()[0]:.2f}", flush=True)
    res = Results()
    env = {"PODSHIM_CHECKPOINT_CONTAINER_CHECKPOINT": "always"}  # podshim's own, not containerd's
    with bench_bed(containerd="2.2", restore_via_create=True, extra_env=env) as bed:
        rt = runtime_stub(bed.podshim_socket)
        pm = Podman(bed, Path(bed.base_dir) / "podman")
        try:
            pm.load_counter()
            measure_startup(pm, bed, res)
            say("warm-up and lazy probe: a small pod, CheckpointPod, RestorePod lazy (not counted)")
            cc = {"counter": counter_config("counter", 4, INTERVAL_MS)}
            pod = start_counter_pod(rt, bed, "peers-warmup", cc)
            archive = Path(bed.checkpoint_root) / "warmup"
            checkpoint_pod(rt, pod.id, archive)
            res.lazy = restore_grid.probe_lazy(rt, bed, archive, cc)
            remove_pod(rt, pod.id)
            remove_tree(archive)
            for mem in sizes:
                if meminfo_mib() < mem * 4 + 1024:  # two sources, a restored copy, page cache
                    say(f"{mem} MiB skipped: only {meminfo_mib()} MiB available")
                    continue
                say(f"{mem} MiB: {args.repeat} repeats")
                run_size(rt, bed, pm, mem, args.repeat, res)
        finally:
            pm.remove_all()
    figures = report(res, sizes)
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    print(result_line(**figures), flush=True)
    return 0 if res.samples else 1


if __name__ == "__main__":
    sys.exit(main())
