"""Unit tests of lazy restore's edges (docs/design/restore-pod.md (Lazy restore)): the RestorePod option
and the node default, the runtime check, the runc argv, the wrapper's acceptance of a daemon's
work dir, the userfaultfd duplicate podshim holds, and recovery of a daemon's journal record with
a fake upstream. The end-to-end behaviour is tests/test_lazy_restore.py."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import config, contract, errors, metrics, procs
from shim.config import Config
from shim.criu import lazy as criu_lazy
from shim.criu.options import CriuOptions
from shim.criu.runtime import OciRuntime
from shim.ops import lazy_pages
from shim.ops.restore_checks import RestoreOptions
from shim.state import Journal
from shim.wrapper import restore as wrapper_restore
from tests.fakes import FakeUpstream

# ---------------------------------------------------------------------------- the option


def test_option_defaults_to_the_node_default() -> None:
    assert RestoreOptions.parse({}).lazy_pages is False
    assert RestoreOptions.parse({}, lazy_default=True).lazy_pages is True
    assert RestoreOptions.parse({"lazy-pages": "true"}).lazy_pages is True
    assert RestoreOptions.parse({"lazy-pages": "false"}, lazy_default=True).lazy_pages is False
    assert RestoreOptions.parse({"lazy-pages": " Yes "}).lazy_pages is True
    assert RestoreOptions.parse({"start": "true", "lazy-pages": "1"}) == RestoreOptions(True, True)


def test_bad_option_value_names_the_option() -> None:
    with pytest.raises(errors.InvalidArgument, match="lazy-pages='sometimes'"):
        RestoreOptions.parse({"lazy-pages": "sometimes"})
    with pytest.raises(errors.InvalidArgument, match="known: lazy-pages, start"):
        RestoreOptions.parse({"lazy_pages": "true"})


def test_config_restore_lazy_pages(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[restore]\nlazy_pages = true\n")
    assert config.load(str(path), env={}).lazy_pages is True
    assert config.load(str(path), env={"PODSHIM_RESTORE_LAZY_PAGES": "false"}).lazy_pages is False
    path.write_text('[restore]\nlazy_pages = "yes"\n')
    with pytest.raises(config.ConfigError, match="restore.lazy_pages"):
        config.load(str(path), env={})
    path.write_text("")
    assert config.load(str(path), env={}).lazy_pages is False
    with pytest.raises(config.ConfigError, match="PODSHIM_RESTORE_LAZY_PAGES"):
        config.load(str(path), env={"PODSHIM_RESTORE_LAZY_PAGES": "on"})


def test_config_default_is_off() -> None:
    assert Config().lazy_pages is False


# ---------------------------------------------------------------------------- runtime and argv


def _fake_runtime(tmp_path: Path, help_text: str) -> str:
    exe = tmp_path / f"rt-{abs(hash(help_text))}"
    exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}\nEOF\n")
    exe.chmod(0o755)
    return str(exe)


def test_runtime_without_lazy_restore_is_failed_precondition(tmp_path: Path) -> None:
    without = _fake_runtime(tmp_path, "  --work-path=DIR  path for saving work files")
    with_it = _fake_runtime(tmp_path, "   --lazy-pages   use userfaultfd to lazily restore memory pages")
    assert criu_lazy.runtime_supports(with_it)
    assert not criu_lazy.runtime_supports(without)
    assert not criu_lazy.runtime_supports(str(tmp_path / "missing"))
    with pytest.raises(errors.FailedPrecondition, match=r"handler 'crun'.*no lazy restore"):
        criu_lazy.check_runtime(without, "crun")
    criu_lazy.check_runtime(with_it, "")


def test_restore_argv_lazy_pages() -> None:
    rt = OciRuntime("/usr/sbin/runc", "/run/runc")
    eager = rt.restore_argv("c1", "/b", "/img", "/work", CriuOptions())
    lazy = rt.restore_argv("c1", "/b", "/img", "/lazy/w", CriuOptions(), lazy_pages=True)
    assert "--lazy-pages" not in eager
    assert "--lazy-pages" in lazy and lazy[lazy.index("--work-path") + 1] == "/lazy/w"
    assert lazy[-1] == "c1"


# ---------------------------------------------------------------------------- the wrapper


def _spec(value: str) -> dict:
    return {"annotations": {contract.LAZY_PAGES_ANNOTATION: value}}


def test_wrapper_accepts_only_a_listening_daemon_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = Config(state_dir=str(state), allowed_roots=(str(tmp_path / "ckpt"),))
    work = contract.lazy_root(state) / "0123456789abcdef"
    work.mkdir(parents=True)
    assert wrapper_restore._lazy_dir({"annotations": {}}, cfg, "c1") is None
    with pytest.raises(wrapper_restore.RestoreFailed, match="no lazy-pages daemon listens"):
        wrapper_restore._lazy_dir(_spec(str(work)), cfg, "c1")
    (work / contract.LAZY_PAGES_SOCKET).touch()
    assert wrapper_restore._lazy_dir(_spec(str(work)), cfg, "c1") == work.resolve()
    other = tmp_path / "elsewhere" / "lazy" / "x"
    other.mkdir(parents=True)
    (other / contract.LAZY_PAGES_SOCKET).touch()
    with pytest.raises(wrapper_restore.RestoreFailed, match="not a lazy-pages work dir"):  # not podshim's
        wrapper_restore._lazy_dir(_spec(str(other)), cfg, "c1")
    with pytest.raises(wrapper_restore.RestoreFailed, match="not a lazy-pages work dir"):  # not a lazy dir
        wrapper_restore._lazy_dir(_spec(str(state)), cfg, "c1")


# ---------------------------------------------------------------------------- the held userfaultfd

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}


def test_podshim_holds_a_duplicate_of_a_daemons_userfaultfd() -> None:
    """pidfd_getfd of a userfaultfd another process holds: the duplicate is the same file, and it
    stays open after that process is gone (what keeps a dead daemon's ranges registered)."""
    nr = _SYS_USERFAULTFD.get(platform.machine())
    if nr is None or os.geteuid() != 0:
        pytest.skip("needs root on x86_64 or aarch64")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.syscall(nr, os.O_CLOEXEC)
            os.write(w, str(fd).encode())
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        fd = int(os.read(r, 16))
        assert fd >= 0, "userfaultfd(2) failed in the child"
        assert criu_lazy.daemon_uffds(pid) == [fd]
        pidfd = os.pidfd_open(pid)
        dup = criu_lazy.pidfd_getfd(pidfd, fd)
        os.close(pidfd)
        assert os.readlink(f"/proc/self/fd/{dup}") == criu_lazy.UFFD_LINK
        assert os.stat(f"/proc/self/fd/{dup}").st_ino == os.stat(f"/proc/{pid}/fd/{fd}").st_ino
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert os.readlink(f"/proc/self/fd/{dup}") == criu_lazy.UFFD_LINK  # still open
        os.close(dup)
    finally:
        os.close(r)
        os.close(w)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _wait(cond: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _wchan(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return ""


def _fd_ino(pid: int, fd: str) -> int:
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino
    except OSError:
        return 0


def _pipe_closed(r: int) -> bool:
    """Whether every write end of the pipe whose read end is `r` is closed (its read sees EOF)."""
    os.set_blocking(r, False)
    try:
        return os.read(r, 1) == b""
    except BlockingIOError:
        return False


@pytest.mark.parametrize("end", ["released", "podshim-gone", "podshim-gone-holding-nothing"])
def test_uffd_guard_holds_what_it_was_handed_until_released_or_killed(end: str) -> None:
    """The guard (shim/criu/uffd_guard.py) holds each descriptor it is handed (a pipe's write end
    stands in for a userfaultfd: it is still open while the read end sees no EOF): `release` closes
    them and ends it; the socket's end (podshim died) does not, holding anything; only a SIGKILL
    (recovery's) does then. Holding nothing, it exits at the socket's end."""
    proc, sock = criu_lazy.start_guard()
    r, w = os.pipe()
    try:
        if end != "podshim-gone-holding-nothing":
            criu_lazy.guard_hold(sock, w)
            ino = os.fstat(w).st_ino
            _wait(lambda: any(_fd_ino(proc.pid, fd) == ino for fd in os.listdir(f"/proc/{proc.pid}/fd")))
        os.close(w)
        if end == "released":
            criu_lazy.guard_release(sock)
            assert proc.wait(timeout=30) == 0
        else:
            sock.close()  # what podshim's death does to its end
            if end == "podshim-gone-holding-nothing":
                assert proc.wait(timeout=30) == 0
            else:
                _wait(lambda: proc.poll() is not None or "pause" in _wchan(proc.pid))
                assert proc.poll() is None, "the guard exited: the faults would read zero pages"
                assert not _pipe_closed(r), "the guard let go of what it held"
                proc.send_signal(signal.SIGTERM)  # ignored: only recovery's SIGKILL ends it
                with pytest.raises(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)
                proc.kill()
                proc.wait(timeout=30)
        assert _pipe_closed(r)
    finally:
        sock.close()
        os.close(r)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_process_start_time() -> None:
    assert procs.process_start_time(os.getpid()) > 0
    assert procs.process_start_time(2**22 + 12345) == 0


# ---------------------------------------------------------------------------- recovery


def _record(journal: Journal, tmp_path: Path, cid: str, pid: int) -> tuple[object, Path, Path]:
    work = contract.lazy_root(tmp_path / "state") / "feedfacefeedface"
    work.mkdir(parents=True)
    dec = tmp_path / "state" / "decrypted" / "d1"
    dec.mkdir(parents=True)
    rec = journal.begin(
        "lazy-pages",
        "ns/pod",
        {
            "container": "counter",
            "work_dir": str(work),
            "images": str(dec / "checkpoint"),
            "decrypted_dir": str(dec),
        },
    )
    journal.update(rec, "attached", pid=pid, start_time=12345, container_id=cid)
    return journal.pending()[0], work, dec


def _failures(reason: str) -> float:
    return metrics.lazy_restore_failures.labels(reason)._value.get()


async def test_recover_kills_the_container_of_a_daemon_gone(tmp_path: Path) -> None:
    up = FakeUpstream()
    log = tmp_path / "c.log"
    log.write_text("")
    up.containers["c1"] = cri.ContainerStatus(id="c1", state=cri.CONTAINER_RUNNING, log_path=str(log))
    journal = Journal(tmp_path / "state")
    rec, work, dec = _record(journal, tmp_path, "c1", 2**22 + 7)  # no such process
    lp = lazy_pages.LazyPages(Config(state_dir=str(tmp_path / "state")), up, journal)
    before = _failures("podshim-restart")
    await lp.recover(rec)
    assert ("StopContainer", "c1") in up.calls
    assert "lazy restore interrupted" in log.read_text() and " stderr F podshim: " in log.read_text()
    assert _failures("podshim-restart") == before + 1
    assert not work.exists() and not dec.exists()


async def test_recover_of_a_removed_container_only_cleans_up(tmp_path: Path) -> None:
    up = FakeUpstream()
    journal = Journal(tmp_path / "state")
    rec, work, dec = _record(journal, tmp_path, "gone", 2**22 + 7)
    lp = lazy_pages.LazyPages(Config(state_dir=str(tmp_path / "state")), up, journal)
    await lp.recover(rec)
    assert "StopContainer" not in up.names()
    assert not work.exists() and not dec.exists()


async def test_recover_keeps_the_record_while_the_container_cannot_be_killed(tmp_path: Path) -> None:
    from tests.fakes import unreachable

    up = FakeUpstream()
    up.containers["c1"] = cri.ContainerStatus(id="c1", state=cri.CONTAINER_RUNNING)
    up.fail["StopContainer"] = unreachable()
    journal = Journal(tmp_path / "state")
    rec, work, _dec = _record(journal, tmp_path, "c1", 2**22 + 7)
    lp = lazy_pages.LazyPages(Config(state_dir=str(tmp_path / "state")), up, journal)
    with pytest.raises(errors.ShimError):
        await lp.recover(rec)
    assert work.exists(), "the daemon's work dir went before its container was killed"
    assert json.loads(Path(rec.path).read_text())["kind"] == "lazy-pages"


async def test_recover_finds_a_daemon_by_its_work_dir(tmp_path: Path) -> None:
    """A crash between the daemon's start and the journaling of its pid: recovery finds the daemon
    by the work dir on its command line and ends it (else it would wait on its socket forever)."""
    import subprocess

    up = FakeUpstream()
    journal = Journal(tmp_path / "state")
    work = contract.lazy_root(tmp_path / "state") / "0badc0de0badc0de"
    work.mkdir(parents=True)
    rec = journal.begin("lazy-pages", "ns/pod", {"container": "counter", "work_dir": str(work)})
    fake = subprocess.Popen(["sh", "-c", "sleep 60", "lazy-pages", "--work-dir", str(work)])
    try:
        # /proc/<pid>/cmdline can read empty for a moment after the spawn: wait until it shows
        until = time.monotonic() + 5
        while criu_lazy.daemon_serving(str(work)) != fake.pid and time.monotonic() < until:
            time.sleep(0.01)
        assert criu_lazy.daemon_serving(str(work)) == fake.pid
        lp = lazy_pages.LazyPages(Config(state_dir=str(tmp_path / "state")), up, journal)
        await lp.recover(journal.pending()[0])
        assert fake.wait(timeout=10) == -signal.SIGKILL
        assert not work.exists()
    finally:
        fake.kill()
        fake.wait()
    assert rec.op_id


def _fake_criu(tmp_path: Path, ready: bool) -> str:
    """A `criu` whose `lazy-pages` writes `\\0` to its --status-fd and serves (sleeps), or exits
    without a word (a daemon that died before it listened)."""
    import sys

    fake = tmp_path / "criu"
    body = "import os, sys, time\nfd = int(sys.argv[sys.argv.index('--status-fd') + 1])\n" + (
        "os.write(fd, b'\\0')\ntime.sleep(60)\n" if ready else "sys.exit(1)\n"
    )
    fake.write_text(f"#!{sys.executable}\n{body}")
    fake.chmod(0o755)
    return str(fake)


async def test_start_waits_for_the_status_fd_and_journals_the_pass_with_the_pid(tmp_path: Path) -> None:
    """The daemon's `\\0` on its status fd ends the wait (the event loop watches the fd); its pid,
    start time and the count of page images to checksum are journaled in one record write."""
    journal = Journal(tmp_path / "state")
    lp = lazy_pages.LazyPages(Config(state_dir=str(tmp_path / "state")), FakeUpstream(), journal)
    d = await lp.start(tmp_path, "counter", "ns/pod", _fake_criu(tmp_path, True), None, "op1", verifying=3)
    try:
        doc = json.loads(Path(d.rec.path).read_text())
        assert doc["phase"] == "serving"
        assert doc["data"]["pid"] == d.pid and doc["data"]["start_time"] > 0
        assert doc["data"]["verifying"] == 3
        assert d.proc is not None and d.proc.poll() is None
    finally:
        await lp.abandon_op("op1")
    assert journal.pending() == [] and not d.work.exists()


async def test_start_of_a_daemon_that_dies_before_listening_is_internal(tmp_path: Path) -> None:
    """EOF on the status fd (the daemon exited without its `\\0`): INTERNAL at once, not after the
    30 s readiness timeout; its record is closed and its work dir removed."""
    journal = Journal(tmp_path / "state")
    lp = lazy_pages.LazyPages(Config(state_dir=str(tmp_path / "state")), FakeUpstream(), journal)
    started = time.monotonic()
    with pytest.raises(errors.Internal, match="did not start serving"):
        await lp.start(tmp_path, "counter", "ns/pod", _fake_criu(tmp_path, False), None, "op1")
    assert time.monotonic() - started < 10
    assert journal.pending() == []
    assert list(contract.lazy_root(tmp_path / "state").iterdir()) == []


def test_keep_log_copies_a_failed_daemons_log(tmp_path: Path) -> None:
    src = tmp_path / "w" / lazy_pages.LOG_NAME
    src.parent.mkdir()
    src.write_text("Error (criu/uffd.c:1): boom\n")
    kept = Path(lazy_pages._keep_log(src, str(tmp_path / "state"), "c1"))
    assert kept == tmp_path / "state" / "logs" / "lazy-pages-c1.log"
    assert kept.read_text() == src.read_text() and (kept.stat().st_mode & 0o777) == 0o600


def test_transfer_split_reads_the_daemons_account_of_its_time(tmp_path: Path) -> None:
    """CRIU patches 0014 and 0015 log where the daemon's time went (its receiving thread's and its
    copiers'); podshim reads both lines from the log's tail, and nothing from a CRIU without them."""
    log = tmp_path / lazy_pages.LOG_NAME
    log.write_text(
        "(00.010000) uffd: Background pages are copied by 2 copier threads\n"
        + "(00.020000) pr1-1 Read 7f0000000000 1024 pages\n" * 4000  # more than the tail it reads
        + "(08.950000) uffd: page transfer time split: pages=1048584 wall=8.937 wait=4.262 recv=4.097 "
        "sock=1.669 copy=0.000 copies=2 other=0.578 cpu=2.820 runnable=2.658\n"
        "(08.950100) uffd: copier time split: threads=2 copy=15.213 idle=2.514 copies=1050 cpu=10.682 "
        "runnable=4.747\n"
        "(08.950200) page-xfer: Disconnect from the page server\n"
    )
    split = criu_lazy.transfer_split(log)
    assert split["pages"] == 1048584 and split["wall"] == 8.937 and split["copy"] == 0.0
    assert split["copier_threads"] == 2 and split["copier_copy"] == 15.213 and split["copier_copies"] == 1050
    log.write_text("(00.010000) uffd: UFFD transferred pages: (65543/65543)\n")
    assert criu_lazy.transfer_split(log) == {}
    assert criu_lazy.transfer_split(tmp_path / "missing.log") == {}


# ---------------------------------------------------------------------------- page checksums while serving


def _archive_with_pages(tmp_path: Path) -> tuple[Path, Any]:
    import hashlib

    from shim.archive.manifest import FileEntry

    root = tmp_path / "ckpt"
    files = {
        "containers/app/checkpoint/pages-1.img": os.urandom(3 << 20),
        "containers/app/checkpoint/pages-2.img": os.urandom(1000),
        "containers/app/checkpoint/pagemap-1.img": b"map",
        "containers/app/config.dump": b"{}",
        "containers/other/checkpoint/pages-1.img": b"x",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)

    class M:  # the manifest's files are all check_pages and page_images read
        pass

    m = M()
    m.files = {rel: FileEntry(size=len(d), sha256=hashlib.sha256(d).hexdigest()) for rel, d in files.items()}
    return root, m


def test_page_images_are_one_containers_pages_files(tmp_path: Path) -> None:
    _root, m = _archive_with_pages(tmp_path)
    assert criu_lazy.page_images(m, "containers/app") == [
        "containers/app/checkpoint/pages-1.img",
        "containers/app/checkpoint/pages-2.img",
    ]


def test_check_pages_names_the_file_that_differs_or_cannot_be_read(tmp_path: Path) -> None:
    import threading

    root, m = _archive_with_pages(tmp_path)
    rels = criu_lazy.page_images(m, "containers/app")
    check = criu_lazy.PageCheck(root, m, rels)
    assert criu_lazy.check_pages(check, threading.Event()) == ""
    big = root / rels[0]
    with open(big, "r+b") as f:  # one byte in the middle: same size, another sha256
        f.seek(1 << 20)
        b = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([b[0] ^ 1]))
    why = criu_lazy.check_pages(check, threading.Event())
    assert why.startswith(f"checksum mismatch in {rels[0]}"), why
    stop = threading.Event()
    stop.set()  # stopped (the daemon ended): no verdict
    assert criu_lazy.check_pages(check, stop) == ""
    big.unlink()
    assert criu_lazy.check_pages(check, threading.Event()).startswith(f"cannot read {rels[0]}")


def test_wrapper_reports_the_reason_podshim_left_for_an_ended_daemon(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = Config(state_dir=str(state))
    work = contract.lazy_root(state) / "0123456789abcdef"
    work.mkdir(parents=True)
    (work / contract.LAZY_PAGES_SOCKET).touch()
    lazy_pages._mark_failed(work, "lazy restore failed: checksum mismatch in pages-1.img")
    assert not (work / contract.LAZY_PAGES_SOCKET).exists()
    with pytest.raises(wrapper_restore.RestoreFailed, match="checksum mismatch in pages-1.img"):
        wrapper_restore._lazy_dir(_spec(str(work)), cfg, "c1")


def test_check_pages_reads_nothing_until_the_container_is_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass reads no byte until CRIU has restored the container (its stats-restore in W): the
    new sandbox, CreateContainer, podshim-runc's start and CRIU go first; then it gives its verdict."""
    import threading

    work = tmp_path / "w"
    work.mkdir()
    assert criu_lazy.restore_pending(work)
    (work / "criu.conf").write_text("tcp-close\n")  # podshim-runc's start: still pending
    assert criu_lazy.restore_pending(work)
    root, m = _archive_with_pages(tmp_path)
    check = criu_lazy.PageCheck(root, m, criu_lazy.page_images(m, "containers/app"))
    looks: list[float] = []
    reads: list[int] = []
    readv = os.readv

    def counted_readv(fd: int, buffers: Any) -> int:
        assert not criu_lazy.restore_pending(work), "a page image was read before the restore ended"
        reads.append(fd)
        return readv(fd, buffers)

    monkeypatch.setattr(criu_lazy.os, "readv", counted_readv)

    def paused() -> bool:
        looks.append(time.monotonic())
        if len(looks) == 3:
            (work / "stats-restore").write_bytes(b"")  # CRIU's restore ended
        return criu_lazy.restore_pending(work)

    assert criu_lazy.check_pages(check, threading.Event(), paused) == ""
    assert len(looks) >= 3 and reads and not criu_lazy.restore_pending(work)
