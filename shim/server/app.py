"""Builds and runs podshim's gRPC server on its unix socket."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import signal
import stat
from collections.abc import Callable
from pathlib import Path

import grpc

from api.runtime.v1 import api_pb2 as cri
from shim import cni, logs, metrics
from shim.config import Config
from shim.deadlines import PASSTHROUGH_STOP_GRACE, STOP_CLEANUP, STOP_GRACE
from shim.kube import service as kube_service
from shim.kube.service import ClusterApi
from shim.server import front, sockets
from shim.server.front import Front, FrontError, private_socket
from shim.server.proxy import CriHandler, Passthrough
from shim.server.runtime import Engine, RuntimeHandlers
from shim.upstream import Upstream

log = logs.get("shim.server")
MAX_MESSAGE = 16 * 1024 * 1024


def streaming_methods() -> frozenset[str]:
    """Server-streaming CRI methods, read from the proto so a new one is never proxied as unary."""
    names = set()
    for service in cri.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            if m.server_streaming:
                names.add(f"/{service.full_name}/{m.name}")
    return frozenset(names)


def unary_methods() -> frozenset[str]:
    """CRI methods with one message each way (the front pumps any other, whatever its shape)."""
    return frozenset(
        f"/{service.full_name}/{m.name}"
        for service in cri.DESCRIPTOR.services_by_name.values()
        for m in service.methods
        if not (m.server_streaming or m.client_streaming)
    )


def prepare_state_dir(path: str) -> None:
    """server.state_dir private (0700) whatever the umask or the unit: it holds the journal, kept
    CRIU logs, container checkpoint imports and decrypted images. An existing one open to others
    is narrowed to 0700, with a warning."""
    d = Path(path)
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(d)
        if stat.S_IMODE(st.st_mode) & 0o077:
            log.warning(
                "server.state_dir was open to other users; made it 0700",
                state_dir=path,
                mode=oct(stat.S_IMODE(st.st_mode)),
            )
            os.chmod(d, 0o700)
    except OSError as e:
        raise StartupError(f"server.state_dir {path}: {e.strerror or e}") from None


def reset_scratch_dir(path: str) -> None:
    """Config.scratch_dir empty and 0700: what a podshim killed mid-dump left there (a CRIU config
    file, a dump's gate) is of no use to anyone once it is gone. Run under the state dir's lock:
    no other podshim's dump uses it."""
    try:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, 0o700, exist_ok=True)
    except OSError as e:
        raise StartupError(f"server.state_dir {path}: {e.strerror or e}") from None


class StartupError(Exception):
    """podshim cannot start (port busy, socket path unusable): a one-line message naming the key."""


class Server:
    def __init__(
        self,
        config: Config,
        engine: Engine | None = None,
        upstream: Upstream | None = None,
        cluster: ClusterApi | None = None,
    ) -> None:
        self.config = config
        self.upstream = upstream or Upstream(config.upstream_endpoint, config.upstream_timeout)
        passthrough = Passthrough(self.upstream)
        self.handlers = RuntimeHandlers(passthrough, engine, config.runtime_name, cluster)
        own = self.handlers.handlers()
        self.grpc = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
            ]
        )
        self.grpc.add_generic_rpc_handlers([CriHandler(passthrough, own, streaming_methods())])
        # With the front (docs/design/proxy.md (The proxy)) the daemon listens on a private
        # socket and the front serves server.socket; without it, the daemon serves server.socket.
        self.front: Front | None = None
        self.listen, self.listen_key = config.socket, "server.socket"
        if config.front:
            try:
                self.listen, self.listen_key = private_socket(config, "daemon.sock"), "server.state_dir"
            except FrontError as e:
                raise StartupError(str(e)) from None
            self.front = Front(config, self.listen, own, unary_methods())
            metrics.read_front(self.front.metrics_text)

    async def start(self) -> None:
        try:
            sockets.remove_stale(self.listen)
            self.grpc.add_insecure_port(f"unix://{self.listen}")
        except (OSError, RuntimeError, sockets.SocketInUse) as e:
            raise StartupError(f"{self.listen_key} {self.listen}: cannot listen: {e}") from None
        await self.grpc.start()
        os.chmod(self.listen, 0o600 if self.front else 0o660)
        if self.front is not None:
            try:
                await self.front.start()
            except (FrontError, OSError) as e:
                await self.grpc.stop(None)
                raise StartupError(str(e)) from None
        log.info(
            "serving",
            socket=self.config.socket,
            upstream=self.config.upstream_endpoint,
            front=self.front.pid if self.front else None,
        )

    async def stop(self, grace: float = 5.0, engine: Engine | None = None, cleanup: float = 0.0) -> None:
        """Graceful stop: podshim's operations in flight get `grace` seconds to finish (new ones
        are refused; passed-through calls, long streams included, are served meanwhile); then the
        server stops taking calls and cancels what is left within a second; then the cancelled
        operations get `cleanup` seconds to undo what they did (engine.stop)."""
        if engine is not None:
            await engine.drain(grace)
            grace = min(grace, PASSTHROUGH_STOP_GRACE)
        if self.front is not None:  # first: the calls it has in flight to the daemon end meanwhile
            await self.front.stop()
        await self.grpc.stop(grace)
        if engine is not None:
            await engine.stop(cleanup)
        await self.upstream.close()
        sockets.remove_unserved(self.listen)  # Front.stop removes server.socket


STATE_LOCK_FILE = "podshim.lock"


def lock_state_dir(path: str) -> int:
    """Hold server.state_dir for this process's life (flock on `podshim.lock`, released by the
    kernel when the process ends, however it ends): a second podshim on the same state dir would
    replay the journal of operations the first one is still running (thawing its frozen pods,
    clearing its archives). The descriptor is not inherited (O_CLOEXEC): a runc or CRIU that
    outlives podshim does not keep the next one out."""
    lock = os.path.join(path, STATE_LOCK_FILE)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise StartupError(f"server.state_dir {path}: cannot open {lock}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StartupError(
            f"server.state_dir {path}: another podshim (pid {holder}) serves from this state dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


async def run(config: Config, engine_factory: Callable[[Config, Upstream], Engine]) -> None:
    """Recover from a previous crash, then serve until SIGTERM/SIGINT."""
    if config.metrics_address:
        try:
            metrics.serve(config.metrics_address)
        except OSError as e:
            raise StartupError(
                f"server.metrics_address {config.metrics_address}: {e.strerror or e}"
            ) from None
    prepare_state_dir(config.state_dir)
    lock_state_dir(config.state_dir)  # held until the process ends
    reset_scratch_dir(config.scratch_dir)  # this podshim's alone now: a killed one's leftovers go
    # before the recovery, which must not run beside another podshim (a front a daemon before this
    # one left running is this daemon's to adopt: its state dir, locked above, records it)
    if sockets.serving(config.socket) and not (config.front and front.left_running(config)):
        raise StartupError(f"server.socket {config.socket}: another process serves this socket")
    upstream = Upstream(config.upstream_endpoint, config.upstream_timeout)
    cni.preload()
    engine = engine_factory(config, upstream)
    await engine.recover()
    await engine.startup()  # the wiring check runs in the background
    # the cluster API (shim/kube/): its watch starts once the node's CRI is served
    cluster = kube_service.from_config(config, engine, upstream)
    server = Server(config, engine, upstream, cluster)
    # before the start: the front answers Version once it is up, before server.start() returns, so
    # a SIGTERM from a caller that saw it must stop both gracefully, not end the daemon alone
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    if cluster is not None:
        cluster.start()
    await stopping.wait()
    # A graceful stop (systemd's KillMode=process signals podshim alone; runc and CRIU go on): no
    # new calls; a checkpoint or restore in flight may finish within STOP_GRACE, else it is
    # cancelled and thaws, clears and rolls back as on a deadline, within STOP_CLEANUP.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: log.warning("already stopping"))
    log.info("stopping", grace=STOP_GRACE)
    if cluster is not None:  # no new PodCheckpoint is taken; the ones in flight may finish
        await cluster.stop_watching()
    await server.stop(STOP_GRACE, engine, STOP_CLEANUP)
    if cluster is not None:
        await cluster.stop()
    log.info("stopped")
