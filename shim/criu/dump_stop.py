"""A dump podshim no longer wants, ended without harm to the container it dumps: its processes
found, stopped, looked at, and killed only once CRIU holds nothing of the container's
(docs/design/crash-safety.md (Cancellation))."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from shim.deadlines import DUMP_FINISH_WAIT, DUMP_LOOK_INTERVAL, DUMP_STOP_CONFIRM, KILL_WAIT


def dump_processes(pgid: int, image_dir: Path) -> list[int]:
    """Live (not zombie) processes of a dump: the members of runc's process group (runc, its
    CRIU and CRIU's helpers), and any process whose command line names the image dir (CRIU
    titles itself `criu: dump --rpc ... -D <image_dir>`: found in another group too)."""
    needle = os.fsencode(os.path.realpath(image_dir))  # a /proc/self/fd/N/... path: where it is
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rfind(b")") + 2 :].split()
            if fields[0] == b"Z":
                continue
            if int(fields[2]) == pgid:
                found.append(int(entry.name))
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read()
            if b"criu" in os.path.basename(argv.split(b"\0", 1)[0]) and needle in argv:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


def end_dump(pgid: int, image_dir: Path, timeout: float = KILL_WAIT) -> None:
    """SIGKILL every process of a dump (see dump_processes) and wait until none is left. Only
    for a dump that holds no task of the container, or one taken for hung (see stop_dump)."""
    end = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        left = dump_processes(pgid, image_dir)
        if not left:
            return
        if time.monotonic() > end:
            from shim import logs

            logs.get("shim.criu.dump_stop").error(
                "runtime/CRIU processes of a dump outlived SIGKILL", pids=left, image_dir=str(image_dir)
            )
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _state(pid: int) -> str:
    """The scheduler state letter of `pid` (R, S, D, T...), "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2 :].split(maxsplit=1)[0].decode()
    except (OSError, IndexError):
        return ""


def _stop_all(pgid: int, image_dir: Path, timeout: float) -> tuple[list[int], bool]:
    """SIGSTOP every process of a dump until a listing finds them all stopped (a CRIU stopped
    can no longer seize a task nor inject code into one). Returns the processes and whether
    they all stopped within `timeout` (one in uninterruptible sleep stops only when it wakes)."""
    end = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGSTOP)  # the group at once: a fork under way is restarted
        procs = dump_processes(pgid, image_dir)
        for pid in procs:  # a CRIU outside runc's group too
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        if all(_state(pid) in ("T", "t", "") for pid in procs) and dump_processes(pgid, image_dir) == procs:
            return procs, True
        if time.monotonic() > end:
            return procs, False
        time.sleep(0.005)


def _tracees(tracers: set[int]) -> dict[int, list[int]]:
    """Every thread on the node that one of `tracers` holds with ptrace (TracerPid), by process."""
    found: dict[int, list[int]] = {}
    for proc in os.scandir("/proc"):
        if not proc.name.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{proc.name}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{proc.name}/task/{tid}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"TracerPid:"):
                            if int(line.split()[1]) in tracers:
                                found.setdefault(int(proc.name), []).append(int(tid))
                            break
            except (OSError, ValueError, IndexError):
                continue
    return found


# compel's injected system call (compel/arch/x86/src/lib/infect.c, code_syscall: syscall; int3...)
# and the name of the memfd that holds CRIU's parasite in a task (compel/include/infect-priv.h)
_INJECTED_CALL = {"x86_64": bytes((0x0F, 0x05, 0xCC, 0xCC, 0xCC, 0xCC, 0xCC, 0xCC))}
_PARASITE_MEMFD = b"CRIUMFD"
_USER_SPACE_END = 1 << 47


def _untouched(pid: int, tids: list[int]) -> bool:
    """Whether CRIU holds task `pid` (its traced threads `tids`) without anything of CRIU's in it:
    each thread stopped by ptrace at a PC in the task's own code (a file or the vDSO), no parasite
    mapped, no injected call (nor the parasite memfd's name) at the start of any of its code
    mappings. A CRIU killed then leaves the task as it was: ptrace lets it go. Anything unknown
    (another architecture, a file that cannot be read) says no."""
    call = _INJECTED_CALL.get(os.uname().machine)
    if call is None:
        return False
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            maps = f.read().splitlines()
        code: list[tuple[int, int]] = []  # executable mappings
        own: list[tuple[int, int]] = []  # of them, the task's own code
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split(b"-"))
            path = fields[5] if len(fields) > 5 else b""
            if _PARASITE_MEMFD in path:
                return False
            if b"x" in fields[1] and lo < _USER_SPACE_END:
                code.append((lo, hi))
                if path.startswith(b"/") or path == b"[vdso]":
                    own.append((lo, hi))
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for lo, _hi in code:
                mem.seek(lo)
                head = mem.read(len(call) + len(_PARASITE_MEMFD))
                if head.startswith(call) or head[len(call) :].startswith(_PARASITE_MEMFD):
                    return False
        for tid in tids:
            if _state(tid) != "t":
                return False
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                regs = f.read().split()
            if not regs or regs[0] == "running":
                return False
            pc = int(regs[-1], 16)
            if not any(lo <= pc < hi for lo, hi in own):
                return False
    except (OSError, ValueError, IndexError):
        return False
    return True


def _releasable(procs: list[int]) -> bool:
    """Whether the dump's processes (stopped) can be killed without harm to what they dump: they
    hold no task, or only tasks with nothing of CRIU's in them (_untouched)."""
    return all(_untouched(pid, tids) for pid, tids in _tracees(set(procs)).items())


def _continue(pgid: int, procs: list[int]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGCONT)
    for pid in procs:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)


def stop_dump(
    pgid: int,
    image_dir: Path,
    finish_wait: float = DUMP_FINISH_WAIT,
    confirm: float = DUMP_STOP_CONFIRM,
    interval: float = DUMP_LOOK_INTERVAL,
) -> None:
    """End a dump podshim no longer wants (its caller's deadline, another container's failure, a
    service stop, runc gone) without killing what it dumps, and return once none of its
    processes is left (docs/design/crash-safety.md (Cancellation)).

    CRIU holds the container's tasks with ptrace from the seize to the end of the dump, and for
    parts of it runs code in them: a system call it injected (compel: `syscall; int3` swapped
    into the task's text, its registers set to the call) while it infects and cures each task,
    its parasite in between. CRIU killed then (SIGKILL, and SIGTERM or SIGINT alike: CRIU has no
    handler for them) leaves the task, no longer traced, to run into the int3: it dies of
    SIGTRAP. CRIU's own SIGALRM timeout is no safe stop either: it makes the call under way fail
    with EINTR, wherever that is. So every process of the dump is stopped (SIGSTOP: a stopped
    CRIU can neither seize nor inject) and looked at: if the tasks it holds have nothing of
    CRIU's in them (_releasable: none held yet, or all cured), the dump is killed, which touches
    nothing of the container. Otherwise it is continued (one that someone else stopped too: a
    stopped CRIU never lets the tasks go) and looked at again every `interval`, until it ends by
    itself or the tasks are released; one still holding them after `finish_wait` is taken for
    hung and killed, logged as such.

    Before the caller thaws either way: CRIU, when it ends, puts back the freezer state it
    found (FROZEN: podshim's cut), which must not land after the thaw."""
    procs, stopped = _stop_all(pgid, image_dir, confirm)
    if not procs:
        return
    if stopped and _releasable(procs):
        end_dump(pgid, image_dir)  # nothing of CRIU's runs in the tasks: the kill touches none
        return
    from shim import logs

    log = logs.get("shim.criu.dump_stop")
    log.warning(
        "a dump given up on runs CRIU's code in the container's tasks: letting CRIU go on",
        pids=procs,
        image_dir=str(image_dir),
    )
    _continue(pgid, procs)
    end = time.monotonic() + finish_wait
    while True:
        time.sleep(interval)
        procs, stopped = _stop_all(pgid, image_dir, confirm)
        if not procs:
            return
        if stopped and _releasable(procs):
            end_dump(pgid, image_dir)
            return
        if time.monotonic() > end:
            log.error(
                f"a dump given up on still holds the tasks after {finish_wait:.0f}s: taken for hung, killed",
                pids=procs,
                image_dir=str(image_dir),
            )
            end_dump(pgid, image_dir)
            return
        _continue(pgid, procs)
