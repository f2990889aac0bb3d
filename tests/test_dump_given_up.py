"""A dump podshim gives up on never kills the container it dumps (docs/design/crash-safety.md
(Cancellation)), on runc and crun.

CRIU makes each task it dumps run system calls it injects (compel: while it infects the task,
and while it cures it after its memory was dumped). CRIU ended at such an instant leaves the task
to run into CRIU's int3 untraced: it dies of SIGTRAP. That is what ended a counter container of
tests/test_checkpoint_pod.py::test_criu_failure_is_internal_and_cleaned at high load: podshim
SIGKILLed the counter's CRIU when the other container's dump failed. Here real CRIU is held at
those instants by construction (testbed/criu_hold.c, preloaded into the CRIU that a second
podshim's runc/crun start) while podshim gives the dump up: another container's CRIU fails, or
the caller's deadline passes. The counter must keep counting with its memory intact.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from test_checkpoint_pod import (
    assert_empty,
    assert_memory_intact,
    busybox,
    container_state,
    counter,
    counter_pid,
    empty_dir,
    start_pod,
    wait_counting,
)

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import criu_hold, pods
from testbed.bed import TestBed
from testbed.checks import verbose_info

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="criu_hold reads x86-64 registers"),
]

Rt = api_pb2_grpc.RuntimeServiceStub
HOLD_WAIT = 60.0  # for CRIU to reach the instant it is held at (runc's and CRIU's start, a dump)


class Held:
    """A podshim whose runc/crun start CRIU with criu_hold.so, its stub and its state dir."""

    def __init__(self, rt: Rt, hold: criu_hold.CriuHold, state_dir: Path) -> None:
        self.rt, self.hold, self.state_dir = rt, hold, state_dir

    def journal(self) -> list[Path]:
        return sorted((self.state_dir / "ops").glob("*.json"))


@pytest.fixture
def held(bed: TestBed, tmp_path: Path) -> Iterator[Held]:
    hold = criu_hold.CriuHold(tmp_path / "hold", criu_hold.build(Path(bed.base_dir)))
    (tmp_path / "podshim").mkdir()
    with bed.extra_podshim(tmp_path / "podshim", env=hold.env()) as (sock, _log), hold:
        yield Held(pods.stubs(sock)[0], hold, tmp_path / "podshim" / "state")


class Call(threading.Thread):
    """CheckpointPod in the background; `error` is the RpcError (None: it succeeded)."""

    def __init__(self, rt: Rt, pod_id: str, out: Path, timeout: float) -> None:
        super().__init__(daemon=True)
        self.rt, self.pod_id, self.out, self.timeout = rt, pod_id, out, timeout
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        req = cri.CheckpointPodRequest(
            pod_sandbox_id=self.pod_id,
            container_ids=pods.running_ids(self.rt, self.pod_id),
            output_path=str(self.out),
        )
        try:
            self.rt.CheckpointPod(req, timeout=self.timeout)
        except grpc.RpcError as e:
            self.error = e


def assert_still_counting(held: Held, pod: pods.Pod, counters: list[str]) -> None:
    """Every counter RUNNING, counting and its memory intact; podshim's journal closed."""
    pods.wait_for(lambda: not held.journal(), 90, what=f"podshim's journal closed ({held.journal()})")
    for name in counters:
        cid = pod.containers[name]
        st = held.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
        assert st.state == cri.CONTAINER_RUNNING, (
            f"{name} is {cri.ContainerState.Name(st.state)} after the dump was given up (exit code "
            f"{st.exit_code}; 133 = 128 + SIGTRAP: it ran into CRIU's int3)"
        )
        wait_counting(pod, name, ticks=3, timeout=30)
        assert_memory_intact(held.rt, pod, name)


def test_a_failure_while_another_container_is_infected(
    bed: TestBed, held: Held, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """One container's CRIU fails (an established TCP connection) while the counter's CRIU is in
    the middle of infecting the counter: podshim lets the counter's dump finish, then answers
    INTERNAL naming the failed container, the pod thawed and the output path empty."""
    script = (
        f"sleep 1000 | nc -l -p 7777 & {pods.until_listening(7777)}; "
        "exec nc 127.0.0.1 7777 </dev/zero >/dev/null"
    )
    pod = start_pod(
        held.rt,
        "given-up-fail",
        log_root,
        pod_cleanup,
        {"tcp": busybox("tcp", script), "counter": counter("counter", mem_mib=192)},
        runtime_handler,
    )
    wait_counting(pod, "counter", 3, timeout=60)
    counter_task = counter_pid(held.rt, pod.containers["counter"])
    tcp_task = int(verbose_info(held.rt, pod.containers["tcp"])["pid"])
    # both CRIUs held at their first injected call: the order below is by construction
    held.hold.arm(criu_hold.FIRST_INJECTED, [counter_task, tcp_task])
    out = empty_dir(bed, "given-up-fail")
    call = Call(held.rt, pod.id, out, timeout=300)
    call.start()
    criu = held.hold.wait_held([counter_task, tcp_task], HOLD_WAIT)
    held.hold.disarm()
    os.kill(criu[tcp_task], signal.SIGCONT)  # goes on, and fails on the TCP connection
    call.join(300)
    assert not call.is_alive()
    assert call.error is not None, "CheckpointPod succeeded with an established TCP connection"
    assert call.error.code() == grpc.StatusCode.INTERNAL, call.error.details()
    assert "'tcp'" in (call.error.details() or "") and "--tcp-established" in (call.error.details() or "")
    assert_still_counting(held, pod, ["counter"])
    assert container_state(held.rt, pod.containers["tcp"]) == cri.CONTAINER_RUNNING
    assert_empty(out)


def test_the_deadline_while_a_large_container_is_cured(
    bed: TestBed, held: Held, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    """The caller's deadline passes after CRIU dumped a large container's memory, while CRIU
    removes its parasite from the counter (held there until podshim gives the dump up): podshim
    lets CRIU finish, thaws, empties the output path and closes its journal."""
    pod = start_pod(
        held.rt,
        "given-up-deadline",
        log_root,
        pod_cleanup,
        {"counter": counter("counter", mem_mib=512)},
        runtime_handler,
    )
    wait_counting(pod, "counter", 3, timeout=60)
    task = counter_pid(held.rt, pod.containers["counter"])
    held.hold.arm(criu_hold.CURE, [task])
    out = empty_dir(bed, "given-up-deadline")
    deadline = HOLD_WAIT / 3  # the memory dumped well within it; CRIU then held past it, whatever it is
    call = Call(held.rt, pod.id, out, timeout=deadline)
    start = time.monotonic()
    call.start()
    try:
        held.hold.wait_held([task], deadline)
    except TimeoutError:
        held.hold.release_all()
        pytest.fail(f"CRIU did not dump 512 MiB within the {deadline:.0f} s deadline here")
    reached = time.monotonic() - start
    held.hold.disarm()
    call.join(deadline + 5)
    assert reached < deadline, "the deadline passed before CRIU was held: the case was not made"
    assert call.error is not None and call.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, call.error
    assert_still_counting(held, pod, ["counter"])
    assert_empty(out)
