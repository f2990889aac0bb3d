"""Drives the OCI runtime that runs the containers (runc or crun) to checkpoint them with CRIU.

podshim always goes through the OCI runtime, never CRIU directly: the runtime knows the
container's namespaces, mounts, cgroups and the descriptors to re-attach on restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from shim import errors, faults

CRIU_LOG_TAIL = 6
# Error lines CRIU prints on every run of this kind of host without failing because of them
# (no CAP_SYS_RESOURCE to raise its own RLIMIT_NOFILE): kept out of error messages.
_HARMLESS = ("Can't setup RLIMIT_NOFILE for self",)


@dataclass(frozen=True)
class CriuOptions:
    """CRIU behaviour podshim exposes (CheckpointPod `options`, documented in the README)."""

    file_locks: bool = True  # as CRI-O: a locked file would otherwise fail the dump
    tcp_established: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False

    def flags(self) -> list[str]:
        out = []
        if self.file_locks:
            out.append("--file-locks")
        if self.tcp_established:
            out.append("--tcp-established")
        if self.ext_unix_sk:
            out.append("--ext-unix-sk")
        if self.shell_job:
            out.append("--shell-job")
        return out


def criu_error_lines(log_path: Path, limit: int = CRIU_LOG_TAIL) -> list[str]:
    """The last error lines of a CRIU log (what a person needs to see first)."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    errs = [
        line.strip()
        for line in lines
        if ("Error" in line or "error" in line) and not any(n in line for n in _HARMLESS)
    ]
    return (errs or [line.strip() for line in lines])[-limit:]


class OciRuntime:
    """One runc/crun binary with the --root the upstream uses for its containers."""

    def __init__(self, binary: str, root: str, criu: str = "") -> None:
        self.binary = binary
        self.root = root
        self.criu = criu

    @property
    def is_runc(self) -> bool:
        return "runc" in os.path.basename(self.binary)

    def global_args(self) -> list[str]:
        argv = [self.binary, "--root", self.root]
        # crun links libcriu and has no --criu flag; runc execs the binary named here.
        if self.is_runc and self.criu and os.path.isabs(self.criu):
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
    ) -> float:
        """Dump one container; returns the seconds it took. A failure names the container and
        the CRIU log, with its last error lines. Cancellation kills runc and CRIU."""
        argv = self.checkpoint_argv(container_id, image_dir, work_dir, opts, leave_running)
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a cancel can kill runc and the CRIU it started
        )
        faults.hit("checkpoint.mid-dump")
        try:
            out, _ = await proc.communicate()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.shield(proc.wait())
            raise
        if proc.returncode != 0:
            log_path = work_dir / "dump.log"
            detail = "; ".join(criu_error_lines(log_path)) or out.decode(errors="replace").strip()[-500:]
            raise errors.Internal(
                f"checkpoint of container {name!r} ({container_id[:13]}) failed: "
                f"{os.path.basename(self.binary)} exited {proc.returncode}: {detail} "
                f"(CRIU log: {log_path})"
            )
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
    ) -> list[str]:
        """`restore --detach` into `bundle`. `global_args` replaces --root/--criu with the flags
        the upstream passed (podshim-runc keeps its --log, --log-format, --systemd-cgroup...)."""
        head = [self.binary, *global_args] if global_args is not None else self.global_args()
        argv = [*head, "restore", "--detach"]
        if self.is_runc:
            argv.append("--no-subreaper")  # crun has no such flag (and no subreaper to disable)
        argv += ["--bundle", bundle, "--image-path", image_dir, "--work-path", work_dir]
        if pid_file:
            argv += ["--pid-file", pid_file]
        if console_socket:
            argv += ["--console-socket", console_socket]
        return [*argv, *opts.flags(), container_id]


def binary_version(binary: str) -> str:
    """First line of `<binary> --version` (runc, crun, criu all print it there)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
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
