"""Hold a real CRIU at a chosen instant of its dump, by construction (testbed/criu_hold.c, a
library the tests preload into the CRIU that podshim's runc/crun start): right after CRIU made
the task it dumps run a system call it injected, the instant at which ending CRIU kills the task
(`arm`); or once CRIU wrote so many bytes of the task's memory images, where ending CRIU leaves
the task unharmed (`arm_pages`: for a test that kills CRIU, or acts while CRIU still dumps).
Used by tests/test_dump_given_up.py and tests/faults/; `arm` on x86-64 only (the call number is
read from rax)."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from testbed import _sys

SOURCE = Path(__file__).with_name("criu_hold.c")
# compel's injected system calls into each task it infects: memfd_create first (the parasite's
# memory), munmap last (the parasite removed, after the task's memory was dumped)
FIRST_INJECTED = 319  # memfd_create
CURE = 11  # munmap


def build(out_dir: Path) -> Path:
    """criu_hold.so compiled into `out_dir` (named after its source's hash: built once)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    so = out_dir / f"criu_hold-{digest}.so"
    if not so.exists():
        tmp = so.with_suffix(".tmp")
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp), str(SOURCE), "-ldl"], check=True
        )
        tmp.rename(so)
    return so


class CriuHold:
    """The control directory of the preloaded library: `arm` says which call into which tasks
    to hold CRIU at; `wait_held` returns the held CRIUs; `release_all` (also on exit) lets them
    go, so that no CRIU stays stopped whatever the test did."""

    def __init__(self, directory: Path, library: Path) -> None:
        self.dir = directory
        self.library = library
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        """The environment of the podshim whose runc/crun and CRIU are to be held."""
        return {"LD_PRELOAD": str(self.library), "PODSHIM_CRIU_HOLD": str(self.dir)}

    def arm(self, call: int, pids: Iterable[int]) -> None:
        """Hold each CRIU at its first injected system call `call` into one of `pids`."""
        tmp = self.dir / "hold.tmp"
        tmp.write_text(f"{call} {' '.join(str(p) for p in pids)}\n")
        tmp.rename(self.dir / "hold")

    def arm_pages(self, min_bytes: int) -> None:
        """Hold each CRIU once it has written `min_bytes` of memory pages (its pages-*.img images)
        in all: in CRIU's own code, the task whose memory it dumps waiting in CRIU's parasite for
        its next command. A CRIU ended there (SIGKILL, SIGTERM) leaves the task running as it was;
        `held` names that task."""
        tmp = self.dir / "hold.tmp"
        tmp.write_text(f"pages {min_bytes}\n")
        tmp.rename(self.dir / "hold")

    def disarm(self) -> None:
        (self.dir / "hold").unlink(missing_ok=True)

    def held(self) -> dict[int, int]:
        """Task pid -> pid of the CRIU that stopped itself injecting a call into it (or dumping
        its memory: `arm_pages`)."""
        out = {}
        for marker in self.dir.glob("held-*"):
            text = marker.read_text().split()
            if len(text) == 2:
                out[int(text[1])] = int(marker.name.removeprefix("held-"))
        return out

    def wait_held(self, tasks: Iterable[int], timeout: float) -> dict[int, int]:
        """Wait until a CRIU is held (stopped) in each of `tasks`; returns task -> CRIU pid."""
        want = set(tasks)
        end = time.monotonic() + timeout
        while True:
            held = {t: c for t, c in self.held().items() if t in want}
            if set(held) == want and all(_stopped(c) for c in held.values()):
                return held
            if time.monotonic() > end:
                raise TimeoutError(f"no CRIU held in each of {sorted(want)} in {timeout:.0f} s: {held}")
            time.sleep(0.01)

    def release_all(self) -> None:
        self.disarm()
        for criu in self.held().values():
            _sys.kill(criu, signal.SIGCONT)

    def __enter__(self) -> CriuHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_all()


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].startswith("T")
