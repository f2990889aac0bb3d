"""A caller's directory replaced by a symlink to somewhere else while podshim checkpoints into it:
podshim holds the directory it validated open and writes, chmods, lists and
removes only through that descriptor, so nothing outside the allowed roots is touched and the
call fails instead of answering OK for an archive the caller's path does not hold.

A failpoint sleeps right after the freeze; a watcher swaps the directory as soon as podshim has
prepared it (before runc/CRIU start), so the dump, the rootfs diff, the chmods, the checksums and
the manifest all come after the swap.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from testbed import pods
from testbed.bed import TestBed
from testbed.checks import freezer_state

from .helpers import (
    FailpointPodshim,
    Rt,
    assert_thawed_and_counting,
    journal_files,
    new_output_dir,
    start_counter_pod,
    tree_listing,
    wait_journal_empty,
    wait_serving,
)

pytestmark = pytest.mark.e2e

SLEEP = "sleep:2"  # after the freeze: time for the watcher to swap before runc starts


def fingerprint(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under `root` (and root itself): type and mode, size, mtime, content hash."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [".", *dirnames, *filenames]:
            p = Path(dirpath) / n
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def outside(bed: TestBed) -> Iterator[Path]:
    """A directory outside the allowed roots, with files and directories of the wrong modes for
    an archive (0644, 0755) and the layout a checkpoint would write into."""
    d = Path(bed.base_dir) / f"outside-{secrets.token_hex(3)}"
    (d / "containers" / "counter" / "checkpoint").mkdir(parents=True)
    (d / "sandbox").mkdir()
    for p in (d, d / "containers", d / "containers" / "counter", d / "sandbox"):
        p.chmod(0o755)
    (d / "containers" / "counter" / "checkpoint").chmod(0o755)
    (d / "keep.txt").write_text("caller data outside the roots\n")
    (d / "keep.txt").chmod(0o644)
    (d / "sandbox" / "note").write_text("not podshim's\n")
    (d / "sandbox" / "note").chmod(0o644)
    assert d.resolve().is_relative_to(Path(bed.base_dir).resolve())
    assert not d.resolve().is_relative_to(Path(bed.checkpoint_root).resolve())
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Swapper:
    """Watches for `ready(dir)`, then moves `dir` away and puts a symlink to `to` in its place."""

    def __init__(self, target: Path, to: Path, ready: Callable[[Path], bool]) -> None:
        self.target, self.to, self.ready = target, to, ready
        self.moved = target.with_name(target.name + ".moved")
        self.swapped = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.ready(self.target):
                os.rename(self.target, self.moved)
                os.symlink(self.to, self.target)
                self.swapped.set()
                return
            time.sleep(0.001)

    def __enter__(self) -> Swapper:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def cleanup(self) -> None:
        if self.target.is_symlink():
            self.target.unlink()
        shutil.rmtree(self.moved, ignore_errors=True)
        shutil.rmtree(self.target, ignore_errors=True)


def _call(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _failed_replaced(code: grpc.StatusCode, details: str) -> None:
    assert code == grpc.StatusCode.FAILED_PRECONDITION, f"{code}: {details}"
    assert "replaced during the checkpoint" in details, details


def test_output_path_swapped_mid_checkpoint_pod(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], outside: Path
) -> None:
    cp = start_counter_pod(rt, bed, "swap-pod", pod_cleanup, mem_mib=16)
    out = new_output_dir(bed, "swap-pod")
    before = fingerprint(outside)
    swap = Swapper(out, outside, lambda d: (d / "containers" / "counter" / "checkpoint").is_dir())
    try:
        with FailpointPodshim(bed, f"checkpoint.after-freeze={SLEEP}") as fp, swap:
            code, details = _call(
                lambda: fp.rt.CheckpointPod(
                    cri.CheckpointPodRequest(
                        pod_sandbox_id=cp.id, container_ids=pods.running_ids(rt, cp.id), output_path=str(out)
                    ),
                    timeout=120,
                )
            )
            assert swap.swapped.is_set(), "the watcher never swapped the output path"
            assert fingerprint(outside) == before, "podshim wrote, chmod'ed or removed outside the roots"
            _failed_replaced(code, details)
            # what podshim wrote went into the directory it held, and is gone again
            assert tree_listing(swap.moved) == []
            assert not journal_files(bed)
            assert_thawed_and_counting(fp.rt, cp)
    finally:
        swap.cleanup()
    wait_serving(rt)
    wait_journal_empty(bed)


def test_location_swapped_mid_checkpoint_container(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], outside: Path
) -> None:
    cp = start_counter_pod(rt, bed, "swap-ctr", pod_cleanup, mem_mib=16)
    loc = new_output_dir(bed, "swap-loc")
    before = fingerprint(outside)
    staged = lambda d: any(n.startswith(".podshim-checkpoint") for n in os.listdir(d))  # noqa: E731
    swap = Swapper(loc, outside, staged)
    try:
        with FailpointPodshim(bed, f"checkpoint-container.after-freeze={SLEEP}") as fp, swap:
            code, details = _call(
                lambda: fp.rt.CheckpointContainer(
                    cri.CheckpointContainerRequest(
                        container_id=cp.pod.containers["counter"], location=str(loc)
                    ),
                    timeout=120,
                )
            )
            assert swap.swapped.is_set(), "the watcher never swapped the location"
            assert fingerprint(outside) == before, "podshim wrote outside the roots"
            _failed_replaced(code, details)
            assert tree_listing(swap.moved) == [], "the staging dir was left behind"
            assert not journal_files(bed)
            assert_thawed_and_counting(fp.rt, cp)
    finally:
        swap.cleanup()
    wait_serving(rt)


# (failpoint the checkpoint is held at, what is planted in output_path then): a directory where
# podshim makes its own, one inside its layout, and one it never writes
PLANTS = (
    ("before-prepare", "sandbox"),
    ("before-prepare", "containers/counter"),
    ("before-prepare", "planted"),
    ("after-freeze", "planted/deeper"),
    ("after-freeze", "containers/other"),
)


def test_subdirectory_planted_after_the_emptiness_check(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], tmp_path: Path
) -> None:
    """A sub-directory planted in output_path between the emptiness check and the dump:
    FAILED_PRECONDITION every time, never INTERNAL; the pod thawed, output_path left
    empty, nothing written elsewhere."""
    cp = start_counter_pod(rt, bed, "plant", pod_cleanup)
    # each failpoint holds the checkpoint (on podshim's loop) until its file exists: the planter
    # sees the hold, plants, then creates the file, whatever the machine's speed
    release = {point: tmp_path / f"release-{point}" for point in ("before-prepare", "after-freeze")}
    spec = ",".join(f"checkpoint.{point}=wait:{path}" for point, path in release.items())
    container = cp.cgroups[1]
    held = {
        # journaled, which comes after the emptiness check: the failpoint is next, then _prepare
        "before-prepare": lambda: bool(journal_files(bed)),
        # the container frozen (it is THAWED between the calls): the cut is made, the dumps wait
        # at their gates until the failpoint lets the call on
        "after-freeze": lambda: freezer_state(container) == "FROZEN",
    }
    with FailpointPodshim(bed, spec) as fp:
        for point, rel in PLANTS:
            out = new_output_dir(bed, "plant")
            for other, path in release.items():  # only this case's failpoint holds the call
                if other == point:
                    path.unlink(missing_ok=True)
                else:
                    path.touch()
            planted = threading.Event()

            def plant(
                point: str = point, out: Path = out, rel: str = rel, done: threading.Event = planted
            ) -> None:
                try:
                    pods.wait_for(held[point], 60, interval=0.001, what=f"the checkpoint held at {point}")
                    (out / rel).mkdir(parents=True, exist_ok=True)
                    done.set()
                finally:
                    release[point].touch()  # never leaves podshim held

            planter = threading.Thread(target=plant, daemon=True)
            planter.start()
            code, details = _call(
                lambda out=out: fp.rt.CheckpointPod(
                    cri.CheckpointPodRequest(
                        pod_sandbox_id=cp.id, container_ids=pods.running_ids(rt, cp.id), output_path=str(out)
                    ),
                    timeout=120,
                )
            )
            planter.join(70)
            assert planted.is_set(), f"{point} {rel}: not planted while the checkpoint was held"
            assert code == grpc.StatusCode.FAILED_PRECONDITION, f"{point} {rel}: {code}: {details}"
            assert "written to by someone else" in details, details
            assert out.is_dir() and not out.is_symlink() and tree_listing(out) == []
            assert not journal_files(bed)
            assert_thawed_and_counting(fp.rt, cp)
    wait_serving(rt)
    wait_journal_empty(bed)
