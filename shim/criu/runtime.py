"""Drives the OCI runtime that runs the containers (runc or crun) to checkpoint them with CRIU.

podshim always goes through the OCI runtime, never CRIU directly: the runtime knows the
container's namespaces, mounts, cgroups and the descriptors to re-attach on restore.

podshim-runc's restore imports this module for `restore_argv` on every restore's StartContainer,
so asyncio and the logging set-up (structlog) are imported where the dump uses them, not here
(docs/design/runtime-wrapper.md (The runtime wrapper)).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from shim import errors, faults
from shim.criu.dump_stop import stop_dump
from shim.criu.log import criu_error_lines, option_hint
from shim.criu.options import CriuOptions, DumpGate, criu_config, criu_path_env
from shim.deadlines import VERSION_TIMEOUT


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
        with criu_config(opts, self.criu, extra, self.scratch, gate) as env:  # lives as long as the dump
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
