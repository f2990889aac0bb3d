"""stop_dump (shim/criu/dump_stop.py): a dump podshim gives up on is killed only when it holds no
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

from shim.criu import dump_stop

# A stand-in for CRIU (compel's steps, with ctypes): seizes `target` (PTRACE_SEIZE) and, by `mode`,
# also stops it in a ptrace-stop (PTRACE_INTERRUPT) and, for "inject", writes compel's injected
# call (syscall; int3...) over the start of the task's first code mapping; says so, holds it for
# `hold` seconds, puts the code back and exits (the kernel detaches the task); "none" seizes nothing.
TRACER = """
import ctypes, os, sys, time
target, mode, hold = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
def ptrace(req, addr=None, data=None):
    ctypes.set_errno(0)
    r = libc.ptrace(req, target, addr, data)
    if r == -1 and ctypes.get_errno():
        sys.exit(f"ptrace {req:#x}: errno {ctypes.get_errno()}")
    return r
restore = None
if mode != "none":
    ptrace(0x4206)  # PTRACE_SEIZE
if mode in ("interrupt", "inject"):
    ptrace(0x4207)  # PTRACE_INTERRUPT
    os.waitpid(target, 0x40000000)  # __WALL: it is in its ptrace-stop
if mode == "inject":
    start = next(int(l.split("-")[0], 16) for l in open(f"/proc/{target}/maps") if l.split()[1][2] == "x")
    word = ptrace(1, start)  # PTRACE_PEEKTEXT
    ptrace(4, start, int.from_bytes(bytes((0x0F, 0x05) + (0xCC,) * 6), "little"))  # PTRACE_POKETEXT
    restore = (start, word & (2**64 - 1))
print("ready", flush=True)
time.sleep(hold)
if restore:
    ptrace(4, restore[0], restore[1])
"""


@pytest.fixture
def task() -> Iterator[int]:
    """A task for the stand-in to seize (what a container's process is to CRIU)."""
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    yield p.pid
    p.kill()
    p.wait()


def tracer(target: int, hold: float, mode: str = "seize") -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", TRACER, str(target), mode, str(hold)],
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
    p = tracer(task, 1000, "none")
    start = time.monotonic()
    dump_stop.stop_dump(p.pid, tmp_path, finish_wait=30)
    assert time.monotonic() - start < 5
    assert p.wait(5) == -signal.SIGKILL
    assert alive(task)


def test_a_dump_that_holds_a_task_is_let_finish(tmp_path: Path, task: int) -> None:
    p = tracer(task, 1.0)
    dump_stop.stop_dump(p.pid, tmp_path, finish_wait=30)
    assert p.wait(5) == 0, "the stand-in for CRIU was killed while it held a task"
    assert alive(task)
    with open(f"/proc/{task}/status") as f:
        assert "TracerPid:\t0\n" in f.read()


def test_a_dump_stopped_by_someone_else_is_continued(tmp_path: Path, task: int) -> None:
    p = tracer(task, 1.0)
    os.kill(p.pid, signal.SIGSTOP)  # a stopped CRIU never lets the tasks go
    dump_stop.stop_dump(p.pid, tmp_path, finish_wait=30)
    assert p.wait(5) == 0
    assert alive(task)


def test_a_dump_that_never_ends_is_killed_after_the_wait(tmp_path: Path, task: int) -> None:
    p = tracer(task, 1000)
    start = time.monotonic()
    dump_stop.stop_dump(p.pid, tmp_path, finish_wait=1.0)
    assert 1.0 <= time.monotonic() - start < 10
    assert p.wait(5) == -signal.SIGKILL
    assert alive(task)  # a seized task that runs no injected code outlives its tracer


def test_a_dump_that_holds_tasks_with_nothing_of_its_own_in_them_is_killed_at_once(
    tmp_path: Path, task: int
) -> None:
    """Seized and stopped (CRIU between its seize and its first injected call, or after its cure):
    killing the tracer lets the task go as it was."""
    p = tracer(task, 1000, "interrupt")
    start = time.monotonic()
    dump_stop.stop_dump(p.pid, tmp_path, finish_wait=30)
    assert time.monotonic() - start < 5
    assert p.wait(5) == -signal.SIGKILL
    assert alive(task) and state(task) != "t"


def test_a_dump_with_its_call_injected_in_a_task_is_let_finish(tmp_path: Path, task: int) -> None:
    """compel's `syscall; int3` in the task's code: a kill now would leave it there; the tracer is
    let put the code back and end."""
    p = tracer(task, 1.5, "inject")
    dump_stop.stop_dump(p.pid, tmp_path, finish_wait=30)
    assert p.wait(5) == 0, "the stand-in for CRIU was killed with its call injected"
    assert alive(task)


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
