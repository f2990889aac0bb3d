"""The migration link (shim/migration/wire.py, credentials.py): mutual TLS between node
certificates of one CA, the control channel's frames; an unauthenticated peer,
a peer of another CA and a peer with the wrong name are refused."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from shim import errors
from shim.deadlines import MIGRATION_PEER_HANDSHAKE
from shim.migration import credentials, wire

ADDR = "127.0.0.1"


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, credentials.NodeCredentials]:
    d = tmp_path_factory.mktemp("pki")
    issued = credentials.issue(d, {"node-a": [ADDR], "node-b": [ADDR]})
    other = credentials.issue(d / "other", {"node-a": [ADDR]})  # same name, another CA
    ca = str(d / "ca.pem")
    out = {n: credentials.NodeCredentials(str(c), str(k), ca) for n, (c, k) in issued.items()}
    c, k = other["node-a"]
    out["impostor"] = credentials.NodeCredentials(str(c), str(k), str(d / "other" / "ca.pem"))
    return out


def free_address() -> str:
    with socket.socket() as s:
        s.bind((ADDR, 0))
        return f"{ADDR}:{s.getsockname()[1]}"


async def connected_pair(creds: dict) -> tuple[wire.Listener, ssl.SSLSocket, ssl.SSLSocket]:
    """A listener of node-b and one authenticated connection from node-a: (listener, a's, b's)."""
    addr = free_address()
    listener = wire.Listener(addr, creds["node-b"].server_context())
    loop = asyncio.get_running_loop()
    accepted = loop.run_in_executor(None, listener.accept, "node-a", 5.0, lambda why: None)
    a_tls = await asyncio.to_thread(
        wire.connect, addr, creds["node-a"].client_context(), {"t": "control"}, 5.0
    )
    b_tls, _ = await accepted
    return listener, a_tls, b_tls


def accept_in_thread(listener: wire.Listener, expected: str, refused: list[str]) -> dict[str, object]:
    got: dict[str, object] = {}

    def run() -> None:
        try:
            got["conn"] = listener.accept(expected, 5.0, refused.append)
        except Exception as e:  # noqa: BLE001 - reported to the test
            got["error"] = e

    t = threading.Thread(target=run)
    t.start()
    got["thread"] = t
    return got


def test_authenticated_peer_is_accepted_and_others_refused(creds: dict) -> None:
    addr = free_address()
    listener = wire.Listener(addr, creds["node-b"].server_context())
    refused: list[str] = []
    try:
        got = accept_in_thread(listener, "node-a", refused)
        # no certificate at all
        plain_ctx = ssl.create_default_context(cafile=creds["node-b"].ca_file)
        plain_ctx.check_hostname = False
        with pytest.raises((ssl.SSLError, OSError)):
            s = wire.connect(addr, plain_ctx, {"t": "control"}, 5.0)
            s.recv(1)  # TLS 1.3: the server's refusal of the client certificate arrives on read
        # a certificate of another CA under the expected name
        with pytest.raises((ssl.SSLError, OSError)):
            wire.connect(addr, creds["impostor"].client_context(), {"t": "control"}, 5.0).recv(1)
        # a valid certificate naming another node
        with pytest.raises((ssl.SSLError, OSError, wire.LinkLost)):
            s = wire.connect(addr, creds["node-b"].client_context(), {"t": "control"}, 5.0)
            if not s.recv(1):
                raise wire.LinkLost("closed")
        s = wire.connect(addr, creds["node-a"].client_context(), {"t": "control", "migration": "m1"}, 5.0)
        got["thread"].join(10)  # type: ignore[attr-defined]
        assert "error" not in got, got
        tls, greeting = got["conn"]  # type: ignore[misc]
        assert greeting == {"t": "control", "migration": "m1"}
        assert credentials.peer_names(tls.getpeercert()) >= {"node-a"}
        assert len(refused) == 3, refused
        tls.close()
        s.close()
    finally:
        listener.close()


def test_silent_and_garbage_strangers_do_not_delay_the_expected_peer(creds: dict) -> None:
    """20 silent TCP connections and 20 clients sending garbage, opened before the expected peer
    and while it connects: it is accepted as soon as its own handshake is done (not after the
    strangers' handshakes time out), and every stranger is refused."""
    addr = free_address()
    host, port = wire.split_address(addr)
    listener = wire.Listener(addr, creds["node-b"].server_context())
    refused: list[str] = []
    strangers: list[socket.socket] = []
    try:

        def open_strangers() -> None:
            for i in range(20):
                strangers.append(socket.create_connection((host, port)))  # says nothing
                g = socket.create_connection((host, port))
                strangers.append(g)
                with contextlib.suppress(OSError):  # the listener may have refused it already
                    g.sendall(os.urandom(64) if i % 2 else b"\x16\x03\x01\x00\x05hello")  # not TLS

        open_strangers()
        got = accept_in_thread(listener, "node-a", refused)
        more = threading.Thread(target=open_strangers)
        more.start()
        start = time.monotonic()
        s = wire.connect(addr, creds["node-a"].client_context(), {"t": "control", "migration": "m2"}, 5.0)
        got["thread"].join(10)  # type: ignore[attr-defined]
        took = time.monotonic() - start
        more.join()
        assert "error" not in got, got
        tls, greeting = got["conn"]  # type: ignore[misc]
        assert greeting == {"t": "control", "migration": "m2"}
        # well inside the strangers' own bound: their handshakes never held it up
        assert took < MIGRATION_PEER_HANDSHAKE, took
        assert refused, "the garbage clients were not refused"
        tls.close()
        s.close()
    finally:
        for c in strangers:
            c.close()
        listener.close()


def test_a_flood_of_silent_connections_past_the_cap_cannot_crowd_out_the_peer(creds: dict) -> None:
    """More silent connections than the listener takes mid-handshake: the oldest silent ones make
    room, and the expected peer is accepted."""
    addr = free_address()
    host, port = wire.split_address(addr)
    listener = wire.Listener(addr, creds["node-b"].server_context())
    refused: list[str] = []
    flood: list[socket.socket] = []
    try:
        got = accept_in_thread(listener, "node-a", refused)
        for _ in range(wire.MIGRATION_UNAUTHENTICATED_MAX + 16):
            flood.append(socket.create_connection((host, port)))
        until = time.monotonic() + 5
        while len(refused) < 16 and time.monotonic() < until:  # the listener took them all in
            time.sleep(0.01)
        assert len(refused) >= 16 and all("sent nothing" in r for r in refused), refused[:3]
        s = wire.connect(addr, creds["node-a"].client_context(), {"t": "control"}, 5.0)
        got["thread"].join(10)  # type: ignore[attr-defined]
        assert "error" not in got, got
        tls, greeting = got["conn"]  # type: ignore[misc]
        assert greeting == {"t": "control"}
        tls.close()
        s.close()
    finally:
        for c in flood:
            c.close()
        listener.close()


def test_the_greeting_is_read_alone_and_what_follows_stays_for_the_channel(creds: dict) -> None:
    """The source may send its first message right behind the greeting: the listener reads only
    the greeting, and the message reaches the channel."""
    addr = free_address()
    listener = wire.Listener(addr, creds["node-b"].server_context())
    try:
        got = accept_in_thread(listener, "node-a", [])
        s = wire.connect(addr, creds["node-a"].client_context(), {"t": "control"}, 5.0)
        s.sendall(wire.encode({"t": "offer", "containers": []}))
        got["thread"].join(10)  # type: ignore[attr-defined]
        tls, greeting = got["conn"]  # type: ignore[misc]
        assert greeting == {"t": "control"}
        tls.settimeout(5)
        head = tls.recv(wire.FRAME.size)
        length, kind = wire.FRAME.unpack(head)
        assert kind == wire.JSON and b'"offer"' in tls.recv(length)
        tls.close()
        s.close()
    finally:
        listener.close()


def test_the_source_checks_the_destinations_name(creds: dict) -> None:
    addr = free_address()
    listener = wire.Listener(addr, creds["node-b"].server_context())
    try:
        accept_in_thread(listener, "node-a", [])
        with pytest.raises(ssl.SSLCertVerificationError):
            wire.connect(addr, creds["node-a"].client_context(), {"t": "control"}, 5.0, "node-c")
    finally:
        listener.close()


def test_credentials_that_do_not_load_are_failed_precondition(tmp_path: Path) -> None:
    bad = credentials.NodeCredentials(
        str(tmp_path / "x.pem"), str(tmp_path / "x-key.pem"), str(tmp_path / "ca")
    )
    with pytest.raises(errors.FailedPrecondition, match="cert_file"):
        bad.server_context()


async def test_control_channel(creds: dict) -> None:
    listener, a_tls, b_tls = await connected_pair(creds)
    loop = asyncio.get_running_loop()
    try:
        a, b = wire.Channel(a_tls, loop).start(), wire.Channel(b_tls, loop).start()
        a.send({"t": "hello", "n": 1})
        assert await asyncio.wait_for(b.inbox.get(), 5) == {"t": "hello", "n": 1}
        blob = os.urandom(3 << 20)
        await asyncio.to_thread(b.send_bytes_waiting, blob, 5.0)
        got = await asyncio.wait_for(a.inbox.get(), 5)
        assert got == blob
        a.send({"t": "ping"})  # refreshes last_received, not delivered
        b.send({"t": "bye"})
        assert await asyncio.wait_for(a.inbox.get(), 5) == {"t": "bye"}
        a.close()
        lost = await asyncio.wait_for(b.inbox.get(), 5)
        assert isinstance(lost, wire.LinkLost)

    finally:
        listener.close()


def test_offer_helpers() -> None:
    from shim.migration import protocol
    from shim.ops.restore_checks import container_set_problem

    # the container set (RestorePod's rule, the migration's pre-check: INVALID_ARGUMENT)
    assert container_set_problem(["app"], {"init"}, ["app"]) is None
    exited = container_set_problem(["app"], {"init"}, ["app", "init"])
    assert exited is not None and "init had exited when the pod was checkpointed" in exited
    assert "missing app" in (container_set_problem(["app"], {"init"}, []) or "")
    assert "not in the checkpoint extra" in (container_set_problem(["app"], {"init"}, ["app", "extra"]) or "")
    host = protocol.host_of({"host": {"arch": "x86_64", "kernel": "6.18.1", "future": "x", "cpuinfo": 3}})
    assert (host.arch, host.kernel, host.cpuinfo) == ("x86_64", "6.18.1", "3")
    assert "2 mismatches" in protocol.refusal(["a", "b"]) and protocol.refusal([]) == ""


async def test_a_malformed_frame_ends_the_channel(creds: dict) -> None:
    """A frame over MAX_FRAME (or of an unknown kind) from the peer is a protocol error: the
    channel ends with LinkLost instead of buffering it."""
    listener, a_tls, b_tls = await connected_pair(creds)
    loop = asyncio.get_running_loop()
    try:
        b = wire.Channel(b_tls, loop).start()
        await asyncio.to_thread(a_tls.sendall, wire.FRAME.pack(wire.MAX_FRAME + 1, wire.BYTES))
        lost = await asyncio.wait_for(b.inbox.get(), 5)
        assert isinstance(lost, wire.LinkLost) and "malformed frame" in lost.reason
        a_tls.close()
    finally:
        listener.close()


async def test_closing_an_ended_channel_writes_into_no_reused_fd(creds: dict) -> None:
    """The peer ended the channel (its pump closed its wake-up pipe); the fd number of that pipe's
    write end now names another file (here a pipe of the test, put there by dup2): close(), a
    send and a heartbeat after the end write nothing into it."""
    listener, a_tls, b_tls = await connected_pair(creds)
    loop = asyncio.get_running_loop()
    try:
        b = wire.Channel(b_tls, loop).start()
        old_w = b._wake.w
        a_tls.close()
        assert isinstance(await asyncio.wait_for(b.inbox.get(), 5), wire.LinkLost)
        await asyncio.to_thread(b.thread.join, 5)
        r, w = os.pipe2(os.O_NONBLOCK)
        os.dup2(w, old_w)  # the number is free again: another file takes it
        try:
            b.close()
            b.send({"t": "late"})
            b._wake.set()
            with pytest.raises(BlockingIOError):
                os.read(r, 16)  # nothing was written into the file that reused the number
        finally:
            for fd in (r, w, old_w):
                os.close(fd)
    finally:
        listener.close()
