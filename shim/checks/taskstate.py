"""Every task of a checkpointed container ends in the scheduling state it had before the freeze
(docs/design/checkpoint-pod.md (Task states after a checkpoint)).

The freezer being thawed does not say the tasks run: a CRIU told `leave-stopped` (or killed at the
wrong instant, or a signal that landed while the tasks were frozen) leaves them in TASK_STOPPED
with their cgroup THAWED, and every API then reports the pod as running. So the state of every
task (threads included) is read before the freeze, outside the freeze window, and compared after
the thaw: a task stopped now that was not before gets SIGCONT (which resumes its whole thread
group); so does one with a stop signal queued (sent while it was frozen, it stops the instant it
runs, after this check); a task traced now that was not before is reported (it cannot be let go
without killing its tracer). Neither read lies inside the freeze window.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

from shim.cgroups import cgroup_procs

# SIGSTOP always stops; SIGTSTP, SIGTTIN, SIGTTOU when neither ignored nor caught (bit n-1 of the
# masks in /proc/<pid>/task/<tid>/status)
_STOP_ALWAYS = 1 << (signal.SIGSTOP - 1)
_STOP_DEFAULT = sum(1 << (s - 1) for s in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU))


@dataclass(frozen=True)
class Task:
    pid: int  # its thread group (the process)
    tid: int
    state: str  # /proc/<pid>/task/<tid>/stat's one-letter state
    start: int  # start time in clock ticks: a reused tid is another task
    traced: bool  # a tracer is attached (TracerPid)
    stop_pending: bool  # a stop signal is queued: it stops as soon as it runs (thawed a moment ago)

    @property
    def stopped(self) -> bool:
        return self.state == "T" or self.stop_pending


def _read_task(pid: int, tid: int) -> Task | None:
    # status (its pending signals) before stat (its state): a task that takes a queued stop signal
    # dequeues it and enters TASK_STOPPED under its sighand lock, which status's pending read
    # takes too. Read in this order, the signal is seen pending, or else the stop is already set
    # when stat is read. The other order misses a stop that lands between the two reads: the
    # state read still running, the signal already gone from the pending set.
    try:
        with open(f"/proc/{pid}/task/{tid}/status", "rb") as f:
            status = f.read()
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None  # gone meanwhile
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        pending = _field(status, b"SigPnd", 16) | _field(status, b"ShdPnd", 16)
        default = ~(_field(status, b"SigIgn", 16) | _field(status, b"SigCgt", 16))
        stop_pending = bool(pending & (_STOP_ALWAYS | (_STOP_DEFAULT & default)))
        traced = _field(status, b"TracerPid", 10) != 0
        return Task(pid, tid, fields[0].decode(), int(fields[19]), traced, stop_pending)
    except (IndexError, ValueError):
        return None


def _field(status: bytes, name: bytes, base: int) -> int:
    """A number of /proc/<pid>/status (0 when the line is missing)."""
    at = status.find(b"\n" + name + b":")
    if at < 0:
        return 0
    return int(status[at + len(name) + 2 : status.find(b"\n", at + 1)].strip(), base)


def read_tasks(cgroups: list[str]) -> dict[tuple[int, int], Task]:
    """Every task of the processes in `cgroups`, by (tid, start time)."""
    out: dict[tuple[int, int], Task] = {}
    for cg in cgroups:
        for pid in cgroup_procs(cg):
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for name in tids:
                task = _read_task(pid, int(name))
                if task is not None:
                    out[(task.tid, task.start)] = task
    return out


@dataclass
class Disturbed:
    """What the check after the thaw found (and did)."""

    resumed: list[Task]  # stopped by the checkpoint, SIGCONT sent
    traced: list[Task]  # traced since the freeze: reported, left alone
    still_stopped: list[Task]  # stopped again right after the SIGCONT

    def __bool__(self) -> bool:
        return bool(self.resumed or self.traced)

    def describe(self, what: str) -> str:
        parts = []
        if self.resumed:
            tids = ", ".join(str(t.tid) for t in self.resumed[:8])
            parts.append(
                f"{len(self.resumed)} task(s) of {what} were left stopped after the thaw (tid {tids}) "
                "and were resumed with SIGCONT"
            )
        if self.still_stopped:
            parts.append(f"{len(self.still_stopped)} of them stopped again: send them SIGCONT by hand")
        if self.traced:
            tids = ", ".join(str(t.tid) for t in self.traced[:8])
            parts.append(f"{len(self.traced)} task(s) of {what} are traced since the checkpoint (tid {tids})")
        return "; ".join(parts)


class TaskStates:
    """The tasks of the containers' cgroups as they were before the freeze (`before`), and the
    check after the thaw (`settle`)."""

    def __init__(self, cgroups: list[str]) -> None:
        self.cgroups = list(cgroups)
        self.before = read_tasks(self.cgroups)

    def settle(self) -> Disturbed:
        """After the thaw: resume every task stopped now that was not stopped before (a task born
        since the read was running: a new task starts running), report the traced ones."""
        now = read_tasks(self.cgroups)
        stopped, traced = [], []
        for key, task in now.items():
            was = self.before.get(key)
            if task.stopped and task.state != "t" and (was is None or not (was.stopped or was.state == "t")):
                stopped.append(task)
            elif (task.traced or task.state == "t") and (was is None or not was.traced):
                traced.append(task)
        for pid in sorted({t.pid for t in stopped}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # the whole thread group leaves the stop
        again = []
        for t in stopped:
            now_t = _read_task(t.pid, t.tid)
            if now_t is not None and now_t.stopped:
                again.append(now_t)
        return Disturbed(stopped, traced, again)


def settle(states: TaskStates | None, operation: str, what: str, **fields: object) -> Disturbed | None:
    """`states.settle()` after a thaw, reported: a log line, `podshim_checkpoint_tasks_resumed_total`
    and a note in the caller's answer (errors.tell_caller). Never raises: it runs in the `finally`
    that thaws, where an error would hide the operation's own."""
    if states is None:
        return None
    from shim import errors, logs, metrics

    try:
        found = states.settle()
    except Exception:  # noqa: BLE001 - reading /proc failed: say so, the operation's result stands
        logs.get("shim.checks.taskstate").exception(
            "could not check the task states after the thaw", **fields
        )
        return None
    if found:
        message = found.describe(what)
        logs.get("shim.checks.taskstate").warning(
            "tasks disturbed by the checkpoint", detail=message, **fields
        )
        metrics.tasks_resumed.labels(operation).inc(len(found.resumed))
        errors.tell_caller(message)
    return found
