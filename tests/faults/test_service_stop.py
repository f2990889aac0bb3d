"""A service stop under a running checkpoint: what `systemctl stop/restart podshim` does to runc,
CRIU and podshim.

* The runtime process killed mid-dump (SIGTERM to `runc checkpoint`, alone or with its process
  group, CRIU included: what the unit's old `KillMode=control-group` did): the operation fails,
  and the container is thawed and STAYS thawed (an orphaned CRIU used to put back the FROZEN
  state it found a second later, with no journal record left to undo it).
* podshim alone SIGTERMed mid-checkpoint (`KillMode=mixed`): it stops accepting calls, lets the
  operation finish or aborts it, thaws, closes the journal and exits by itself.

After each: the pod THAWED (polled for a while after the answer), running and counting, the
journal empty, output_path empty or a complete archive, and the next checkpoint works.

"Mid-dump" by construction, whatever the machine's speed: the podshim under test preloads
testbed/criu_hold.c into the CRIU its runc/crun start, and CRIU holds itself 32 MiB into the
counter's memory images, in its own code, where ending it leaves the counter unharmed
(CriuHold.arm_pages); the test signals what it signals, then lets CRIU go on.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from shim.archive import manifest as mf
from shim.server.app import STOP_GRACE
from testbed import _sys, criu_hold, pods
from testbed.bed import TestBed
from testbed.checks import container_cgroup

from .helpers import (
    Call,
    CounterPod,
    Rt,
    assert_checkpoint_works,
    assert_empty_dir,
    assert_thawed_and_counting,
    counter_task,
    freezer_state,
    held_criu,
    held_podshim,
    journal_files,
    new_output_dir,
    processes_under,
    start_counter_pod,
    wait_journal_empty,
    wait_serving,
)

pytestmark = pytest.mark.e2e

WATCH = 3.0  # seconds the freezer is watched after the answer: the orphan CRIU re-froze in ~1-2 s
HOLD_PAGES = 32 << 20  # where CRIU is held: 32 MiB into the counter's 512 MiB of memory images


def _let_go(hold: criu_hold.CriuHold, runtime: int) -> None:
    """Once `runtime` (runc/crun, SIGTERMed) is gone, the held CRIU goes on alone."""
    assert not _sys.wait_gone({runtime}, 30), f"the runtime {runtime} outlived SIGTERM"
    hold.release_all()


def _runtime_pid(out: Path) -> int:
    """The `runc checkpoint` process writing into `out`."""
    found = [
        p for p in processes_under(out) if Path((_sys.read_cmdline(p) or [""])[0]).name in ("runc", "crun")
    ]
    assert found, "no runc/crun checkpoint process found"
    return found[0]


def _never_frozen_again(cgroups: list[str], seconds: float = WATCH) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        states = {cg: freezer_state(cg) for cg in cgroups}
        assert all(s == "THAWED" for s in states.values()), f"frozen again after the answer: {states}"
        time.sleep(0.02)


def _still_counting(rt: Rt, cp: CounterPod, bed: TestBed, out: Path) -> None:
    _never_frozen_again(cp.cgroups)
    wait_journal_empty(bed)
    assert_thawed_and_counting(rt, cp)
    assert processes_under(out) == []


def _crun_counter_pod(rt: Rt, bed: TestBed, handler: str, cleanup: list[str]) -> CounterPod:
    args = ["--mem-mib", "512", "--interval-ms", "100"]
    configs = {"counter": pods.container_config("counter", args=args)}
    pod = pods.run_pod(
        rt, f"term-crun-{secrets.token_hex(3)}", bed.pod_logs_dir, configs, runtime_handler=handler
    )
    cleanup.append(pod.id)
    pods.wait_count(pod.log_path("counter"), 2, timeout=60)
    return CounterPod(pod, [pod.config.linux.cgroup_parent, container_cgroup(rt, pod.containers["counter"])])


@pytest.mark.parametrize("target", ["runc", "process-group", "crun"])
def test_runtime_terminated_mid_dump(
    rt: Rt,
    bed: TestBed,
    pod_cleanup: list[str],
    archives: list[Path],
    target: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """SIGTERM to runc (or crun) alone while CRIU is held mid-dump: once runc is gone CRIU goes on
    alone, and used to re-freeze the pod after the thaw; or to runc's whole process group, CRIU
    included (it dies of it, held or not)."""
    if target == "crun":
        cp = _crun_counter_pod(rt, bed, request.getfixturevalue("crun_handler"), pod_cleanup)
    else:
        cp = start_counter_pod(rt, bed, f"term-{target}", pod_cleanup, mem_mib=512)
    task = counter_task(rt, cp)
    out = new_output_dir(bed, f"term-{target}")
    archives.append(out)
    with held_podshim(bed, tmp_path / "hold") as (fp, hold):
        hold.arm_pages(HOLD_PAGES)
        held_rt = fp.rt
        call = Call(held_rt, cp.id, out)
        call.start()
        held_criu(hold, task, call.is_alive)
        runc = _runtime_pid(out)
        if target in ("runc", "crun"):
            os.kill(runc, signal.SIGTERM)
            _let_go(hold, runc)  # CRIU goes on alone
        else:
            os.killpg(os.getpgid(runc), signal.SIGTERM)
            hold.release_all()  # a CRIU that had a handler for SIGTERM would run it now
        call.join(120)
        assert not call.is_alive(), "CheckpointPod did not end"
        assert call.error is not None, "CheckpointPod succeeded although runc was killed"
        print(f"runc SIGTERMed ({target}): {call.error.code()}: {call.error.details()}")
        assert call.error.code() == grpc.StatusCode.INTERNAL, call.error.details()
        _still_counting(held_rt, cp, bed, out)
        assert_empty_dir(out)
        archives.append(assert_checkpoint_works(held_rt, bed, cp))


def test_container_checkpoint_runtime_terminated_mid_dump(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], tmp_path: Path
) -> None:
    """The same through CheckpointContainer (podshim's own KEP-2008 checkpoint): runc alone."""
    cp = start_counter_pod(rt, bed, "term-ctr", pod_cleanup, mem_mib=512)
    cid = cp.pod.containers["counter"]
    task = counter_task(rt, cp)
    where = new_output_dir(bed, "term-ctr")
    archives.append(where)
    errors: list[grpc.RpcError] = []
    with held_podshim(bed, tmp_path / "hold") as (fp, hold):
        hold.arm_pages(HOLD_PAGES)
        held_rt = fp.rt

        def run() -> None:
            try:
                held_rt.CheckpointContainer(
                    cri.CheckpointContainerRequest(container_id=cid, location=str(where)), timeout=120
                )
            except grpc.RpcError as e:
                errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        held_criu(hold, task, t.is_alive)
        # the staging dir is inside `where`; runc names it in its argv
        runc = [p for p in processes_under(where) if "runc" in Path((_sys.read_cmdline(p) or [""])[0]).name]
        assert runc, "no runc checkpoint process found"
        os.kill(runc[0], signal.SIGTERM)
        _let_go(hold, runc[0])  # CRIU goes on alone
        t.join(120)
        assert not t.is_alive(), "CheckpointContainer did not end"
        assert errors, "CheckpointContainer succeeded although runc was killed"
        assert errors[0].code() == grpc.StatusCode.INTERNAL, errors[0].details()
        _still_counting(held_rt, cp, bed, where)
        assert list(where.iterdir()) == [], "a tar or staging dir was left"


@pytest.mark.parametrize("mode", ["mixed-finishes", "mixed-aborts", "control-group"])
def test_podshim_terminated_mid_checkpoint(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], mode: str, tmp_path: Path
) -> None:
    """SIGTERM to podshim mid-dump, alone (KillMode=mixed, the unit's setting) or with all its
    descendants (runc and CRIU too). podshim stops taking calls and exits by itself; the pod is
    thawed, alive and counting; the journal is closed. mixed-finishes: the dump (CRIU held past
    the 5 s podshim used to give) ends within the grace: the checkpoint completes. mixed-aborts:
    held past the grace: podshim gives it up, continues the held CRIU (which holds the counter:
    killing it could kill the counter) and lets it finish, discards it, thaws and clears
    output_path."""
    cp = start_counter_pod(rt, bed, f"stop-{mode}", pod_cleanup, mem_mib=512)
    task = counter_task(rt, cp)
    out = new_output_dir(bed, f"stop-{mode}")
    archives.append(out)
    with held_podshim(bed, tmp_path / "hold") as (fp, hold):
        hold.arm_pages(HOLD_PAGES)
        held_rt = fp.rt
        call = Call(held_rt, cp.id, out)
        call.start()
        held_criu(hold, task, call.is_alive)
        assert fp.proc is not None
        podshim = fp.proc.pid
        if mode == "control-group":
            # the unit's cgroup: podshim, runc and CRIU; never the pod's own tasks, although the one
            # CRIU's parasite runs in holds CRIU's log (under `out`) open during the dump
            pod_tasks = set().union(*(_sys.cgroup_pids(cg) for cg in cp.cgroups))
            for pid in {podshim, *_sys.descendants({podshim}), *processes_under(out)} - pod_tasks:
                _sys.kill(pid, signal.SIGTERM)
            hold.release_all()  # a CRIU that had a handler for SIGTERM would run it now
        else:
            held_for = 6.0 if mode == "mixed-finishes" else STOP_GRACE + 5.0
            _sys.kill(podshim, signal.SIGTERM)
            start = time.monotonic()
            if mode == "mixed-finishes":
                # draining: a new operation is refused, passed-through calls are still served
                draining = "stopping: letting operations finish"
                pods.wait_for(lambda: draining in fp.log_text(), 10, what=f"{draining!r} in podshim's log")
                assert any(p.id == cp.id for p in held_rt.ListPodSandbox(cri.ListPodSandboxRequest()).items)
                other = new_output_dir(bed, "while-stopping")
                archives.append(other)
                with pytest.raises(grpc.RpcError) as err:
                    held_rt.CheckpointPod(
                        cri.CheckpointPodRequest(
                            pod_sandbox_id=cp.id,
                            container_ids=pods.running_ids(rt, cp.id),
                            output_path=str(other),
                        ),
                        timeout=10,
                    )
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                assert "stopping" in (err.value.details() or "")
            time.sleep(max(0.0, held_for - (time.monotonic() - start)))
            if mode == "mixed-finishes":
                assert call.is_alive(), "CheckpointPod ended while its CRIU was held"
            hold.release_all()  # mixed-aborts: podshim has continued it already, giving the dump up
        assert not _sys.wait_gone({podshim}, STOP_GRACE + 30), "podshim did not stop on SIGTERM"
        call.join(60)
        assert not call.is_alive(), "CheckpointPod did not end"
        print(f"podshim SIGTERMed ({mode}) mid-dump: {call.error.code() if call.error else 'OK'}")
        # nothing frozen, nothing running for the dump, the journal closed: before any restart
        _never_frozen_again(cp.cgroups)
        assert processes_under(out) == []
        assert journal_files(bed) == [], "podshim stopped without closing its journal record"
        if mode == "mixed-finishes":
            assert call.error is None, f"the checkpoint was not let finish: {call.error.details()}"
            mf.load_and_verify(out, [str(bed.checkpoint_root)])
        else:
            assert call.error is not None
            assert_empty_dir(out)
        for n in cp.pod.containers:  # alive and counting without podshim
            last = cp.last_count(n)
            pods.wait_count(cp.pod.log_path(n), last + 2, timeout=15)
    # the bed's podshim started again on the way out
    wait_serving(rt)
    assert_thawed_and_counting(rt, cp)
    archives.append(assert_checkpoint_works(rt, bed, cp))
