"""What a dump's or a restore's CRIU is told beyond runc's and crun's argv: the options podshim
exposes (CriuOptions), the CRIU config file for those neither runtime has a flag for, the CRIU
put first on PATH, and the gate a dump waits at until the pod is frozen (DumpGate).

podshim-runc's restore imports this module for `CriuOptions` on every restore's StartContainer:
asyncio and tempfile are imported where a dump uses them, not here (docs/design/runtime-wrapper.md
(The runtime wrapper))."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim import contract
from shim.deadlines import GATE_LOOK, GATE_WAIT


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
        self.config_file = self.dir / "podshim-criu-dump.conf"  # the dump's CRIU config (criu_config)
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
def criu_config(
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
