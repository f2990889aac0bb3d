"""bench/restore: warm start through RestorePod, and restore time vs plain ``runc restore``.

1. Warm start. A counter that spends ``--init-seconds`` (10) initialising ``--warm-mem`` (512)
   MiB. Cold: from the RunPodSandbox request (then CreateContainer, StartContainer, as a kubelet
   does) until its ``ready`` line is in the CRI log. Restored: from the RestorePod request (then
   StartContainer of each returned container, as a kubelet does) until the restored counter's
   next ``count=`` line is in the new pod's log. Cold and restored runs alternate; one
   CheckpointPod of the first cold pod serves all restores. Target: restored/cold <= 0.15.
2. Restore time vs memory size (``--mem``, default 64,256,1024 MiB). For each size one counter
   pod is checkpointed with CheckpointPod; then, alternating the order per repeat:
   * podshim: RestorePod + StartContainer until the first new ``count=`` line in the new log;
   * raw: ``runc --root <bed runc root> --criu /usr/local/sbin/criu restore --detach
     --image-path <copy of the archive's CRIU images> --work-path <fresh dir> --bundle <B>``
     where B holds the checkpointed container's ``spec.dump`` (root = a copy of the source
     container's rootfs, cgroupsPath = a fresh cgroup in the bed's subtree; it joins the still
     running source pod's network/IPC/UTS namespaces, as the spec says), until the restored
     process writes its first new ``count=`` line to the stdout pipe runc hands it.
   Both read images that are in the page cache (the archive was just written, the copy just
   made); the disk is synced before each measurement. CRIU's own ``restore_time`` (from the
   ``stats-restore`` each restore leaves in its work dir) is shown for both. Parts 2 and 4 start
   with an uncounted plain restore (warm_up_restore): the first after the checkpoint is slower.
3. Replicas: ``--replicas`` (4) restores of ONE archive (a ``--replica-mem`` (64) MiB
   counter) at once, against one alone: from the requests (RestorePod + StartContainer, each in a
   thread of its own) until every restored counter printed its next ``count=`` line. Restores of
   one archive run side by side (they hold its path shared).
   ``--skip-grid --skip-eager`` runs this part alone.
4. Eager overhead (measure_eager_overhead): RestorePod + StartContainer of a
   ``--eager-mem`` (256) MiB counter against the floor of a plain ``runc restore`` of the same
   images plus a plain RunPodSandbox straight through containerd, alternating, in one run; with
   the median per-phase seconds from podshim's "restore done" log line. Prints
   ``eager_overhead_ratio=… (restore+start …s, floor runc restore …s + RunPodSandbox …s)``.
5. The restore grid (bench/restore_grid.py): ``--grid-mem`` (256,1024,4096) MiB
   × eager / lazy (RestorePod option ``lazy-pages=true``, when podshim takes it) / plain runc
   restore (the floor) × warm / cold page cache: first output, fully resident (the counter's
   pattern check passed), the first count; and the cold start of a ``--cold-mem`` (1024) MiB
   counter with ``--init-seconds`` of initialisation; ``--repeat`` repeats per cell, ``--big-repeat``
   (2) at 4096 MiB (there a cell takes 10-40 s on this VM). ``--skip-grid`` leaves it out.

Parts 1 and 2 run only with ``--warm`` and ``--sizes`` (the grid measures the same at 256 MiB to
4 GiB); ``make bench-restore`` runs parts 3, 4 and 5 (about 12 minutes here).

With the grid, ends with exactly ``RESULT lazy_first_output_4g_s=… lazy_slope_s_per_gib=…
eager_overhead_ratio=… warm_start_ratio_lazy=…`` (bench/restore_grid.py; eager_overhead_ratio is
part 4's, or the grid's worst over its sizes when part 4 is skipped); the figures below are then
printed on an ``also:`` line before it. Without the grid it ends with
``RESULT warm_start_ratio=… restore_ratio_vs_runc=…`` (medians; the runc ratio is the worst over
the sizes), plus ``replicas_N_vs_one=…`` (N at once / one alone) when part 3 ran and
``eager_overhead_ratio=…`` when part 4 ran.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from bench import restore_grid
from bench.common import (
    COUNT_RE,
    READY_RE,
    RESTORE_WORK_DIR,
    CriLog,
    bench_bed,
    checkpoint_pod,
    counter_config,
    machine_summary,
    median,
    meminfo_mib,
    ratio,
    read_criu_stats,
    remove_pod,
    remove_tree,
    restore_phases,
    result_line,
    runtime_stub,
    say,
    start_counter_pod,
    sync_disk,
    table,
    task_dir,
    worst,
)
from bench.raw_restore import RawBundle, build_raw_bundle, raw_restore, sandbox_alone, warm_up_restore
from testbed import pods
from testbed.bed import TestBed

WARM_TARGET = 0.15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.restore", description=__doc__.split("\n\n")[0])
    p.add_argument("--warm-mem", type=int, default=512, help="MiB of the warm-start workload (512)")
    p.add_argument("--init-seconds", type=int, default=10, help="its initialisation time (10)")
    p.add_argument("--mem", default="64,256,1024", help="sizes for podshim vs runc restore (MiB)")
    p.add_argument("--repeat", type=int, default=3, help="repeats of every measurement (default 3)")
    # Parts 1 and 2 run on demand: the grid (part 5) measures the same at 256 MiB-4 GiB.
    p.add_argument("--skip-warm", action="store_true", default=True, help="skip part 1 (the default)")
    p.add_argument("--warm", dest="skip_warm", action="store_false", help="run part 1 (warm start)")
    p.add_argument("--skip-sizes", action="store_true", default=True, help="skip part 2 (the default)")
    p.add_argument("--sizes", dest="skip_sizes", action="store_false", help="run part 2 (vs runc restore)")
    p.add_argument("--replicas", type=int, default=4, help="concurrent restores of one archive (4)")
    p.add_argument("--replica-mem", type=int, default=64, help="MiB of the replicas' counter (64)")
    p.add_argument("--skip-replicas", action="store_true", help="skip part 3 (concurrent restores)")
    p.add_argument("--eager-mem", type=int, default=256, help="MiB of the eager-overhead counter (256)")
    p.add_argument("--skip-eager", action="store_true", help="skip part 4 (podshim's eager overhead)")
    p.add_argument("--grid-mem", default="256,1024,4096", help="sizes of the restore grid, part 5 (MiB)")
    p.add_argument("--cold-mem", type=int, default=1024, help="MiB of the grid's cold start (1024)")
    p.add_argument("--big-repeat", type=int, default=2, help="the grid's repeats at 4096 MiB and more (2)")
    p.add_argument("--skip-grid", action="store_true", help="skip part 5 (the restore grid)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- podshim's restore


@dataclass
class Restored:
    pod_id: str
    call: float  # RestorePod
    start: float  # StartContainer (all)
    first: float  # request -> first new count line
    count: int  # the value it resumed at
    criu_restore_s: float  # CRIU's restore_time from stats-restore
    # podshim-runc's page-check.json: the page images hashed beside CRIU's restore ({} when none)
    page_check: dict = field(default_factory=dict)


def podshim_restore(
    rt: api_pb2_grpc.RuntimeServiceStub,
    bed: TestBed,
    archive: Path,
    configs: dict[str, cri.ContainerConfig],
    name: str,
) -> Restored:
    """RestorePod, then StartContainer of every returned container (as the kubelet does), until
    the first restored container prints its next count line in the new pod's log."""
    new = pods.pod_config(name, bed.pod_logs_dir)
    first_name = next(iter(configs))
    log = CriLog(Path(new.log_directory) / configs[first_name].log_path)
    sync_disk()
    t0 = time.perf_counter()
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(archive), config=new, container_configs=list(configs.values())
        ),
        timeout=600,
    )
    t1 = time.perf_counter()
    for c in resp.restored_containers:
        rt.StartContainer(cri.StartContainerRequest(container_id=c.container_id), timeout=600)
    t2 = time.perf_counter()
    seen, line = log.wait(COUNT_RE, 120)
    m = COUNT_RE.search(line)
    cid = next(c.container_id for c in resp.restored_containers if c.name == first_name)
    stats = read_criu_stats(task_dir(bed, cid) / RESTORE_WORK_DIR / "stats-restore", "restore")
    try:
        page_check = json.loads((task_dir(bed, cid) / RESTORE_WORK_DIR / "page-check.json").read_text())
    except (OSError, ValueError):
        page_check = {}
    return Restored(
        pod_id=resp.pod_sandbox_id,
        call=t1 - t0,
        start=t2 - t1,
        first=seen - t0,
        count=int(m.group(1)) if m else -1,
        criu_restore_s=stats.get("restore_time", 0) / 1e6 if stats else float("nan"),
        page_check=page_check,
    )


# ---------------------------------------------------------------------------- warm start


def warm_start(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, args: argparse.Namespace) -> dict:
    cc = counter_config("app", args.warm_mem, 100, args.init_seconds)
    configs = {"app": cc}
    colds: list[float] = []
    restores: list[Restored] = []

    def cold(i: int) -> pods.Pod:
        config = pods.pod_config(f"warm-cold-{i}", bed.pod_logs_dir)
        log = CriLog(Path(config.log_directory) / cc.log_path)
        sync_disk()
        t0 = time.perf_counter()
        pod_id = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
        cid = rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config), timeout=300
        ).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=300)
        seen, _ = log.wait(READY_RE, args.init_seconds * 4 + 120)
        colds.append(seen - t0)
        say(f"  cold start {i + 1}: ready after {colds[-1]:.3f}s")
        return pods.Pod(pod_id, config, {"app": cid})

    def restore(i: int) -> None:
        r = podshim_restore(rt, bed, archive, configs, f"warm-restored-{i}")
        restores.append(r)
        say(
            f"  restore {i + 1}: RestorePod {r.call:.3f}s + StartContainer {r.start:.3f}s, "
            f"count={r.count} after {r.first:.3f}s (CRIU restore_time {r.criu_restore_s:.3f}s)"
        )
        remove_pod(rt, r.pod_id)

    say(f"warm start: {args.warm_mem} MiB, {args.init_seconds}s init; cold 1 is the checkpoint's source")
    source = cold(0)
    pods.wait_count(source.log_path("app"), 3, timeout=60)
    archive = Path(bed.checkpoint_root) / "warm"
    wall, m = checkpoint_pod(rt, source.id, archive)
    say(f"  CheckpointPod of the source: {wall:.3f}s (freeze {m['timings']['freeze_window']:.3f}s)")
    for i in range(args.repeat):
        if i % 2 == 0:
            restore(i)
            remove_pod(rt, cold(i + 1).id)
        else:
            remove_pod(rt, cold(i + 1).id)
            restore(i)
    remove_pod(rt, source.id)
    remove_tree(archive)
    return {"cold": colds, "restored": restores}


# ---------------------------------------------------------------------------- raw runc restore


def size_sweep(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, args: argparse.Namespace) -> dict:
    results: dict[int, dict[str, list]] = {}
    for idx, mem in enumerate(int(x) for x in args.mem.split(",") if x.strip()):
        if meminfo_mib() < mem * 4 + 1024:
            say(f"size {mem} MiB skipped: only {meminfo_mib()} MiB available")
            continue
        say(f"restore vs runc: {mem} MiB")
        cc = counter_config("counter", mem, 100)
        configs = {"counter": cc}
        source = start_counter_pod(rt, bed, f"rs-src-{mem}", configs)
        pods.wait_count(source.log_path("counter"), 3, timeout=60)
        archive = Path(bed.checkpoint_root) / f"sweep-{mem}"
        wall, m = checkpoint_pod(rt, source.id, archive)
        say(f"  CheckpointPod: {wall:.3f}s")
        rb = build_raw_bundle(bed, archive, source.containers["counter"], "counter")
        res: dict[str, list] = {"podshim": [], "raw": [], "sandbox": []}
        try:
            warm_up_restore(bed, rb)
            for r in range(args.repeat):
                podshim_first = (idx + r) % 2 == 0
                for which in ("podshim", "raw") if podshim_first else ("raw", "podshim"):
                    if which == "podshim":
                        p = podshim_restore(rt, bed, archive, configs, f"rs-{mem}-{r}")
                        res["podshim"].append(p)
                        remove_pod(rt, p.pod_id)
                        say(
                            f"  rep {r + 1} podshim: RestorePod {p.call:.3f}s + StartContainer "
                            f"{p.start:.3f}s, count={p.count} after {p.first:.3f}s "
                            f"(CRIU restore_time {p.criu_restore_s:.3f}s)"
                        )
                    else:
                        q = raw_restore(bed, rb, r)
                        res["raw"].append(q)
                        say(
                            f"  rep {r + 1} raw:     runc restore {q.runc:.3f}s, count={q.count} after "
                            f"{q.first:.3f}s (CRIU restore_time {q.criu_restore_s:.3f}s)"
                        )
                res["sandbox"].append(sandbox_alone(rt, bed, f"rs-sandbox-{mem}-{r}"))
        except (grpc.RpcError, RuntimeError, TimeoutError, subprocess.SubprocessError) as e:
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            say(f"  size {mem} MiB failed: {detail}")
            res["error"] = [detail]
        finally:
            remove_pod(rt, source.id)
            remove_tree(rb.base)
            remove_tree(archive)
        results[mem] = res
    return results


# ---------------------------------------------------------------------------- eager overhead

EAGER_OVERHEAD_TARGET = 1.3  # restore+start / (runc restore + RunPodSandbox)


def measure_eager_overhead(
    rt: api_pb2_grpc.RuntimeServiceStub,
    bed: TestBed,
    archive: Path,
    configs: dict[str, cri.ContainerConfig],
    rb: RawBundle,
    repeat: int,
    tag: str = "eo",
) -> dict:
    """podshim's own eager restore overhead, measured in one run: RestorePod +
    StartContainer of every container (until both calls returned) against the floor of a plain
    ``runc restore --detach`` of the same images (raw_restore) plus a plain RunPodSandbox of an
    empty pod straight through containerd (not through podshim). The three alternate, `repeat`
    times each; medians. Returns {"ratio", "restore_start_s", "runc_s", "sandbox_s", "phases"
    (median seconds per phase of podshim's "restore done" log line), and the raw lists}."""
    direct = runtime_stub(bed.containerd_socket)
    shim: list[float] = []
    calls: list[tuple[float, float]] = []  # (RestorePod, StartContainer)
    checks: list[str] = []  # the page check beside CRIU's restore, as podshim-runc recorded it
    runc: list[float] = []
    sandbox: list[float] = []
    phases: dict[str, list[float]] = {}
    for r in range(repeat):
        order = ("podshim", "raw", "sandbox") if r % 2 == 0 else ("sandbox", "raw", "podshim")
        for which in order:
            if which == "podshim":
                p = podshim_restore(rt, bed, archive, configs, f"{tag}-{r}")
                shim.append(p.call + p.start)
                calls.append((p.call, p.start))
                pc = p.page_check
                checks.append(
                    f"; page check {pc['hash_s']:.3f}s beside restore {pc['restore_s']:.3f}s, "
                    f"waited {pc['wait_s']:.3f}s"
                    if pc
                    else ""
                )
                for k, v in restore_phases(bed, p.pod_id).items():
                    phases.setdefault(k, []).append(v)
                remove_pod(rt, p.pod_id)
            elif which == "raw":
                runc.append(raw_restore(bed, rb, 1000 + r).runc)
            else:
                sandbox.append(sandbox_alone(direct, bed, f"{tag}-sandbox-{r}"))
        say(
            f"  eager rep {r + 1}: RestorePod {calls[-1][0]:.3f}s + StartContainer {calls[-1][1]:.3f}s; "
            f"runc restore {runc[-1]:.3f}s + RunPodSandbox {sandbox[-1]:.3f}s{checks[-1]}"
        )
    floor = median(runc) + median(sandbox)
    return {
        "ratio": ratio(median(shim), floor),
        "restore_start_s": median(shim),
        "restore_pod_s": median([c for c, _ in calls]),
        "start_container_s": median([s for _, s in calls]),
        "runc_s": median(runc),
        "sandbox_s": median(sandbox),
        "phases": {k: median(v) for k, v in phases.items()},
        "restore_start": shim,
        "runc": runc,
        "sandbox": sandbox,
    }


def eager_overhead(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, args: argparse.Namespace) -> dict:
    """A ``--eager-mem`` MiB counter pod, checkpointed once, then measure_eager_overhead."""
    mem = args.eager_mem
    say(f"eager overhead: {mem} MiB, RestorePod + StartContainer vs runc restore + RunPodSandbox")
    configs = {"counter": counter_config("counter", mem, 100)}
    source = start_counter_pod(rt, bed, f"eo-src-{mem}", configs)
    archive = Path(bed.checkpoint_root) / f"eager-{mem}"
    rb: RawBundle | None = None
    try:
        pods.wait_count(source.log_path("counter"), 3, timeout=60)
        checkpoint_pod(rt, source.id, archive)
        rb = build_raw_bundle(bed, archive, source.containers["counter"], "counter")
        warm_up_restore(bed, rb)
        return {"mem": mem, **measure_eager_overhead(rt, bed, archive, configs, rb, args.repeat)}
    except (grpc.RpcError, RuntimeError, TimeoutError, subprocess.SubprocessError) as e:
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
        say(f"  eager overhead failed: {detail}")
        return {"mem": mem, "error": detail}
    finally:
        remove_pod(rt, source.id)
        if rb is not None:
            remove_tree(rb.base)
        remove_tree(archive)


def eager_overhead_line(eo: dict) -> str:
    """The bench's summary line of measure_eager_overhead's result."""
    return (
        f"eager_overhead_ratio={eo['ratio']:.3f} (restore+start {eo['restore_start_s']:.3f}s, floor runc "
        f"restore {eo['runc_s']:.3f}s + RunPodSandbox {eo['sandbox_s']:.3f}s; {eo['mem']} MiB, target "
        f"<= {EAGER_OVERHEAD_TARGET})"
    )


# ---------------------------------------------------------------------------- replicas


def replicas(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, args: argparse.Namespace) -> dict:
    """One restore alone vs `args.replicas` restores of the same archive at once (seconds until
    every restored counter printed its next count line), `args.repeat` times each, alternating."""
    n = max(2, args.replicas)
    say(f"replicas: {n} restores of one {args.replica_mem} MiB archive at once vs one alone")
    cc = counter_config("counter", args.replica_mem, 100)
    configs = {"counter": cc}
    source = start_counter_pod(rt, bed, "rep-src", configs)
    pods.wait_count(source.log_path("counter"), 3, timeout=60)
    archive = Path(bed.checkpoint_root) / "replicas"
    checkpoint_pod(rt, source.id, archive)
    res: dict[str, list] = {"one": [], "many": []}

    def batch(count: int, tag: str) -> float:
        t0 = time.perf_counter()
        done: list[Restored | BaseException] = []

        def run(i: int) -> None:
            try:
                done.append(podshim_restore(rt, bed, archive, configs, f"rep-{tag}-{i}"))
            except BaseException as e:  # noqa: BLE001 - reported below
                done.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - t0
        for r in done:
            if isinstance(r, Restored):
                remove_pod(rt, r.pod_id)
        errors_ = [r for r in done if not isinstance(r, Restored)]
        if errors_:
            e = errors_[0]
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else repr(e)
            raise RuntimeError(f"{len(errors_)} of {count} restores failed: {detail}")
        return took

    try:
        for r in range(args.repeat):
            for which in ("one", "many") if r % 2 == 0 else ("many", "one"):
                took = batch(1 if which == "one" else n, f"{which}-{r}")
                res[which].append(took)
                say(f"  rep {r + 1} {which}: {took:.3f}s")
    except (grpc.RpcError, RuntimeError, TimeoutError) as e:
        say(f"  replicas failed: {e}")
        res["error"] = [str(e)]
    finally:
        remove_pod(rt, source.id)
        remove_tree(archive)
    return {"n": n, **res}


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("bench/restore: warm start via RestorePod, and podshim restore vs plain runc restore", flush=True)
    print(machine_summary(), flush=True)
    warm: dict = {}
    sweep: dict = {}
    reps: dict = {}
    eager: dict = {}
    grid: tuple[str, dict[str, float]] | None = None
    with bench_bed() as bed:
        rt = runtime_stub(bed.podshim_socket)
        say("warm-up: a small pod, CheckpointPod, RestorePod + StartContainer (not counted)")
        cc = counter_config("counter", 16, 100)
        pod = start_counter_pod(rt, bed, "rs-warmup", {"counter": cc})
        archive = Path(bed.checkpoint_root) / "warmup"
        checkpoint_pod(rt, pod.id, archive)
        r = podshim_restore(rt, bed, archive, {"counter": cc}, "rs-warmup-restored")
        remove_pod(rt, r.pod_id)
        remove_pod(rt, pod.id)
        remove_tree(archive)
        if not args.skip_warm:
            warm = warm_start(rt, bed, args)
        if not args.skip_sizes:
            sweep = size_sweep(rt, bed, args)
        if not args.skip_replicas:
            reps = replicas(rt, bed, args)
        if not args.skip_eager:
            eager = eager_overhead(rt, bed, args)
        if not args.skip_grid:
            grid = run_grid(rt, bed, args)

    warm_ratio = float("nan")
    if warm:
        colds, rest = warm["cold"], warm["restored"]
        warm_ratio = ratio(median([r.first for r in rest]), median(colds))
        print()
        print(
            f"Warm start: {args.warm_mem} MiB, --init-seconds {args.init_seconds}, seconds "
            f"(median of {len(colds)} cold / {len(rest)} restored)"
        )
        print(
            table(
                ["path", "to ready / next count", "RestorePod", "StartContainer", "CRIU restore_time"],
                [
                    ["cold (RunPodSandbox..ready)", median(colds), "", "", ""],
                    [
                        "restored (RestorePod..count)",
                        median([r.first for r in rest]),
                        median([r.call for r in rest]),
                        median([r.start for r in rest]),
                        median([r.criu_restore_s for r in rest]),
                    ],
                    ["restored / cold", warm_ratio, "", "", ""],
                ],
            )
        )
    ratios = []
    if sweep:
        rows = []
        for mem, res in sweep.items():
            ps, raw = res["podshim"], res["raw"]
            rr = ratio(median([p.first for p in ps]), median([q.first for q in raw]))
            if ps and raw:
                ratios.append(rr)
            rows.append(
                [
                    f"{mem} MiB",
                    f"{len(ps)}/{len(raw)}",
                    median([p.call for p in ps]),
                    median([p.start for p in ps]),
                    median([p.first for p in ps]),
                    median([p.criu_restore_s for p in ps]),
                    median([q.runc for q in raw]),
                    median([q.first for q in raw]),
                    median([q.criu_restore_s for q in raw]),
                    rr,
                    median(res["sandbox"]),
                ]
            )
        print()
        print(
            "Restore vs memory size, seconds (medians); 'to count' = request until the first new count line"
        )
        print(
            table(
                [
                    "size",
                    "n shim/raw",
                    "RestorePod",
                    "StartCtr",
                    "shim to count",
                    "shim CRIU",
                    "runc restore",
                    "raw to count",
                    "raw CRIU",
                    "shim/raw",
                    "sandbox ref",
                ],
                rows,
            )
        )
        print(
            "shim = RestorePod (archive checksums, new sandbox + CNI, CreateContainer) + StartContainer "
            "(podshim-runc: rootfs diff,\nrunc restore); raw = runc restore --detach of a copy of the same "
            "images into a prepared bundle; CRIU = restore_time\nfrom each restore's stats-restore; "
            "sandbox ref = RunPodSandbox of an empty pod alone (pause + CNI), which a\n"
            "restore into a new pod pays and a raw restore into the source pod's namespaces does not."
        )
        for mem, res in sweep.items():
            if "error" in res:
                print(f"size {mem} MiB: {res['error'][0]}")
    extra: dict[str, float] = {}
    if reps.get("one") and reps.get("many"):
        n = reps["n"]
        one, many = median(reps["one"]), median(reps["many"])
        extra[f"replicas_{n}_vs_one"] = ratio(many, one)
        print()
        print(f"Replicas: {n} RestorePod + StartContainer of one archive at once vs one, seconds (medians)")
        print(
            table(
                ["restores", "until every counter counts", "per restore"],
                [["1", one, one], [str(n), many, many / n], [f"{n} / 1", extra[f"replicas_{n}_vs_one"], ""]],
            )
        )
    if "error" in reps:
        print(f"replicas: {reps['error'][0]}")
    if eager and "error" not in eager:
        print()
        print(f"Eager restore phases ({eager['mem']} MiB, podshim's log, median seconds; they overlap):")
        print(table(["phase", "seconds"], [[k, v] for k, v in sorted(eager["phases"].items())]))
        print(eager_overhead_line(eager))
        extra["eager_overhead_ratio"] = eager["ratio"]
    elif eager:
        print(f"eager overhead: {eager['error']}")
    print()
    print(f"target: restored/cold <= {WARM_TARGET}")
    older = result_line(warm_start_ratio=warm_ratio, restore_ratio_vs_runc=worst(ratios), **extra)
    if grid is None:
        print(older, flush=True)
        return 0
    print("also: " + older.removeprefix("RESULT "))
    grid_report, values = grid
    print()
    print(grid_report)
    if "eager_overhead_ratio" in extra:  # part 4's figure, its own measurement
        values["eager_overhead_ratio"] = extra["eager_overhead_ratio"]
    print(restore_grid.targets_line(values))
    print(result_line(**values), flush=True)
    return 0


# ---------------------------------------------------------------------------- the grid (part 5)


def run_grid(
    rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, args: argparse.Namespace
) -> tuple[str, dict[str, float]]:
    """Part 5 (bench/restore_grid.py): the grid's tables and its RESULT values."""
    sizes = [int(x) for x in args.grid_mem.split(",") if x.strip()]
    g = restore_grid.run(rt, bed, sizes, args.repeat, args.cold_mem, args.init_seconds, args.big_repeat)
    return restore_grid.report(g), restore_grid.summarize(g)


if __name__ == "__main__":
    sys.exit(main())
