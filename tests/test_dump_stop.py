"""stop_dump (shim/criu/runtime.py): a dump podshim gives up on is killed only when it holds no
task; one that holds tasks (ptrace, as CRIU does from its seize to its end) is let finish, and
killed only once taken for hung. Real processes and real ptrace (root): a stand-in for CRIU seizes
a `sleep`, as CRIU seizes the container's tasks. The e2e tests with CRIU itself are in
tests/test_dump_given_up.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.criu import runtime

# A stand-in for CRIU: seizes `target` (PTRACE_SEIZE, as CRIU does), says so, then holds it for
# `hold` seconds and exits (the kernel detaches the task); a negative `target` seizes nothing.
TRACER = """
import ctypes, sys, time
target, hold = int(sys.argv[1]), float(sys.argv[2])
if target > 0:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(0x4206, target, None, None) != 0:  # PTRACE_SEIZE
        sys.exit(f"PTRACE_SEIZE: errno {ctypes.get_errno()}")
print("ready", flush=True)
time.sleep(hold)
"""


@pytest.fixture
def task() -> Iterator[int]:
    """A task for the stand-in to seize (what a container's process is to CRIU)."""
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    yield p.pid
    p.kill()
    p.wait()


def tracer(target: int, hold: float) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", TRACER, str(target), str(hold)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as podshim starts runc
    )
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_dump_that_holds_no_task_is_killed_at_once(tmp_path: Path, task: int) -> None:
    p = tracer(-1, 1000)
    start = time.monotonic()
    runtime.stop_dump(p.pid, tmp_path, finish_wait=30)
    assert time.monotonic() - start < 5
    assert p.wait(5) == -signal.SIGKILL
    assert alive(task)


def test_a_dump_that_holds_a_task_is_let_finish(tmp_path: Path, task: int) -> None:
    p = tracer(task, 1.0)
    runtime.stop_dump(p.pid, tmp_path, finish_wait=30)
    assert p.wait(5) == 0, "the stand-in for CRIU was killed while it held a task"
    assert alive(task)
    with open(f"/proc/{task}/status") as f:
        assert "TracerPid:\t0\n" in f.read()


def test_a_dump_stopped_by_someone_else_is_continued(tmp_path: Path, task: int) -> None:
    p = tracer(task, 1.0)
    os.kill(p.pid, signal.SIGSTOP)  # a stopped CRIU never lets the tasks go
    runtime.stop_dump(p.pid, tmp_path, finish_wait=30)
    assert p.wait(5) == 0
    assert alive(task)


def test_a_dump_that_never_ends_is_killed_after_the_wait(tmp_path: Path, task: int) -> None:
    p = tracer(task, 1000)
    start = time.monotonic()
    runtime.stop_dump(p.pid, tmp_path, finish_wait=1.0)
    assert 1.0 <= time.monotonic() - start < 10
    assert p.wait(5) == -signal.SIGKILL
    assert alive(task)  # a seized task that runs no injected code outlives its tracer
