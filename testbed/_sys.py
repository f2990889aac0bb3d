"""Host plumbing for the test bed: mounts, processes, cgroups, links (Linux only, stdlib only)."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

MNT_DETACH = 2
CGROUP_ROOT = Path("/sys/fs/cgroup")

_libc = ctypes.CDLL(None, use_errno=True)


# ---------------------------------------------------------------------------- mounts


@dataclass(frozen=True)
class Mount:
    mount_point: str
    root: str
    fstype: str
    source: str


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def mounts() -> list[Mount]:
    result = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            result.append(
                Mount(_unescape(fields[4]), _unescape(fields[3]), rfields[0], _unescape(rfields[1]))
            )
    return result


def is_under(path: str, base: str) -> bool:
    base = base.rstrip("/")
    return path == base or path.startswith(base + "/")


def mounts_under(base: str | os.PathLike[str]) -> list[Mount]:
    b = os.fspath(base)
    return [m for m in mounts() if is_under(m.mount_point, b)]


def umount_lazy(path: str) -> int:
    """umount2(path, MNT_DETACH); returns 0 or the errno."""
    if _libc.umount2(path.encode(), MNT_DETACH) == 0:
        return 0
    return ctypes.get_errno()


def unmount_all_under(base: str | os.PathLike[str], rounds: int = 5) -> list[str]:
    """Lazily unmount everything mounted at or under ``base``, deepest first.

    Returns the mount points still there afterwards.
    """
    for _ in range(rounds):
        left = mounts_under(base)
        if not left:
            return []
        for m in sorted(left, key=lambda m: m.mount_point.count("/"), reverse=True):
            umount_lazy(m.mount_point)
    return sorted({m.mount_point for m in mounts_under(base)})


# ---------------------------------------------------------------------------- processes


def read_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ..."; comm may hold spaces and parentheses
    return raw[raw.rfind(")") + 2 :].split()


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def parent_map() -> dict[int, int]:
    out = {}
    for pid in all_pids():
        fields = _stat_fields(pid)
        if fields is not None:
            out[pid] = int(fields[1])
    return out


def descendants(roots: set[int]) -> set[int]:
    parents = parent_map()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def ancestors(pid: int) -> set[int]:
    parents = parent_map()
    out: set[int] = set()
    while pid in parents and pid not in out and pid > 1:
        out.add(pid)
        pid = parents[pid]
    return out


def mentions_path(argv: list[str], path: str) -> bool:
    """Whether an argument is ``path`` or names something inside it."""
    path = path.rstrip("/")
    return any(a == path or path + "/" in a for a in argv)


def pids_mentioning(path: str) -> set[int]:
    """Processes whose command line mentions ``path`` or a file under it (e.g. the base dir)."""
    me = os.getpid()
    return {pid for pid in all_pids() if pid != me and mentions_path(read_cmdline(pid), path)}


def holds_open(pid: int, path: str) -> bool:
    """Whether process ``pid`` has a descriptor open on ``path`` or on a file under it."""
    path = path.rstrip("/")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target == path or target.startswith(path + "/"):
            return True
    return False


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def stop_criu_reading(path: str, timeout: float) -> set[int]:
    """A CRIU that hangs, by construction: wait until a ``criu`` process (CRIU itself, or a task it
    is restoring, whose comm is still ``criu``) holds a file under ``path`` open (runc hands CRIU
    the images dir as a descriptor; its argv does not name it), then SIGSTOP every such process.
    Returns the stopped pids; SIGKILL still ends them."""
    deadline = time.monotonic() + timeout
    while True:
        pids = {p for p in all_pids() if comm(p) == "criu" and holds_open(p, path)}
        if pids:
            for pid in pids:
                kill(pid, signal.SIGSTOP)
            return pids
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no CRIU process read {path} within {timeout:.0f} s")
        time.sleep(0.01)


def programs_running(names: set[str]) -> set[int]:
    """Live processes whose executable name (argv[0] basename) is in ``names``."""
    found = set()
    for pid in all_pids():
        argv = read_cmdline(pid)
        if argv and os.path.basename(argv[0]) in names and alive(pid):
            found.add(pid)
    return found


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until none of ``pids`` is alive (reaping our own children); returns survivors."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in list(pids):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        left = {p for p in pids if alive(p)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def stop_child(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM a child this process started, SIGKILL after `timeout` seconds; reaped either way."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def terminate(pids: set[int], timeout: float = 10.0) -> set[int]:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the pids still alive after that."""
    for pid in pids:
        kill(pid, signal.SIGTERM)
    left = wait_gone(pids, timeout)
    for pid in left:
        kill(pid, signal.SIGKILL)
    return wait_gone(left, 5.0)


# ---------------------------------------------------------------------------- cgroups


POD_CGROUP_ROOT_PREFIX = "/podshim-test-p"  # + the pid of the process whose test pods live below


def sweep_stale_pod_roots() -> list[str]:
    """End what a run that is gone left in its pod cgroup root (`POD_CGROUP_ROOT_PREFIX<pid>` of a
    pid no longer alive): e.g. a restore CRIU was still running when that run was killed, which
    no bed knew of (runc records a container's cgroup only once it exists). Every process there
    is thawed and SIGKILLed and the cgroups removed; returns the roots swept."""
    prefix = POD_CGROUP_ROOT_PREFIX.lstrip("/")
    names = {d.name for top in cgroup_hierarchies() for d in top.glob(prefix + "*") if d.is_dir()}
    swept = []
    for name in sorted(names):
        pid = name.removeprefix(prefix)
        if not pid.isdigit() or alive(int(pid)):
            continue
        rel = "/" + name
        thaw(rel)
        for p in cgroup_pids(rel):
            kill(p, signal.SIGKILL)
        remove_cgroup_tree(rel)
        swept.append(rel)
    return swept


def cgroup_hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers and the v2 one)."""
    return sorted(
        {Path(m.mount_point) for m in mounts() if m.fstype in ("cgroup", "cgroup2")},
        key=str,
    )


def cgroup_dirs(rel: str) -> list[Path]:
    """Every existing directory of cgroup ``rel`` (e.g. "/podshim-test-ab12") in every hierarchy."""
    rel = rel.strip("/")
    return [h / rel for h in cgroup_hierarchies() if rel and (h / rel).is_dir()]


def cgroup_pids(rel: str) -> set[int]:
    pids: set[int] = set()
    for top in cgroup_dirs(rel):
        for d, _, _ in os.walk(top):
            try:
                pids.update(int(x) for x in Path(d, "cgroup.procs").read_text().split())
            except OSError:
                pass
    return pids


def thaw(rel: str) -> None:
    """Thaw every frozen cgroup under ``rel`` (v1 freezer and v2 cgroup.freeze)."""
    for top in cgroup_dirs(rel):
        for d, _, _ in os.walk(top):
            for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                p = Path(d, name)
                if p.exists():
                    try:
                        p.write_text(value)
                    except OSError:
                        pass


def thaw_pid_cgroups(pids: set[int]) -> None:
    """Thaw the freezer cgroups holding ``pids`` (a frozen process cannot die)."""
    hier = {h.name: h for h in cgroup_hierarchies()}
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            _, ctrls, path = line.split(":", 2)
            if "freezer" in ctrls.split(",") and "freezer" in hier and path != "/":
                try:
                    (hier["freezer"] / path.lstrip("/") / "freezer.state").write_text("THAWED")
                except OSError:
                    pass


def remove_cgroup_tree(rel: str, timeout: float = 5.0) -> list[str]:
    """rmdir cgroup ``rel`` and everything below it in every hierarchy; returns what is left."""
    deadline = time.monotonic() + timeout
    while True:
        for top in cgroup_dirs(rel):
            for d, _, _ in sorted(os.walk(top), key=lambda t: t[0].count("/"), reverse=True):
                try:
                    os.rmdir(d)
                except OSError as e:
                    if e.errno not in (errno.ENOENT, errno.EBUSY, errno.ENOTEMPTY):
                        raise
        left = [str(p) for p in cgroup_dirs(rel)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


# ---------------------------------------------------------------------------- links


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def delete_link(name: str) -> None:
    if link_exists(name):
        subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout
