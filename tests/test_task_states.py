"""The task-state pieces that need no test bed: the task states read before a freeze and settled
after the thaw (shim/checks/taskstate.py), on real processes, and the CRIU config file runc would hand a
dump (shim/criu/rpc_config.py), on a runc state dir laid out here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim import errors
from shim.checks import taskstate
from shim.criu import rpc_config


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_state(pid: int, want: str) -> None:
    end = time.monotonic() + 5
    while state(pid) != want:
        assert time.monotonic() < end, f"{pid} never reached {want}: {state(pid)}"
        time.sleep(0.005)


@pytest.fixture
def sleepers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Two sleeping processes, the 'cgroup' of the test (cgroup_procs answers their pids)."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    pids = [p.pid for p in procs]
    monkeypatch.setattr(taskstate, "cgroup_procs", lambda cg: pids if cg == "cg" else [])
    yield pids
    for p in procs:
        p.kill()
        p.wait()


def test_a_task_stopped_since_the_read_is_resumed(sleepers: list[int]) -> None:
    states = taskstate.TaskStates(["cg"])
    os.kill(sleepers[0], signal.SIGSTOP)  # what a leftover leave-stopped does
    wait_state(sleepers[0], "T")
    found = states.settle()
    assert [t.pid for t in found.resumed] == [sleepers[0]] and not found.still_stopped
    assert state(sleepers[0]) != "T"
    assert "1 task(s) of pod p were left stopped" in found.describe("pod p")


def test_a_task_stopped_before_the_freeze_stays_stopped(sleepers: list[int]) -> None:
    os.kill(sleepers[1], signal.SIGSTOP)
    wait_state(sleepers[1], "T")
    states = taskstate.TaskStates(["cg"])
    found = states.settle()
    assert not found and state(sleepers[1]) == "T"  # not ours to resume
    os.kill(sleepers[1], signal.SIGCONT)


def test_settle_reports_in_the_answer_and_the_metric(sleepers: list[int]) -> None:
    from shim import metrics

    metric = metrics.tasks_resumed.labels("checkpoint_pod")
    before = metric._value.get()
    notes = errors.collect_caller_notes()
    states = taskstate.TaskStates(["cg"])
    for pid in sleepers:
        os.kill(pid, signal.SIGSTOP)
        wait_state(pid, "T")
    found = taskstate.settle(states, "checkpoint_pod", "pod p")
    assert found is not None and len(found.resumed) == 2
    assert metric._value.get() == before + 2
    assert len(notes) == 1 and "resumed with SIGCONT" in notes[0]
    assert taskstate.settle(None, "checkpoint_pod", "pod p") is None


def test_reading_costs_one_file_per_thread() -> None:
    """The reads lie outside the freeze window; what one costs is printed for the record (-s), not
    asserted (a time bound here would only measure this machine's load: non-negotiable 4). What
    keeps it cheap is asserted instead: one read of a process's threads finds each thread of it,
    and opens nothing but their stat and status files (and the task directory)."""
    pids = [os.getpid()]
    tids = {int(t) for t in os.listdir("/proc/self/task")}
    taskstate_cgroup = taskstate.cgroup_procs
    opened: list[str] = []
    active = [True]  # an audit hook stays for the process's life: it records this read only

    def audit(event: str, args: tuple) -> None:
        if active[0] and event == "open" and isinstance(args[0], str) and args[0].startswith("/proc/"):
            opened.append(args[0])

    try:
        taskstate.cgroup_procs = lambda cg: pids  # type: ignore[assignment]
        sys.addaudithook(audit)
        t0 = time.perf_counter()
        found = taskstate.read_tasks(["cg"])
        per = time.perf_counter() - t0
    finally:
        active[0] = False
        taskstate.cgroup_procs = taskstate_cgroup  # type: ignore[assignment]
    assert {t.tid for t in found.values()} >= tids
    reading = opened.copy()
    per_thread = [p for p in reading if "/task/" in p and p.rsplit("/", 1)[1] in ("stat", "status")]
    assert len(reading) - len(per_thread) <= 1 and len(per_thread) <= 2 * len(found)
    print(f"\nread_tasks of one process ({len(tids)} threads): {per * 1e6:.0f} µs, {len(reading)} files")


# ---------------------------------------------------------------------------- rpc_config


def runc_state(root: Path, cid: str, labels: list[str]) -> None:
    (root / cid).mkdir(parents=True)
    (root / cid / "state.json").write_text(json.dumps({"config": {"labels": labels}}))


def test_a_restores_leftover_config_is_removed(tmp_path: Path) -> None:
    conf = tmp_path / "bundle" / "podshim-restore" / "criu.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("tcp-close\nleave-stopped\n")
    runc_state(tmp_path / "root", "c1", ["bundle=/b", f"org.criu.config={conf}"])
    assert rpc_config.check_before_dump(str(tmp_path / "root"), True, "c1", "app") == str(conf)
    assert not conf.exists()
    assert rpc_config.check_before_dump(str(tmp_path / "root"), True, "c1", "app") is None  # idempotent


def test_an_empty_annotation_and_crun_need_nothing(tmp_path: Path) -> None:
    runc_state(tmp_path, "c1", ["org.criu.config="])
    assert rpc_config.check_before_dump(str(tmp_path), True, "c1", "app") is None
    assert rpc_config.check_before_dump(str(tmp_path), False, "nope", "app") is None
    assert rpc_config.check_before_dump(str(tmp_path), True, "missing", "app") is None


def test_a_foreign_config_overriding_the_dump_is_refused(tmp_path: Path) -> None:
    conf = tmp_path / "ops.conf"
    conf.write_text("# the operator's\n--leave-stopped\nlog-file x.log\nno-tcp-established\n")
    runc_state(tmp_path / "root", "c1", [f"org.criu.config={conf}"])
    with pytest.raises(errors.FailedPrecondition) as err:
        rpc_config.check_before_dump(str(tmp_path / "root"), True, "c1", "app")
    assert "leave-stopped, tcp-established" in err.value.message and str(conf) in err.value.message
    conf.write_text("log-file x.log\n")  # options podshim does not decide: accepted
    assert rpc_config.check_before_dump(str(tmp_path / "root"), True, "c1", "app") is None
    assert conf.exists()
