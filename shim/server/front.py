"""podshim-front (native/front/), the compiled program that serves podshim's public socket: the
daemon starts it, starts it again if it dies, stops it, and reads its metrics
(docs/architecture.md §3 (The proxy)).

The front passes every CRI call podshim does not own straight to the upstream; the methods the
daemon owns (its routing table, given on the command line) come to the daemon's private socket
under the state dir. It dies with the daemon (the kernel's parent-death signal) and removes its
socket when it stops.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import random
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from shim import logs
from shim.config import Config
from shim.deadlines import (
    FRONT_EXIT_MARGIN,
    FRONT_METRICS_TIMEOUT,
    FRONT_READY_TIMEOUT,
    FRONT_RESTART_FIRST,
    FRONT_RESTART_JITTER,
    FRONT_RESTART_MAX,
    FRONT_STEADY,
    PASSTHROUGH_DEADLINE_MARGIN,
    PASSTHROUGH_STOP_GRACE,
)
from shim.server import sockets

log = logs.get("shim.server")
BINARY = "podshim-front"
UNIX_PATH_MAX = 107  # sun_path less its NUL


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
        self.argv = [
            str(self.binary),
            f"--listen={config.socket}",
            f"--upstream={config.upstream_endpoint}",
            f"--daemon={daemon_socket}",
            f"--parent={os.getpid()}",
            f"--own={','.join(sorted(own))}",
            f"--unary={','.join(sorted(unary))}",
            f"--metrics-socket={self.metrics_socket}",
            f"--grace={PASSTHROUGH_STOP_GRACE}s",
            f"--deadline-margin={PASSTHROUGH_DEADLINE_MARGIN}s",
            f"--log-format={config.log_format}",
            f"--log-level={config.log_level}",
        ]
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        if not os.access(self.binary, os.X_OK):
            raise FrontError(
                f"server.front: {self.binary} is missing or not executable: build it (make setup), "
                "set server.front_binary, or set server.front = false"
            )
        await self._spawn()
        self._watch = asyncio.create_task(self._supervise())

    async def _spawn(self) -> None:
        try:
            sockets.remove_stale(self.config.socket)
            if self.metrics_socket:
                sockets.remove_stale(self.metrics_socket)
        except sockets.SocketInUse as e:
            raise FrontError(f"server.socket {e}") from None
        # forked from the event loop's thread, the main thread, which lives as long as the daemon:
        # the front's parent-death signal fires when the daemon ends, not when some thread does
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdout is not None
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
        self._proc = proc
        log.info("front started", pid=proc.pid, socket=self.config.socket)

    async def _supervise(self) -> None:
        """A front that exits while the daemon runs (a crash, a kill) is started again: the node's
        CRI is down meanwhile."""
        delay = FRONT_RESTART_FIRST
        while not self._stopping:
            assert self._proc is not None
            started = time.monotonic()
            code = await self._proc.wait()
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

    async def stop(self) -> None:
        """The front stops taking calls, gives those in flight PASSTHROUGH_STOP_GRACE, removes its
        socket and exits; killed if it has not after a margin."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), PASSTHROUGH_STOP_GRACE + FRONT_EXIT_MARGIN)
            except TimeoutError:
                log.warning("front did not stop; killing it", pid=proc.pid)
                proc.kill()
                await proc.wait()
        if proc is not None:
            sockets.remove_unserved(self.config.socket)  # a front that was killed left it behind

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


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock
