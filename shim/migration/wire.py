"""The control channel between two nodes during a migration (docs/design/migration.md (Live
migration)): one mutually authenticated TLS connection from the source to the destination's
one-shot listener, carrying framed JSON messages and the archive's bytes. (The pages travel in
CRIU's own TLS connections, from the source's page servers to the destination's daemons.)

The connection is driven by a thread of its own that alone reads and writes its TLS socket (an SSL
object must not be used by two threads at once); it hands the messages to podshim's event loop
through a queue. Its first frame is a greeting: {"t": "control", "migration": ID}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from shim import errors, logs
from shim.deadlines import MIGRATION_PEER_HANDSHAKE

log = logs.get("shim.migration.wire")

FRAME = struct.Struct(">IB")  # payload length, kind
JSON, BYTES = 0, 1
MAX_FRAME = 16 << 20  # a frame longer than this is a protocol error
CHUNK = 1 << 20  # one read; one BYTES frame of a file
MAX_BUFFERED = 8 << 20  # bytes queued for the peer before a sender of file data waits
GREETING_MAX = 64 << 10  # a connection's first frame
# connections mid-handshake at once; past it the oldest that has sent nothing yet makes room (or,
# if every one has, the newcomer is closed): a flood of silent connections cannot crowd out a peer
MIGRATION_UNAUTHENTICATED_MAX = 64


class LinkLost(Exception):
    """The connection ended (EOF, an error, a stop): `reason` says how."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT or [IPv6]:PORT -> (host, port); INVALID_ARGUMENT otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.InvalidArgument(f"{address!r} is not HOST:PORT")
    return host, int(port)


def encode(msg: dict[str, Any]) -> bytes:
    payload = json.dumps(msg, separators=(",", ":")).encode()
    return FRAME.pack(len(payload), JSON) + payload


def encode_bytes(data: bytes | memoryview) -> bytes:
    return FRAME.pack(len(data), BYTES) + bytes(data)


def _recv(sock: socket.socket, buf: bytearray | memoryview) -> int | None:
    """recv_into without blocking: None when nothing is there yet, 0 at EOF."""
    try:
        return sock.recv_into(buf)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
        return None
    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
        return 0


def _send(sock: socket.socket, data: bytearray | memoryview) -> int:
    """send without blocking: how much went out (0: none could)."""
    try:
        return sock.send(data)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
        return 0


# ---------------------------------------------------------------------- connections


def connect(
    address: str, ctx: ssl.SSLContext, greeting: dict[str, Any], timeout: float, server_hostname: str = ""
) -> ssl.SSLSocket:
    """A TLS connection to the destination's listener at `address` (its certificate must name
    `server_hostname`, by default the address's host), greeted with `greeting`. Blocking."""
    host, port = split_address(address)
    raw = socket.create_connection((host, port), timeout=timeout)
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = ctx.wrap_socket(raw, server_hostname=server_hostname or host)
    except BaseException:
        raw.close()
        raise
    try:
        tls.settimeout(timeout)
        tls.sendall(encode(greeting))
    except BaseException:
        tls.close()
        raise
    return tls


class Listener:
    """The destination's listening socket, open only while a migration into this node runs
    (RestorePod with `lazy-migration-from` until the transfer has ended). `accept` hands back
    the connection whose peer completed the TLS handshake with a certificate of the CA naming the
    expected source; any other peer is refused (logged, counted by the caller's `refused`).

    Handshakes run side by side on one thread (non-blocking sockets, a selector), each within
    MIGRATION_PEER_HANDSHAKE, at most MIGRATION_UNAUTHENTICATED_MAX at once: whatever else connects
    (silent TCP, garbage TLS, another node's certificate) the expected peer is served as soon as
    its own handshake ends."""

    def __init__(self, address: str, ctx: ssl.SSLContext) -> None:
        host, port = split_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(128)
        except OSError as e:
            self.sock.close()
            raise errors.Unavailable(f"cannot listen for the migration on {address}: {e.strerror}") from None
        self.ctx = ctx
        self.address = address
        self._closed = threading.Event()

    def accept(
        self, expected_peer: str, timeout: float, refused: Callable[[str], None]
    ) -> tuple[ssl.SSLSocket, dict[str, Any]]:
        """The first authenticated connection from `expected_peer` and its greeting (blocking, up
        to `timeout` seconds in all: TimeoutError). Others are closed and reported to `refused`."""
        end = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        pending: dict[ssl.SSLSocket, _Handshake] = {}
        self.sock.setblocking(False)
        sel.register(self.sock, selectors.EVENT_READ)

        def drop(h: _Handshake, why: str) -> None:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(h.tls)
            pending.pop(h.tls, None)
            with contextlib.suppress(OSError):
                h.tls.close()
            refused(f"{h.where}: {why}")

        try:
            while True:
                now = time.monotonic()
                if self._closed.is_set():
                    raise LinkLost(f"the listener on {self.address} closed")
                if now >= end:
                    raise TimeoutError
                for h in [h for h in pending.values() if now >= h.deadline]:
                    drop(h, f"no TLS handshake and greeting within {MIGRATION_PEER_HANDSHAKE:g}s")
                wake = min([end, now + 0.1, *(h.deadline for h in pending.values())])
                for key, _ in sel.select(max(0.0, wake - now)):
                    h = key.data
                    if h is None:  # the listening socket
                        self._take_new(sel, pending, refused, drop)
                        continue
                    try:
                        done = h.step(expected_peer)
                    except (errors.ShimError, LinkLost, OSError, ValueError) as e:
                        drop(h, getattr(e, "message", None) or str(e))
                        continue
                    if done is not None:
                        sel.unregister(h.tls)
                        del pending[h.tls]
                        h.tls.setblocking(True)
                        return h.tls, done
                    sel.modify(h.tls, h.events, h)
        finally:
            for h in list(pending.values()):
                with contextlib.suppress(OSError):
                    h.tls.close()
            sel.close()
            with contextlib.suppress(OSError):
                self.sock.setblocking(True)

    def _take_new(
        self,
        sel: selectors.BaseSelector,
        pending: dict[ssl.SSLSocket, _Handshake],
        refused: Callable[[str], None],
        drop: Callable[[_Handshake, str], None],
    ) -> None:
        """Every connection waiting in the backlog, each started on its handshake."""
        while True:
            try:
                raw, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise LinkLost(f"the listener on {self.address} closed ({e.strerror})") from None
            where = f"{peer[0]}:{peer[1]}"
            if len(pending) >= MIGRATION_UNAUTHENTICATED_MAX:
                silent = [h for h in pending.values() if not h.heard]
                if not silent:
                    raw.close()
                    refused(f"{where}: {MIGRATION_UNAUTHENTICATED_MAX} connections already mid-handshake")
                    continue
                drop(min(silent, key=lambda h: h.deadline), "sent nothing; its place was needed")
            try:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                raw.setblocking(False)
                tls = self.ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
            except (OSError, ssl.SSLError) as e:
                raw.close()
                refused(f"{where}: {e}")
                continue
            h = _Handshake(tls, where, time.monotonic() + MIGRATION_PEER_HANDSHAKE)
            pending[tls] = h
            sel.register(tls, h.events, h)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class _Handshake:
    """One connection to the listener on its way to being authenticated: the TLS handshake, the
    peer's certificate checked at once (a wrong peer is dropped before anything is read from
    it), then its greeting frame, all without blocking."""

    def __init__(self, tls: ssl.SSLSocket, where: str, deadline: float) -> None:
        self.tls = tls
        self.where = where
        self.deadline = deadline
        self.events = selectors.EVENT_READ
        self.heard = False  # the socket was ready at least once: the peer sent something
        self.shaken = False
        self.inbuf = bytearray()

    def step(self, expected_peer: str) -> dict[str, Any] | None:
        """Advance as far as the socket allows; the greeting once it is whole, else None."""
        from shim.migration.credentials import check_peer

        self.heard = True
        if not self.shaken:
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                self.events = selectors.EVENT_READ
                return None
            except ssl.SSLWantWriteError:
                self.events = selectors.EVENT_WRITE
                return None
            except ssl.SSLError as e:
                raise LinkLost(f"TLS handshake failed ({e})") from None
            self.shaken = True
            check_peer(self.tls.getpeercert(), expected_peer)
        self.events = selectors.EVENT_READ
        while True:  # exactly the greeting's bytes: what follows is the channel's (tls.pending())
            if len(self.inbuf) < FRAME.size:
                need = FRAME.size - len(self.inbuf)
            else:
                length, kind = FRAME.unpack_from(self.inbuf)
                if kind != JSON or length > GREETING_MAX:
                    raise LinkLost("the peer's first frame is not a greeting")
                need = FRAME.size + length - len(self.inbuf)
                if need == 0:
                    break
            buf = bytearray(need)
            n = _recv(self.tls, buf)
            if n is None:
                return None
            if n == 0:
                raise LinkLost("the peer closed the connection before its greeting")
            self.inbuf += buf[:n]
        greeting = json.loads(bytes(self.inbuf[FRAME.size :]))
        if not isinstance(greeting, dict):
            raise ValueError("the peer's greeting is not an object")
        return greeting


# ---------------------------------------------------------------------- the pump


class _Wake:
    """A pipe a pump thread's selector watches, so another thread can interrupt its wait. Once
    closed (the pump ended) `set` does nothing: its fd numbers may already name another file, and
    a write there would land in it. The lock keeps a `set` from another thread from writing
    between the close and the fds' reuse."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._closed = False

    def set(self) -> None:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending already
                    os.write(self.w, b"x")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.r, 4096):
                pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.r)
                os.close(self.w)


class Channel:
    """The control channel: frames to and from the peer over one TLS connection, driven by a
    thread; received messages go to an asyncio queue (JSON frames as dicts, BYTES frames as
    bytes); its end puts a LinkLost there. `send` is callable from any thread."""

    def __init__(self, tls: ssl.SSLSocket, loop: asyncio.AbstractEventLoop, name: str = "control") -> None:
        self.tls = tls
        self.loop = loop
        self.inbox: asyncio.Queue[dict[str, Any] | bytes | LinkLost] = asyncio.Queue()
        self.last_received = time.monotonic()
        self.ended: str = ""  # how it ended ("" while it runs)
        self._out: deque[bytes] = deque()
        self._out_bytes = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._wake = _Wake()
        self.thread = threading.Thread(target=self._run, name=f"podshim-migration-{name}", daemon=True)

    def start(self) -> Channel:
        self.thread.start()
        return self

    def send(self, msg: dict[str, Any]) -> None:
        self._enqueue(encode(msg))

    async def heartbeat(self, interval: float) -> None:
        """A ping every `interval` seconds while the channel lives (a task of its own, so that no
        step of either side, however slow, lets the other's lease run out)."""
        ping = encode({"t": "ping"})
        while not self.ended:
            self._enqueue(ping)
            await asyncio.sleep(interval)

    def send_bytes_waiting(self, data: bytes | memoryview, timeout: float) -> None:
        """Queue a BYTES frame once less than MAX_BUFFERED is queued (blocking: from a worker
        thread). LinkLost if the channel ends or nothing drains within `timeout`."""
        frame = encode_bytes(data)
        end = time.monotonic() + timeout
        with self._cond:
            while self._out_bytes > MAX_BUFFERED and not self.ended:
                left = end - time.monotonic()
                if left <= 0:
                    raise LinkLost("the peer node stopped reading")
                self._cond.wait(left)
            if self.ended:
                raise LinkLost(self.ended)
        self._enqueue(frame)

    def _enqueue(self, frame: bytes) -> None:
        with self._cond:
            if self.ended:
                return
            self._out.append(frame)
            self._out_bytes += len(frame)
        self._wake.set()

    def close(self) -> None:
        """End the channel (what is queued may not be sent)."""
        self._stop.set()
        self._wake.set()

    def flush_and_close(self, timeout: float) -> None:
        """Send what is queued (up to `timeout`), then end the channel (blocking)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._out_bytes and not self.ended and time.monotonic() < end:
                self._cond.wait(max(0.0, min(0.05, end - time.monotonic())))
        self.close()
        self.thread.join(timeout=max(0.0, end - time.monotonic()) + 1.0)

    def _deliver(self, item: dict[str, Any] | bytes | LinkLost) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: podshim is exiting
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)

    def _run(self) -> None:
        reason = "closed"
        try:
            reason = self._pump()
        except (OSError, ssl.SSLError, ValueError) as e:
            reason = f"connection error: {e}"
        finally:
            with contextlib.suppress(OSError):
                self.tls.close()
            self._wake.close()
            with self._cond:
                self.ended = reason
                self._cond.notify_all()
            self._deliver(LinkLost(reason))

    def _pump(self) -> str:
        tls = self.tls
        tls.setblocking(False)
        inbuf = bytearray()
        buf = bytearray(CHUNK)
        pending = bytearray()
        sel = selectors.DefaultSelector()
        sel.register(self._wake.r, selectors.EVENT_READ)
        sel.register(tls, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                with self._cond:
                    while self._out:
                        pending += self._out.popleft()
                moved = True
                while moved:
                    moved = False
                    n = _recv(tls, buf)
                    if n == 0:
                        return "the peer node closed the connection"
                    if n:
                        inbuf += memoryview(buf)[:n]
                        self.last_received = time.monotonic()
                        moved = True
                        self._parse(inbuf)
                    if pending:
                        n = _send(tls, pending)
                        if n:
                            del pending[:n]
                            with self._cond:
                                self._out_bytes -= n
                                self._cond.notify_all()
                            moved = True
                if tls.pending():
                    continue
                events = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
                sel.modify(tls, events)
                sel.select(timeout=1.0)
                self._wake.clear()
            return "closed by this node"
        finally:
            sel.close()

    def _parse(self, inbuf: bytearray) -> None:
        while len(inbuf) >= FRAME.size:
            length, kind = FRAME.unpack_from(inbuf)
            if length > MAX_FRAME or kind not in (JSON, BYTES):
                raise ValueError(f"a malformed frame from the peer node (kind {kind}, {length} bytes)")
            if len(inbuf) < FRAME.size + length:
                return
            payload = bytes(inbuf[FRAME.size : FRAME.size + length])
            del inbuf[: FRAME.size + length]
            if kind == JSON:
                msg = json.loads(payload)
                if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
                    raise ValueError("a control message without a type")
                if msg["t"] != "ping":  # heartbeats only refresh last_received
                    self._deliver(msg)
            else:
                self._deliver(payload)
