"""CRIU's lazy migration on this node (live migration's first step, docs/design/versions.md
(This machine (Debian 12, kernel 6.18))): a process dumped with `--lazy-pages` serves its memory from its own
page server, a `criu lazy-pages --page-server` daemon fetches it for `criu restore --lazy-pages`.

Plain CRIU, no container: what podshim's migration (shim/migration/) is built on. Without the
project's patch 0004 the dump's page server failed at the first page request on a node without
CAP_SYS_RESOURCE (`page-pipe: tee: 65536: Operation not permitted`, `Lazy pages transfer
FAILED`); without 0005 a daemon whose page server died exited and let the restored process read
zero pages. Since 0008 the page server reads the pages from the dumped task itself; 0010 sets
the page connection's congestion control; 0015 copies the background pages on copier threads and
0014 logs where the daemon's time went.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from images import build as images_build
from shim.criu.lazy import transfer_split
from testbed import versions as testbed_versions

pytestmark = pytest.mark.e2e

COUNTER_SOURCE = Path(images_build.__file__).resolve().parent / "counter.c"
WAIT = 60.0


def criu() -> str:
    return str(testbed_versions.CRIU)  # the CRIU the test beds give podshim


@pytest.fixture(scope="module")
def counter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("counter") / "counter"
    images_build.compile_c(COUNTER_SOURCE, out)
    return out


# A counter (the same arguments and lines) whose SIGUSR1 changes its memory map mid-transfer: it
# drops the third quarter of its memory (MADV_DONTNEED: a userfaultfd REMOVE event), unmaps the last
# (UNMAP), then checks the first half against the pattern and the third quarter reads zero.
CHURN_SOURCE = r"""
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static volatile sig_atomic_t usr1;
static void on_usr1(int s) { (void)s; usr1 = 1; }
static uint64_t pattern(uint64_t i) {
    i ^= 0x9e3779b97f4a7c15ULL;
    i *= 0xbf58476d1ce4e5b9ULL;
    return i ^ (i >> 31);
}
int main(int argc, char **argv) {
    long mib = 0, ms = 100;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--mem-mib")) mib = atol(argv[i + 1]);
        if (!strcmp(argv[i], "--interval-ms")) ms = atol(argv[i + 1]);
    }
    size_t bytes = (size_t)mib << 20, words = bytes / 8;
    uint64_t *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return 3;
    for (size_t i = 0; i < words; i++) mem[i] = pattern(i);
    signal(SIGUSR1, on_usr1);
    for (long n = 0;; n++) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        printf("count=%ld ts=%ld.%03ld\n", n, (long)ts.tv_sec, ts.tv_nsec / 1000000);
        fflush(stdout);
        if (usr1) {
            usr1 = 0;
            size_t bad = 0;
            char *half = (char *)mem + bytes / 2, *last = (char *)mem + bytes / 4 * 3;
            if (madvise(half, bytes / 4, MADV_DONTNEED) || munmap(last, bytes / 4))
                printf("churn FAILED: madvise/munmap\n");
            for (size_t i = 0; i < words / 2; i++) bad += mem[i] != pattern(i);
            for (size_t i = words / 2; i < words / 4 * 3; i++) bad += mem[i] != 0;
            printf(bad ? "churn FAILED bad_words=%zu\n" : "churn ok%.0zu\n", bad);
            fflush(stdout);
        }
        usleep(ms * 1000);
    }
}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, cond: object, timeout: float = WAIT) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


class HoldingRelay:
    """A TCP relay between the daemon and the dump's page server that passes the first `limit`
    bytes of pages and holds the rest (read, never forwarded): the transfer is mid-way when the
    test kills the page server, on a machine of any speed. The page server's end is passed on
    (the daemon's connection closed). With `release`, the rest is held unread instead (the page
    server blocks in its send once the socket buffers are full, the daemon waits for answers, no
    request is lost) until `release` is set, then passed on as a plain relay would. `held` is set
    once `limit` bytes were passed."""

    def __init__(self, server_port: int, limit: int, release: threading.Event | None = None) -> None:
        self.server_port, self.limit, self.release = server_port, limit, release
        self.passed = 0
        self.held = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with self.listener, self.listener.accept()[0] as daemon:
            try:
                with socket.create_connection(("127.0.0.1", self.server_port)) as server:
                    threading.Thread(target=self._requests, args=(daemon, server), daemon=True).start()
                    while data := server.recv(1 << 16):
                        keep = data[: max(0, self.limit - self.passed)]
                        if keep:
                            daemon.sendall(keep)
                            self.passed += len(keep)
                        if len(keep) < len(data):
                            self.held.set()
                            if self.release is not None:
                                self.release.wait()
                                self.limit = sys.maxsize  # released: everything passes from now on
                                daemon.sendall(data[len(keep) :])
                                self.passed += len(data) - len(keep)
            except ConnectionResetError:
                pass  # the page server killed with requests unread: its end too
            finally:
                daemon.shutdown(socket.SHUT_RDWR)  # (a close would wait for _requests' recv)

    @staticmethod
    def _requests(daemon: socket.socket, server: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := daemon.recv(1 << 16):
                server.sendall(data)


@dataclass
class Migration:
    """One lazy migration of the counter on this node: its source (left frozen by the dump's
    page server), the images copied for the restore, the daemon, the restored process."""

    dir: Path
    out: Path
    source_pid: int
    dump: subprocess.Popen[bytes]
    daemon: subprocess.Popen[bytes] | None = None
    restored_pid: int = 0
    relay: HoldingRelay | None = None

    def log(self, name: str) -> str:
        for d in (self.dir / "img", self.dir / "dest"):
            with contextlib.suppress(OSError):
                return (d / name).read_text(errors="replace")
        return ""

    def lines(self) -> list[str]:
        return self.out.read_text(errors="replace").splitlines()


@contextlib.contextmanager
def migration(
    tmp: Path,
    counter: Path,
    mem_mib: int,
    hold_after: int = 0,
    dump_args: tuple[str, ...] = (),
    daemon_args: tuple[str, ...] = (),
    release: threading.Event | None = None,
) -> Iterator[Migration]:
    """Start the counter in its own pid namespace, dump it lazily (its page server on a loopback
    port), copy the images, start the daemon, restore. `hold_after`: the daemon reaches the page
    server through a HoldingRelay passing that many bytes (`release`: the relay's); `dump_args`,
    `daemon_args`: more options of the dump and of the daemon. Everything is killed at the end."""
    out = tmp / "counter.out"
    src = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "setsid",
            str(counter),
            "--mem-mib",
            str(mem_mib),
            "--interval-ms",
            "50",
        ],
        stdin=subprocess.DEVNULL,
        # appending: the restored counter's file (restored with the dumped offset) and the source's
        # `unshare` (its last words when the source is killed) would otherwise write over each other
        stdout=out.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    m: Migration | None = None
    pids: list[int] = []
    try:
        wait_for("the counter to fill its memory", lambda: "count=1 " in out.read_text(errors="replace"))
        inner = int(subprocess.check_output(["pgrep", "-P", str(src.pid)]).split()[0])
        pids.append(inner)
        port = free_port()
        img = tmp / "img"
        img.mkdir()
        dump = subprocess.Popen(
            [criu(), "dump", "-t", str(inner), "-D", str(img), "-o", "dump.log", "-v4"]
            + ["--lazy-pages", "--address", "127.0.0.1", "--port", str(port), *dump_args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        m = Migration(tmp, out, inner, dump)
        wait_for("the dump's page server", lambda: "Starting page server" in m.log("dump.log"))  # type: ignore[union-attr]
        dest = tmp / "dest"
        shutil.copytree(img, dest)  # the images but the lazy pages, as another node receives them
        if hold_after:
            m.relay = HoldingRelay(port, hold_after, release)
            port = m.relay.port
        m.daemon = subprocess.Popen(
            [criu(), "lazy-pages", "--page-server", "--address", "127.0.0.1", "--port", str(port)]
            + ["-D", str(dest), "-o", "lazy.log", "-v4", *daemon_args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for("the daemon's socket", lambda: (dest / "lazy-pages.socket").exists())
        pidfile = tmp / "restored.pid"
        res = subprocess.run(
            [criu(), "restore", "-D", str(dest), "--lazy-pages", "-d", "-o", "restore.log", "-v4"]
            + ["--pidfile", str(pidfile)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=WAIT,
        )
        if res.returncode != 0:
            errors = [
                ln for name in ("dump.log", "lazy.log", "restore.log") for ln in m.log(name).splitlines()
            ]
            raise AssertionError(
                f"{criu()} restore failed: " + "\n".join(ln for ln in errors if "Error" in ln)
            )
        m.restored_pid = int(pidfile.read_text())
        pids.append(m.restored_pid)
        yield m
    finally:
        if release is not None:
            release.set()  # (a relay left holding would keep its thread)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        procs = [src] + ([m.dump] if m else []) + ([m.daemon] if m and m.daemon else [])
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=WAIT)


def test_lazy_migration_through_the_page_server(tmp_path: Path, counter: Path) -> None:
    """All 256 MiB arrive through the dump's page server; the pattern checks on the restored side
    and the dump ends with the transfer (patch 0004)."""
    with migration(tmp_path, counter, 256) as m:
        assert m.daemon is not None
        assert m.daemon.wait(timeout=WAIT) == 0, m.log("lazy.log")[-2000:]
        assert m.dump.wait(timeout=WAIT) == 0, m.log("dump.log")[-2000:]
        assert "Lazy pages transfer finished successfully" in m.log("dump.log")
        seen = len(m.lines())
        os.kill(m.restored_pid, signal.SIGUSR1)
        wait_for("the restored counter's verify line", lambda: any("verify" in ln for ln in m.lines()[seen:]))
        verdicts = [ln for ln in m.lines()[seen:] if ln.startswith("verify")]
        assert verdicts == ["verify ok mem_mib=256"], verdicts
        # the source, whose dump ended successfully without --leave-running, was killed by CRIU
        wait_for("the source to be gone", lambda: state(m.source_pid) in ("", "Z"))


def test_daemon_copies_on_copier_threads_and_logs_its_time(tmp_path: Path, counter: Path) -> None:
    """The background pages are copied into the restored process by the daemon's copier threads,
    beside the receipt of the next answers (patch 0015), and the daemon logs where its time went
    (0014): every page of 256 MiB counted, the copiers' copies making up the transfer, the
    receiving thread's own copies (the faults' answers) few; the memory checks on the restored
    side."""
    with migration(tmp_path, counter, 256) as m:
        assert m.daemon is not None
        assert m.daemon.wait(timeout=WAIT) == 0, m.log("lazy.log")[-2000:]
        assert m.dump.wait(timeout=WAIT) == 0, m.log("dump.log")[-2000:]
        split = transfer_split(m.dir / "dest" / "lazy.log")
        assert split.get("pages", 0) >= (256 << 20) // 4096, m.log("lazy.log")[-2000:]
        assert split["copier_threads"] >= 1 and split["copier_copies"] >= 64 > split["copies"], split
        assert split["wall"] >= split["wait"] + split["recv"] + split["copy"] - 0.01, split
        seen = len(m.lines())
        os.kill(m.restored_pid, signal.SIGUSR1)
        wait_for("the restored counter's verify line", lambda: any("verify" in ln for ln in m.lines()[seen:]))
        assert [ln for ln in m.lines()[seen:] if ln.startswith("verify")] == ["verify ok mem_mib=256"]


def test_faults_during_the_background_transfer(tmp_path: Path, counter: Path) -> None:
    """The restored counter reads all of its 1 GiB at once (SIGUSR1 as soon as it runs), while the
    background transfer and the copier threads' queue are mid-way: its faults are answered beside
    them (a fault's answer copied at once, a fault on a page whose copy is queued waiting for that
    copy, patch 0015) and it reads its memory whole."""
    with migration(tmp_path, counter, 1024) as m:
        assert m.daemon is not None
        seen = len(m.lines())
        os.kill(m.restored_pid, signal.SIGUSR1)
        wait_for("the restored counter's verify line", lambda: any("verify" in ln for ln in m.lines()[seen:]))
        assert [ln for ln in m.lines()[seen:] if ln.startswith("verify")] == ["verify ok mem_mib=1024"]
        assert m.daemon.wait(timeout=WAIT) == 0, m.log("lazy.log")[-2000:]
        assert m.dump.wait(timeout=WAIT) == 0, m.log("dump.log")[-2000:]
        split = transfer_split(m.dir / "dest" / "lazy.log")
        assert split.get("pages", 0) >= (1024 << 20) // 4096, m.log("lazy.log")[-2000:]


def test_memory_map_changes_during_the_background_transfer(tmp_path: Path) -> None:
    """The restored process drops a quarter of its 1 GiB and unmaps another (userfaultfd REMOVE
    and UNMAP events) as soon as it runs, while the background transfer and the copier threads'
    queue are mid-way: the daemon finishes the copies queued before it changes its ranges (patch
    0015), the process reads its first half whole and zeros where it dropped, and the daemon ends
    with every page it still owed delivered."""
    source = tmp_path / "churn.c"
    source.write_text(CHURN_SOURCE)
    churn = tmp_path / "churn"
    images_build.compile_c(source, churn)
    with migration(tmp_path, churn, 1024) as m:
        assert m.daemon is not None
        seen = len(m.lines())
        os.kill(m.restored_pid, signal.SIGUSR1)
        wait_for("the restored process's check", lambda: any("churn" in ln for ln in m.lines()[seen:]))
        assert [ln for ln in m.lines()[seen:] if ln.startswith("churn")] == ["churn ok"], m.lines()[-5:]
        assert m.daemon.wait(timeout=WAIT) == 0, m.log("lazy.log")[-2000:]
        assert m.dump.wait(timeout=WAIT) == 0, m.log("dump.log")[-2000:]


def test_page_connection_congestion_control(tmp_path: Path, counter: Path) -> None:
    """`--tcp-congestion` (patch 0010) sets the page connection's congestion control on the page
    server's sockets (reno: neither this host's default nor podshim's); a name the kernel refuses
    (the daemon's here) is a warning, and the pages cross all the same."""
    with migration(
        tmp_path,
        counter,
        64,
        dump_args=("--tcp-congestion", "reno"),
        daemon_args=("--tcp-congestion", "no-such-cc"),
    ) as m:
        assert m.daemon is not None
        assert m.daemon.wait(timeout=WAIT) == 0, m.log("lazy.log")[-2000:]
        assert m.dump.wait(timeout=WAIT) == 0, m.log("dump.log")[-2000:]
        # the listening socket, then the accepted one
        assert m.log("dump.log").count("TCP congestion control: reno") == 2, m.log("dump.log")[-2000:]
        assert "Unable to set TCP congestion control no-such-cc" in m.log("lazy.log")
        seen = len(m.lines())
        os.kill(m.restored_pid, signal.SIGUSR1)
        wait_for("the restored counter's verify line", lambda: any("verify" in ln for ln in m.lines()[seen:]))
        assert [ln for ln in m.lines()[seen:] if ln.startswith("verify")] == ["verify ok mem_mib=64"]


def test_daemon_holds_the_faults_when_the_page_server_dies(tmp_path: Path, counter: Path) -> None:
    """The page server killed mid-transfer: the daemon stops with the userfaultfds still open
    (patch 0005), so the restored process blocks on its next missing page instead of reading a
    zero page; killing the process, then the daemon, ends it. Mid-transfer by construction: the
    daemon's connection passes 4 MiB of pages and holds the rest (HoldingRelay)."""
    with migration(tmp_path, counter, 256, hold_after=4 << 20) as m:
        assert m.daemon is not None
        wait_for(
            "the first pages to arrive",
            lambda: "uffd_copy" in m.log("lazy.log") or m.daemon.poll() is not None,
        )  # type: ignore[union-attr]
        m.dump.kill()  # the page server, mid-transfer (the relay holds all but the first 4 MiB)
        m.dump.wait(timeout=WAIT)
        wait_for("the daemon to stop", lambda: state(m.daemon.pid) == "T" or m.daemon.poll() is not None)  # type: ignore[union-attr]
        assert m.daemon.poll() is None, (
            f"the daemon exited {m.daemon.returncode}: {m.log('lazy.log')[-1500:]}"
        )
        assert "the userfaultfds stay open" in m.log("lazy.log")
        seen = len(m.lines())
        os.kill(m.restored_pid, signal.SIGUSR1)  # reads every page: blocks on the first missing one
        wait_for(
            "the restored counter to block on a missing page",
            lambda: Path(f"/proc/{m.restored_pid}/wchan").read_text() == "handle_userfault",
            timeout=10,
        )
        time.sleep(0.5)
        assert not [ln for ln in m.lines()[seen:] if ln.startswith("verify")], "it read memory it never got"
        os.kill(m.restored_pid, signal.SIGKILL)  # a fault blocked on a userfaultfd is killable
        wait_for("the restored counter to die", lambda: state(m.restored_pid) in ("", "Z"))
        m.daemon.kill()
        assert m.daemon.wait(timeout=WAIT) == -signal.SIGKILL


def test_page_server_fails_when_the_dumped_task_is_gone(tmp_path: Path, counter: Path) -> None:
    """The source killed mid-transfer: its page server reads the pages from the task (patch 0008),
    so it fails with the reason rather than serve pages it no longer has, and the daemon holds the
    faults (0005) as when the page server dies. Mid-transfer by construction: the daemon's
    connection passes 4 MiB of pages and holds the rest unread (HoldingRelay with `release`); the
    source is killed while it holds, then the relay lets the transfer go on, and the page server's
    next read from the task fails."""
    release = threading.Event()
    with migration(tmp_path, counter, 256, hold_after=4 << 20, release=release) as m:
        assert m.daemon is not None and m.relay is not None
        relay, daemon = m.relay, m.daemon
        wait_for("the relay to hold the transfer", lambda: relay.held.is_set() or daemon.poll() is not None)
        assert relay.held.is_set(), f"the daemon exited {daemon.returncode} before the relay held"
        assert m.dump.poll() is None, f"the transfer ended while held: {m.log('dump.log')[-1500:]}"
        os.kill(m.source_pid, signal.SIGKILL)
        wait_for("the source to be gone", lambda: state(m.source_pid) in ("", "Z"))
        release.set()  # the page server's next answer reads from a task that is gone
        assert m.dump.wait(timeout=WAIT) != 0
        assert f"Lazy pages of {m.source_pid} cannot be read" in m.log("dump.log"), m.log("dump.log")[-2000:]
        assert "Lazy pages transfer FAILED" in m.log("dump.log")
        wait_for("the daemon to stop", lambda: state(m.daemon.pid) == "T" or m.daemon.poll() is not None)  # type: ignore[union-attr]
        assert m.daemon.poll() is None, (
            f"the daemon exited {m.daemon.returncode}: {m.log('lazy.log')[-1500:]}"
        )
        assert "the userfaultfds stay open" in m.log("lazy.log")
        os.kill(m.restored_pid, signal.SIGKILL)
        wait_for("the restored counter to die", lambda: state(m.restored_pid) in ("", "Z"))
        m.daemon.kill()
        assert m.daemon.wait(timeout=WAIT) == -signal.SIGKILL
