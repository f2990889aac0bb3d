"""The task-state invariant after every checkpoint (docs/design/checkpoint-pod.md (Task states
after a checkpoint)): a task the checkpoint left stopped is resumed by podshim, and the
answer, the log and the metric say so, on success and on the deadline's error alike.

The leftover stop is injected the way a stray `leave-stopped` or a signal landing inside the freeze
window leaves it: a failpoint holds the pod frozen after the dumps (`checkpoint.before-thaw`,
`checkpoint-container.before-thaw`: `wait:<file>`, until the test created the file), and the test
SIGSTOPs the counter then, and only then lets it go (or lets the deadline pass); at the thaw the
kernel stops it, with its cgroup THAWED, exactly the state of the bug. No step depends on how fast
this machine is: the hold lasts until the test's stop landed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from testbed import pods
from testbed.bed import TestBed

from .helpers import (
    CALL_TIMEOUT,
    FailpointPodshim,
    Rt,
    assert_thawed_and_counting,
    new_output_dir,
    start_counter_pod,
    wait_journal_empty,
)

pytestmark = pytest.mark.e2e

# the deadline of a call whose pod is held frozen after the dumps until the deadline: ample for
# the checks, the freeze and the dump of the 8 MiB counter (0.2-0.5 s here)
HELD_DEADLINE = 10.0


def counter_pid(rt: Rt, cid: str) -> int:
    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True))
    return int(json.loads(st.info["info"])["pid"])


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def stop_when_dumped(
    fp: FailpointPodshim, pid: int, line: str, seen: int = 0, release: Path | None = None
) -> threading.Thread:
    """SIGSTOP `pid` once the failpoint podshim logged `line` more than `seen` times (its dump is
    over, the pod held frozen), then create `release` (the failpoint's `wait:` file: the thaw)."""

    def run() -> None:
        pods.wait_for(lambda: fp.log_text().count(line) > seen, timeout=60, interval=0.01, what=line)
        os.kill(pid, signal.SIGSTOP)
        if release is not None:
            release.touch()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def notable(fp: FailpointPodshim) -> list[str]:
    """The failpoint podshim's log lines about the checkpoint (for a failure's message)."""
    return [line[:300] for line in fp.log_text().splitlines() if '"method"' not in line][-12:]


def call_with_trailer(call: Callable[..., Any], request: Any, timeout: float) -> dict[str, str]:
    _resp, c = call.with_call(request, timeout=timeout)
    return dict(c.trailing_metadata() or ())


def test_a_task_left_stopped_is_resumed(bed: TestBed, rt: Rt, pod_cleanup: list[str], tmp_path: Path) -> None:
    cp = start_counter_pod(rt, bed, "stopped-left", pod_cleanup)
    cid = cp.pod.containers["counter"]
    pid = counter_pid(rt, cid)
    pod_go, ctr_go = tmp_path / "thaw-pod", tmp_path / "thaw-container"
    spec = f"checkpoint.before-thaw=wait:{pod_go},checkpoint-container.before-thaw=wait:{ctr_go}"
    with FailpointPodshim(bed, spec) as fp:
        # CheckpointPod answers OK, with a notice; the counter was resumed
        stopper = stop_when_dumped(fp, pid, '"container dumped"', release=pod_go)
        out = new_output_dir(bed, "stopped-left")
        trailer = call_with_trailer(
            fp.rt.CheckpointPod,
            cri.CheckpointPodRequest(
                pod_sandbox_id=cp.id, container_ids=pods.running_ids(rt, cp.id), output_path=str(out)
            ),
            CALL_TIMEOUT,
        )
        stopper.join()
        assert "resumed with SIGCONT" in trailer.get("podshim-notice", ""), (trailer, notable(fp))
        assert proc_state(pid) != "T"
        assert_thawed_and_counting(rt, cp)
        assert "tasks disturbed by the checkpoint" in fp.log_text()

        # CheckpointContainer alike
        dumped = fp.log_text().count('"container dumped"')
        stopper = stop_when_dumped(fp, pid, '"container dumped"', dumped, release=ctr_go)
        target = new_output_dir(bed, "stopped-left-ctr") / "counter.tar"
        trailer = call_with_trailer(
            fp.rt.CheckpointContainer,
            cri.CheckpointContainerRequest(container_id=cid, location=str(target)),
            CALL_TIMEOUT,
        )
        stopper.join()
        assert "resumed with SIGCONT" in trailer.get("podshim-notice", ""), (trailer, notable(fp))
        assert target.is_file() and proc_state(pid) != "T"
        assert_thawed_and_counting(rt, cp)
    wait_journal_empty(bed)


def test_a_task_left_stopped_at_the_deadline_is_resumed(
    bed: TestBed, rt: Rt, pod_cleanup: list[str], tmp_path: Path
) -> None:
    """The deadline passes while the pod is held frozen (until a file nobody creates: the deadline
    cancels the hold): DEADLINE_EXCEEDED, whose message says the counter was resumed, and the pod
    runs on."""
    cp = start_counter_pod(rt, bed, "stopped-deadline", pod_cleanup)
    pid = counter_pid(rt, cp.pod.containers["counter"])
    with FailpointPodshim(bed, f"checkpoint.before-thaw=wait:{tmp_path / 'never'}") as fp:
        stopper = stop_when_dumped(fp, pid, '"container dumped"')
        out = new_output_dir(bed, "stopped-deadline")
        with pytest.raises(grpc.RpcError) as err:
            fp.rt.CheckpointPod(
                cri.CheckpointPodRequest(
                    pod_sandbox_id=cp.id, container_ids=pods.running_ids(rt, cp.id), output_path=str(out)
                ),
                timeout=HELD_DEADLINE,
            )
        stopper.join()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        pods.wait_for(lambda: "resumed with SIGCONT" in fp.log_text(), timeout=10, what="the log line")
        pods.wait_for(lambda: proc_state(pid) != "T", timeout=10, what="the counter resumed")
        assert_thawed_and_counting(rt, cp)
        assert os.listdir(out) == []
    wait_journal_empty(bed)
