"""The environment failing under a running CheckpointPod: CRIU killed mid-dump, containerd
restarted mid-operation, the checkpoint filesystem filled by another writer mid-dump (the size
estimate before the freeze cannot foresee that).

"Mid-dump" by construction, whatever the machine's speed: the podshim under test preloads
testbed/criu_hold.c into the CRIU its runc starts, and CRIU holds itself once it wrote so many
bytes of the counter's memory images, in its own code, where ending it leaves the counter
unharmed (CriuHold.arm_pages); the test acts, then lets it go.

After each: a typed error naming what failed (or, where the failure cannot touch the dump, a
complete archive), the pod THAWED and counting, output_path empty, the journal empty, podshim
serving, and the next CheckpointPod succeeding.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from shim.archive import manifest as mf
from testbed import _sys, pods
from testbed.bed import TestBed

from .helpers import (
    HELD_DEADLINE,
    HOLD_DUMP,
    Call,
    CounterPod,
    FailpointPodshim,
    Rt,
    assert_checkpoint_works,
    assert_empty_dir,
    assert_thawed_and_counting,
    checkpoint,
    counter_task,
    held_criu,
    held_podshim,
    journal_files,
    new_output_dir,
    processes_under,
    start_counter_pod,
    wait_journal_empty,
    wait_reaching_containerd,
    wait_serving,
)

pytestmark = pytest.mark.e2e


def _after(rt: Rt, bed: TestBed, cp: CounterPod, out: Path) -> None:
    wait_serving(rt)
    wait_journal_empty(bed)
    assert_thawed_and_counting(rt, cp)
    assert_empty_dir(out)
    assert processes_under(out) == []


def _pages_written(out: Path) -> int:
    return sum(f.stat().st_size for f in out.glob("containers/*/checkpoint/pages-*.img"))


def test_criu_killed_mid_dump(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], tmp_path: Path
) -> None:
    """CRIU SIGKILLed 32 MiB into the counter's 512 MiB of memory images (held there: nothing of
    CRIU's runs in the counter then, whose parasite lets it go on when CRIU's socket closes): an
    INTERNAL error naming the container and the CRIU log, kept outside output_path."""
    cp = start_counter_pod(rt, bed, "criu-killed", pod_cleanup, mem_mib=512)
    task = counter_task(rt, cp)
    out = new_output_dir(bed, "criu-killed")
    archives.append(out)
    with held_podshim(bed, tmp_path / "hold") as (held_fp, hold):
        held_rt = held_fp.rt
        hold.arm_pages(32 << 20)
        call = Call(held_rt, cp.id, out)
        call.start()
        criu = held_criu(hold, task, call.is_alive, "32 MiB into the counter's memory")
        assert _pages_written(out) >= 32 << 20 and call.is_alive()
        _sys.kill(criu, signal.SIGKILL)
        call.join(120)
        assert not call.is_alive(), "CheckpointPod did not end after its CRIU was killed"
        assert call.error is not None, "CheckpointPod succeeded although CRIU was killed"
        code, details = call.error.code(), call.error.details() or ""
        print(f"CRIU killed mid-dump: {code}: {details}")
        assert code == grpc.StatusCode.INTERNAL, details
        assert "'counter'" in details and "CRIU log" in details
        kept = Path(details.rsplit("CRIU log: ", 1)[1].rstrip(")"))
        assert kept.is_file(), f"the CRIU log {kept} was not kept"
        assert not kept.is_relative_to(out), "the CRIU log was not kept outside output_path"
        _after(held_rt, bed, cp, out)
        archives.append(assert_checkpoint_works(held_rt, bed, cp))


def test_containerd_down_at_checkpoint(rt: Rt, bed: TestBed, pod_cleanup: list[str]) -> None:
    cp = start_counter_pod(rt, bed, "upstream-down", pod_cleanup, mem_mib=8)
    out = new_output_dir(bed, "upstream-down")
    bed.stop_containerd()
    try:
        with pytest.raises(grpc.RpcError) as err:
            checkpoint(rt, cp.id, out, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert str(bed.containerd_socket) in (err.value.details() or "")
        assert_empty_dir(out)
        assert journal_files(bed) == []
    finally:
        bed.start_containerd()
    wait_reaching_containerd(rt)
    _after(rt, bed, cp, out)
    shutil.rmtree(assert_checkpoint_works(rt, bed, cp))
    out.rmdir()


def test_containerd_restarted_mid_checkpoint(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], tmp_path: Path
) -> None:
    """containerd stops while CRIU dumps a 512 MiB pod (held 1 MiB into its memory images until
    containerd is down) and comes back. The dump itself needs only runc and CRIU (podshim talks
    to containerd before it), so the call may complete; either way the result is whole: a
    verified archive, or an error and an empty output_path."""
    cp = start_counter_pod(rt, bed, "upstream-restart", pod_cleanup, mem_mib=512)
    task = counter_task(rt, cp)
    out = new_output_dir(bed, "upstream-restart")
    archives.append(out)
    with held_podshim(bed, tmp_path / "hold") as (held_fp, hold):
        held_rt = held_fp.rt
        hold.arm_pages(1 << 20)
        call = Call(held_rt, cp.id, out)
        call.start()
        held_criu(hold, task, call.is_alive, "1 MiB into the counter's memory")
        bed.stop_containerd()
        try:
            assert call.is_alive(), "CheckpointPod ended while its CRIU was held"
            hold.release_all()  # the rest of the dump, and what follows, with containerd down
            call.join(120)
        finally:
            bed.start_containerd()
        assert not call.is_alive(), "CheckpointPod did not end"
        wait_reaching_containerd(held_rt)
        if call.error is None:
            print(f"containerd restarted mid-checkpoint: CheckpointPod OK in {call.seconds:.2f}s")
            m = mf.load_and_verify(out, [str(bed.checkpoint_root)])
            assert m.container("counter").checkpointed
            shutil.rmtree(out)
            out.mkdir(mode=0o700)
        else:
            details = call.error.details() or ""
            print(f"containerd restarted mid-checkpoint: {call.error.code()}: {details}")
            assert call.error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), details
        _after(held_rt, bed, cp, out)
        archives.append(assert_checkpoint_works(held_rt, bed, cp))


@pytest.fixture
def small_fs(bed: TestBed) -> Iterator[Path]:
    """A 512 MiB tmpfs mounted inside the allowed checkpoint root (unmounted after): room enough
    for the up-front size estimate of a 256 MiB pod, so the check before the freeze lets it pass."""
    mnt = Path(bed.checkpoint_root) / "small-fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def _fill(fs: Path) -> Path:
    """Take every free byte of `fs` (another writer on the node), as a file beside the archive."""
    filler = fs / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
    return filler


def test_checkpoint_filesystem_full(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], small_fs: Path, tmp_path: Path
) -> None:
    """The filesystem had room when podshim estimated the archive (before the freeze), then another
    writer took it all while CRIU dumped (held 1 MiB into the counter's memory images until the
    filesystem is full): RESOURCE_EXHAUSTED naming the container, the pod thawed."""
    cp = start_counter_pod(rt, bed, "disk-full", pod_cleanup, mem_mib=256)
    task = counter_task(rt, cp)
    out = new_output_dir(bed, "disk-full", parent=small_fs)
    with held_podshim(bed, tmp_path / "hold") as (held_fp, hold):
        held_rt = held_fp.rt
        hold.arm_pages(1 << 20)
        call = Call(held_rt, cp.id, out)
        call.start()
        held_criu(hold, task, call.is_alive, "1 MiB into the counter's memory")
        filler = _fill(small_fs)
        assert call.is_alive(), "CheckpointPod ended while its CRIU was held"
        hold.release_all()  # the other 255 MiB go into a full filesystem
        call.join(120)
        assert not call.is_alive(), "CheckpointPod did not end"
        assert call.error is not None, "CheckpointPod succeeded although its filesystem was full"
        code, details = call.error.code(), call.error.details() or ""
        print(f"checkpoint filesystem full: {code}: {details}")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "no space left on its filesystem" in details, details
        assert "'counter'" in details
        kept = Path(details.rsplit("CRIU log: ", 1)[1].split(")")[0])  # a path that outlives the call
        assert kept.is_file() and not str(kept).startswith("/proc/"), details
        filler.unlink()
        _after(held_rt, bed, cp, out)
        assert [p.name for p in small_fs.iterdir()] == [out.name]
        shutil.rmtree(assert_checkpoint_works(held_rt, bed, cp))


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_caller_gives_up_mid_dump(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], how: str, tmp_path: Path
) -> None:
    """The caller's deadline passes, or the caller cancels, while CRIU dumps: podshim stops the
    dump, thaws the pod and removes the partial files (whether or not anyone still listens). The
    deadline runs out during a dump step held longer than it (HOLD_DUMP), whatever this machine's
    speed, once runc and CRIU have ended (a small counter: they end well within HELD_DEADLINE; a
    CRIU still dumping at the deadline is let finish first, tests/test_dump_given_up.py); the
    cancel comes while CRIU is held 1 MiB into the memory images of a large one, and podshim
    lets it finish (it continues the held CRIU when it gives the dump up, as in
    tests/test_dump_given_up.py)."""
    cp = start_counter_pod(rt, bed, f"gives-up-{how}", pod_cleanup, mem_mib=512 if how == "cancel" else 64)
    out = new_output_dir(bed, f"gives-up-{how}")
    archives.append(out)
    req = cri.CheckpointPodRequest(
        pod_sandbox_id=cp.id, container_ids=pods.running_ids(rt, cp.id), output_path=str(out)
    )
    if how == "deadline":
        with FailpointPodshim(bed, HOLD_DUMP) as fp, pytest.raises(grpc.RpcError) as err:
            fp.rt.CheckpointPod(req, timeout=HELD_DEADLINE)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        assert "did not finish within the caller's deadline" in (err.value.details() or "")
        print(f"deadline mid-dump: {err.value.code()}: {err.value.details()}")
        wait_journal_empty(bed)
        _after(rt, bed, cp, out)
        archives.append(assert_checkpoint_works(rt, bed, cp))
        return
    task = counter_task(rt, cp)
    with held_podshim(bed, tmp_path / "hold") as (held_fp, hold):
        held_rt = held_fp.rt
        hold.arm_pages(1 << 20)
        fut = held_rt.CheckpointPod.future(req, timeout=60)
        held_criu(hold, task, lambda: not fut.done(), "1 MiB into the counter's memory")
        assert fut.cancel(), "CheckpointPod ended while its CRIU was held"
        wait_journal_empty(bed)
        _after(held_rt, bed, cp, out)
        archives.append(assert_checkpoint_works(held_rt, bed, cp))
