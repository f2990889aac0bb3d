"""bench/raw_restore: the floor, a plain ``runc restore`` of podshim's archive without podshim.

bench/restore.py (parts 2 and 4) and bench/restore_grid.py (mode ``runc``, ``runc-lazy``) measure
podshim's restore against it: the container's CRIU images copied out of the archive, a bundle of
the recorded spec over a copy of the source container's rootfs in a cgroup of its own, ``runc
restore --detach`` (or with ``--lazy-pages`` from a plain ``criu lazy-pages``), and a RunPodSandbox
of an empty pod, the part of a restore into a new pod that a raw restore into the source pod's
namespaces does not pay.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from bench.common import (
    COUNT_RE,
    VERIFY_RE,
    read_criu_stats,
    remove_pod,
    remove_tree,
    runc_argv,
    say,
    sync_disk,
    task_dir,
)
from testbed import pods
from testbed.bed import TestBed
from testbed.versions import CRIU


@dataclass
class RawRestore:
    runc: float  # runc restore --detach until it exited
    first: float  # request -> first new count line on the pipe
    count: int
    criu_restore_s: float


@dataclass
class RawBundle:
    """Everything a plain runc restore needs, built once per size from podshim's archive."""

    base: Path
    images: Path
    spec: dict
    source_rootfs: Path
    runs: list[str] = field(default_factory=list)


def build_raw_bundle(bed: TestBed, archive: Path, source_cid: str, container: str) -> RawBundle:
    base = Path(bed.checkpoint_root) / f"raw-{secrets.token_hex(3)}"
    base.mkdir(mode=0o700)
    images = base / "images"
    shutil.copytree(archive / "containers" / container / "checkpoint", images, symlinks=True)
    spec = json.loads((archive / "containers" / container / "spec.dump").read_text())
    rootfs = task_dir(bed, source_cid) / "rootfs"  # the source container's live overlay mount
    if not (rootfs / "counter").exists() and not any(rootfs.iterdir()):
        raise RuntimeError(f"source rootfs {rootfs} is not mounted")
    return RawBundle(base, images, spec, rootfs)


def fresh_bundle(bed: TestBed, rb: RawBundle, index: int, prefix: str) -> tuple[str, Path, Path]:
    """A container id, a bundle (a copy of the source rootfs, the recorded spec in its own
    cgroup) and an empty CRIU work dir for one plain restore of `rb`'s images."""
    raw_id = f"{prefix}-{secrets.token_hex(4)}"
    bundle = rb.base / f"bundle-{index}"
    work = rb.base / f"work-{index}"
    work.mkdir(mode=0o700)
    bundle.mkdir(mode=0o700)
    subprocess.run(["cp", "-a", str(rb.source_rootfs), str(bundle / "rootfs")], check=True)
    spec = json.loads(json.dumps(rb.spec))
    spec["root"] = {"path": str(bundle / "rootfs"), "readonly": bool(spec.get("root", {}).get("readonly"))}
    spec.setdefault("linux", {})["cgroupsPath"] = f"{bed.cgroup_root}/bench-raw/{raw_id}"
    (bundle / "config.json").write_text(json.dumps(spec))
    return raw_id, bundle, work


def raw_restore(bed: TestBed, rb: RawBundle, index: int) -> RawRestore:
    """One plain ``runc restore --detach`` into a fresh bundle; killed and deleted afterwards."""
    raw_id, bundle, work = fresh_bundle(bed, rb, index, "benchraw")
    argv = runc_argv(
        bed,
        "restore",
        "--detach",
        "--image-path",
        str(rb.images),
        "--work-path",
        str(work),
        "--bundle",
        str(bundle),
        raw_id,
    )
    r_fd, w_fd = os.pipe()
    seen: list[tuple[float, bytes]] = []
    got = threading.Event()

    def reader() -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(r_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not seen and COUNT_RE.search(line):
                    seen.append((time.perf_counter(), line))
                    got.set()
        got.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    rb.runs.append(raw_id)
    stderr = open(work / "runc-stderr.log", "wb")  # runc's and the restored stderr
    try:
        sync_disk()
        t0 = time.perf_counter()
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=w_fd, stderr=stderr, timeout=600)
        t1 = time.perf_counter()
        os.close(w_fd)
        w_fd = -1
        if proc.returncode != 0:
            tail = (work / "restore.log").read_text(errors="replace").splitlines()[-6:]
            err = (work / "runc-stderr.log").read_text(errors="replace").strip()[-400:]
            raise RuntimeError(f"runc restore failed ({proc.returncode}): {err} | {' | '.join(tail)}")
        got.wait(120)
        if not seen:
            raise RuntimeError("the raw-restored counter printed no count line within 120s")
        t2, line = seen[0]
        m = COUNT_RE.search(line)
        stats = read_criu_stats(work / "stats-restore", "restore")
        return RawRestore(
            runc=t1 - t0,
            first=t2 - t0,
            count=int(m.group(1)) if m else -1,
            criu_restore_s=stats.get("restore_time", 0) / 1e6 if stats else float("nan"),
        )
    finally:
        if w_fd >= 0:
            os.close(w_fd)
        stderr.close()
        delete_raw(bed, raw_id)
        os.close(r_fd)
        thread.join(timeout=5)
        remove_tree(bundle)


def warm_up_restore(bed: TestBed, rb: RawBundle) -> None:
    """Not counted: a plain runc restore right after the checkpoint. The first restore of an
    archive after its checkpoint is often 2-4x slower inside CRIU (256 MiB: restore_time 1.02 and
    1.09 s in two of four runs, then 0.2-0.5 s; the grid's 4 GiB: 17-21 s, then 5-8 s), whichever
    path comes first; parts 2 and 4 start with podshim, so its first sample carried it."""
    w = raw_restore(bed, rb, 999)
    say(f"  warm-up (plain runc restore, not counted): CRIU restore_time {w.criu_restore_s:.3f}s")


def delete_raw(bed: TestBed, raw_id: str) -> None:
    subprocess.run(runc_argv(bed, "kill", raw_id, "KILL"), capture_output=True, timeout=30)
    for _ in range(50):
        res = subprocess.run(runc_argv(bed, "delete", "--force", raw_id), capture_output=True, timeout=30)
        if res.returncode == 0 or not (Path(bed.runc_root) / raw_id).exists():
            return
        time.sleep(0.1)
    say(f"warning: runc delete {raw_id} failed: {res.stderr.decode(errors='replace').strip()}")


def sandbox_alone(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, name: str) -> float:
    """Reference: RunPodSandbox of an empty pod (pause + CNI), the part of a restore into a new pod
    that a raw runc restore into an existing pod's namespaces does not pay."""
    config = pods.pod_config(name, bed.pod_logs_dir)
    sync_disk()
    t0 = time.perf_counter()
    pod_id = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=300).pod_sandbox_id
    took = time.perf_counter() - t0
    remove_pod(rt, pod_id)
    return took


class PipeLines:
    """Reads a pipe in a thread; remembers when the first count line and the first verify line came."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.first: tuple[float, bytes] | None = None
        self.verify: tuple[float, bytes] | None = None
        self.got_first = threading.Event()
        self.got_verify = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            now = time.perf_counter()
            for line in lines:
                if self.first is None and COUNT_RE.search(line):
                    self.first = (now, line)
                    self.got_first.set()
                if self.verify is None and VERIFY_RE.search(line):
                    self.verify = (now, line)
                    self.got_verify.set()
        self.got_first.set()
        self.got_verify.set()


def start_lazy_daemon(images: Path, work: Path) -> subprocess.Popen[bytes]:
    """A plain ``criu lazy-pages`` serving ``images`` from ``work``, once it listens (its status fd)."""
    r_fd, w_fd = os.pipe()
    try:
        daemon = subprocess.Popen(
            [CRIU, "lazy-pages", "--images-dir", str(images), "--work-dir", str(work),
             "--status-fd", str(w_fd), "-o", "lazy-pages.log"],
            pass_fds=(w_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(w_fd)
        w_fd = -1
        if os.read(r_fd, 1) != b"\0":
            daemon.kill()
            daemon.wait()
            tail = (work / "lazy-pages.log").read_text(errors="replace").splitlines()[-4:]
            raise RuntimeError(f"criu lazy-pages did not start: {' | '.join(tail)}")
        return daemon
    finally:
        if w_fd >= 0:
            os.close(w_fd)
        os.close(r_fd)
