"""A restored container's processes, continued or killed, and what a failed or killed restore
leaves behind removed: the mounts CRIU made below its dirs, the runtime's state, the container's
cgroups (docs/design/runtime-wrapper.md (The runtime wrapper)). For the page check's verdict, the
watchdog and the hook's abort; no thread, no import of the daemon."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def container_pids(cgroups_path: str, pid_file: str | None = None) -> set[int]:
    """Every process of the container: those in its cgroup and the cgroups below it (freezer
    hierarchy on v1, the unified one on v2), and the runtime's pid-file process with its
    descendants (/proc/<pid>/task/*/children), in case a cgroup cannot be read."""
    pids: set[int] = set()
    if cgroups_path:
        with contextlib.suppress(Exception):
            from shim.cgroups.freezer import default_freezer

            top = default_freezer().path(cgroups_path)
            for d, _dirs, _files in os.walk(top):
                with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
                    pids.update(int(x) for x in f.read().split())
    if pid_file:
        with contextlib.suppress(OSError, ValueError):
            with open(pid_file) as f:
                todo = [int(f.read().strip())]
            seen: set[int] = set()
            while todo:
                pid = todo.pop()
                if pid <= 0 or pid in seen:
                    continue
                seen.add(pid)
                with contextlib.suppress(OSError):
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as c:
                            todo.extend(int(x) for x in c.read().split())
            pids |= {p for p in seen if os.path.exists(f"/proc/{p}")}
    return pids


def continue_tasks(cgroups_path: str, pid_file: str | None) -> str:
    """SIGCONT every process of the container (CRIU left them stopped): "" when done, else why
    not. A pidfd is taken of each first, while they are all stopped, so no signal reaches a pid
    reused meanwhile."""
    pids = container_pids(cgroups_path, pid_file)
    if not pids:
        where = f"cgroup {cgroups_path!r}, pid file {pid_file!r}"
        return f"cannot find the restored processes to continue them ({where})"
    fds = []
    try:
        for pid in sorted(pids):
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                continue  # gone already (killed by someone else): nothing to continue
        for fd in fds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGCONT)
            except ProcessLookupError:
                continue
    except OSError as e:
        return f"cannot continue the restored processes: {e.strerror or e}"
    finally:
        for fd in fds:
            os.close(fd)
    return ""


def kill_tasks(cgroups_path: str, pid_file: str | None) -> None:
    """SIGKILL every process of the container (a stopped one dies too): first all it has (through
    pidfds: the pid file's pid may be reused once the container's init is reaped), then what its
    cgroup still holds, until nothing alive is left (at most ~2 s)."""
    for pid in container_pids(cgroups_path, pid_file):
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(pid)
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            finally:
                os.close(fd)
    for _ in range(40):
        alive = [p for p in container_pids(cgroups_path) if _alive(p)]
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def delete_state(delete: list[str]) -> None:
    """Run the runtime's `delete --force` of a restored container that is then killed (its stdio
    is not the container's; a failure leaves it to the upstream's own delete)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(delete, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)


def _alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a killed task waiting for its parent's wait)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def hold_dirs(dirs: list[Path]) -> dict[Path, int]:
    """O_PATH descriptors of the existing `dirs` (a renamed directory stays reachable by them)."""
    held = {}
    for d in dirs:
        try:
            held[d] = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
    return held


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are octal escapes there."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def detach_mounts_below(dirs: list[Path], held: dict[Path, int], rounds: int = 20) -> None:
    """Detach (umount2 MNT_DETACH, no subprocess) every mount below `dirs`: shortest first (a
    detached mount takes its subtree along), then look again until none is left. A held
    directory is named through /proc/self/fd (its current place, wherever it was renamed to)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    mnt_detach = 2
    for _ in range(rounds):
        roots = []  # (how to name the directory now, its path as mountinfo shows it)
        for d in dirs:
            if d in held:
                via = f"/proc/self/fd/{held[d]}"
                try:
                    roots.append((via, os.readlink(via)))
                except OSError:
                    continue
            else:
                roots.append((str(d), str(d)))
        try:
            with open("/proc/self/mountinfo") as f:
                mounts = [_unescape(line.split()[4]) for line in f]
        except OSError:
            return
        targets: set[str] = set()
        for via, real in roots:
            prefix = real.rstrip("/") + "/"
            targets.update(via + m[len(real.rstrip("/")) :] for m in mounts if m.startswith(prefix))
        if not targets:
            return
        for target in sorted(targets, key=len):
            libc.umount2(os.fsencode(target), mnt_detach)  # EINVAL: gone with its parent already


def kill_restore(
    pgid: int | None,
    cgroups_path: str,
    dirs: list[Path],
    held: dict[Path, int] | None = None,
    delete: list[str] | None = None,
) -> None:
    if pgid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    if cgroups_path:  # every process of the container's cgroup and the cgroups below it
        kill_tasks(cgroups_path, None)
    detach_mounts_below(dirs, held or {})
    state_dir = dirs[-1]
    if delete and (state_dir / "state.json").exists():  # a restore that completed (tasks held stopped)
        delete_state(delete)
    remove_cgroups(cgroups_path)
    if state_dir.is_dir() and not (state_dir / "state.json").exists():
        import shutil

        shutil.rmtree(state_dir, ignore_errors=True)


def remove_cgroups(cgroups_path: str, attempts: int = 20) -> None:
    """After a failed or killed restore: remove the container's cgroup in every hierarchy, with
    what the runtime made below it (crun restores on cgroup v1 through a `.proxy-crun` child it
    leaves behind when the restore fails, and the container's cgroup then cannot be removed by
    anyone). Only empty cgroups go (rmdir); a few retries let the killed tasks leave."""
    from shim.cgroups import resolve_cgroups_path

    try:
        rel = resolve_cgroups_path(cgroups_path).strip("/")
        mounts = [line.split(" - ", 1) for line in open("/proc/self/mountinfo")]
    except Exception:  # noqa: BLE001 - nothing to clean up we can name
        return
    tops = [Path(a.split()[4]) / rel for a, b in mounts if b.split()[0] in ("cgroup", "cgroup2")]
    for _ in range(attempts):
        left = False
        for top in tops:
            if not top.is_dir():
                continue
            for d, _dirs, _files in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError:
                    left = True
        if not left:
            return
        time.sleep(0.05)
