"""The check that a container's cgroup holds only its process tree (shim/checks/strays.py,
CheckpointPod's and CheckpointContainer's check_dumpable), with real processes: a container's
shell forks while its cgroup is read."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import errors
from shim.checks import strays
from shim.ops import checkpoint_checks
from shim.sandbox import ContainerView


@pytest.fixture
def shell() -> Iterator[subprocess.Popen[str]]:
    """A shell that starts a `sleep` child for each line it reads (a container's main process)."""
    proc = subprocess.Popen(
        ["sh", "-c", "while read line; do sleep 30 & done"], stdin=subprocess.PIPE, text=True
    )
    yield proc
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.kill()
    proc.wait()


def fork_child(shell: subprocess.Popen[str]) -> int:
    """Have `shell` start one more child; its pid."""
    before = {p.pid for p in psutil.Process(shell.pid).children()}
    assert shell.stdin is not None
    shell.stdin.write("go\n")
    shell.stdin.flush()
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:
        new = {p.pid for p in psutil.Process(shell.pid).children()} - before
        if new:
            return new.pop()
        time.sleep(0.005)
    raise AssertionError("the shell started no child")


def view(pid: int) -> ContainerView:
    return ContainerView(
        id="c1",
        name="app",
        state=cri.CONTAINER_RUNNING,
        status=cri.ContainerStatus(),
        config={},
        spec={"linux": {"cgroupsPath": "/fake"}},
        pid=pid,
        runtime_root="/nonexistent",
        runtime_binary="runc",
    )


def test_outside_tree_keeps_descendants_and_drops_the_ended(shell: subprocess.Popen[str]) -> None:
    child = fork_child(shell)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ended = subprocess.Popen(["true"])
    ended.wait()
    try:
        assert strays.outside_tree(shell.pid, [shell.pid, child, stranger.pid, ended.pid]) == [stranger.pid]
    finally:
        stranger.kill()
        stranger.wait()


def test_a_child_forked_after_the_tree_was_listed_is_no_stray(
    shell: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of a container whose shell forks every second (`while …; do sleep 1; done`): the
    cgroup holds a child forked just before it was read. It is in the tree."""
    forked: list[int] = []

    def procs_after_a_fork(cgroup: str) -> list[int]:
        forked.append(fork_child(shell))
        return [shell.pid, *forked]

    monkeypatch.setattr(checkpoint_checks, "cgroup_procs", procs_after_a_fork)
    checkpoint_checks.check_dumpable(view(shell.pid), exec_wait=0)
    assert len(forked) == 1


def test_a_process_outside_the_tree_is_refused(
    shell: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        monkeypatch.setattr(checkpoint_checks, "cgroup_procs", lambda cgroup: [shell.pid, stranger.pid])
        with pytest.raises(errors.FailedPrecondition, match=rf"process {stranger.pid} \(python"):
            checkpoint_checks.check_dumpable(view(shell.pid), exec_wait=0)
    finally:
        stranger.kill()
        stranger.wait()
