"""bench/distribution: a pod checkpoint through an OCI registry.

Two nodes (two test beds: containerd + podshim each) and a private registry (Debian's
docker-registry, basic auth, on a loopback port; testbed/registry.py), all on this machine's disk.
A counter pod of `--mem-mib` MiB (default 1024) runs on node A and is checkpointed with
CheckpointPod. Per repeat and per compression (none, zstd):

* push: `shim.distribution.push` of the archive to the registry, then a `sync` (the registry does
  not fsync; the floor's bytes are durable too). Floor: `cp -r` of the same archive into the
  registry's storage directory + `sync`.
* pull: `shim.distribution.pull` into node B's checkpoint root (verified as it arrives, fsynced
  before manifest.json). Floor: `cp -r` of the artifact's blobs from the registry's storage into
  node B's checkpoint root + `sync`.

The page cache is left as it is between the steps (the archive was just written, the blobs just
pushed), the same for podshim and the floor. Then, per repeat, the whole migration: CheckpointPod
on A → push → pull on B → RestorePod + StartContainer on B → the counter's first line on B
(`migrate_1g_s`, wall time from the CheckpointPod call to that line).

The pull's CPU seconds (podshim's pull runs in this process) are reported beside curl's.
`--compression none` and `--skip-migrate` run parts (what is left out is n/a in the RESULT).

Ends with `RESULT push_vs_floor=… pull_vs_floor=… migrate_1g_s=…` (medians, plain layers).
Targets (reported, not enforced): push and pull within 1.5 × the floor.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from bench.common import (
    COUNT_RE,
    MIB,
    CriLog,
    bench_bed,
    checkpoint_pod,
    counter_config,
    disk_free_mib,
    machine_summary,
    median,
    remove_pod,
    remove_tree,
    result_line,
    runtime_stub,
    say,
    start_counter_pod,
    table,
)
from shim.distribution import pull, push
from testbed import pods
from testbed.bed import TestBed
from testbed.registry import Registry


def timed_cmd(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - start


def cp_sync(src: list[Path], dest: Path) -> float:
    """The floor: copy `src` into the new dir `dest` (one `cp -r` each, as `<i>-<name>`), then
    sync (seconds)."""
    dest.mkdir(mode=0o700)
    start = time.perf_counter()
    for i, s in enumerate(src):
        subprocess.run(["cp", "-r", str(s), str(dest / f"{i}-{s.name}")], check=True)
    os.sync()
    return time.perf_counter() - start


def warm_memory(where: Path, mib: int) -> float:
    """Write and delete `mib` MiB: this VM backs guest memory lazily, and the first touch of a page
    costs ~4 ms per MiB (measured: 256 MiB of writes 1.04 s the first time, 0.08 s after), which
    would land on whichever side allocates fresh page cache first."""
    buf = os.urandom(MIB)
    path = where / f"warm-{secrets.token_hex(3)}"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for _ in range(mib):
            os.write(fd, buf)
    finally:
        os.close(fd)
        os.unlink(path)
    return time.perf_counter() - start


def _location(head: str, host: str, default: str = "") -> str:
    loc = next(
        (ln.split(":", 1)[1].strip() for ln in head.splitlines() if ln.lower().startswith("location:")),
        default,
    )
    return f"http://{host}{loc}" if loc.startswith("/") else loc


class Curl:
    """The registry's own floor: the same blobs through curl (streamed PATCH + PUT; GET to files),
    credentials in a private netrc file, not on a command line."""

    def __init__(self, reg: Registry, workdir: Path) -> None:
        self.reg = reg
        self.netrc = workdir / f"netrc-{secrets.token_hex(3)}"
        self.netrc.write_text(f"machine 127.0.0.1 login {reg.user} password {reg.password}\n")
        self.netrc.chmod(0o600)

    def _run(self, *args: str) -> str:
        argv = ["curl", "-sS", "--fail", "--netrc-file", str(self.netrc), *args]
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout

    def push(self, repo: str, blobs: list[tuple[Path, str]]) -> float:
        base = f"http://{self.reg.host}/v2/{repo}"
        start = time.perf_counter()
        for path, digest in blobs:
            loc = _location(
                self._run("-X", "POST", "-D", "-", "-o", "/dev/null", f"{base}/blobs/uploads/"), self.reg.host
            )
            head = self._run(
                "-X",
                "PATCH",
                "-H",
                "Content-Type: application/octet-stream",
                "-T",
                str(path),
                "-D",
                "-",
                "-o",
                "/dev/null",
                loc,
            )
            loc = _location(head, self.reg.host, loc)
            self._run("-X", "PUT", "-o", "/dev/null", loc + ("&" if "?" in loc else "?") + f"digest={digest}")
        os.sync()
        return time.perf_counter() - start

    def pull(self, repo: str, digests: list[str], dest: Path) -> float:
        dest.mkdir(mode=0o700)
        start = time.perf_counter()
        for i, digest in enumerate(digests):
            self._run("-o", str(dest / str(i)), f"http://{self.reg.host}/v2/{repo}/blobs/{digest}")
        os.sync()
        return time.perf_counter() - start


def _cpu_since(before: resource.struct_rusage, who: int) -> float:
    """CPU seconds (user + system) of `who` (RUSAGE_SELF: the pull, run in this process;
    RUSAGE_CHILDREN: curl) since `before`."""
    after = resource.getrusage(who)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def migrate(
    rt_a: Any, rt_b: Any, bed_a: TestBed, bed_b: TestBed, reg: Registry, pod: pods.Pod, mem_mib: int, tag: str
) -> dict[str, float]:
    """CheckpointPod on A → push → pull on B → RestorePod + StartContainer → first count on B."""
    out = Path(bed_a.checkpoint_root) / f"migrate-{tag}"
    ref = reg.ref("bench/migrate", tag)
    dest = Path(bed_b.checkpoint_root) / f"migrate-{tag}"
    config = pods.pod_config(f"migrated-{tag}", bed_b.pod_logs_dir)
    start = time.perf_counter()
    ckpt, _ = checkpoint_pod(rt_a, pod.id, out)
    t1 = time.perf_counter()
    push.push(out, ref)
    t2 = time.perf_counter()
    dest.mkdir(mode=0o700)
    pull.pull(ref, dest, allowed_roots=[str(bed_b.checkpoint_root)])
    t3 = time.perf_counter()
    log = CriLog(Path(config.log_directory) / "counter" / "0.log")
    resp = rt_b.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(dest),
            config=config,
            container_configs=[counter_config("counter", mem_mib)],
        ),
        timeout=900,
    )
    for c in resp.restored_containers:
        rt_b.StartContainer(cri.StartContainerRequest(container_id=c.container_id), timeout=900)
    seen, _line = log.wait(COUNT_RE, 300)
    total = seen - start
    remove_pod(rt_b, resp.pod_sandbox_id)
    remove_tree(out)
    remove_tree(dest)
    return {
        "checkpoint": ckpt,
        "push": t2 - t1,
        "pull": t3 - t2,
        "restore+start": seen - t3,
        "total": total,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mem-mib", type=int, default=1024, help="the counter's resident memory")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compression", default="none,zstd", help="layer compressions measured (none,zstd)")
    ap.add_argument("--skip-migrate", action="store_true", help="leave out the migration part")
    args = ap.parse_args(argv)
    comps = [c for c in args.compression.split(",") if c]
    print(machine_summary())
    with contextlib.ExitStack() as stack:
        bed_a = stack.enter_context(bench_bed())
        say("starting node B (a second bed)")
        bed_b = stack.enter_context(TestBed())
        reg = stack.enter_context(Registry(Path(bed_a.base_dir)))
        os.environ.update(reg.auth_env())
        say(f"registry at {reg.host}, storage {reg.storage}")
        if disk_free_mib(bed_a.base_dir) < args.mem_mib * 8:
            say("warning: little free disk for this size")
        rt_a, rt_b = runtime_stub(bed_a.podshim_socket), runtime_stub(bed_b.podshim_socket)
        pod = start_counter_pod(rt_a, bed_a, "dist-src", {"counter": counter_config("counter", args.mem_mib)})
        stack.callback(remove_pod, rt_a, pod.id)
        archive = Path(bed_a.checkpoint_root) / "archive"
        say(f"CheckpointPod of the {args.mem_mib} MiB counter")
        checkpoint_pod(rt_a, pod.id, archive)
        size = tree_bytes(archive)
        say(f"archive: {size / MIB:.1f} MiB")
        warm = warm_memory(Path(bed_b.checkpoint_root), 4 * size // MIB)
        say(f"warmed {4 * size // MIB} MiB of page cache in {warm:.1f}s")
        curl = Curl(reg, Path(bed_a.base_dir))
        rows: list[list[Any]] = []
        figures: dict[str, list[float]] = {}

        def note(key: str, value: float) -> None:
            figures.setdefault(key, []).append(value)

        for i in range(args.repeats):
            for comp in comps:
                tag = f"{comp}-{i}-{secrets.token_hex(2)}"
                ref = reg.ref("bench/pod", tag)
                os.sync()
                floor_push = cp_sync([archive], reg.storage / f"floor-{tag}")
                remove_tree(reg.storage / f"floor-{tag}")
                os.sync()
                start = time.perf_counter()
                result = push.push(archive, ref, compression=comp)
                pushed = time.perf_counter() - start
                os.sync()
                push_sync = time.perf_counter() - start
                blobs = [reg.blob_path(x.digest) for x in result.layers]
                os.sync()
                floor_pull = cp_sync(blobs, Path(bed_b.checkpoint_root) / f"floor-{tag}")
                remove_tree(Path(bed_b.checkpoint_root) / f"floor-{tag}")
                os.sync()
                digests = [x.digest for x in result.layers]
                os.sync()
                curl_push = curl.push(f"bench/curl-{tag}", [(reg.blob_path(d), d) for d in digests])
                os.sync()
                cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
                curl_pull = curl.pull("bench/pod", digests, Path(bed_b.checkpoint_root) / f"curl-{tag}")
                curl_cpu = _cpu_since(cpu, resource.RUSAGE_CHILDREN)
                remove_tree(Path(bed_b.checkpoint_root) / f"curl-{tag}")
                os.sync()
                dest = Path(bed_b.checkpoint_root) / f"pulled-{tag}"
                dest.mkdir(mode=0o700)
                start = time.perf_counter()
                cpu = resource.getrusage(resource.RUSAGE_SELF)
                pull.pull(ref, dest, allowed_roots=[str(bed_b.checkpoint_root)])
                pulled = time.perf_counter() - start
                pull_cpu = _cpu_since(cpu, resource.RUSAGE_SELF)
                remove_tree(dest)
                stored = result.stored_bytes
                rows.append(
                    [
                        f"{comp} #{i + 1}",
                        size / MIB,
                        stored / MIB,
                        pushed,
                        push_sync,
                        floor_push,
                        curl_push,
                        pulled,
                        floor_pull,
                        curl_pull,
                        pull_cpu,
                        curl_cpu,
                    ]
                )
                note(f"curl_push_{comp}", curl_push)
                note(f"curl_pull_{comp}", curl_pull)
                note(f"push_{comp}", push_sync)
                note(f"push_nosync_{comp}", pushed)
                note(f"floor_push_{comp}", floor_push)
                note(f"pull_{comp}", pulled)
                note(f"floor_pull_{comp}", floor_pull)
                note(f"ratio_{comp}", stored / size)
                say(
                    f"{comp} #{i + 1}: push {push_sync:.2f}s (floor {floor_push:.2f}s), "
                    f"pull {pulled:.2f}s (floor {floor_pull:.2f}s, curl {curl_pull:.2f}s; "
                    f"CPU seconds: podshim {pull_cpu:.2f}, curl {curl_cpu:.2f})"
                )
        print()
        print(
            table(
                [
                    "layers",
                    "archive MiB",
                    "stored MiB",
                    "push s",
                    "push+sync s",
                    "floor cp+sync s",
                    "curl push+sync s",
                    "pull s",
                    "floor cp+sync s",
                    "curl GET+sync s",
                    "pull cpu s",
                    "curl cpu s",
                ],
                rows,
            )
        )
        mig_rows = []
        for i in range(0 if args.skip_migrate else args.repeats):
            say(f"migration #{i + 1}: CheckpointPod on A → push → pull on B → RestorePod + StartContainer")
            mig = migrate(rt_a, rt_b, bed_a, bed_b, reg, pod, args.mem_mib, f"m{i}-{secrets.token_hex(2)}")
            mig_rows.append(
                [f"#{i + 1}", mig["checkpoint"], mig["push"], mig["pull"], mig["restore+start"], mig["total"]]
            )
            note("migrate", mig["total"])
        print()
        print(
            table(["migration", "checkpoint s", "push s", "pull s", "restore+start s", "total s"], mig_rows)
        )
        med = {k: median(v) for k, v in figures.items()}

        def m(key: str) -> float:  # NaN for a part left out (--compression, --skip-migrate)
            return med.get(key, math.nan)

        print()
        if "zstd" in comps:
            print(
                f"zstd: stored {m('ratio_zstd'):.3f} of the archive; push+sync {m('push_zstd'):.2f}s vs "
                f"{m('push_none'):.2f}s plain, pull {m('pull_zstd'):.2f}s vs {m('pull_none'):.2f}s plain"
            )
        print(
            result_line(
                push_vs_floor=m("push_none") / m("floor_push_none"),
                pull_vs_floor=m("pull_none") / m("floor_pull_none"),
                migrate_1g_s=m("migrate"),
                push_vs_curl=m("push_none") / m("curl_push_none"),
                pull_vs_curl=m("pull_none") / m("curl_pull_none"),
                push_zstd_vs_floor=m("push_zstd") / m("floor_push_zstd"),
                pull_zstd_vs_floor=m("pull_zstd") / m("floor_pull_zstd"),
                zstd_ratio=m("ratio_zstd"),
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
