"""The restore side of podshim-runc (docs/design/runtime-wrapper.md (The runtime wrapper)).

RestorePod creates each container through the upstream with RESTORE_ANNOTATION naming its
directory in the checkpoint. When the upstream later runs the OCI runtime's `create` for that
container (at StartContainer), podshim-runc applies the rootfs diff onto the new rootfs and
runs `restore --detach` instead, with the upstream's bundle, pid file and stdio, so the
restored process lives in the new pod's namespaces and cgroups and logs into the new log.
The following `start` is a no-op. Everything else is an exec of the real runtime.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim import contract, faults, kept_logs
from shim.contract import (
    ABORT_ENV,
    CRIU_CONFIG_ANNOTATION,
    LAZY_PAGES_ANNOTATION,
    LAZY_PAGES_FAILED,
    LAZY_PAGES_SOCKET,
    PAGE_DIGESTS_ANNOTATION,
    RESTORE_ANNOTATION,
    RESTORE_OPTIONS_ANNOTATION,
    RESTORED_MARKER,
    WORK_DIR,
)
from shim.wrapper.cleanup import hold_dirs, kill_restore, kill_tasks, remove_cgroups
from shim.wrapper.page_check import PageImages, settler


def _arg(rest: list[str], *names: str) -> str | None:
    for i, a in enumerate(rest):
        for n in names:
            if a == n and i + 1 < len(rest):
                return rest[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


class RestoreFailed(Exception):
    """The create of a restored container fails: the message goes to the runtime's --log file
    (the upstream shows the last line) and stderr, by the hook (_fail) or by podshim-runc itself
    (the broker's `fail`, docs/design/runtime-wrapper.md (The runtime wrapper))."""


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
    if not (flags.get("--root") and container_id):
        return False
    return (_runtime_state_dir(flags, container_id) / RESTORED_MARKER).exists()


def maybe_restore(binary: str, argv: list[str], flags: dict[str, str], rest: list[str]) -> None:
    """`create` of a container carrying RESTORE_ANNOTATION becomes a restore (exits); returns for
    any other container. With PODSHIM_RUNC_ABORT set (podshim-runc lost podshim's broker after
    `runc restore` started) the restore is undone instead and the create fails."""
    log_file = flags.get("--log")
    try:
        aborted = os.environ.get(ABORT_ENV)
        if aborted:
            abort(binary, flags, rest, aborted)
        prepared = prepare(binary, argv, flags, rest)
        if prepared is None:
            return  # not ours to judge: the real runtime reports it
        faults.hit("runc-wrapper.before-restore")
        returncode = _run_guarded(prepared)
        conclude(prepared, returncode)
    except RestoreFailed as e:
        _fail(str(e), log_file)
    raise SystemExit(0)


def _bundle_spec(rest: list[str], cwd: str | None = None) -> tuple[Path, dict] | None:
    """The bundle and its config.json, None when it cannot be read (not ours to judge)."""
    bundle = Path(cwd or os.getcwd(), _arg(rest, "--bundle", "-b") or ".")
    try:
        spec = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (bundle, spec) if isinstance(spec, dict) else None


@dataclass
class Prepared:
    """A restore ready to run: `cmd` with `env` (the runtime's `restore`), and what settling and
    concluding it need. Made by prepare() in the hook, or in podshim for podshim-runc (broker)."""

    container_id: str
    ckpt: Path
    work: Path
    lazy: bool
    state_dir: Path  # the runtime's state dir of the container (the marker's)
    cgroups_path: str
    pid_file: str | None
    cmd: list[str]
    env: dict[str, str]  # set on top of the caller's environment
    delete: list[str]  # the runtime's delete --force of the container
    pages: PageImages | None
    cfg_state_dir: str

    def settle(self, returncode: int, hit: Callable[[str], None] | None = None) -> None:
        """Once the restore ended, before the watchdog lets go: the page check's verdict (settler)."""
        if self.pages is not None:
            settler(self.pages, self.cgroups_path, self.pid_file, self.work, self.delete, hit)(returncode)


def prepare(
    binary: str,
    argv: list[str],
    flags: dict[str, str],
    rest: list[str],
    cwd: str | None = None,
    page_check: Callable[[Path, dict[str, str]], PageImages | None] | None = None,
    cfg: Any = None,
    stop: threading.Event | None = None,
) -> Prepared | None:
    """Everything before the runtime's `restore` runs, None for a container that is not a restore:
    the archive dir checked, the page check started, the rootfs diff applied, criu.conf and the
    bundle's config.json written. Raises RestoreFailed. `page_check(ckpt, digests)`: a page check
    already running for these images (podshim started it at RestorePod), else one is started.
    `cfg`: podshim's Config (the broker), else the hook loads it. `stop` set (the broker's client
    is gone): errors.Stopped from the rootfs diff, the page check stopped."""
    from shim import config
    from shim.archive import layout, paths, rootfs_diff
    from shim.criu.options import CriuOptions, criu_path_env
    from shim.criu.runtime import OciRuntime
    from shim.errors import ShimError, Stopped

    container_id = rest[-1] if rest else ""
    found = _bundle_spec(rest, cwd)
    if found is None:
        return None
    bundle, spec = found
    annotations = spec.get("annotations") or {}
    if not isinstance(annotations, dict) or not annotations.get(RESTORE_ANNOTATION):
        return None
    try:
        if cfg is None:
            cfg = config.load(check_files=False)  # the node key is podshim's business, not ours
        # podshim-owned dirs are accepted like the allowed roots: container checkpoint imports and
        # the plaintext of encrypted archives (shim/archive/crypto.py)
        roots = [*cfg.allowed_roots, *contract.owned_roots(cfg.state_dir)]
        ckpt = paths.validate_archive_dir(str(annotations[RESTORE_ANNOTATION]), roots)
    except (config.ConfigError, ShimError) as e:
        raise RestoreFailed(f"restore of {container_id}: {e}") from None
    # an eager restore of a plain archive: its page images are checked beside the rootfs diff
    # and CRIU's restore, the tasks held stopped until they match (docs/design/restore-pod.md
    # (RestorePod) step 4); started first, so the three overlap
    pages = None
    if not annotations.get(LAZY_PAGES_ANNOTATION):
        pages = _page_check(spec, ckpt, container_id, page_check)
    cl = layout.ContainerLayout(root=ckpt, rel="")
    rootfs = bundle / spec.get("root", {}).get("path", "rootfs")
    try:
        if cl.rootfs_diff_tar.exists():
            deleted = rootfs_diff.read_deleted_files(cl.deleted_files)
            rootfs_diff.apply_rootfs_diff(cl.rootfs_diff_tar, rootfs, deleted, stop)
    except Stopped:
        if pages is not None:
            pages.stop.set()
        raise
    except (ShimError, OSError, ValueError) as e:
        if pages is not None:
            pages.stop.set()
        raise RestoreFailed(
            f"restore of {container_id}: applying the rootfs diff of {ckpt} failed: {e}"
        ) from None

    # CRIU only reads the image dir on restore (its log and restore stats go to the work dir, its
    # cwd), so the archive is used in place and never modified.
    lazy = _lazy_dir(spec, cfg, container_id)
    work = lazy or bundle / WORK_DIR
    work.mkdir(mode=0o700, exist_ok=True)
    # Established TCP connections are closed on restore (KEP-5823 alpha) and, for the page check,
    # every restored task is left stopped: neither runc nor crun has a flag for either, so they go
    # to CRIU in a config file named only in this restore's environment (CRIU_CONFIG_FILE, read by
    # the CRIU runc and crun start). Never by the spec's org.criu.config: runc keeps the spec's
    # annotations with the container and hands that file to CRIU on every later run, so the next
    # checkpoint's dump would leave the pod stopped (docs/design/checkpoint-pod.md (Task states after
    # a checkpoint)). runc gets it empty (no config file, now and at every later dump); crun 1.21
    # ignores it, a newer crun passes an annotation to CRIU, and fails when its libcriu predates
    # CRIU 4.2 whatever the value, so for crun it is dropped.
    criu_conf = work / "criu.conf"
    criu_conf.write_text("tcp-close\n" + ("leave-stopped\n" if pages is not None else ""))
    annotations = spec.setdefault("annotations", {})
    if OciRuntime(binary, "").is_runc:
        annotations[CRIU_CONFIG_ANNOTATION] = ""
    else:
        annotations.pop(CRIU_CONFIG_ANNOTATION, None)
    (bundle / "config.json").write_text(json.dumps(spec))

    criu_opts = CriuOptions.from_record(annotations.get(RESTORE_OPTIONS_ANNOTATION, ""))
    handler = cfg.runtime_for_root(flags.get("--root", ""))
    # the handler's CRIU: runc >= 1.2 and crun run the `criu` on PATH, and containerd 2.x passes
    # no --criu (CriuPath) at all; a --criu of containerd 1.x's goes (runc >= 1.2 would print its
    # warning into the restored container's log)
    path_env = criu_path_env(handler.criu)
    global_args = argv[: len(argv) - len(rest) - 1]
    if path_env:
        global_args = _without_flag(global_args, "--criu")
    # Keep the upstream's other global flags (--root, --log, --log-format, ...) as they were.
    pid_file = _arg(rest, "--pid-file")
    cmd = OciRuntime(binary, flags.get("--root", "")).restore_argv(
        container_id,
        str(bundle),
        str(cl.checkpoint_dir),
        str(work),
        criu_opts,
        pid_file=pid_file,
        console_socket=_arg(rest, "--console-socket"),
        global_args=global_args,
        lazy_pages=lazy is not None,
    )
    return Prepared(
        container_id=container_id,
        ckpt=ckpt,
        work=work,
        lazy=lazy is not None,
        state_dir=_runtime_state_dir(flags, container_id),
        cgroups_path=spec.get("linux", {}).get("cgroupsPath", ""),
        pid_file=pid_file,
        cmd=cmd,
        env={"CRIU_CONFIG_FILE": str(criu_conf), **path_env},
        delete=_runtime_delete(binary, flags, container_id),
        pages=pages,
        cfg_state_dir=cfg.state_dir,
    )


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """`argv` (global flags) without `flag VALUE` and `flag=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _runtime_state_dir(flags: dict[str, str], container_id: str) -> Path:
    """The runtime's state dir of the container (`--root`/<id>): its state.json and our marker."""
    return Path(flags.get("--root", "")) / container_id


def _runtime_delete(binary: str, flags: dict[str, str], container_id: str) -> list[str]:
    """The runtime's `delete --force` of the container. A restored container killed afterwards
    (its page images differ, or podshim-runc died while they were held) leaves no runtime state
    behind: runc saved it, and containerd 2.1 does not delete it after the failed create. (--root
    and the cgroup driver only: the --log file lies in the bundle, gone when the watchdog runs.)"""
    systemd = ["--systemd-cgroup"] if "--systemd-cgroup" in flags else []
    return [binary, "--root", flags.get("--root", ""), *systemd, "delete", "--force", container_id]


def conclude(p: Prepared, returncode: int) -> None:
    """After the restore ran and settled: remove decrypted images, report a failed restore or page
    check (RestoreFailed), record the restore for `start` (RESTORED_MARKER)."""
    from shim.criu.log import criu_error_lines

    if not p.lazy and (p.ckpt / contract.DECRYPTED_MARKER).is_file():  # crypto.is_decrypted_dir
        # Decrypted images: CRIU is done with them (a failed create is not retried), and plaintext
        # memory must not stay on disk. A lazy restore's daemon still reads them: podshim removes
        # them when it has ended (docs/design/restore-pod.md (Lazy restore)). crypto is imported
        # only here: it costs every restore's start-up (docs/design/runtime-wrapper.md (The runtime wrapper)).
        from shim.archive import crypto

        crypto.remove_decrypted(p.ckpt)
    if returncode != 0:
        remove_cgroups(p.cgroups_path)
        log_path = p.work / "restore.log"
        kept = _keep_log(log_path, p.cfg_state_dir, p.container_id)
        detail = "; ".join(criu_error_lines(log_path))
        raise RestoreFailed(
            f"CRIU restore of container {p.container_id} from {p.ckpt} failed (exit {returncode}): "
            f"{detail} (CRIU log: {kept})"
        )
    if p.pages is not None and p.pages.problem:
        raise RestoreFailed(
            f"restore of container {p.container_id} from {p.ckpt}: {p.pages.problem}; its processes were "
            "killed before they ran: take a new checkpoint"
        )
    try:
        (p.state_dir / RESTORED_MARKER).write_text(str(p.ckpt))
    except OSError as e:
        raise RestoreFailed(f"restored {p.container_id} but cannot record it in {p.state_dir}: {e}") from None


def _remove_decrypted(ckpt: str | None, state_dir: str) -> None:
    """Remove the decrypted images in `ckpt` once checked to be podshim's (an owned root of
    `state_dir`)."""
    from shim.archive import crypto, paths
    from shim.errors import ShimError

    if not ckpt:
        return
    with contextlib.suppress(ShimError, OSError):
        real = paths.validate_archive_dir(ckpt, contract.owned_roots(state_dir))
        if (real / contract.DECRYPTED_MARKER).is_file():
            crypto.remove_decrypted(real)


def undo(p: Prepared, pgid: int | None, held: dict[Path, int] | None = None) -> None:
    """The watchdog's work once whoever ran the restore died before it concluded: kill the
    restore (`pgid`) and the container's processes, detach the mounts CRIU left, delete the
    runtime's state, remove the cgroups (kill_restore). (The page check's threads are left
    alone: in the hook's forked watchdog they do not exist.)"""
    kill_restore(pgid, p.cgroups_path, [p.work, p.state_dir], held, p.delete)


def abort(binary: str, flags: dict[str, str], rest: list[str], reason: str) -> None:
    """podshim-runc ran `runc restore` for podshim's broker and lost it (ABORT_ENV says how): the
    restore was killed; whatever it restored is killed and removed here, and the create fails
    (RestoreFailed): the upstream may create it again, a new restore."""
    container_id = rest[-1] if rest else ""
    found = _bundle_spec(rest)
    spec = found[1] if found else {}
    bundle = found[0] if found else Path(os.getcwd())
    work = bundle / WORK_DIR
    value = (spec.get("annotations") or {}).get(LAZY_PAGES_ANNOTATION)
    if value and Path(os.path.realpath(value)).parent.name == contract.LAZY_DIR:
        work = Path(os.path.realpath(value))
    cgroups_path = spec.get("linux", {}).get("cgroupsPath", "")
    kill_tasks(cgroups_path, _arg(rest, "--pid-file"))
    delete = _runtime_delete(binary, flags, container_id)
    kill_restore(
        None, cgroups_path, [work, _runtime_state_dir(flags, container_id)], hold_dirs([work]), delete
    )
    cfg = _hook_config()
    if not value:  # decrypted images no CRIU reads any more (a lazy daemon's: podshim's business)
        _remove_decrypted((spec.get("annotations") or {}).get(RESTORE_ANNOTATION), cfg.state_dir)
    kept = _keep_log(work / "restore.log", cfg.state_dir, container_id)
    raise RestoreFailed(
        f"restore of container {container_id} undone: {reason}; its processes were killed: start it "
        f"again (CRIU log: {kept})"
    )


def _hook_config() -> Any:
    """podshim's config as the hook reads it (the defaults when it cannot)."""
    from shim import config

    try:
        return config.load(check_files=False)
    except config.ConfigError:
        return config.Config()


def _lazy_dir(spec: dict, cfg: Any, container_id: str) -> Path | None:
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
        raise RestoreFailed(
            f"restore of {container_id}: {LAZY_PAGES_ANNOTATION} {value!r} is not a lazy-pages work dir "
            f"of podshim (in {contract.lazy_root(cfg.state_dir)})"
        )
    failed = real / LAZY_PAGES_FAILED
    if failed.is_file() and not failed.is_symlink():  # podshim ended the daemon: its reason
        raise RestoreFailed(f"restore of {container_id}: {failed.read_text(errors='replace')[:2000]}")
    if not (real / LAZY_PAGES_SOCKET).exists():
        raise RestoreFailed(
            f"restore of {container_id}: no lazy-pages daemon listens in {real} (it has ended): "
            "remove the pod and restore again"
        )
    return real


def _page_check(
    spec: dict,
    ckpt: Path,
    container_id: str,
    running: Callable[[Path, dict[str, str]], PageImages | None] | None = None,
) -> PageImages | None:
    """The page check of an eager restore (PAGE_DIGESTS_ANNOTATION), started; None without the
    annotation. Every page image of the checkpoint dir (a name CRIU reads, pages-<n>.img) must be
    listed: one that is not would be restored unchecked (RestorePod checked any other name up
    front). `running(ckpt, digests)`: the check podshim started at RestorePod for exactly these
    images, if any (docs/design/runtime-wrapper.md (The runtime wrapper))."""
    import re

    value = spec.get("annotations", {}).get(PAGE_DIGESTS_ANNOTATION)
    if not value:
        return None
    try:
        digests = contract.parse_page_digests(value)
    except ValueError as e:
        raise RestoreFailed(
            f"restore of {container_id}: {PAGE_DIGESTS_ANNOTATION} is malformed: {e}"
        ) from None
    try:
        names = os.listdir(ckpt / "checkpoint")
    except OSError as e:
        raise RestoreFailed(
            f"restore of {container_id}: cannot list {ckpt / 'checkpoint'}: {e.strerror or e}"
        ) from None
    unlisted = sorted(
        f"checkpoint/{n}"
        for n in names
        if re.fullmatch(contract.PAGE_IMAGE_RE, f"checkpoint/{n}") and f"checkpoint/{n}" not in digests
    )
    if unlisted:
        raise RestoreFailed(
            f"restore of {container_id}: {', '.join(unlisted)} in {ckpt} is not a page image RestorePod "
            "recorded (the archive changed since): take a new checkpoint"
        )
    pages = running(ckpt, digests) if running is not None else None
    if pages is not None:
        pages.boost()
    else:
        pages = PageImages(ckpt, digests)
        pages.start()
    return pages


def _run_guarded(p: Prepared) -> int:
    """Run the restore with a watchdog: the upstream kills podshim-runc (SIGKILL) when
    StartContainer is cancelled, and runc's CRIU and the half-restored tasks must not go on
    unowned. The watchdog waits on a pipe; if podshim-runc dies before the restore ended, it
    kills the restore's process group and every process in the container's cgroup, detaches the
    mounts CRIU left under the work dir and the runtime's state dir, and removes a state dir the
    killed restore never completed (so the upstream's `delete` finds nothing to trip on).
    `p.settle(returncode)` runs before the watchdog is released: the tasks held stopped for the page
    check are continued or killed while a death of podshim-runc still kills them. `p.delete` (the
    runtime's `delete --force`) removes the state of a restore that had completed. (podshim-runc
    with podshim's broker: podshim is the watchdog, shim/ops/restore_broker.py.)"""
    # The work dir, held by an O_PATH descriptor (close-on-exec: runc does not get it): the
    # upstream renames the bundle (<id> -> .<id>) while it deletes it, so the watchdog finds CRIU's
    # mounts below through the descriptor, never through a path that may be gone.
    held = hold_dirs([p.work])
    # stdio and every other descriptor the upstream gave us go to the restored process.
    child = subprocess.Popen(p.cmd, close_fds=False, start_new_session=True, env={**os.environ, **p.env})
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # the watchdog
        try:
            os.close(write_end)
            keep = sorted({read_end, *held.values()})
            os.closerange(0, keep[0])  # hold none of the upstream's stdio open
            for lo, hi in zip(keep, [*keep[1:], 4096], strict=True):
                os.closerange(lo + 1, hi)
            if os.read(read_end, 1) == b"":  # EOF: podshim-runc died mid-restore
                undo(p, child.pid, held)
        finally:
            os._exit(0)
    os.close(read_end)
    for fd in held.values():
        os.close(fd)
    if p.pages is not None:
        # what settle needs (container_pids, ~13 ms), loaded while the restore runs: here, after
        # the fork, never in a thread (a module lock held by a thread at the fork would hang the
        # watchdog's own imports)
        import shim.cgroups.freezer  # noqa: F401
    returncode = child.wait()
    if p.pages is not None:
        p.settle(returncode)  # raising, podshim-runc exits: the watchdog kills the held tasks
    os.write(write_end, b"d")  # done: the watchdog leaves everything alone
    os.close(write_end)
    return returncode


def _keep_log(log_path: Path, state_dir: str, container_id: str) -> str:
    """Copy the CRIU log out of the bundle (which the upstream deletes) for the operator."""
    try:
        return str(kept_logs.keep(log_path.read_bytes(), state_dir, f"restore-{container_id}.log"))
    except OSError:
        return str(log_path)
