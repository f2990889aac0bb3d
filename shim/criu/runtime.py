"""Drives the OCI runtime that runs the containers (runc or crun) to checkpoint them with CRIU.

podshim always goes through the OCI runtime, never CRIU directly: the runtime knows the
container's namespaces, mounts, cgroups and the descriptors to re-attach on restore.

podshim-runc's restore imports this module for `restore_argv` and `CriuOptions` on every
restore's StartContainer, so asyncio and the logging set-up (structlog) are imported where the
dump uses them, not here (docs/design/runtime-wrapper.md (The runtime wrapper)).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim import contract, errors, faults
from shim.deadlines import (
    DUMP_FINISH_WAIT,
    DUMP_LOOK_INTERVAL,
    DUMP_STOP_CONFIRM,
    GATE_LOOK,
    GATE_WAIT,
    KILL_WAIT,
    NETLOCK_TIMEOUT,
    VERSION_TIMEOUT,
)

CRIU_LOG_TAIL = 6
# Error lines CRIU prints on every run of this kind of host without failing because of them
# (no CAP_SYS_RESOURCE to raise its own RLIMIT_NOFILE): kept out of error messages.
_HARMLESS = ("Can't setup RLIMIT_NOFILE for self",)
_CRIU_ERROR = re.compile(r"\bError \(")


@dataclass(frozen=True)
class CriuOptions:
    """CRIU behaviour podshim exposes (CheckpointPod `options`, documented in docs/checkpoint-restore.md)."""

    file_locks: bool = True  # as CRI-O: a locked file would otherwise fail the dump
    tcp_established: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False
    ghost_limit: int = 0  # bytes of a deleted-but-open file CRIU keeps in the images; 0: its 1 MiB
    irmap_scan_paths: tuple[str, ...] = ()  # where CRIU looks for the paths of watched files

    def config_lines(self) -> list[str]:
        """CRIU options neither runc nor crun has a flag for: lines of a CRIU config file (the
        CRIU they start reads the one CRIU_CONFIG_FILE names)."""
        out = [f"ghost-limit {self.ghost_limit}"] if self.ghost_limit else []
        return out + [f"irmap-scan-path {p}" for p in self.irmap_scan_paths]

    def dump_config_lines(self) -> list[str]:
        """The CRIU config file of a dump: `config_lines` and `network-lock skip`. CRIU's network
        lock (iptables-restore in the pod's shared netns before and after every container's
        dump) only keeps established TCP connections still while they are dumped, and costs each
        dump four iptables-restore runs (lock and unlock, IPv4 and IPv6) inside the freeze window,
        serialised by the shared netns and colliding on one chain: without `tcp_established`
        nothing needs it; with it the caller takes the same lock once for the pod (`NetnsLock`;
        docs/design/checkpoint-pod.md (The freeze window))."""
        return [*self.config_lines(), "network-lock skip"]

    def flags(self) -> list[str]:
        """runc's and crun's switches: --<name> of each contract.CRIU_SWITCHES entry that is on."""
        return [f"--{name}" for name, attr in contract.CRIU_SWITCHES.items() if getattr(self, attr)]

    def switches_record(self) -> dict[str, str]:
        """The switches as a manifest's `options` entries ("true"/"false")."""
        return {name: str(getattr(self, attr)).lower() for name, attr in contract.CRIU_SWITCHES.items()}

    @classmethod
    def from_record(cls, record: str) -> CriuOptions:
        """The options of a restore record (contract.to_record): the named switches on, every
        other one off."""
        on = {name for name in record.split(",") if name}
        switches: dict[str, Any] = {attr: name in on for name, attr in contract.CRIU_SWITCHES.items()}
        return cls(**switches)


def criu_path_env(criu: str, path: str | None = None) -> dict[str, str]:
    """`PATH` with the configured CRIU's directory first ({} when it cannot name it): runc >= 1.2
    ignores `--criu` and runs the `criu` on its PATH, crun's libcriu runs `criu` from PATH, and
    containerd 2.x passes no CriuPath, so a CRIU outside PATH (the package's /opt/podshim/sbin/criu,
    a private build) is reached only so. It must be named `criu` (docs/design/versions.md
    (containerd, runc and CRIU versions))."""
    if not os.path.isabs(criu) or os.path.basename(criu) != "criu":
        return {}
    rest = os.environ.get("PATH", os.defpath) if path is None else path
    return {"PATH": f"{os.path.dirname(criu)}:{rest}"}


_GATE_SCRIPT = """#!/bin/bash
# podshim's DumpGate (docs/design/checkpoint-pod.md (The freeze window)): this CRIU, started before
# the pod's cut, waits here with its start-up done and nothing seized, until podshim says go
# (CRIU runs it for its other actions too: they pass at once)
[ "$CRTOOLS_SCRIPT_ACTION" = pre-dump ] || exit 0
exec 3<>"{fifo}" || exit 1
: >"{ready}"
# podshim still there: its pid, with the start time it had (field 22 of stat, the 20th after comm)
podshim() {{
  local s
  {{ s=$(</proc/{pid}/stat); }} 2>/dev/null || return 1
  set -- ${{s##*) }}
  [ "${{20}}" = "{start}" ]
}}
end=$((SECONDS + {wait}))
# a read that times out mid-line has consumed what it read (bash reads a FIFO byte by byte and
# keeps the partial input in the variable): kept, so a "go" split by the timeout is still "go"
got=
while [ "$SECONDS" -lt "$end" ] && podshim; do
  if read -r -t {look} word <&3; then [ "$got$word" = go ] && exit 0; break; fi
  got="$got$word"
done
rm -rf "{dir}"  # the dump ends here: told no, podshim gone, or too late
exit 1
"""


def _start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (its start time, in clock ticks since boot): with the pid, names
    one process, not whichever later reuses its pid."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def _made(scratch: str | None) -> str | None:
    """`scratch` made if missing (0700; a podshim that never ran app.run: tests, tools)."""
    if scratch:
        os.makedirs(scratch, 0o700, exist_ok=True)
    return scratch


class DumpGate:
    """Lets a dump start before the pod is frozen and hold at CRIU's `pre-dump` action script,
    where runc's and CRIU's start-up (runc, its CRIU version check, CRIU's kernel probe) is done
    and nothing is seized yet; `open` lets it seize the (by then frozen) container. `close`
    without `open` (or podshim killed: the script looks every GATE_LOOK) fails the dump at the
    gate ("Pre dump script failed"), before anything is touched (docs/design/checkpoint-pod.md (The
    freeze window))."""

    def __init__(self, scratch: str | None = None) -> None:
        import asyncio
        import tempfile

        self.passed = asyncio.Event()  # set by `open` or `close`: the dump may go on (or fail)
        # in podshim's scratch dir (Config.scratch_dir, emptied at start), else the temp dir
        self.dir = Path(tempfile.mkdtemp(prefix="podshim-gate-", dir=_made(scratch)))
        self.fifo = self.dir / "go"
        self.ready_file = self.dir / "ready"
        self.config_file = self.dir / "podshim-criu-dump.conf"  # the dump's CRIU config (_criu_config)
        os.mkfifo(self.fifo, 0o600)
        # read-write, here and in the script: no open of the FIFO ever blocks
        self.fd: int | None = os.open(self.fifo, os.O_RDWR | os.O_CLOEXEC)
        self.script = self.dir / "pre-dump"
        pid = os.getpid()
        self.script.write_text(
            _GATE_SCRIPT.format(
                dir=self.dir,
                fifo=self.fifo,
                ready=self.ready_file,
                wait=int(GATE_WAIT),  # bash counts whole seconds
                look=GATE_LOOK,
                pid=pid,
                start=_start_time(pid),
            )
        )
        self.script.chmod(0o700)

    def config_line(self) -> str:
        return f"action-script {self.script}"

    def ready(self) -> bool:
        """Whether the dump's CRIU waits at the gate."""
        return self.ready_file.exists()

    def open(self) -> None:
        if self.fd is not None:
            os.write(self.fd, b"go\n")
        self.passed.set()

    def close(self) -> None:
        """Ends the gate: a dump waiting at it without `open` reads "no" and fails there; one not
        there yet finds no FIFO (unlinked first: the script opens it read-write, so no open ever
        blocks; a podshim killed meanwhile: within GATE_LOOK the script fails and removes
        the directory)."""
        if self.fd is not None and not self.passed.is_set():
            os.write(self.fd, b"no\n")
        for f in (self.fifo, self.script, self.ready_file, self.config_file):
            with contextlib.suppress(OSError):
                f.unlink()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.passed.set()
        with contextlib.suppress(OSError):
            self.dir.rmdir()


@contextlib.contextmanager
def _criu_config(
    opts: CriuOptions,
    criu: str,
    extra: tuple[str, ...] = (),
    scratch: str | None = None,
    gate: DumpGate | None = None,
) -> Iterator[dict[str, str]]:
    """The environment of a dump: CRIU_CONFIG_FILE naming a private file with the options
    runc/crun have no flag for, and the configured CRIU first on PATH. The file goes in the
    `gate`'s directory when the dump has one and is removed with it, after the checkpoint: an
    unlink waits for the disk where the file system discards freed blocks, and here it would
    block the event loop while the pod is frozen (docs/design/checkpoint-pod.md (The freeze window)).
    Without a gate: in `scratch`, else the temp dir, removed after the dump."""
    env = {**os.environ, **criu_path_env(criu)}
    lines = [*opts.dump_config_lines(), *extra]
    if not lines:
        yield env
        return
    text = "\n".join(lines) + "\n"
    if gate is not None:
        path = str(gate.config_file)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        yield {**env, "CRIU_CONFIG_FILE": path}
        return
    import tempfile  # here: it imports `random`, which podshim-runc's restore never needs

    fd, path = tempfile.mkstemp(prefix="podshim-criu-", suffix=".conf", dir=_made(scratch))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        yield {**env, "CRIU_CONFIG_FILE": path}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


# CRIU's own network lock (criu/net.c, iptables_network_lock_internal and its unlock), taken by
# podshim once per pod instead of once per container: every packet in or out of the pod's netns
# dropped but those CRIU's TCP repair marks (SOCCR_MARK 0xC114).
_LOCK_RULES = (
    "*filter\n:CRIU - [0:0]\n-I INPUT -j CRIU\n-I OUTPUT -j CRIU\n"
    "-A CRIU -m mark --mark 0xC114 -j ACCEPT\n-A CRIU -j DROP\nCOMMIT\n"
)
_UNLOCK_RULES = "*filter\n:CRIU - [0:0]\n-D INPUT -j CRIU\n-D OUTPUT -j CRIU\n-X CRIU\nCOMMIT\n"


class NetnsLock:
    """The pod's network namespace locked as CRIU locks it for a dump of established TCP
    connections, once for every container (docs/design/checkpoint-pod.md (The freeze window)):
    `lock` before the dumps, `unlock` (idempotent, run in a `finally`) after the last one."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self.locked: list[str] = []  # the tools whose tables hold the lock

    def _restore(self, tool: str, rules: str) -> None:
        argv = ["nsenter", f"--net={self.netns}", tool, "-w", "--noflush"]
        try:
            res = subprocess.run(argv, input=rules, capture_output=True, text=True, timeout=NETLOCK_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise errors.Internal(
                f"cannot run {tool} in the pod's network namespace {self.netns}: {e}"
            ) from e
        if res.returncode != 0:
            raise errors.Internal(
                f"{tool} in the pod's network namespace {self.netns} exited {res.returncode}: "
                f"{(res.stderr or res.stdout).strip()[-300:]}"
            )

    @staticmethod
    def _tools() -> list[str]:
        # as CRIU: IPv6 too when the kernel has it
        return ["iptables-restore", *(["ip6tables-restore"] if os.path.exists("/proc/net/if_inet6") else [])]

    def lock(self) -> None:
        """Lock IPv4 and IPv6 (one iptables-restore transaction each); a failure leaves what was
        locked to `unlock`."""
        for tool in self._tools():
            self._restore(tool, _LOCK_RULES)
            self.locked.append(tool)

    def unlock(self) -> None:
        """Undo `lock`; Internal naming the netns if that fails (the pod's network would stay
        dropped)."""
        failures = []
        for tool in self.locked:
            try:
                self._restore(tool, _UNLOCK_RULES)
            except errors.Internal as e:
                failures.append(e.message)
        self.locked = []
        if failures:
            raise errors.Internal(
                f"could not unlock the pod's network namespace {self.netns} after the dumps: "
                f"{'; '.join(failures)}; remove the CRIU chain there by hand (iptables -D INPUT -j CRIU; "
                "iptables -D OUTPUT -j CRIU; iptables -X CRIU)"
            )

    @classmethod
    def unlock_leftover(cls, netns: str) -> bool:
        """Remove a lock that a crashed CheckpointPod left in `netns` (recovery): every table that
        still has the CRIU chain is unlocked; a netns that is gone has nothing to unlock. True if
        a lock was found. Internal if one is there and cannot be removed (recovery retries)."""
        if not os.path.exists(netns):
            return False
        lock = cls(netns)
        for tool in cls._tools():
            lister = tool.replace("-restore", "")  # iptables / ip6tables
            argv = ["nsenter", f"--net={netns}", lister, "-w", "-S", "CRIU"]
            try:
                res = subprocess.run(argv, capture_output=True, timeout=NETLOCK_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise errors.Internal(f"cannot look for a netns lock left in {netns}: {e}") from e
            if res.returncode == 0:  # the chain exists
                lock.locked.append(tool)
        found = bool(lock.locked)
        lock.unlock()
        return found


# CRIU log lines that an option of podshim's would fix -> the hint for the refusal message
_HINTS = (
    (
        re.compile(r"Can't dump ghost file (\S+) of (\d+) size"),
        lambda m: (
            f"; a deleted but open file ({m.group(1)}, {m.group(2)} bytes) is bigger than CRIU's "
            f"ghost-file limit: retry with the CheckpointPod option ghost-limit={m.group(2)} (bytes, or more)"
        ),
    ),
    (
        re.compile(r"Can't dump that handle"),
        lambda m: (
            "; CRIU cannot find the path of a file watched with inotify/fanotify (in the container's "
            "rootfs): retry with the CheckpointPod option irmap-scan-paths=<the watched file's directory, "
            "as the container sees it>[,<another>]"
        ),
    ),
)


def option_hint(log_path: Path) -> str:
    """Which CheckpointPod option would get past this CRIU failure ("" when none would)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    for pattern, hint in _HINTS:
        m = pattern.search(text)
        if m:
            return hint(m)
    return ""


def criu_error_lines(log_path: Path, limit: int = CRIU_LOG_TAIL) -> list[str]:
    """The last error lines of a CRIU log (what a person needs to see first)."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    # CRIU's pr_err lines only ("Error (file:line): ..."): a debug line can hold "error" too, e.g.
    # "Handling VMA" naming /usr/lib/.../libgpg-error.so.0
    errs = [
        line.strip() for line in lines if _CRIU_ERROR.search(line) and not any(n in line for n in _HARMLESS)
    ]
    return (errs or [line.strip() for line in lines])[-limit:]


def _full_fs(image_dir: Path) -> bool:
    """Whether the images' filesystem is (nearly) out of bytes or inodes: CRIU's log lies on it
    too, so CRIU's own "No space left on device" line may never have been written."""
    try:
        st = os.statvfs(image_dir)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20 or (st.f_files > 0 and st.f_favail < 16)


def _group_alive(pgid: int) -> bool:
    """Whether process group `pgid` still has a member (zombies included): one syscall."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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

            logs.get("shim.criu.runtime").error(
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

    log = logs.get("shim.criu.runtime")
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


class OciRuntime:
    """One runc/crun binary with the --root the upstream uses for its containers."""

    def __init__(self, binary: str, root: str, criu: str = "", scratch: str | None = None) -> None:
        self.binary = binary
        self.root = root
        self.criu = criu
        self.scratch = scratch  # where a dump's CRIU config file goes (Config.scratch_dir)

    @property
    def is_runc(self) -> bool:
        return "runc" in os.path.basename(self.binary)

    def global_args(self) -> list[str]:
        argv = [self.binary, "--root", self.root]
        # The CRIU goes first on PATH (criu_path_env, which every runc and crun read); --criu only
        # for a binary not named criu: crun has no such flag, and runc >= 1.2 ignores it with a
        # warning on stderr, which kills it once podshim is gone (SIGPIPE) and lands in the log of
        # a container it restores
        if self.is_runc and self.criu and os.path.isabs(self.criu) and not criu_path_env(self.criu):
            argv += ["--criu", self.criu]
        return argv

    def checkpoint_argv(
        self, container_id: str, image_dir: Path, work_dir: Path, opts: CriuOptions, leave_running: bool
    ) -> list[str]:
        argv = [
            *self.global_args(),
            "checkpoint",
            "--image-path",
            str(image_dir),
            "--work-path",
            str(work_dir),
        ]
        if leave_running:
            argv.append("--leave-running")
        return [*argv, *opts.flags(), container_id]

    async def checkpoint(
        self,
        name: str,
        container_id: str,
        image_dir: Path,
        work_dir: Path,
        opts: CriuOptions,
        leave_running: bool = True,
        pass_fds: tuple[int, ...] = (),
        gate: DumpGate | None = None,
    ) -> float:
        """Dump one container; returns the seconds it took. A failure names the container and
        the CRIU log, with its last error lines, and the option that would help, if one would.
        Cancellation ends runc and CRIU without killing the container (stop_dump). `pass_fds`:
        descriptors runc/crun inherit (podshim names its held directories `/proc/self/fd/<fd>`,
        docs/design/archive.md (Path confinement)). `gate`: CRIU waits at it, its start-up
        done, until the caller opens it (DumpGate)."""
        extra = (gate.config_line(),) if gate is not None else ()
        with _criu_config(opts, self.criu, extra, self.scratch, gate) as env:  # lives as long as the dump
            return await self._checkpoint(
                name, container_id, image_dir, work_dir, opts, leave_running, env, pass_fds, gate
            )

    async def _checkpoint(
        self,
        name: str,
        container_id: str,
        image_dir: Path,
        work_dir: Path,
        opts: CriuOptions,
        leave_running: bool,
        env: dict[str, str],
        pass_fds: tuple[int, ...] = (),
        gate: DumpGate | None = None,
    ) -> float:
        import asyncio

        from shim.aio import run_to_end, wait_out

        argv = self.checkpoint_argv(container_id, image_dir, work_dir, opts, leave_running)
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a cancel finds runc and the CRIU it started (stop_dump)
            env=env,
            pass_fds=pass_fds,
        )
        try:
            if gate is not None:
                await gate.passed.wait()  # opened (the pod is frozen) or closed (given up)
            # runc and CRIU are running: a `kill` here leaves them orphaned, an `error` gives them
            # up as any failure does (tests/faults/test_checkpoint_crash.py)
            await faults.hit_async("checkpoint.mid-dump")
            out, _ = await proc.communicate()
            # runc and CRIU have ended: a `sleep` here outlasts any deadline by construction, with
            # no dump left to let finish (tests/test_checkpoint_pod.py)
            await faults.hit_async("checkpoint.dump-ended")
        except BaseException:
            # cancelled: runc and its CRIU must be gone before the caller thaws (see stop_dump)
            await run_to_end(stop_dump, proc.pid, image_dir)
            await wait_out(asyncio.ensure_future(proc.wait()))  # reaped, even if cancelled again
            raise
        if proc.returncode != 0 or _group_alive(proc.pid):
            # runc killed or failed: a CRIU it leaves behind would put back the FROZEN state it
            # found after the caller's thaw and freeze the container for good
            await run_to_end(stop_dump, proc.pid, image_dir)
        if proc.returncode != 0:
            log_path = work_dir / "dump.log"
            detail = "; ".join(criu_error_lines(log_path)) or out.decode(errors="replace").strip()[-500:]
            failed = (
                f"checkpoint of container {name!r} ({container_id[:13]}) failed: "
                f"{os.path.basename(self.binary)} exited {proc.returncode}: {detail} (CRIU log: {log_path})"
            )
            if _full_fs(image_dir):
                raise errors.out_of_space(image_dir, failed, "room for the container's memory images")
            raise errors.Internal(failed + option_hint(log_path))
        return time.monotonic() - start

    def restore_argv(
        self,
        container_id: str,
        bundle: str,
        image_dir: str,
        work_dir: str,
        opts: CriuOptions,
        *,
        pid_file: str | None = None,
        console_socket: str | None = None,
        global_args: list[str] | None = None,
        lazy_pages: bool = False,
    ) -> list[str]:
        """`restore --detach` into `bundle`. `global_args` replaces --root/--criu with the flags
        the upstream passed (podshim-runc keeps its --log, --log-format, --systemd-cgroup...).
        `lazy_pages`: pages come from the `criu lazy-pages` listening in `work_dir`
        (docs/design/restore-pod.md (Lazy restore))."""
        head = [self.binary, *global_args] if global_args is not None else self.global_args()
        argv = [*head, "restore", "--detach"]
        if self.is_runc:
            argv.append("--no-subreaper")  # crun has no such flag (and no subreaper to disable)
        argv += ["--bundle", bundle, "--image-path", image_dir, "--work-path", work_dir]
        if pid_file:
            argv += ["--pid-file", pid_file]
        if console_socket:
            argv += ["--console-socket", console_socket]
        if lazy_pages:
            argv.append("--lazy-pages")
        return [*argv, *opts.flags(), container_id]


def binary_version(binary: str) -> str:
    """First line of `<binary> --version` (runc, crun, criu all print it there)."""
    try:
        argv = [binary, "--version"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    for line in out.splitlines():
        line = line.strip()
        if line:
            return line.removeprefix("Version:").strip()
    return "unknown"


def read_dump_stats(path: Path) -> dict[str, int]:
    """CRIU's dump statistics (µs and page counts) from a stats-dump image, read with pycriu."""
    try:
        import pycriu  # installed into the venv from CRIU's source by the set-up
    except ImportError:
        return {}
    try:
        with open(path, "rb") as f:
            img = pycriu.images.load(f)
        entry = img["entries"][0].get("dump", {})
    except (OSError, KeyError, IndexError, ValueError, pycriu.images.MagicException):
        return {}
    return {k: int(v) for k, v in entry.items()}
