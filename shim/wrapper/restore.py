"""The restore side of podshim-runc (docs/architecture.md §7 (The runtime wrapper)).

RestorePod creates each container through the upstream with RESTORE_ANNOTATION naming its
directory in the checkpoint. When the upstream later runs the OCI runtime's `create` for that
container (at StartContainer), podshim-runc applies the rootfs diff onto the new rootfs and
runs `restore --detach` instead, with the upstream's bundle, pid file and stdio, so the
restored process lives in the new pod's namespaces and cgroups and logs into the new log.
The following `start` is a no-op. Everything else is an exec of the real runtime.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from shim import contract
from shim.contract import (
    CRIU_CONFIG_ANNOTATION,
    LAZY_PAGES_ANNOTATION,
    LAZY_PAGES_FAILED,
    LAZY_PAGES_SOCKET,
    RESTORE_ANNOTATION,
    RESTORE_OPTIONS_ANNOTATION,
    RESTORED_MARKER,
    WORK_DIR,
)


def _arg(rest: list[str], *names: str) -> str | None:
    for i, a in enumerate(rest):
        for n in names:
            if a == n and i + 1 < len(rest):
                return rest[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _fail(message: str, log_file: str | None) -> None:
    """Report like runc does: a JSON line in the --log file (the upstream shows the last one)."""
    sys.stderr.write(f"podshim-runc: {message}\n")
    if log_file:
        try:
            with open(log_file, "a") as f:
                f.write(json.dumps({"level": "error", "msg": f"podshim-runc: {message}"}) + "\n")
        except OSError:
            pass
    raise SystemExit(1)


def already_restored(flags: dict[str, str], rest: list[str]) -> bool:
    """`start ID` of a container that `create` restored (it is running: start is a no-op)."""
    container_id = rest[-1] if rest else ""
    root = flags.get("--root", "")
    return bool(root and container_id and (Path(root) / container_id / RESTORED_MARKER).exists())


def maybe_restore(binary: str, argv: list[str], flags: dict[str, str], rest: list[str]) -> None:
    """`create` of a container carrying RESTORE_ANNOTATION becomes a restore (exits); returns for
    any other container."""
    container_id = rest[-1] if rest else ""
    bundle = Path(_arg(rest, "--bundle", "-b") or os.getcwd())
    try:
        spec = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        return  # not ours to judge: the real runtime reports it
    ckpt = spec.get("annotations", {}).get(RESTORE_ANNOTATION)
    if not ckpt:
        return
    restore(binary, argv, flags, rest, container_id, bundle, spec, Path(ckpt))


def restore(
    binary: str,
    argv: list[str],
    flags: dict[str, str],
    rest: list[str],
    container_id: str,
    bundle: Path,
    spec: dict,
    ckpt: Path,
) -> None:
    from shim import config, faults
    from shim.archive import crypto, layout, paths, rootfs_diff
    from shim.criu.runtime import OciRuntime, criu_error_lines
    from shim.errors import ShimError

    log_file = flags.get("--log")
    try:
        cfg = config.load(check_files=False)  # the node key is podshim's business, not ours
        # podshim-owned dirs are accepted like the allowed roots: container checkpoint imports and
        # the plaintext of encrypted archives (shim/archive/crypto.py)
        roots = [*cfg.allowed_roots, *contract.owned_roots(cfg.state_dir)]
        ckpt = paths.validate_archive_dir(str(ckpt), roots)
    except (config.ConfigError, ShimError) as e:
        _fail(f"restore of {container_id}: {e}", log_file)
    cl = layout.ContainerLayout(root=ckpt, rel="")
    rootfs = bundle / spec.get("root", {}).get("path", "rootfs")
    try:
        if cl.rootfs_diff_tar.exists():
            deleted = rootfs_diff.read_deleted_files(cl.deleted_files)
            rootfs_diff.apply_rootfs_diff(cl.rootfs_diff_tar, rootfs, deleted)
    except (ShimError, OSError, ValueError) as e:
        _fail(f"restore of {container_id}: applying the rootfs diff of {ckpt} failed: {e}", log_file)

    # CRIU only reads the image dir on restore (its log and restore stats go to the work dir, its
    # cwd), so the archive is used in place and never modified.
    lazy = _lazy_dir(spec, cfg, container_id, log_file)
    work = lazy or bundle / WORK_DIR
    work.mkdir(mode=0o700, exist_ok=True)
    # Established TCP connections are closed on restore (KEP-5823 alpha): neither runc nor crun
    # has a flag for it, so it goes through a CRIU config file: runc passes the one named by the
    # spec's org.criu.config to CRIU; crun does not, but the CRIU it starts reads the file named
    # by CRIU_CONFIG_FILE from its environment (see _run_guarded).
    criu_conf = work / "criu.conf"
    criu_conf.write_text("tcp-close\n")
    spec.setdefault("annotations", {})[CRIU_CONFIG_ANNOTATION] = str(criu_conf)
    (bundle / "config.json").write_text(json.dumps(spec))

    criu_opts = contract.from_record(spec.get("annotations", {}).get(RESTORE_OPTIONS_ANNOTATION, ""))
    # Keep the upstream's global flags (--root, --log, --log-format, --criu ...) as they were.
    cmd = OciRuntime(binary, flags.get("--root", "")).restore_argv(
        container_id,
        str(bundle),
        str(cl.checkpoint_dir),
        str(work),
        criu_opts,
        pid_file=_arg(rest, "--pid-file"),
        console_socket=_arg(rest, "--console-socket"),
        global_args=argv[: len(argv) - len(rest) - 1],
        lazy_pages=lazy is not None,
    )
    # stdio and every other descriptor the upstream gave us go to the restored process.
    faults.hit("runc-wrapper.before-restore")
    state_dir = Path(flags.get("--root", "")) / container_id
    env = {**os.environ, "CRIU_CONFIG_FILE": str(criu_conf)}
    returncode = _run_guarded(cmd, spec.get("linux", {}).get("cgroupsPath", ""), work, state_dir, env)
    if crypto.is_decrypted_dir(ckpt) and lazy is None:
        # Decrypted images: CRIU is done with them (a failed create is not retried), and plaintext
        # memory must not stay on disk. A lazy restore's daemon still reads them: podshim removes
        # them when it has ended (docs/architecture.md §5.1 (Lazy restore)).
        crypto.remove_decrypted(ckpt)
    if returncode != 0:
        remove_cgroups(spec.get("linux", {}).get("cgroupsPath", ""))
        log_path = work / "restore.log"
        kept = _keep_log(log_path, cfg.state_dir, container_id)
        detail = "; ".join(criu_error_lines(log_path))
        _fail(
            f"CRIU restore of container {container_id} from {ckpt} failed (exit {returncode}): "
            f"{detail} (CRIU log: {kept})",
            log_file,
        )
    marker_dir = Path(flags.get("--root", "")) / container_id
    try:
        (marker_dir / RESTORED_MARKER).write_text(str(ckpt))
    except OSError as e:
        _fail(f"restored {container_id} but cannot record it in {marker_dir}: {e}", log_file)
    raise SystemExit(0)


def _lazy_dir(spec: dict, cfg: Any, container_id: str, log_file: str | None) -> Path | None:
    """The work dir of the container's `criu lazy-pages` (LAZY_PAGES_ANNOTATION), None for an eager
    restore. Only a dir directly in a `lazy/` dir of podshim's state dir (or of an allowed root,
    as for decrypted dirs) whose daemon listens is accepted."""
    value = spec.get("annotations", {}).get(LAZY_PAGES_ANNOTATION)
    if not value:
        return None
    real = Path(os.path.realpath(value))
    roots = [Path(os.path.realpath(r)) for r in (cfg.state_dir, *cfg.allowed_roots)]
    parent = real.parent
    inside = any(parent.is_relative_to(r) for r in roots)
    if parent.name != contract.LAZY_DIR or not real.is_dir() or not inside:
        _fail(
            f"restore of {container_id}: {LAZY_PAGES_ANNOTATION} {value!r} is not a lazy-pages work dir "
            f"of podshim (in {contract.lazy_root(cfg.state_dir)})",
            log_file,
        )
    failed = real / LAZY_PAGES_FAILED
    if failed.is_file() and not failed.is_symlink():  # podshim ended the daemon: its reason
        _fail(f"restore of {container_id}: {failed.read_text(errors='replace')[:2000]}", log_file)
    if not (real / LAZY_PAGES_SOCKET).exists():
        _fail(
            f"restore of {container_id}: no lazy-pages daemon listens in {real} (it has ended): "
            "remove the pod and restore again",
            log_file,
        )
    return real


def _run_guarded(cmd: list[str], cgroups_path: str, work: Path, state_dir: Path, env: dict[str, str]) -> int:
    """Run the restore with a watchdog: the upstream kills podshim-runc (SIGKILL) when
    StartContainer is cancelled, and runc's CRIU and the half-restored tasks must not go on
    unowned. The watchdog waits on a pipe; if podshim-runc dies before the restore ended, it
    kills the restore's process group and every process in the container's cgroup, detaches the
    mounts CRIU left under the work dir and the runtime's state dir, and removes a state dir the
    killed restore never completed (so the upstream's `delete` finds nothing to trip on)."""
    # The work dir, held by an O_PATH descriptor (close-on-exec: runc does not get it): the
    # upstream renames the bundle (<id> -> .<id>) while it deletes it, so the watchdog finds CRIU's
    # mounts below through the descriptor, never through a path that may be gone.
    held = _hold_dirs([work])
    # stdio and every other descriptor the upstream gave us go to the restored process.
    child = subprocess.Popen(cmd, close_fds=False, start_new_session=True, env=env)
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # the watchdog
        try:
            os.close(write_end)
            keep = sorted({read_end, *held.values()})
            os.closerange(0, keep[0])  # hold none of the upstream's stdio open
            for lo, hi in zip(keep, [*keep[1:], 4096], strict=True):
                os.closerange(lo + 1, hi)
            if os.read(read_end, 1) == b"":  # EOF: podshim-runc died mid-restore
                _kill_restore(child.pid, cgroups_path, [work, state_dir], held)
        finally:
            os._exit(0)
    os.close(read_end)
    for fd in held.values():
        os.close(fd)
    returncode = child.wait()
    os.write(write_end, b"d")  # done: the watchdog leaves everything alone
    os.close(write_end)
    return returncode


def _hold_dirs(dirs: list[Path]) -> dict[Path, int]:
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


def _detach_mounts_below(dirs: list[Path], held: dict[Path, int], rounds: int = 20) -> None:
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
        targets = set()
        for via, real in roots:
            prefix = real.rstrip("/") + "/"
            targets.update(via + m[len(real.rstrip("/")) :] for m in mounts if m.startswith(prefix))
        if not targets:
            return
        for target in sorted(targets, key=len):
            libc.umount2(os.fsencode(target), mnt_detach)  # EINVAL: gone with its parent already


def _kill_restore(
    pgid: int, cgroups_path: str, dirs: list[Path], held: dict[Path, int] | None = None
) -> None:
    import contextlib

    from shim.cgroups import cgroup_procs

    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    if cgroups_path:
        with contextlib.suppress(Exception):
            for pid in cgroup_procs(cgroups_path):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    _detach_mounts_below(dirs, held or {})
    remove_cgroups(cgroups_path)
    state_dir = dirs[-1]
    if state_dir.is_dir() and not (state_dir / "state.json").exists():
        import shutil

        shutil.rmtree(state_dir, ignore_errors=True)


def remove_cgroups(cgroups_path: str, attempts: int = 20) -> None:
    """After a failed or killed restore: remove the container's cgroup in every hierarchy, with
    what the runtime made below it (crun restores on cgroup v1 through a `.proxy-crun` child it
    leaves behind when the restore fails, and the container's cgroup then cannot be removed by
    anyone). Only empty cgroups go (rmdir); a few retries let the killed tasks leave."""
    import time

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


def _keep_log(log_path: Path, state_dir: str, container_id: str) -> str:
    """Copy the CRIU log out of the bundle (which the upstream deletes) for the operator."""
    try:
        # private whatever the upstream's umask (CRIU logs name the workload's files and sockets)
        dest_dir = Path(state_dir) / "logs"
        dest_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(dest_dir, 0o700)
        dest = dest_dir / f"restore-{container_id}.log"
        data = log_path.read_bytes()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return str(dest)
    except OSError:
        return str(log_path)
