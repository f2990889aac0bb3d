"""podshim's side of podshim-runc's restore: over BROKER_SOCKET in server.state_dir podshim prepares
the restore with the hook's own code, podshim-runc forks the runtime's `restore`, and podshim
settles it, undoing it when the connection ends before the verdict (docs/design/runtime-wrapper.md
(The runtime wrapper))."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from shim import faults, logs
from shim.config import Config
from shim.contract import BROKER_SOCKET
from shim.errors import Stopped
from shim.wrapper import cleanup, page_check, restore
from shim.wrapper.main import split_global

log = logs.get("shim.ops.restore_broker")

EARLY_NICE = 10  # RestorePod's page checks, until podshim-runc's restore takes them (PageImages.boost)
MAX_PACKET = 256 * 1024  # argv, env and a failure message (CRIU's error lines) fit easily


# ---------------------------------------------------------------------------- page checks


class PageChecks:
    """The page checks RestorePod started, by checkpoint dir and digests, until podshim-runc's
    prepare takes them (a check nobody takes within MAX_AGE seconds is stopped and dropped)."""

    MAX_AGE = 600.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checks: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[page_check.PageImages, float]] = {}

    @staticmethod
    def _key(ckpt: Path, digests: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
        return os.path.realpath(ckpt), tuple(sorted(digests.items()))

    def start(self, ckpt: Path, digests: Mapping[str, str]) -> None:
        """Start hashing `ckpt`'s page images (relative path -> sha256) in threads of its own."""
        key = self._key(ckpt, digests)
        now = time.monotonic()
        with self._lock:
            for k, (pages, since) in list(self._checks.items()):
                if now - since > self.MAX_AGE:
                    pages.stop.set()
                    del self._checks[k]
            if key in self._checks:
                return
            pages = page_check.PageImages(Path(key[0]), dict(digests), nice=EARLY_NICE)
            pages.start()
            self._checks[key] = (pages, now)

    def take(self, ckpt: Path, digests: Mapping[str, str]) -> page_check.PageImages | None:
        """The running (or finished) check of exactly these images, removed from here; None if none."""
        with self._lock:
            found = self._checks.pop(self._key(ckpt, digests), None)
        return found[0] if found else None

    def discard(self, ckpt: Path, digests: Mapping[str, str]) -> None:
        """Stop and forget a check nobody will take (its RestorePod failed)."""
        pages = self.take(ckpt, digests)
        if pages is not None:
            pages.stop.set()

    def stop_all(self) -> None:
        with self._lock:
            checks, self._checks = self._checks, {}
        for pages, _since in checks.values():
            pages.stop.set()


# ---------------------------------------------------------------------------- the broker


def _fields(packet: bytes) -> list[str]:
    """A packet's NUL-terminated fields (surrogateescape: argv bytes come back unchanged)."""
    if not packet.endswith(b"\0"):
        return []
    return [f.decode("utf-8", "surrogateescape") for f in packet[:-1].split(b"\0")]


def _packet(*fields: str) -> bytes:
    return b"".join(f.encode("utf-8", "surrogateescape") + b"\0" for f in fields)


class _ClientGone(Exception):
    """podshim-runc died (EOF) or was killed by a failpoint: the restore is undone."""


def _client_failpoints(spec: str, pid: int) -> faults.Failpoints:
    """podshim-runc's failpoints (its PODSHIM_FAILPOINTS, `runc-wrapper.*`), acted on here where the
    hook acted on them: `kill` kills podshim-runc (tests/faults: a death at that instant) and ends
    its restore here (_ClientGone); `error` fails it."""

    def kill(name: str) -> None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        raise _ClientGone(f"failpoint {name} killed podshim-runc")

    def error(name: str) -> Exception:
        return restore.RestoreFailed(f"failpoint {name} triggered (PODSHIM_FAILPOINTS)")

    return faults.Failpoints(spec, kill, error)


class RestoreBroker:
    """Serves podshim-runc's restores on BROKER_SOCKET in `state_dir`, a thread per connection."""

    def __init__(self, config: Config, checks: PageChecks) -> None:
        self.config = config
        self.state_dir = config.state_dir
        self.checks = checks
        self._listener: socket.socket | None = None
        self._dir_fd = -1

    @property
    def path(self) -> Path:
        return Path(self.state_dir) / BROKER_SOCKET

    def start(self) -> None:
        """Listen; on failure podshim-runc falls back to the hook (logged, not fatal)."""
        try:
            # named through a descriptor of the state dir: its path may not fit in sun_path (108)
            self._dir_fd = os.open(self.state_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(BROKER_SOCKET, dir_fd=self._dir_fd)  # a previous run's
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            old = os.umask(0o177)
            try:
                listener.bind(f"/proc/self/fd/{self._dir_fd}/{BROKER_SOCKET}")
            finally:
                os.umask(old)
            listener.listen(64)
        except OSError as e:
            log.warning("restore broker not listening: podshim-runc uses its hook", error=str(e))
            return
        self._listener = listener
        threading.Thread(target=self._accept, name="podshim-restore-broker", daemon=True).start()
        log.info("restore broker listening", socket=str(self.path))

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(BROKER_SOCKET, dir_fd=self._dir_fd)
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        self.checks.stop_all()

    def _accept(self) -> None:
        while (listener := self._listener) is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._listener is None:
                    return
                time.sleep(0.05)  # EMFILE and the like: try again
                continue
            threading.Thread(target=self._serve, args=(conn,), name="podshim-restore", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._restore(conn)
            except Exception:  # noqa: BLE001 - one restore's bug must not end the broker
                log.exception("restore broker: a restore failed unexpectedly")

    def _restore(self, conn: socket.socket) -> None:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        fields = _fields(conn.recv(MAX_PACKET))
        if uid != os.geteuid() or len(fields) < 5 or fields[0] != "prepare":
            _send(conn, "hook")
            return
        cwd, binary, failpoints, argv = fields[1], fields[2], fields[3], fields[4:]
        client_faults = _client_failpoints(failpoints, pid)
        flags, command, rest = split_global(argv)
        if command != "create":
            _send(conn, "hook")
            return
        begun = time.monotonic()
        gone = threading.Event()  # podshim-runc hung up (its deadline): stop preparing
        wake_r, wake_w = os.pipe2(os.O_CLOEXEC)  # prepared: the watcher ends at once
        watching = threading.Thread(target=_watch_hangup, args=(conn, wake_r, gone), daemon=True)
        watching.start()
        prepared = None
        try:
            prepared = restore.prepare(
                binary, argv, flags, rest, cwd=cwd, page_check=self.checks.take, cfg=self.config, stop=gone
            )
            if prepared is None:
                _send(conn, "hook")  # not a restore after all: the hook judges it
                return
            client_faults.hit("runc-wrapper.before-restore")
        except restore.RestoreFailed as e:
            _send(conn, "fail", str(e))
            return
        except (_ClientGone, Stopped) as e:  # nothing started: the runtime never ran
            if prepared is not None and prepared.pages is not None:
                prepared.pages.stop.set()
            log.warning("podshim-runc left before its restore started", why=str(e))
            return
        finally:
            os.write(wake_w, b"x")
            watching.join()
            os.close(wake_r)
            os.close(wake_w)
        self._run(conn, prepared, client_faults, begun)

    def _run(
        self, conn: socket.socket, p: restore.Prepared, client_faults: faults.Failpoints, begun: float
    ) -> None:
        """From `exec` to the verdict, with the watchdog's role: whatever ends this early undoes."""
        held = cleanup.hold_dirs([p.work])  # the upstream renames the bundle while it deletes it
        started: int | None = None
        concluded = False
        t0 = time.monotonic()
        try:
            env = [f"{k}={v}" for k, v in p.env.items()]
            _send(conn, "exec", *env, "", *p.cmd)
            started = int(_expect(conn, "started"))
            returncode = int(_expect(conn, "exited"))
            t1 = time.monotonic()
            faults.hit("restore-broker.after-restore")  # tests/faults: podshim dies, tasks held
            p.settle(returncode, client_faults.hit)
            try:
                restore.conclude(p, returncode)
                reply: tuple[str, ...] = ("ok",)
            except restore.RestoreFailed as e:
                reply = ("fail", str(e))
            _send(conn, *reply)
            concluded = True
            log.info(
                "restore served",
                container=p.container_id,
                ok=reply[0] == "ok",
                prepare_s=round(t0 - begun, 4),
                restore_s=round(t1 - t0, 4),
                settle_s=round(time.monotonic() - t1, 4),
            )
        except Exception as e:  # noqa: BLE001 - whatever ended it (EOF, a bug): nothing is left held
            if started is None:  # podshim-runc's child never passed its gate: nothing ran
                log.warning(
                    "podshim-runc left before its restore started", container=p.container_id, why=str(e)
                )
            else:
                log.warning(
                    "podshim-runc died during its restore: undone", container=p.container_id, why=str(e)
                )
                restore.undo(p, started, held)
        finally:
            if p.pages is not None and not concluded:
                p.pages.stop.set()
            for fd in held.values():
                os.close(fd)


def _watch_hangup(conn: socket.socket, wake: int, gone: threading.Event) -> None:
    """Set `gone` if podshim-runc hangs up before `wake` becomes readable (the caller is done)."""
    poller = select.poll()
    poller.register(conn, select.POLLRDHUP)
    poller.register(wake, select.POLLIN)
    for fd, _events in poller.poll():
        if fd != wake:
            gone.set()


def _send(conn: socket.socket, *fields: str) -> None:
    conn.sendmsg([_packet(*fields)], [], socket.MSG_NOSIGNAL)


def _expect(conn: socket.socket, verb: str) -> str:
    """The one field of the next message, which must be `verb`; _ClientGone on EOF."""
    packet = conn.recv(MAX_PACKET)
    if not packet:
        raise _ClientGone("podshim-runc closed the connection")
    fields = _fields(packet)
    if len(fields) != 2 or fields[0] != verb:
        raise ValueError(f"podshim-runc sent {fields[:1]!r}, not {verb!r}")
    return fields[1]
