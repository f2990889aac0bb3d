"""SIGKILL podshim at each phase of CheckpointPod, then start it again without failpoints.

Each test proves that the crash really happened in the phase it names (the pod is frozen, CRIU
images are on disk, ...), and that after the restart's journal replay: the pod and its
containers are THAWED and keep counting, output_path is empty (and still there), no sandbox,
container or mount appeared, the journal is empty, and the next CheckpointPod succeeds.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from testbed import _sys, criu_hold, pods
from testbed.bed import TestBed
from testbed.checks import FREEZER, set_freezer, verbose_info

from .helpers import (
    CounterPod,
    FailpointPodshim,
    Rt,
    assert_checkpoint_works,
    assert_empty_dir,
    assert_thawed_and_counting,
    checkpoint,
    container_ids,
    freezer_state,
    journal_files,
    new_output_dir,
    processes_under,
    restart_podshim,
    sandbox_ids,
    start_counter_pod,
    tree_listing,
    wait_journal_empty,
    wait_serving,
)

pytestmark = pytest.mark.e2e


def _crash(fp: FailpointPodshim, pod_id: str, out: Path, **fields: int) -> grpc.RpcError:
    """CheckpointPod through the failpoint podshim; it must die on the way."""
    with pytest.raises(grpc.RpcError) as err:
        checkpoint(fp.rt, pod_id, out, timeout=60, **fields)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err.value.details()
    fp.wait_dead(30)
    assert journal_files(fp.bed), "the interrupted checkpoint left no journal record"
    return err.value


def _recovered(
    rt: Rt, bed: TestBed, cp: CounterPod, out: Path, before: tuple[set[str], set[str]], log_mark: int
) -> None:
    wait_serving(rt)
    wait_journal_empty(bed)
    assert_thawed_and_counting(rt, cp)
    assert_empty_dir(out)
    assert (sandbox_ids(rt), container_ids(rt)) == before, "a sandbox or container appeared or vanished"
    assert processes_under(out) == []
    assert not [m for m in _sys.mounts_under(out)], "something is mounted in output_path"
    with open(bed.podshim_log, "rb") as f:
        f.seek(log_mark)
        assert b"recovered interrupted operation" in f.read(), "the recovery was not logged"


def _wait_orphans_gone(out: Path, settle: float = 1.0, timeout: float = 60.0) -> None:
    """Until no process of the orphan dump into `out` is left, for `settle` seconds in a row: one
    empty look is not enough (a CRIU runc has just forked does not name `out` yet; a process
    being exec'ed or exiting shows no fds), and the orphan runc may start another process."""
    deadline = time.monotonic() + timeout
    empty_since: float | None = None
    while time.monotonic() < deadline:
        left = processes_under(out)
        if left:
            empty_since = None
            _sys.wait_gone(set(left), min(1.0, max(0.0, deadline - time.monotonic())))
            continue
        empty_since = empty_since or time.monotonic()
        if time.monotonic() - empty_since >= settle:
            return
        time.sleep(0.05)
    assert processes_under(out) == [], "the orphan dump did not end"


def test_kill_after_freeze(rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path]) -> None:
    cp = start_counter_pod(rt, bed, "crash-frozen", pod_cleanup, mem_mib=16)
    before = (sandbox_ids(rt), container_ids(rt))
    mark = bed.podshim_log.stat().st_size
    out = new_output_dir(bed, "crash-frozen")
    archives.append(out)
    with FailpointPodshim(bed, "checkpoint.after-freeze=kill") as fp:
        _crash(fp, cp.id, out)
        # podshim died holding the pod frozen: exactly what the replay must undo
        assert freezer_state(cp.cgroups[1]) == "FROZEN"
        frozen_at = cp.last_count()
    _recovered(rt, bed, cp, out, before, mark)
    assert cp.last_count() > frozen_at
    archives.append(assert_checkpoint_works(rt, bed, cp))


def test_kill_mid_dump_criu_finishes_before_restart(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path]
) -> None:
    """podshim dies right after starting runc; runc and CRIU (own session) finish the dump alone
    and CRIU puts back the FROZEN state it found: the replay must thaw and clear it."""
    cp = start_counter_pod(rt, bed, "crash-dump", pod_cleanup, mem_mib=32)
    before = (sandbox_ids(rt), container_ids(rt))
    mark = bed.podshim_log.stat().st_size
    out = new_output_dir(bed, "crash-dump")
    archives.append(out)
    with FailpointPodshim(bed, "checkpoint.mid-dump=kill") as fp:
        _crash(fp, cp.id, out)
        _wait_orphans_gone(out)
        left = tree_listing(out)
        assert "containers/counter/checkpoint/inventory.img" in left, left  # the orphan dump completed
        assert "manifest.json" not in left
        assert freezer_state(cp.cgroups[1]) == "FROZEN"  # CRIU restored the state it found
    _recovered(rt, bed, cp, out, before, mark)
    archives.append(assert_checkpoint_works(rt, bed, cp))


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="criu_hold reads x86-64 registers")
def test_kill_mid_dump_criu_outlives_restart(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], tmp_path: Path
) -> None:
    """The orphan runc/CRIU are still dumping when podshim comes back: CRIU holds itself
    (testbed/criu_hold.c) at its first system call injected into the counter, by construction,
    whatever the machine's speed.
    A thaw and clean-up at start would not last (CRIU re-freezes and keeps writing): the replay
    holds the pod (ABORTED) until they end, then thaws and clears."""
    cp = start_counter_pod(rt, bed, "crash-orphan", pod_cleanup, mem_mib=256)
    task = int(verbose_info(rt, cp.pod.containers["counter"])["pid"])
    before = (sandbox_ids(rt), container_ids(rt))
    mark = bed.podshim_log.stat().st_size
    out = new_output_dir(bed, "crash-orphan")
    archives.append(out)
    with criu_hold.CriuHold(tmp_path / "hold", criu_hold.build(Path(bed.base_dir))) as hold:
        hold.arm(criu_hold.FIRST_INJECTED, [task])
        with FailpointPodshim(bed, "checkpoint.mid-dump=kill", env=hold.env()) as fp:
            _crash(fp, cp.id, out)
            criu = hold.wait_held([task], 60)[task]
            orphans = [criu, *processes_under(out)]
            fp.kill()
            restart_podshim(bed)
            wait_serving(rt)
            assert journal_files(bed), "the replay finished while the dump was still running"
            busy = new_output_dir(bed, "while-recovering")
            archives.append(busy)
            with pytest.raises(grpc.RpcError) as err:
                checkpoint(rt, cp.id, busy, timeout=30)
            assert err.value.code() == grpc.StatusCode.ABORTED, err.value.details()
            assert "recovery" in (err.value.details() or "")
        # the held CRIU goes on (hold's exit) and the orphan dump ends
    _sys.wait_gone(set(orphans), 60)
    _recovered(rt, bed, cp, out, before, mark)
    archives.append(assert_checkpoint_works(rt, bed, cp))


def _criu_chain_in(pid: int) -> bool:
    """The CRIU chain (CRIU's netns lock, which podshim puts on once for a tcp-established dump)
    is in the network namespace of process `pid`."""
    res = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "iptables", "-w", "-S"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    return "-j CRIU" in res.stdout


def test_kill_while_the_netns_is_locked(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path]
) -> None:
    """tcp-established: podshim locks the pod's netns once for all the dumps and dies before the
    unlock; the replay removes the lock (journaled before it was taken), or the pod's network
    would stay dropped for good."""
    cp = start_counter_pod(rt, bed, "crash-netlock", pod_cleanup, mem_mib=16)
    before = (sandbox_ids(rt), container_ids(rt))
    mark = bed.podshim_log.stat().st_size
    out = new_output_dir(bed, "crash-netlock")
    archives.append(out)
    pid = int((FREEZER / cp.cgroups[1].lstrip("/") / "cgroup.procs").read_text().split()[0])
    assert not _criu_chain_in(pid)
    with FailpointPodshim(bed, "checkpoint.mid-dump=kill") as fp:
        _crash(fp, cp.id, out, options={"tcp-established": "true"})
        _wait_orphans_gone(out)
        assert _criu_chain_in(pid), "podshim died with the pod's netns locked: the case to recover"
    _recovered(rt, bed, cp, out, before, mark)
    assert not _criu_chain_in(pid), "the replay left the pod's network locked"
    archives.append(assert_checkpoint_works(rt, bed, cp))


def test_kill_while_writing_archive(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path]
) -> None:
    """Dump done and pod thawed, podshim dies before manifest.json: the files must not stay
    (without the manifest nothing tells a complete archive from a partial one)."""
    cp = start_counter_pod(rt, bed, "crash-archive", pod_cleanup, mem_mib=16)
    before = (sandbox_ids(rt), container_ids(rt))
    mark = bed.podshim_log.stat().st_size
    out = new_output_dir(bed, "crash-archive")
    archives.append(out)
    with FailpointPodshim(bed, "checkpoint.archive=kill") as fp:
        _crash(fp, cp.id, out)
        left = tree_listing(out)
        assert "containers/counter/checkpoint/inventory.img" in left and "manifest.json" not in left
        assert freezer_state(cp.cgroups[1]) == "THAWED"
    _recovered(rt, bed, cp, out, before, mark)
    archives.append(assert_checkpoint_works(rt, bed, cp))


@pytest.mark.parametrize("action", ["error", "kill"])
def test_stopped_pod_is_kept_when_its_archive_fails(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], action: str
) -> None:
    """STOPPED kills the pod only once its archive is complete: an error (or a crash of podshim)
    while the archive is written leaves the pod running and thawed, and no archive."""
    cp = start_counter_pod(rt, bed, f"stopped-{action}", pod_cleanup, mem_mib=16)
    before = (sandbox_ids(rt), container_ids(rt))
    mark = bed.podshim_log.stat().st_size
    out = new_output_dir(bed, f"stopped-{action}")
    archives.append(out)
    stopped = {"post_checkpoint_state": cri.POST_CHECKPOINT_STATE_STOPPED}
    with FailpointPodshim(bed, f"checkpoint.archive={action}") as fp:
        if action == "kill":
            _crash(fp, cp.id, out, **stopped)
        else:
            with pytest.raises(grpc.RpcError) as err:
                checkpoint(fp.rt, cp.id, out, timeout=60, **stopped)
            assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
            assert "failpoint checkpoint.archive" in (err.value.details() or "")
            assert_thawed_and_counting(fp.rt, cp)
            assert_empty_dir(out)
    if action == "kill":
        _recovered(rt, bed, cp, out, before, mark)
    else:
        wait_serving(rt)
        assert_thawed_and_counting(rt, cp)
        assert (sandbox_ids(rt), container_ids(rt)) == before


def test_recovery_leaves_a_paused_container_paused(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path]
) -> None:
    """One container paused by someone else before the checkpoint: the cut leaves it paused,
    and so does the recovery after a crash inside the freeze (the journal names only the
    cgroups the checkpoint froze); the other container is thawed and counts again."""
    cp = start_counter_pod(rt, bed, "paused", pod_cleanup, mem_mib=8, containers=("paused", "counter"))
    set_freezer(cp.cgroups[1], "FROZEN")
    try:
        out = new_output_dir(bed, "paused")
        archives.append(out)
        with FailpointPodshim(bed, "checkpoint.after-freeze=kill") as fp:
            _crash(fp, cp.id, out)
        wait_serving(rt)
        wait_journal_empty(bed)
        assert freezer_state(cp.cgroups[1]) == "FROZEN", "recovery thawed a container it had not frozen"
        assert freezer_state(cp.cgroups[0]) == "THAWED" and freezer_state(cp.cgroups[2]) == "THAWED"
        assert_empty_dir(out)
        pods.wait_count(cp.pod.log_path("counter"), cp.last_count("counter") + 2)  # the other counts again
    finally:
        set_freezer(cp.cgroups[1], "THAWED")
