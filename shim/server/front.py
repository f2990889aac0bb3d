"""podshim-front (native/front/), the compiled program that serves podshim's public socket: the
daemon starts it (or adopts the one a daemon before it started), starts it again if it dies,
stops it, hands it the listening descriptor, and reads its metrics (docs/design/proxy.md (The
proxy))."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from shim import __version__, logs
from shim.archive import fsutil
from shim.config import Config
from shim.criu.lazy import pidfd_getfd
from shim.deadlines import (
    FRONT_EXIT_MARGIN,
    FRONT_METRICS_TIMEOUT,
    FRONT_ORPHAN_TIMEOUT,
    FRONT_READY_TIMEOUT,
    FRONT_RESTART_FIRST,
    FRONT_RESTART_JITTER,
    FRONT_RESTART_MAX,
    FRONT_STEADY,
    PASSTHROUGH_DEADLINE_MARGIN,
    PASSTHROUGH_STOP_GRACE,
)
from shim.procs import running_start_time
from shim.server import sockets

log = logs.get("shim.server")
BINARY = "podshim-front"
UNIX_PATH_MAX = 107  # sun_path less its NUL
RECORD = "front.json"  # in the state dir: the running front, for the next daemon to adopt
# server.socket's backlog: the connections made while a front is started again wait in it (the
# kernel caps it at net.core.somaxconn)
BACKLOG = 4096


class FrontError(Exception):
    """The front cannot start: a one-line message naming the key to look at."""


def binary_path(config: Config) -> Path:
    """[server] front_binary, else podshim-front beside the interpreter (the venv's or the
    package's bin/, where the set-up and the package install it)."""
    return Path(config.front_binary) if config.front_binary else Path(sys.executable).parent / BINARY


def private_socket(config: Config, name: str) -> str:
    """A socket of the daemon's in the state dir (0700: only root reaches it)."""
    path = os.path.join(config.state_dir, name)
    if len(path.encode()) > UNIX_PATH_MAX:
        raise FrontError(f"server.state_dir {config.state_dir}: too long for the socket {path}")
    return path


class Front:
    """One podshim-front process at a time, for the daemon's whole life."""

    def __init__(self, config: Config, daemon_socket: str, own: Iterable[str], unary: Iterable[str]) -> None:
        self.config = config
        self.binary = binary_path(config)
        self.metrics_socket = private_socket(config, "front-metrics.sock") if config.metrics_address else ""
        self.argv = [  # --listen-fd follows --listen (command())
            str(self.binary),
            f"--listen={config.socket}",
            f"--upstream={config.upstream_endpoint}",
            f"--daemon={daemon_socket}",
            f"--own={','.join(sorted(own))}",
            f"--unary={','.join(sorted(unary))}",
            f"--version-name={config.runtime_name}",
            f"--podshim-version={__version__}",
            f"--metrics-socket={self.metrics_socket}",
            f"--grace={PASSTHROUGH_STOP_GRACE}s",
            f"--deadline-margin={PASSTHROUGH_DEADLINE_MARGIN}s",
            f"--orphan-timeout={FRONT_ORPHAN_TIMEOUT}s",
            f"--log-format={config.log_format}",
            f"--log-level={config.log_level}",
        ]
        self.record = Path(config.state_dir) / RECORD
        self._proc: asyncio.subprocess.Process | None = None  # a front this daemon started
        # server.socket listening: bound by this daemon or taken from the front it adopted
        self._listener: socket.socket | None = None
        self._pid: int | None = None  # the front this daemon runs, started or adopted
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    def command(self, listen_fd: int) -> list[str]:
        """The front's command line, serving the listening socket it inherits as `listen_fd`."""
        return [*self.argv[:2], f"--listen-fd={listen_fd}", *self.argv[2:]]

    async def start(self) -> None:
        if not os.access(self.binary, os.X_OK):
            raise FrontError(
                f"server.front: {self.binary} is missing or not executable: build it (make setup), "
                "set server.front_binary, or set server.front = false"
            )
        if not self._adopt():
            try:
                await self._spawn()
            except (FrontError, OSError):
                if self._listener is not None:  # bound (or taken) here: nobody serves it now
                    self._close_listener()
                    sockets.remove_unserved(self.config.socket)
                raise
        self._watch = asyncio.create_task(self._supervise())

    def _adopt(self) -> bool:
        """The front a daemon before this one started, if it still runs with this daemon's command
        line: it keeps serving (its calls in flight, its connections) and becomes this daemon's.
        One with another command line (an upgrade) is stopped, so that a new one starts."""
        found = _recorded_front(self.record)
        if found is None:
            return False
        pid, start, argv, listen_fd = found
        if listen_fd is not None:  # kept for the front started after it (this one or its successor)
            self._listener = _take_listener(pid, start, listen_fd, self.config.socket)
        if listen_fd is not None and argv == self.command(listen_fd):
            self._pid = pid
            log.info(
                "front adopted", pid=pid, socket=self.config.socket, socket_held=self._listener is not None
            )
            return True
        log.info("front of another command line stopped", pid=pid)
        _terminate(pid, PASSTHROUGH_STOP_GRACE + FRONT_EXIT_MARGIN)
        return False

    async def _spawn(self) -> None:
        try:
            if self._listener is None:
                self._listener = _listen(self.config.socket)
            if self.metrics_socket:
                sockets.remove_stale(self.metrics_socket)
        except sockets.SocketInUse as e:
            raise FrontError(f"server.socket {e}") from None
        fd = self._listener.fileno()
        argv = self.command(fd)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, pass_fds=(fd,)
        )
        assert proc.stdout is not None
        # recorded at once: a daemon that dies from here on leaves a front the next one can adopt;
        # pass_fds keeps the number, so listen_fd is the front's descriptor too
        record = {"pid": proc.pid, "start": running_start_time(proc.pid), "argv": argv, "listen_fd": fd}
        fsutil.atomic_write(self.record, json.dumps(record).encode())
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), FRONT_READY_TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise FrontError(
                f"server.socket {self.config.socket}: {BINARY} did not listen within "
                f"{FRONT_READY_TIMEOUT:.0f} s"
            ) from None
        said = line.decode(errors="replace").strip()
        if said != "ready":
            code = await proc.wait()
            raise FrontError(
                said.removeprefix("error: ") or f"{BINARY} exited with {code} before it listened"
            )
        self._proc, self._pid = proc, proc.pid
        log.info("front started", pid=proc.pid, socket=self.config.socket)

    async def _supervise(self) -> None:
        """A front that exits while the daemon runs (a crash, a kill) is started again: the node's
        CRI is down meanwhile."""
        delay = FRONT_RESTART_FIRST
        while not self._stopping:
            started = time.monotonic()
            code = await self._exited()
            if self._stopping:
                return
            if time.monotonic() - started > FRONT_STEADY:
                delay = FRONT_RESTART_FIRST
            wait = delay * random.uniform(1 - FRONT_RESTART_JITTER, 1 + FRONT_RESTART_JITTER)
            log.error("front exited; starting it again", code=code, after_seconds=round(wait, 3))
            await asyncio.sleep(wait)
            delay = min(delay * 2, FRONT_RESTART_MAX)
            if self._stopping:
                return
            try:
                await self._spawn()
            except (FrontError, OSError) as e:
                log.error("front did not start again", error=str(e))
                # callers are refused meanwhile, not left waiting in a backlog to their deadlines;
                # the next attempt binds the socket anew
                self._close_listener()

    async def _exited(self) -> int | None:
        """When the front ends: its exit code if this daemon started it, None if it was adopted
        (a process this daemon cannot wait for: its pidfd says when it is gone)."""
        if self._proc is not None and self._proc.pid == self._pid:
            return await self._proc.wait()
        assert self._pid is not None
        try:
            fd = os.pidfd_open(self._pid)
        except ProcessLookupError:
            return None
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await gone
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        return None

    async def stop(self) -> None:
        """The front stops taking calls, gives those in flight PASSTHROUGH_STOP_GRACE and exits;
        killed if it has not after a margin. Then the socket is removed."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        # first: once the front stops listening too, new connections are refused at once, not
        # left in a backlog that no front will accept
        self._close_listener()
        if self._pid is None:
            return
        with contextlib.suppress(OSError):
            os.kill(self._pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self._exited(), PASSTHROUGH_STOP_GRACE + FRONT_EXIT_MARGIN)
        except TimeoutError:
            log.warning("front did not stop; killing it", pid=self._pid)
            with contextlib.suppress(OSError):
                os.kill(self._pid, signal.SIGKILL)
            await self._exited()
        self.record.unlink(missing_ok=True)
        sockets.remove_unserved(self.config.socket)  # the front leaves it to the daemon

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def metrics_text(self) -> str:
        """The front's /metrics exposition ("" when it cannot be read). Called from the metrics
        HTTP server's thread, never the event loop."""
        if not self.metrics_socket:
            return ""
        conn = _UnixHTTPConnection(self.metrics_socket, FRONT_METRICS_TIMEOUT)
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            return resp.read().decode() if resp.status == 200 else ""
        except OSError as e:
            log.warning("front metrics unreadable", error=str(e))
            return ""
        finally:
            conn.close()


def _recorded_front(record: Path) -> tuple[int, int, list[str], int | None] | None:
    """The front the record names, if that very process still runs: its pid, start time, command
    line and the descriptor it serves (None: a front that bound the socket itself)."""
    try:
        doc = json.loads(record.read_text())
        pid, start = int(doc["pid"]), doc["start"]
        listen_fd = int(doc["listen_fd"]) if doc.get("listen_fd") is not None else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not start or running_start_time(pid) != start:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return None
    return (pid, start, argv, listen_fd) if argv and Path(argv[0]).name == BINARY else None


def left_running(config: Config) -> bool:
    """Whether the process serving server.socket is a front a daemon before this one started
    (recorded in this state dir, still running, listening there): this daemon adopts it, so its
    socket being served is no other podshim's."""
    found = _recorded_front(Path(config.state_dir) / RECORD)
    return found is not None and f"--listen={config.socket}" in found[2]


def _listen(path: str) -> socket.socket:
    """server.socket bound and listening, 0660 (SocketInUse if a live process serves it)."""
    sockets.remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        try:
            os.chmod(path, 0o660)  # before listen(): nobody connects before the mode is right
            sock.listen(BACKLOG)
        except OSError:
            os.unlink(path)
            raise
    except OSError:
        sock.close()
        raise
    return sock


def _take_listener(pid: int, start: int, fd: int, path: str) -> socket.socket | None:
    """A copy of the listening socket the front `pid` serves as descriptor `fd`, if it is one
    on `path`; None if it cannot be had (a kernel before 5.6, no ptrace right): the fronts this
    daemon starts then bind the path anew."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        if running_start_time(pid) != start:  # the pid was reused before the pidfd was open
            return None
        got = pidfd_getfd(pidfd, fd)
    except OSError as e:
        log.warning("cannot take the adopted front's socket", pid=pid, fd=fd, error=str(e))
        return None
    finally:
        os.close(pidfd)
    sock: socket.socket | None = None
    try:
        sock = socket.socket(fileno=got)  # OSError if it is no socket at all
    except OSError:
        os.close(got)
    if sock is not None and _listens_on(sock, path):
        return sock
    log.warning("the adopted front's descriptor is not its socket", pid=pid, fd=fd)
    if sock is not None:
        sock.close()
    return None


def _listens_on(sock: socket.socket, path: str) -> bool:
    try:
        return (
            sock.family == socket.AF_UNIX
            and sock.type == socket.SOCK_STREAM
            and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            and sock.getsockname() == path
        )
    except OSError:
        return False


def _terminate(pid: int, wait: float) -> None:
    """SIGTERM, then SIGKILL after `wait` seconds; returns once the process is gone (blocking:
    called at start-up, before the daemon serves)."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + wait
    while running_start_time(pid) and time.monotonic() < end:
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    while running_start_time(pid) and time.monotonic() < end + 5:
        time.sleep(0.02)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock
