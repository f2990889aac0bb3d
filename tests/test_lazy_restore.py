"""Lazy restore end to end (docs/design/restore-pod.md (Lazy restore)): RestorePod
with `lazy-pages=true` on the real containerd + runc + CRIU, the container's memory delivered by a
`criu lazy-pages` daemon podshim starts and supervises.

Checked: the counter's full-memory pattern check passes after a lazy restore at 256 MiB, 1 GiB and
4 GiB (plain) and at 256 MiB and 1 GiB (encrypted), and counting continues exactly from the cut;
each of those restores was lazy (its first output came while a daemon served its memory, none of it
resident yet, and the daemon delivered it all afterwards), and an eager one (lazy-pages=false) of
the same archive started no daemon and had all its memory resident at its first output; the
decrypted copy and the daemon's work dir are gone once the daemon is done, the archive unchanged;
crun (no lazy restore) is refused with FAILED_PRECONDITION; a daemon SIGKILLed mid-transfer, or an
image that became unreadable, kills the container (never running on with missing memory), with the
reason in its log and podshim_lazy_restore_failures_total counted; a podshim SIGKILLed while a
daemon serves handles the daemon's journal record at its next start.

A second podshim (with a node key and /metrics) in front of the bed's containerd serves this
module; its state dir lies in the bed's checkpoint root so that the bed's podshim-runc accepts its
`decrypted/` and `lazy/` dirs. The time to the first output after StartContainer is printed (-s).

The tests that act while a daemon still owes pages hold it by construction: a library preloaded
into podshim (so into the daemons it starts; DaemonHold) makes a daemon stop itself the instant
the restore told it that it finished, before its background transfer begins. The same library's
gate lets the pattern tests' daemons serve faults but hold their background transfer back until
the restored counter's first output was seen, so that lazy and eager differ there whatever the
machine's speed (unheld, a 256 MiB restore had 12-32 % of its memory in place at that moment).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import pods, resume
from testbed.bed import TestBed
from testbed.checks import lacks_room

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 300
LAZY = {"lazy-pages": "true"}
UFFD = "anon_inode:[userfaultfd]"
SMAPS_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(\S*)")  # a mapping's first line


# ---------------------------------------------------------------------------- the daemon's hold

# Preloaded into podshim (and so into the `criu lazy-pages` daemons it starts, which inherit its
# environment), two controls under PODSHIM_LAZY_HOLD=<dir>.
#
# The hold: with <dir>/hold present, a lazy-pages daemon stops
# itself (SIGSTOP) right after it received the restore's "restore finished" message, having written
# <dir>/held-<its pid>. At that instant it holds every userfaultfd of the restored process and has
# answered at most the few faults made until then, none of its background transfer, which begins
# only after that message (criu/uffd.c: lazy_sk_read_event sets restore_finished, handle_requests
# waits for it); the restore never waits for the daemon after sending it. Any other recv, or
# process, is left alone.
#
# The gate: with <dir>/gate present when the restore's "restore finished" reaches a daemon, the
# daemon does not see it (its epoll_wait drops the events of the restore's connection, found as the
# one it accepted) until the gate is removed, having written <dir>/gated-<its pid>. Meanwhile it
# serves every fault (handle_requests answers faults before that message, and only starts its
# background transfer after it): the restored process runs, with just the pages it touched.
DAEMON_HOLD_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define RESTORE_FINISHED 0x52535446 /* criu/uffd.c: LAZY_PAGES_RESTORE_FINISHED */

typedef ssize_t (*recv_fn)(int, void *, size_t, int);
static int held; /* once per process */

/* argv[1] of this process is "lazy-pages" */
static int lazy_pages_daemon(void)
{
    char buf[512];
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    size_t argv0 = strlen(buf) + 1;
    return (size_t)n > argv0 && strcmp(buf + argv0, "lazy-pages") == 0;
}

ssize_t recv(int fd, void *buf, size_t len, int flags)
{
    static recv_fn real;
    if (!real)
        real = (recv_fn)dlsym(RTLD_NEXT, "recv");
    ssize_t ret = real(fd, buf, len, flags);
    const char *dir = getenv("PODSHIM_LAZY_HOLD");
    uint32_t msg;
    if (held || !dir || ret != (ssize_t)sizeof(msg) || len != sizeof(msg))
        return ret;
    memcpy(&msg, buf, sizeof(msg));
    if (msg != RESTORE_FINISHED)
        return ret;
    int saved = errno;
    char path[4096];
    snprintf(path, sizeof(path), "%s/hold", dir);
    if (lazy_pages_daemon() && access(path, F_OK) == 0) {
        held = 1;
        snprintf(path, sizeof(path), "%s/held-%d", dir, (int)getpid());
        int out = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (out >= 0)
            close(out);
        raise(SIGSTOP); /* the whole daemon, until SIGCONT (or SIGKILL) */
    }
    errno = saved;
    return ret;
}

typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
typedef int (*epoll_wait_fn)(int, struct epoll_event *, int, int);
static int restore_sk = -1; /* the restore's connection: the one fd a daemon accepts */
static int let_through;     /* the gate was found open: nothing is held back any more */

int accept(int fd, struct sockaddr *addr, socklen_t *len)
{
    static accept_fn real;
    if (!real)
        real = (accept_fn)dlsym(RTLD_NEXT, "accept");
    int ret = real(fd, addr, len);
    if (ret >= 0 && restore_sk < 0 && getenv("PODSHIM_LAZY_HOLD")) {
        int saved = errno;
        if (lazy_pages_daemon())
            restore_sk = ret;
        errno = saved;
    }
    return ret;
}

/* whether the restore's end is to be held back now; the first time, says so in <dir>/gated-<pid> */
static int gate_closed(void)
{
    static int marked;
    char path[4096];
    const char *dir = getenv("PODSHIM_LAZY_HOLD");
    snprintf(path, sizeof(path), "%s/gate", dir ? dir : "");
    if (!dir || access(path, F_OK) != 0) {
        let_through = 1;
        return 0;
    }
    if (!marked) {
        marked = 1;
        snprintf(path, sizeof(path), "%s/gated-%d", dir, (int)getpid());
        int out = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (out >= 0)
            close(out);
    }
    return 1;
}

int epoll_wait(int epfd, struct epoll_event *evs, int max, int timeout)
{
    static epoll_wait_fn real;
    if (!real)
        real = (epoll_wait_fn)dlsym(RTLD_NEXT, "epoll_wait");
    for (;;) {
        int n = real(epfd, evs, max, timeout);
        if (n <= 0 || restore_sk < 0 || let_through)
            return n;
        int saved = errno, kept = 0, dropped = 0;
        for (int i = 0; i < n; i++) {
            /* CRIU registers a struct epoll_rfd, whose first member is the fd (criu/include/util.h) */
            const int *rfd = evs[i].data.ptr;
            if (rfd && *rfd == restore_sk && gate_closed()) {
                dropped = 1;
                continue;
            }
            evs[kept++] = evs[i];
        }
        errno = saved;
        if (kept || !dropped || timeout == 0)
            return kept;
        usleep(1000); /* only the restore's end (level-triggered) was ready: look again shortly */
    }
}
"""


@dataclass
class DaemonHold:
    """The control directory of the preloaded hold (DAEMON_HOLD_SOURCE): `armed()` makes the daemon
    that receives its restore's end meanwhile stop itself; `held(pid)` tells that it did. `gate()`
    and `gated(pid)` the same for the gate."""

    dir: Path
    library: Path

    def env(self) -> dict[str, str]:
        """The environment of the podshim whose daemons are to be held."""
        return {"LD_PRELOAD": str(self.library), "PODSHIM_LAZY_HOLD": str(self.dir)}

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        (self.dir / "hold").touch()
        try:
            yield
        finally:
            (self.dir / "hold").unlink(missing_ok=True)

    def held(self, pid: int) -> bool:
        return (self.dir / f"held-{pid}").exists()

    @contextlib.contextmanager
    def gate(self) -> Iterator[None]:
        """A daemon that receives its restore's end meanwhile serves faults only, with no background
        transfer, until the gate opens (DAEMON_HOLD_SOURCE)."""
        (self.dir / "gate").touch()
        try:
            yield
        finally:
            (self.dir / "gate").unlink(missing_ok=True)

    def gated(self, pid: int) -> bool:
        return (self.dir / f"gated-{pid}").exists()


@pytest.fixture(scope="module")
def daemon_hold(tmp_path_factory: pytest.TempPathFactory) -> DaemonHold:
    tmp = tmp_path_factory.mktemp("daemon-hold")
    source = tmp / "daemon_hold.c"
    source.write_text(DAEMON_HOLD_SOURCE)
    library = tmp / "daemon_hold.so"
    cc = ["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror"]
    subprocess.run([*cc, "-o", str(library), str(source), "-ldl"], check=True)
    (tmp / "ctl").mkdir()
    return DaemonHold(tmp / "ctl", library)


# ---------------------------------------------------------------------------- the module's podshim


@dataclass
class LazyPodshim:
    rt: Stub
    state_dir: Path
    log: Path
    metrics_port: int

    def failures(self, reason: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "podshim_lazy_restore_failures_total" and s.labels.get("reason") == reason:
                    return s.value
        return 0.0

    def daemon_records(self) -> list[dict]:
        out = []
        for p in sorted((self.state_dir / "ops").glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                doc = json.loads(p.read_text())
                if doc.get("kind") == "lazy-pages":
                    out.append(doc)
        return out

    def lazy_dirs(self) -> list[str]:
        try:
            return sorted(os.listdir(self.state_dir / "lazy"))
        except FileNotFoundError:
            return []

    def decrypted_dirs(self) -> list[str]:
        try:
            return sorted(os.listdir(self.state_dir / "decrypted"))
        except FileNotFoundError:
            return []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def lp(
    bed: TestBed, tmp_path_factory: pytest.TempPathFactory, daemon_hold: DaemonHold
) -> Iterator[LazyPodshim]:
    tmp = tmp_path_factory.mktemp("lazy-podshim")
    key_file = tmp / "checkpoint.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    state_dir = Path(bed.checkpoint_root) / f"lazy-state-{secrets.token_hex(3)}"
    port = _free_port()
    overrides = {
        "server": {"state_dir": str(state_dir), "metrics_address": f"127.0.0.1:{port}"},
        "checkpoint": {"encryption_key_file": str(key_file)},
    }
    try:
        with bed.extra_podshim(tmp, env=daemon_hold.env(), **overrides) as (sock, log):
            channel = grpc.insecure_channel(f"unix://{sock}")
            try:
                yield LazyPodshim(api_pb2_grpc.RuntimeServiceStub(channel), state_dir, log, port)
            finally:
                channel.close()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


# ---------------------------------------------------------------------------- helpers


def log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def take_checkpoint(rt: Stub, bed: TestBed, log_root: Path, mem_mib: int, tag: str) -> tuple[Path, int]:
    """A running counter of `mem_mib` MiB, checkpointed through `rt` (the module's podshim makes
    encrypted archives, the bed's plain ones) until the source's log places the cut
    (testbed/resume.py); the archive and the count every restore of it must print first. The source
    pod is removed at once (memory)."""
    args = ["--mem-mib", str(mem_mib), "--interval-ms", "50"]
    src = pods.run_pod(
        rt,
        f"lazy-src-{tag}-{secrets.token_hex(3)}",
        log_root,
        {"counter": pods.container_config("counter", args=args)},
    )

    def take() -> Path:
        out = Path(bed.checkpoint_root) / f"lazy-{tag}-{secrets.token_hex(3)}"
        out.mkdir(mode=0o700)
        try:
            rt.CheckpointPod(pods.checkpoint_request(rt, src.id, out), timeout=RPC_TIMEOUT)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        return out

    try:
        pods.wait_count(src.log_path("counter"), 3, timeout=120)
        out, first = resume.checkpoint_exactly(take, {"counter": src.log_path("counter")})
    finally:
        with contextlib.suppress(Exception):
            pods.remove_pod(rt, src.id)
    return out, first["counter"]


@dataclass
class Restored:
    pod_id: str
    cid: str
    log: Path
    mem_mib: int


def lazy_restore(
    rt: Stub, path: Path, log_root: Path, mem_mib: int, cleanup: list[str], options: dict[str, str] = LAZY
) -> Restored:
    """RestorePod of a counter archive (lazily by default); the container is not started."""
    config = pods.pod_config(f"lazy-{mem_mib}-{secrets.token_hex(3)}", log_root)
    args = ["--mem-mib", str(mem_mib), "--interval-ms", "50"]
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(path),
            config=config,
            container_configs=[pods.container_config("counter", args=args)],
            options=options,
        ),
        timeout=RPC_TIMEOUT,
    )
    cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    log = Path(config.log_directory) / "counter" / "0.log"
    return Restored(resp.pod_sandbox_id, cid, log, mem_mib)


# ---------------------------------------------------------------------------- lazy or eager


@dataclass(frozen=True)
class Memory:
    """The counter's --mem-mib mapping (its largest anonymous one), from /proc/<pid>/smaps."""

    size_kib: int
    resident_kib: int
    uffd: bool  # registered for missing-page faults with a userfaultfd (VmFlags "um")


def counter_memory(pid: int) -> Memory:
    best = Memory(0, 0, False)
    size = rss = 0
    anon = False
    flags: list[str] = []

    def close() -> None:
        nonlocal best
        if anon and size > best.size_kib:
            best = Memory(size, rss, "um" in flags)

    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        m = SMAPS_MAPPING.match(line)
        if m:
            close()
            size, rss, flags, anon = 0, 0, [], not m.group(1)  # no path: anonymous
        elif head and head[0] == "Size:":
            size = int(head[1])
        elif head and head[0] == "Rss:":
            rss = int(head[1])
        elif head and head[0] == "VmFlags:":
            flags = head[1:]
    close()
    return best


@dataclass(frozen=True)
class FirstOutput:
    """A restored counter the moment the test saw its first output."""

    mem_mib: int
    memory: Memory
    daemons_started: int  # "lazy-pages daemon serving" lines of podshim's log since its RestorePod
    daemon_serving: bool  # its daemon's journal record open and its process not ended
    seconds: float  # from StartContainer to the first output


def why_not_lazy(o: FirstOutput) -> list[str]:
    """What, at its first output, says a restore did not deliver the memory lazily ([]: nothing).
    Lazily, the output came while a daemon served the memory, nearly none of it resident yet (the
    gate held the background transfer back): an eager restore has all of it resident, no daemon."""
    out = []
    if not o.daemons_started:
        out.append("podshim started no lazy-pages daemon for the restore")
    if not o.daemon_serving:
        out.append("no lazy-pages daemon was serving the container at its first output")
    if not o.memory.uffd:
        out.append("its memory was not registered with a userfaultfd")
    if o.memory.resident_kib * 16 > o.mem_mib * 1024:  # the counter never touches it between verifies
        out.append(
            f"{o.memory.resident_kib} KiB of its {o.mem_mib} MiB were resident at its first output: "
            "delivered before it"
        )
    return out


def why_not_eager(o: FirstOutput) -> list[str]:
    """What, at its first output, says a restore did not put all the memory in place before it ran
    ([]: nothing)."""
    out = []
    if o.daemons_started:
        out.append(f"podshim started {o.daemons_started} lazy-pages daemon(s) for the restore")
    if o.daemon_serving:
        out.append("a lazy-pages daemon was serving the container at its first output")
    if o.memory.uffd:
        out.append("its memory was registered with a userfaultfd")
    if o.memory.resident_kib < o.mem_mib * 1024:
        out.append(
            f"only {o.memory.resident_kib} KiB of its {o.mem_mib} MiB were resident at its first output"
        )
    return out


def podshim_lines(log: Path, event: str) -> list[dict]:
    """podshim's JSON log lines of `event`."""
    out = []
    for line in log_text(log).splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("event") == event:
                out.append(doc)
    return out


def counter_pid(rt: Stub, cid: str) -> int:
    info = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True)).info["info"]
    return int(json.loads(info)["pid"])


def restore_observed(
    lp: LazyPodshim,
    hold: DaemonHold,
    path: Path,
    log_root: Path,
    mem_mib: int,
    cleanup: list[str],
    options: dict[str, str] = LAZY,
) -> tuple[Restored, FirstOutput]:
    """RestorePod and StartContainer with the daemons' gate closed (DAEMON_HOLD_SOURCE: a daemon
    serves faults but transfers nothing in the background), and what the counter looked like at its
    first output; the gate opens before this returns. An eager restore meets the same gate, and no
    daemon."""
    started = len(podshim_lines(lp.log, "lazy-pages daemon serving"))
    r = lazy_restore(lp.rt, path, log_root, mem_mib, cleanup, options)
    with hold.gate():
        t0 = time.monotonic()
        lp.rt.StartContainer(cri.StartContainerRequest(container_id=r.cid), timeout=RPC_TIMEOUT)
        pods.wait_for(
            lambda: pods.counts(r.log), timeout=60, interval=0.002, what="the restored counter's output"
        )
        seconds = time.monotonic() - t0
        memory = counter_memory(counter_pid(lp.rt, r.cid))
        daemon = [d for d in lp.daemon_records() if d["data"].get("container_id") == r.cid]
        serving = bool(daemon) and proc_state(int(daemon[0]["data"]["pid"])) not in ("Z", "gone")
        if serving:  # (else the lazy checks below say what is wrong)
            pid = int(daemon[0]["data"]["pid"])
            assert hold.gated(pid), "the daemon's gate did not hold it back"
            (hold.dir / f"gated-{pid}").unlink()  # a later daemon may get the same pid
    started = len(podshim_lines(lp.log, "lazy-pages daemon serving")) - started
    assert memory.size_kib >= mem_mib * 1024, f"no {mem_mib} MiB mapping in the counter: {memory}"
    o = FirstOutput(mem_mib, memory, started, serving, seconds)
    how = "lazy" if options.get("lazy-pages") == "true" else "eager"
    print(f"\n{how} restore {mem_mib} MiB: first output {seconds:.3f} s after StartContainer, {memory}")
    return r, o


def delivered_pages(lp: LazyPodshim, cid: str) -> int | None:
    """The pages the container's daemon delivered through the userfaultfd, from podshim's "lazy
    restore complete" line (the daemon's own count: CRIU patch 0014); None: no such line."""
    done = [d for d in podshim_lines(lp.log, "lazy restore complete") if d.get("container") == cid]
    pages = done[-1].get("transfer", {}).get("pages") if done else None
    return None if pages is None else int(pages)


def verify_memory(rt: Stub, r: Restored) -> None:
    """SIGUSR1: the counter checks every word of its memory (faulting every page in)."""
    seen = log_text(r.log).count("verify ")
    res = rt.ExecSync(cri.ExecSyncRequest(container_id=r.cid, cmd=["kill", "-USR1", "1"], timeout=30))
    assert res.exit_code == 0, res.stderr
    pods.wait_for(lambda: log_text(r.log).count("verify ") > seen, timeout=120, what="the verify line")
    text = log_text(r.log)
    assert f"verify ok mem_mib={r.mem_mib}" in text, text[-600:]
    assert "verify FAILED" not in text, text[-600:]


def state(rt: Stub, cid: str) -> int:
    return rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state


def daemon_pid(records: list[dict], cid: str) -> int:
    for doc in records:
        if doc["data"].get("container_id") == cid:
            return int(doc["data"]["pid"])
    raise AssertionError(f"no lazy-pages journal record for container {cid[:13]}: {records}")


def guard_pid(records: list[dict], cid: str) -> int:
    """The pid of the uffd guard (shim/criu/uffd_guard.py) of the container's daemon."""
    for doc in records:
        if doc["data"].get("container_id") == cid:
            return int(doc["data"]["guard"])
    raise AssertionError(f"no lazy-pages journal record for container {cid[:13]}: {records}")


def holds_uffd(pid: int) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == UFFD:
                return True
    return False


def podshim_pids(config_hint: str) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if "serve" in cmd and config_hint in cmd:
                    out.append(int(p))
    return out


def wchan(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return ""


def proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    return "gone" if st == "X" else st


def start_held(rt: Stub, cid: str, hold: DaemonHold, lp_pids: list[int], pid: int) -> None:
    """StartContainer of a lazily restored container with its daemon's hold armed: the daemon
    (`pid`) stops itself the instant the restore has finished, before its background transfer, so
    it still owes nearly every page; then until podshim (`lp_pids`) holds its userfaultfd."""
    with hold.armed():
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
        pods.wait_for(
            lambda: (hold.held(pid) and proc_state(pid) in ("T", "t")) or proc_state(pid) in ("Z", "gone"),
            timeout=30,
            interval=0.005,
            what="the daemon to stop itself at the restore's end",
        )
    assert proc_state(pid) in ("T", "t"), "the daemon ended (every page delivered) before it was held"
    assert holds_uffd(pid), "the held daemon holds no userfaultfd"
    pods.wait_for(
        lambda: any(holds_uffd(p) for p in lp_pids),
        timeout=10,
        interval=0.005,
        what="podshim holding the userfaultfd",
    )


# ---------------------------------------------------------------------------- archives (module-scoped)


class Archives(dict[int, Path]):
    """Counter archives by memory size, each taken on first use (`take`); `first[mem]`: the count
    every restore of that archive must print first (testbed/resume.py)."""

    def __init__(self, take: Callable[[int], tuple[Path, int]]) -> None:
        super().__init__()
        self.take = take
        self.first: dict[int, int] = {}

    def __missing__(self, mem: int) -> Path:
        self[mem], self.first[mem] = self.take(mem)
        return self[mem]


@pytest.fixture(scope="module")
def plain(rt: Stub, bed: TestBed) -> Iterator[Archives]:
    """Plain archives by size, taken on demand (a 4 GiB one only when its test runs)."""
    log_root = Path(bed.base_dir) / "pod-logs"
    log_root.mkdir(exist_ok=True)
    made = Archives(lambda mem: take_checkpoint(rt, bed, log_root, mem, f"plain{mem}"))
    yield made
    for p in made.values():
        shutil.rmtree(p, ignore_errors=True)


@pytest.fixture(scope="module")
def encrypted(lp: LazyPodshim, bed: TestBed) -> Iterator[Archives]:
    log_root = Path(bed.base_dir) / "pod-logs"
    log_root.mkdir(exist_ok=True)
    made = Archives(lambda mem: take_checkpoint(lp.rt, bed, log_root, mem, f"enc{mem}"))
    yield made
    for p in made.values():
        shutil.rmtree(p, ignore_errors=True)


@pytest.fixture
def lp_cleanup(lp: LazyPodshim) -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for pod_id in ids:
        with contextlib.suppress(Exception):
            pods.remove_pod(lp.rt, pod_id)


def fingerprint(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def skip_without_room(lp: LazyPodshim, mem_mib: int, copies: int) -> None:
    """A counter of `mem_mib` (the source, then the restored one, with the archive's pages in the
    page cache: twice that), and `copies` of its archive on disk."""
    why = lacks_room(2 * mem_mib, copies * mem_mib, lp.state_dir.parent)
    if why:
        pytest.skip(f"a {mem_mib} MiB lazy restore {why}")


def wait_daemon_done(lp: LazyPodshim) -> None:
    """The daemon delivered every page and podshim cleaned up after it."""
    pods.wait_for(
        lambda: not lp.daemon_records() and not lp.lazy_dirs() and not lp.decrypted_dirs(),
        timeout=120,
        what="the lazy-pages daemon to finish (journal record, work dir and decrypted copy gone)",
    )


# ---------------------------------------------------------------------------- integrity


def assert_lazy(o: FirstOutput) -> None:
    """The restore was lazy: its first output came with its memory still to be delivered (and so
    the restore is not an eager one: why_not_eager has something to say)."""
    assert not why_not_lazy(o), f"not a lazy restore: {'; '.join(why_not_lazy(o))} ({o})"
    assert why_not_eager(o), o


def assert_delivered_lazily(lp: LazyPodshim, r: Restored) -> None:
    """After its daemon is done: the daemon delivered at least the whole --mem-mib memory through
    the userfaultfd, all of it after the first output (the gate held every page the process did
    not touch until then)."""
    pages = delivered_pages(lp, r.cid)
    assert pages is not None, f"podshim logged no `lazy restore complete` with a page count for {r.cid}"
    assert pages >= r.mem_mib * 256, f"the daemon delivered {pages} pages, fewer than {r.mem_mib} MiB"


@pytest.mark.parametrize("mem_mib", [256, 1024, 4096])
def test_lazy_restore_plain_pattern_intact(
    lp: LazyPodshim,
    plain: Archives,
    log_root: Path,
    lp_cleanup: list[str],
    mem_mib: int,
    daemon_hold: DaemonHold,
) -> None:
    skip_without_room(lp, mem_mib, copies=1)
    path = plain[mem_mib]
    before = fingerprint(path)
    r, first_output = restore_observed(lp, daemon_hold, path, log_root, mem_mib, lp_cleanup)
    assert_lazy(first_output)
    # from exactly the count after the cut, then on one by one (never its start-up again)
    resume.assert_exact_resume({"counter": r.log}, {"counter": plain.first[mem_mib]})
    verify_memory(lp.rt, r)
    pods.wait_count(r.log, pods.counts(r.log)[-1] + 5)  # it keeps counting
    assert state(lp.rt, r.cid) == cri.CONTAINER_RUNNING
    wait_daemon_done(lp)
    assert_delivered_lazily(lp, r)
    assert state(lp.rt, r.cid) == cri.CONTAINER_RUNNING
    verify_memory(lp.rt, r)  # and after the daemon is gone
    assert fingerprint(path) == before, "the restore modified the archive"
    pods.remove_pod(lp.rt, r.pod_id)
    lp_cleanup.remove(r.pod_id)
    if mem_mib == 4096:
        shutil.rmtree(path, ignore_errors=True)  # 4 GiB of disk


@pytest.mark.parametrize("mem_mib", [256, 1024, 4096])
def test_lazy_restore_encrypted_pattern_intact(
    lp: LazyPodshim,
    encrypted: Archives,
    log_root: Path,
    lp_cleanup: list[str],
    mem_mib: int,
    daemon_hold: DaemonHold,
) -> None:
    skip_without_room(lp, mem_mib, copies=2)  # the archive and its decrypted copy
    path = encrypted[mem_mib]
    before = fingerprint(path)
    r, first_output = restore_observed(lp, daemon_hold, path, log_root, mem_mib, lp_cleanup)
    assert_lazy(first_output)
    resume.assert_exact_resume({"counter": r.log}, {"counter": encrypted.first[mem_mib]})
    verify_memory(lp.rt, r)
    # the plaintext copy the daemon served goes once the daemon is done, not before the restore
    wait_daemon_done(lp)
    assert_delivered_lazily(lp, r)
    pods.wait_count(r.log, pods.counts(r.log)[-1] + 5)
    verify_memory(lp.rt, r)
    assert fingerprint(path) == before, "the restore modified the archive"
    if mem_mib == 4096:
        pods.remove_pod(lp.rt, r.pod_id)
        lp_cleanup.remove(r.pod_id)
        shutil.rmtree(path, ignore_errors=True)  # 4 GiB of disk


def test_eager_restore_runs_no_daemon(
    lp: LazyPodshim, plain: Archives, log_root: Path, lp_cleanup: list[str], daemon_hold: DaemonHold
) -> None:
    """The same archive and podshim with lazy-pages=false: no daemon is started (the gate closed
    as for the lazy tests holds nothing), its whole memory is resident at its first output and not
    registered with a userfaultfd, no page is delivered lazily; it resumes exactly as the lazy
    restores do."""
    r, first_output = restore_observed(
        lp, daemon_hold, plain[256], log_root, 256, lp_cleanup, options={"lazy-pages": "false"}
    )
    assert not why_not_eager(first_output), f"not an eager restore: {'; '.join(why_not_eager(first_output))}"
    assert why_not_lazy(first_output), first_output  # the lazy tests' check refuses it
    resume.assert_exact_resume({"counter": r.log}, {"counter": plain.first[256]})
    verify_memory(lp.rt, r)
    assert not lp.daemon_records() and not lp.lazy_dirs()
    assert delivered_pages(lp, r.cid) is None, "a daemon delivered pages to the eager restore"
    pods.remove_pod(lp.rt, r.pod_id)
    lp_cleanup.remove(r.pod_id)


def test_decrypted_copy_kept_while_the_daemon_serves(
    lp: LazyPodshim,
    encrypted: Archives,
    log_root: Path,
    lp_cleanup: list[str],
    daemon_hold: DaemonHold,
) -> None:
    """After `runc restore` returned, the daemon still reads the decrypted images: they stay until it
    has delivered every page (podshim-runc removes them at once after an eager restore)."""
    r = lazy_restore(lp.rt, encrypted[1024], log_root, 1024, lp_cleanup)
    assert len(lp.decrypted_dirs()) == 1 and len(lp.lazy_dirs()) == 1
    pid = daemon_pid(lp.daemon_records(), r.cid)
    lp_pids = podshim_pids("lazy-podshim")  # its config lies in the tmp dir lazy-podshim<N>
    start_held(lp.rt, r.cid, daemon_hold, lp_pids, pid)  # the daemon has not delivered everything
    try:
        assert len(lp.decrypted_dirs()) == 1, "the decrypted copy went while the daemon still serves"
        assert lp.daemon_records(), "the daemon's record went while it still serves"
    finally:
        os.kill(pid, signal.SIGCONT)
    verify_memory(lp.rt, r)
    wait_daemon_done(lp)


# ---------------------------------------------------------------------------- refusals


def test_crun_is_refused_with_failed_precondition(
    lp: LazyPodshim, plain: Archives, log_root: Path, crun_handler: str
) -> None:
    config = pods.pod_config(f"lazy-crun-{secrets.token_hex(3)}", log_root)
    with pytest.raises(grpc.RpcError) as err:
        lp.rt.RestorePod(
            cri.RestorePodRequest(
                checkpoint_path=str(plain[256]),
                config=config,
                container_configs=[
                    pods.container_config("counter", args=["--mem-mib", "256", "--interval-ms", "50"])
                ],
                runtime_handler=crun_handler,
                options=LAZY,
            ),
            timeout=RPC_TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "crun" in err.value.details() and "lazy" in err.value.details()
    assert not lp.daemon_records() and not lp.lazy_dirs()


def test_bad_option_value_is_invalid_argument(lp: LazyPodshim, plain: Archives, log_root: Path) -> None:
    config = pods.pod_config(f"lazy-bad-{secrets.token_hex(3)}", log_root)
    with pytest.raises(grpc.RpcError) as err:
        lp.rt.RestorePod(
            cri.RestorePodRequest(
                checkpoint_path=str(plain[256]), config=config, options={"lazy-pages": "maybe"}
            ),
            timeout=RPC_TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lazy-pages" in err.value.details()


# ---------------------------------------------------------------------------- supervision


def test_daemon_killed_mid_transfer_kills_the_container(
    lp: LazyPodshim,
    plain: Archives,
    log_root: Path,
    lp_cleanup: list[str],
    bed: TestBed,
    daemon_hold: DaemonHold,
) -> None:
    """The daemon is SIGKILLed while the counter faults on pages it has not delivered yet. With
    podshim itself stopped meanwhile (so it cannot kill the container at once), the fault stays
    blocked: podshim's duplicate of the userfaultfd keeps the ranges registered (without it the
    kernel unregisters them when the daemon dies and the fault reads a zero page: `verify FAILED`).
    Once podshim runs again it kills the container and says why."""
    before = lp.failures("killed")
    r = lazy_restore(lp.rt, plain[1024], log_root, 1024, lp_cleanup)
    pid = daemon_pid(lp.daemon_records(), r.cid)
    lp_pids = podshim_pids("lazy-podshim")  # its config lies in the tmp dir lazy-podshim<N>
    assert lp_pids, "the module's podshim process was not found"
    start_held(lp.rt, r.cid, daemon_hold, lp_pids, pid)
    counter = json.loads(
        lp.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=r.cid, verbose=True)).info["info"]
    )["pid"]
    os.kill(counter, signal.SIGUSR1)  # the counter reads every page: it blocks on a missing one
    pods.wait_for(
        lambda: wchan(counter) == "handle_userfault", timeout=30, what="the counter blocked in a fault"
    )
    for p in lp_pids:
        os.kill(p, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        pods.wait_for(lambda: proc_state(pid) in ("Z", "gone"), timeout=10, what="the daemon dead")
        time.sleep(2)  # a zero-filled verify of 1 GiB ends well within this
        text = log_text(r.log)
        assert "verify " not in text, f"the counter read memory the daemon never delivered: {text[-400:]}"
        assert wchan(counter) == "handle_userfault", wchan(counter)
    finally:
        for p in lp_pids:
            os.kill(p, signal.SIGCONT)
    pods.wait_for(
        lambda: state(lp.rt, r.cid) == cri.CONTAINER_EXITED, timeout=60, what="the container killed"
    )
    text = log_text(r.log)
    assert "verify FAILED" not in text and "verify ok" not in text, text[-600:]
    assert "lazy restore failed" in text and "killed by signal 9" in text, text[-600:]
    assert lp.failures("killed") == before + 1
    assert "lazy restore failed" in log_text(lp.log)
    pods.wait_for(lambda: not lp.daemon_records() and not lp.lazy_dirs(), timeout=30, what="clean-up")


def test_unreadable_image_kills_the_container(
    lp: LazyPodshim,
    plain: Archives,
    log_root: Path,
    lp_cleanup: list[str],
    bed: TestBed,
    daemon_hold: DaemonHold,
) -> None:
    """The archive's pages become unreadable (truncated) while the daemon still has pages to
    deliver: the daemon fails (counted as `exit`), or the page images' background checksum pass
    finds it first (`checksum`); either way the container is killed with the reason in its log."""
    copy = Path(bed.checkpoint_root) / f"lazy-unreadable-{secrets.token_hex(3)}"
    shutil.copytree(plain[1024], copy)
    try:
        before = lp.failures("exit") + lp.failures("checksum")
        r = lazy_restore(lp.rt, copy, log_root, 1024, lp_cleanup)
        pid = daemon_pid(lp.daemon_records(), r.cid)
        lp_pids = podshim_pids("lazy-podshim")  # its config lies in the tmp dir lazy-podshim<N>
        start_held(lp.rt, r.cid, daemon_hold, lp_pids, pid)
        try:
            for p in (copy / "containers" / "counter" / "checkpoint").glob("pages-*.img"):
                os.truncate(p, 0)
        finally:
            with contextlib.suppress(ProcessLookupError):  # ended by the checksum pass already
                os.kill(pid, signal.SIGCONT)
        pods.wait_for(
            lambda: state(lp.rt, r.cid) == cri.CONTAINER_EXITED, timeout=60, what="the container killed"
        )
        pods.wait_for(lambda: "lazy restore failed" in log_text(r.log), timeout=30, what="the reason")
        text = log_text(r.log)
        assert "exited with status" in text or "checksum mismatch" in text, text[-600:]
        assert "verify FAILED" not in text
        assert lp.failures("exit") + lp.failures("checksum") == before + 1
        pods.wait_for(lambda: not lp.daemon_records(), timeout=30, what="the daemon's record closed")
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_corrupt_page_image_kills_the_lazy_container(
    lp: LazyPodshim, plain: Archives, log_root: Path, lp_cleanup: list[str], bed: TestBed
) -> None:
    """A plain archive's page images are checksummed while the daemon serves, not before the lazy
    restore: one flipped byte in a copy's pages image kills the container (before or after it ran,
    whichever comes first) with the checksum reason in its log, counted as `checksum`, and the
    work dir and record go. The eager restore of the same copy fails before its process runs
    (RestorePod start=true: DATA_LOSS naming the image, docs/design/restore-pod.md (RestorePod) step 4)."""
    copy = Path(bed.checkpoint_root) / f"lazy-corrupt-{secrets.token_hex(3)}"
    shutil.copytree(plain[256], copy)
    try:
        pages = max((copy / "containers" / "counter" / "checkpoint").glob("pages-*.img"), key=os.path.getsize)
        with open(pages, "r+b") as f:  # same size: only the checksum can tell
            f.seek(pages.stat().st_size // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        before = lp.failures("checksum")
        r = lazy_restore(lp.rt, copy, log_root, 256, lp_cleanup)
        # the mismatch may be found before the start (it then fails: the daemon is gone) or after
        with contextlib.suppress(grpc.RpcError):
            lp.rt.StartContainer(cri.StartContainerRequest(container_id=r.cid), timeout=RPC_TIMEOUT)
        pods.wait_for(
            lambda: state(lp.rt, r.cid) == cri.CONTAINER_EXITED, timeout=60, what="the container killed"
        )
        pods.wait_for(
            lambda: "checksum mismatch" in log_text(r.log), timeout=30, what="the reason in its log"
        )
        text = log_text(r.log)
        assert "lazy restore failed" in text and pages.name in text, text[-600:]
        assert lp.failures("checksum") == before + 1
        assert "checksum mismatch" in log_text(lp.log)
        pods.wait_for(lambda: not lp.daemon_records() and not lp.lazy_dirs(), timeout=30, what="clean-up")
        # the eager path verifies every byte before the process runs (the page images while CRIU
        # restores it, stopped)
        config = pods.pod_config(f"eager-corrupt-{secrets.token_hex(3)}", log_root)
        with pytest.raises(grpc.RpcError) as err:
            lp.rt.RestorePod(
                cri.RestorePodRequest(
                    checkpoint_path=str(copy),
                    config=config,
                    container_configs=[
                        pods.container_config("counter", args=["--mem-mib", "256", "--interval-ms", "50"])
                    ],
                    options={"start": "true"},
                ),
                timeout=RPC_TIMEOUT,
            )
        assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value.details()
        assert pages.name in err.value.details()
    finally:
        shutil.rmtree(copy, ignore_errors=True)


# ---------------------------------------------------------------------------- recovery


def bed_daemon_records(bed: TestBed) -> list[dict]:
    out = []
    for p in sorted((Path(bed.podshim_state_dir) / "ops").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(p.read_text())
            if doc.get("kind") == "lazy-pages":
                out.append(doc)
    return out


@pytest.fixture
def bed_podshim_held(rt: Stub, bed: TestBed, daemon_hold: DaemonHold) -> Iterator[DaemonHold]:
    """The bed's podshim restarted with the daemons' hold preloaded (DaemonHold); its next start is
    without it again, and one still running with it at the end is restarted without it."""
    saved = dict(bed.extra_env)
    bed.extra_env = {**saved, **daemon_hold.env()}
    try:
        bed.kill_podshim(signal.SIGTERM)
        bed.start_podshim_again()
    finally:
        bed.extra_env = saved  # (the environment of a process is the one it started with)
    held_podshim = bed.podshim_pid
    rt.Version(cri.VersionRequest(), timeout=30, wait_for_ready=True)
    yield daemon_hold
    if bed.podshim_running and bed.podshim_pid == held_podshim:
        bed.kill_podshim(signal.SIGTERM)
    if not bed.podshim_running:
        bed.start_podshim_again()


@pytest.mark.parametrize("daemon", ["alive", "gone", "podshim-stopped"])
def test_podshim_killed_while_a_daemon_serves(
    rt: Stub,
    bed: TestBed,
    plain: Archives,
    log_root: Path,
    pod_cleanup: list[str],
    daemon: str,
    bed_podshim_held: DaemonHold,
) -> None:
    """podshim is SIGKILLed (or stopped with SIGTERM: the daemon must outlive it, never be killed
    with it) while a daemon serves (held stopped mid-transfer) and the counter is blocked on a page
    it has not delivered; `gone`: the daemon is SIGKILLed too. The fault stays blocked (the daemon's
    guard holds the userfaultfd: without it the counter read zero pages, `verify FAILED`). At
    podshim's next start the journal's record is handled: the container, whose daemon's result can
    no longer be known, is killed with the reason in its log; an alive daemon and the guard are
    ended; the record and work dir go."""
    r = lazy_restore(rt, plain[1024], log_root, 1024, pod_cleanup)
    pid = daemon_pid(bed_daemon_records(bed), r.cid)
    podshim = bed.podshim_pid
    assert podshim
    start_held(rt, r.cid, bed_podshim_held, [podshim], pid)
    guard = guard_pid(bed_daemon_records(bed), r.cid)
    pods.wait_for(
        lambda: holds_uffd(guard), timeout=10, interval=0.005, what="the guard holding the userfaultfd"
    )
    counter = json.loads(
        rt.ContainerStatus(cri.ContainerStatusRequest(container_id=r.cid, verbose=True)).info["info"]
    )["pid"]
    os.kill(counter, signal.SIGUSR1)  # the counter reads every page: it blocks on a missing one
    pods.wait_for(
        lambda: wchan(counter) == "handle_userfault", timeout=30, what="the counter blocked in a fault"
    )
    bed.kill_podshim(signal.SIGTERM if daemon == "podshim-stopped" else signal.SIGKILL)
    assert proc_state(pid) in ("T", "t"), "the daemon did not outlive podshim"
    if daemon == "gone":
        os.kill(pid, signal.SIGKILL)
        pods.wait_for(lambda: proc_state(pid) == "gone", timeout=10, what="the daemon reaped")
    # podshim's duplicates closed with it, and a dead daemon's before it was reaped: without the
    # guard the kernel has woken the fault by now, to read a zero page (`verify FAILED`)
    assert wchan(counter) == "handle_userfault", (wchan(counter), log_text(r.log)[-400:])
    assert bed_daemon_records(bed), "the daemon's journal record went with podshim"
    bed.start_podshim_again()
    pods.wait_for(lambda: state(rt, r.cid) == cri.CONTAINER_EXITED, timeout=60, what="the container killed")
    text = log_text(r.log)
    assert "lazy restore interrupted" in text, text[-600:]
    assert "verify " not in text, text[-600:]  # killed still blocked on a page never delivered
    pods.wait_for(lambda: not bed_daemon_records(bed), timeout=30, what="the record closed")
    pods.wait_for(lambda: proc_state(pid) == "gone", timeout=10, what="the daemon ended")
    pods.wait_for(lambda: proc_state(guard) == "gone", timeout=10, what="the guard ended")
    lazy_dir = Path(bed.podshim_state_dir) / "lazy"
    assert not lazy_dir.exists() or not os.listdir(lazy_dir)
    assert "lazy-pages daemon of a previous podshim handled" in log_text(Path(bed.podshim_log))


@pytest.mark.parametrize("daemon", ["finishes", "killed"])
def test_containerd_restart_while_a_daemon_serves(
    lp: LazyPodshim,
    bed: TestBed,
    plain: Archives,
    log_root: Path,
    lp_cleanup: list[str],
    daemon: str,
    daemon_hold: DaemonHold,
) -> None:
    """containerd is down while a daemon serves (the container runs on under its shim): a daemon that
    finishes meanwhile leaves an intact, running container; one killed meanwhile has its container
    killed once containerd answers again (podshim retries; the faults stay blocked until then)."""
    before = lp.failures("killed")
    r = lazy_restore(lp.rt, plain[1024], log_root, 1024, lp_cleanup)
    pid = daemon_pid(lp.daemon_records(), r.cid)
    lp_pids = podshim_pids("lazy-podshim")  # its config lies in the tmp dir lazy-podshim<N>
    start_held(lp.rt, r.cid, daemon_hold, lp_pids, pid)
    bed.stop_containerd()
    try:
        if daemon == "finishes":
            os.kill(pid, signal.SIGCONT)
            pods.wait_for(lambda: not lp.daemon_records(), timeout=60, what="the daemon done")
        else:
            os.kill(pid, signal.SIGKILL)
            pods.wait_for(lambda: proc_state(pid) == "gone", timeout=10, what="the daemon reaped")
            assert lp.daemon_records(), "the record went before the container could be killed"
    finally:
        bed.start_containerd()

    def answers() -> bool:
        try:
            state(lp.rt, r.cid)
        except grpc.RpcError:
            return False
        return True

    pods.wait_for(answers, timeout=60, what="containerd answering through podshim again")
    if daemon == "finishes":
        verify_memory(lp.rt, r)
        assert state(lp.rt, r.cid) == cri.CONTAINER_RUNNING
        assert lp.failures("killed") == before
    else:
        pods.wait_for(
            lambda: state(lp.rt, r.cid) == cri.CONTAINER_EXITED, timeout=90, what="the container killed"
        )
        # the reason goes into the log once containerd says where it is: after the kill
        pods.wait_for(
            lambda: "lazy restore failed" in log_text(r.log), timeout=30, what="the reason in the log"
        )
        assert "verify " not in log_text(r.log), log_text(r.log)[-600:]
        assert lp.failures("killed") == before + 1
        pods.wait_for(lambda: not lp.daemon_records(), timeout=30, what="the record closed")
