"""The destination node of a live migration: RestorePod with the option `lazy-migration-from=NAME`
(the source node's name in its certificate). It accepts or refuses the source's offer, receives
the archive, restores lazily from the source's page servers, starts the containers only after
`go`, and kills them when the link, the source or a page server is lost before every page arrived
(docs/design/migration.md (Live migration))."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from api.runtime.v1 import api_pb2 as cri
from shim import errors, faults, logs, metrics
from shim.aio import run_to_end, undo_to_end
from shim.archive import compat, layout, paths
from shim.archive.dirfd import DirHandle, clear_dir_contents, open_checked
from shim.checks.wiring import confirm_restored
from shim.config import Config
from shim.criu.lazy import check_runtime
from shim.criu.runtime import binary_version
from shim.deadlines import (
    DEFAULT_DEADLINE,
    MIGRATION_HEARTBEAT,
    MIGRATION_LEASE,
    MIGRATION_STEP,
    RESTORE_CLEANUP_MARGIN,
)
from shim.migration import guard, protocol, wire
from shim.migration.source import credentials, criu_congestion_argv
from shim.ops.restore_checks import container_set_problem
from shim.ops.restore_pod import PodRestorer
from shim.sandbox import build_pod_view
from shim.state import Journal, OpRecord
from shim.state.records import MigrationDestinationRecord
from shim.upstream import Upstream

log = logs.get("shim.migration.destination")

OPTION = "lazy-migration-from"  # RestorePod: the source node's name
KIND = "migration-destination"
LOOPBACK = "127.0.0.1"


class _Refused(Exception):
    """This side ends the migration: `error` for the caller, `reason` for the source."""

    def __init__(self, error: errors.ShimError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class _Session:
    source: str
    migration: str = ""
    channel: wire.Channel | None = None
    listener: wire.Listener | None = None
    peer: str = ""  # the source's address (its page servers')
    rec: Any = None
    sandbox_id: str = ""
    containers: dict[str, str] = field(default_factory=dict)  # name -> id
    images: list[Path] = field(default_factory=list)  # each container's images dir (lazy.page_servers keys)
    guard: subprocess.Popen[bytes] | None = None
    cgroups: list[str] = field(default_factory=list)  # the migrated containers' (what a kill empties)
    sandbox: asyncio.Future[str] | None = None  # RunPodSandbox, made while the source dumps
    sandbox_since: str = ""  # RFC 3339, when it was asked for (found by its metadata if unanswered)
    metadata: dict[str, Any] = field(default_factory=dict)  # the new sandbox's (protobuf JSON)
    go: bool = False  # the containers may run
    heartbeat: asyncio.Task[None] | None = None


class MigrationDestination:
    def __init__(self, config: Config, upstream: Upstream, journal: Journal, restorer: PodRestorer) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = journal
        self.restorer = restorer
        self._following: set[asyncio.Task[None]] = set()

    @property
    def following(self) -> set[asyncio.Task[None]]:
        """The background tasks of migrations whose containers run while their pages arrive."""
        return set(self._following)

    async def restore(self, req: cri.RestorePodRequest, deadline: float | None) -> cri.RestorePodResponse:
        loop = asyncio.get_running_loop()
        caller_end = loop.time() + (deadline if deadline is not None else DEFAULT_DEADLINE)
        source = req.options[OPTION].strip()
        if not source:
            raise errors.InvalidArgument(f"option {OPTION}: the source node's name is empty")
        if not self.config.migration_listen:
            raise errors.FailedPrecondition(
                "this node accepts no migration: set [migration] listen (HOST:PORT) in podshim's config"
            )
        unknown = sorted(set(req.options) - {OPTION, "start", "lazy-pages"})
        if unknown:
            raise errors.InvalidArgument(
                f"option(s) {', '.join(unknown)} cannot be combined with {OPTION} "
                "(a migration restores lazily and starts the containers)"
            )
        ctx = await run_to_end(credentials(self.config).server_context)
        runtime = self.config.runtime_for_handler(req.runtime_handler)
        if runtime is None:
            raise errors.InvalidArgument(
                f"runtime_handler {req.runtime_handler!r} is not configured in podshim"
            )
        out = await run_to_end(paths.validate_output_dir, req.checkpoint_path, self.config.allowed_roots)
        held = open_checked(out, req.checkpoint_path, "checkpoint path", empty=True)
        s = _Session(source, metadata=json_format.MessageToDict(req.config.metadata))
        md = req.config.metadata
        try:
            s.rec = await run_to_end(
                self.journal.begin,
                KIND,
                f"{md.namespace}/{md.name}",
                MigrationDestinationRecord(
                    checkpoint_path=str(out), source=source, sandbox_metadata=s.metadata
                ),
            )
            s.listener = wire.Listener(self.config.migration_listen, ctx)
            log.info("migration: listening", address=self.config.migration_listen, source=source)
            async with asyncio.timeout_at(caller_end - RESTORE_CLEANUP_MARGIN):
                resp = await self._run(s, req, held, runtime.binary, caller_end)
        except BaseException as e:
            error = _as_error(e, s)
            await undo_to_end(self._undo(s, held, error))
            held.close()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise error from None
        held.close()
        task = asyncio.ensure_future(self._follow(s))
        self._following.add(task)
        task.add_done_callback(self._following.discard)
        return resp

    # ------------------------------------------------------------------ until the containers run

    async def _run(
        self, s: _Session, req: cri.RestorePodRequest, held: DirHandle, runtime_binary: str, caller_end: float
    ) -> cri.RestorePodResponse:
        assert s.listener is not None
        loop = asyncio.get_running_loop()
        tls, greeting = await self._accept(s, max(0.1, caller_end - loop.time()))
        if greeting.get("t") != protocol.CONTROL:
            tls.close()
            raise _Refused(
                errors.FailedPrecondition("the source's first connection was not its control channel")
            )
        s.migration = str(greeting.get("migration") or "")
        s.peer = tls.getpeername()[0]
        s.listener.close()  # the one connection is in: nothing listens any more
        s.listener = None
        s.channel = wire.Channel(tls, loop, f"from-{s.source}").start()
        s.heartbeat = asyncio.ensure_future(s.channel.heartbeat(MIGRATION_HEARTBEAT))
        offer = await self._expect(s, {protocol.OFFER})
        offered = [c for c in offer.get("containers", []) if isinstance(c, dict)]
        bad_request = container_set_problem(
            [str(c.get("name")) for c in offered if c.get("checkpointed", True)],
            {str(c.get("name")) for c in offered if not c.get("checkpointed", True)},
            [cc.metadata.name for cc in req.container_configs],
        )
        if bad_request:  # what RestorePod refuses as INVALID_ARGUMENT, refused so before A freezes
            self._send(s, {"t": protocol.REFUSE, "reason": bad_request})
            raise _Refused(errors.InvalidArgument(bad_request))
        problems = await self._precheck(offer, req, runtime_binary)
        if problems:
            reason = protocol.refusal(problems)
            self._send(s, {"t": protocol.REFUSE, "reason": reason})
            raise _Refused(errors.FailedPrecondition(f"the migration from {s.source} was refused: {reason}"))
        self._send(s, {"t": protocol.ACCEPT})
        # the new sandbox is made while the source freezes and dumps: off the downtime's path
        s.sandbox_since = datetime.datetime.now(datetime.UTC).isoformat()
        s.sandbox = asyncio.ensure_future(self._make_sandbox(s, req))
        dumped = [str(c["name"]) for c in offer["containers"] if c.get("checkpointed", True)]
        ports = await self._receive_archive(s, held)
        archive = layout.ArchiveLayout(Path(held.path))
        creds = credentials(self.config)
        for name in dumped:
            port = ports.get(name)
            if not isinstance(port, int) or not 0 < port < 65536:
                raise _Refused(errors.Internal(f"the source named no page server for container {name!r}"))
            images = Path(os.path.realpath(archive.container(name).root)) / layout.CHECKPOINT_DIR
            s.images.append(images)
            # CRIU's TLS: the source's certificate must name the address it is reached at
            self.restorer.lazy.page_servers[images] = [
                "--page-server",
                "--address",
                s.peer,
                "--port",
                str(port),
                "--tls",
                "--tls-cacert",
                creds.ca_file,
                "--tls-cert",
                creds.cert_file,
                "--tls-key",
                creds.key_file,
                *criu_congestion_argv(self.config),
            ]
        plain = cri.RestorePodRequest()
        plain.CopyFrom(req)
        plain.options.clear()
        plain.options["lazy-pages"] = "true"
        resp = await self.restorer.restore(
            plain, caller_end - loop.time(), sandbox_id=await s.sandbox, pages_from_source=True
        )
        s.sandbox_id = resp.pod_sandbox_id
        s.containers = {c.name: c.container_id for c in resp.restored_containers}
        await run_to_end(self.journal.update, s.rec, "created", sandbox_id=s.sandbox_id)
        self._send(s, {"t": protocol.CREATED})
        log.info("migration: containers created", sandbox=s.sandbox_id, migration=s.migration)
        await self._start_guard(s)  # its start-up overlaps the round trip for `go`
        await self._hold(s, "migration.before-ready")
        self._send(s, {"t": protocol.READY})
        await self._expect(s, {protocol.GO})
        s.go = True
        for name, cid in s.containers.items():
            try:
                await self.upstream.start_container(cid, doing=f"starting migrated container {name!r}")
                await confirm_restored(self.upstream, self.config, cid, name)
            finally:
                if self.restorer.restored is not None:
                    self.restorer.restored.discard(cid)
        self._send(s, {"t": protocol.RUNNING})
        log.info(
            "migration: containers running", sandbox=s.sandbox_id, migration=s.migration, source=s.source
        )
        return resp

    async def _accept(self, s: _Session, timeout: float) -> tuple[ssl.SSLSocket, dict[str, Any]]:
        assert s.listener is not None

        def refused(why: str) -> None:
            metrics.migration_refused_peers.inc()
            log.warning("migration listener: peer refused", peer=why)

        try:
            # a thread of its own (not run_to_end): closing the listener ends it at once
            return await asyncio.to_thread(s.listener.accept, s.source, timeout, refused)
        except TimeoutError:
            raise _Refused(
                errors.DeadlineExceeded(f"the source {s.source} did not connect within {timeout:.0f}s")
            ) from None

    async def _precheck(
        self, offer: dict[str, Any], req: cri.RestorePodRequest, runtime_binary: str
    ) -> list[str]:
        """What RestorePod would refuse on this node as FAILED_PRECONDITION (the host, the
        runtime, the images of the offered containers), before the source freezes anything."""
        offered = [c for c in offer.get("containers", []) if isinstance(c, dict)]
        problems: list[str] = []
        rt = self.config.runtime_for_handler(req.runtime_handler)
        criu = self.config.runtime.criu
        versions = await run_to_end(
            lambda: (
                compat.per_binary(binary_version, criu),
                compat.per_binary(binary_version, runtime_binary),
            )
        )
        node = compat.Node.here(versions[0], os.path.basename(runtime_binary), versions[1], criu)
        problems += await run_to_end(compat.host_mismatches, protocol.host_of(offer), node)
        try:
            await run_to_end(check_runtime, rt.binary if rt else runtime_binary, req.runtime_handler)
        except errors.FailedPrecondition as e:
            problems.append(e.message)
        by_name = {cc.metadata.name: cc for cc in req.container_configs}
        for c in offered:
            cc = by_name.get(str(c.get("name")))
            if cc is None or not c.get("checkpointed", True):
                continue
            st = await self.upstream.image_status(cc.image.image)
            present = [st.image.id, *st.image.repo_digests] if st.HasField("image") else None
            problem = compat.image_mismatch(
                cc.metadata.name, cc.image.image, present, str(c.get("image_ref", ""))
            )
            if problem:
                problems.append(problem)
        return problems

    async def _receive_archive(self, s: _Session, held: DirHandle) -> dict[str, Any]:
        """The archive's members into checkpoint_path until `archived` (manifest.json last), which
        names each container's page server port."""
        while True:
            msg = await self._expect(s, {protocol.FILE, protocol.ARCHIVED})
            if msg["t"] == protocol.ARCHIVED:
                pages = msg.get("pages")
                return pages if isinstance(pages, dict) else {}
            rel = paths.check_member_path(str(msg.get("rel", ""))).as_posix()
            size = int(msg.get("size", -1))
            if size < 0:
                raise _Refused(errors.DataLoss(f"archive member {rel}: no size"))
            parent, _, name = rel.rpartition("/")
            fd = await run_to_end(_create, held, parent, name)
            try:
                left = size
                while left:
                    assert s.channel is not None
                    item = await asyncio.wait_for(s.channel.inbox.get(), MIGRATION_STEP)
                    if not isinstance(item, bytes):
                        raise (
                            item
                            if isinstance(item, wire.LinkLost)
                            else _Refused(
                                errors.DataLoss(
                                    f"archive member {rel} ended after {size - left} of {size} bytes"
                                )
                            )
                        )
                    if len(item) > left:
                        raise _Refused(
                            errors.DataLoss(f"archive member {rel} is longer than its {size} bytes")
                        )
                    await run_to_end(_write_all, fd, item)
                    left -= len(item)
            finally:
                os.close(fd)

    async def _make_sandbox(self, s: _Session, req: cri.RestorePodRequest) -> str:
        sid = await self.upstream.run_pod_sandbox(
            cri.RunPodSandboxRequest(config=req.config, runtime_handler=req.runtime_handler),
            doing="creating the new sandbox",
        )
        s.sandbox_id = sid
        await run_to_end(self.journal.update, s.rec, "sandbox", sandbox_id=sid)
        return sid

    async def _start_guard(self, s: _Session) -> None:
        """The watchdog that kills the containers if this podshim dies before the migration is
        complete (guard.py): its stdin is the only end of a pipe podshim holds."""
        pod = await build_pod_view(self.upstream, s.sandbox_id)
        s.cgroups = [c.cgroups_path for c in pod.containers if c.id in s.containers.values()]
        s.guard = subprocess.Popen(
            [sys.executable, "-m", "shim.migration.guard", *s.cgroups],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _release_guard(self, s: _Session) -> None:
        if s.guard is not None and s.guard.stdin is not None:
            with contextlib.suppress(OSError):
                s.guard.stdin.write(b"done\n")
                s.guard.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.guard.wait(timeout=5)

    # ------------------------------------------------------------------ after the containers run

    async def _follow(self, s: _Session) -> None:
        """Until every page is here and the source acknowledged: heartbeats, the lease, the
        daemons' ends. Any failure kills the migrated containers and removes the new pod."""
        daemons = [d for d in self.restorer.lazy.live.values() if d.images in s.images]
        finished = {d.finished for d in daemons}
        reason, label = "", ""
        try:
            while finished:
                done, _ = await asyncio.wait(finished, timeout=MIGRATION_HEARTBEAT)
                for f in done:
                    finished.discard(f)
                    if not f.result():
                        raise _Lost("a lazy-pages daemon ended before every page was delivered", "link")
                self._poll(s)
            await self._hold(s, "migration.before-done")
            self._send(s, {"t": protocol.DONE})
            while True:
                msg = await self._next(s)
                if isinstance(msg, dict) and msg["t"] == protocol.ACK:
                    break
            self._release_guard(s)
            await run_to_end(self.journal.update, s.rec, "acked")
            self.journal.finish(s.rec)
            _stop(s.heartbeat)
            if s.channel is not None:
                s.channel.close()
            metrics.migrations.labels("destination", "OK").inc()
            log.info("migration complete: every page arrived", sandbox=s.sandbox_id, migration=s.migration)
            return
        except _Lost as e:
            reason, label = e.reason, e.label
        except wire.LinkLost as e:
            reason, label = f"the link to the source node was lost ({e.reason})", "link"
        except asyncio.CancelledError:
            reason, label = "podshim stopped", "link"  # its guard kills them too
        except Exception as e:  # noqa: BLE001 - the containers must not run on
            reason, label = f"the migration failed: {e!r}", "link"
        await undo_to_end(self._kill(s, reason, label))  # a stop waits for it (Engine.stop)

    async def _hold(self, s: _Session, failpoint: str) -> None:
        """A failpoint that sleeps (the tests hold the migration there) while the link is watched
        as usual: an abort, the link's end or the lease still end the migration."""
        held = asyncio.ensure_future(faults.hit_async(failpoint))
        try:
            while not held.done():
                await asyncio.wait({held}, timeout=MIGRATION_HEARTBEAT)
                self._poll(s)
            held.result()
        finally:
            held.cancel()

    def _poll(self, s: _Session) -> None:
        """Between waits for the daemons: what the source said (an abort, the link's end; nothing
        else is due now), the lease, a heartbeat."""
        assert s.channel is not None
        while not s.channel.inbox.empty():
            self._seen(s.channel.inbox.get_nowait())
        self._check_link(s)

    @staticmethod
    def _seen(item: dict[str, Any] | bytes | wire.LinkLost | None) -> None:
        if isinstance(item, wire.LinkLost):
            raise item
        if isinstance(item, dict) and item["t"] == protocol.ABORT:
            raise _Lost(f"the source gave up: {item.get('reason', '')}", "abort")

    def _check_link(self, s: _Session) -> None:
        assert s.channel is not None
        if time.monotonic() - s.channel.last_received > MIGRATION_LEASE:
            raise _Lost(
                f"nothing from the source node for {MIGRATION_LEASE:.0f}s (the lease ran out)", "lease"
            )

    async def _next(self, s: _Session) -> dict[str, Any] | bytes | None:
        """The next item from the source within a heartbeat (None: none came), the link checked."""
        assert s.channel is not None
        try:
            item = await asyncio.wait_for(s.channel.inbox.get(), MIGRATION_HEARTBEAT)
        except TimeoutError:
            item = None
        self._seen(item)
        self._check_link(s)
        return item  # type: ignore[return-value]

    async def _kill(self, s: _Session, reason: str, label: str) -> None:
        """The migrated containers must not run on: killed with the reason (podshim's log, their CRI
        log, the metric), the link closed, the new pod removed."""
        full = (
            f"live migration from {s.source} failed after the containers ran: {reason}; the container was "
            "killed so that it never runs with missing memory (the pod runs on at the source)"
        )
        _stop(s.heartbeat)
        # at once, here (the source thaws its copy a lease after its last word): frozen, SIGKILLed,
        # thawed; then the upstream records it and the reason is written
        await run_to_end(guard.kill_cgroups, s.cgroups)
        for name, cid in s.containers.items():
            metrics.migration_kills.labels(label).inc()
            try:
                await self.restorer.lazy.fail(cid, full, "migration")
            except errors.ShimError as e:
                log.error("migration: cannot kill a migrated container", container=name, error=e.message)
        if s.channel is not None:
            s.channel.send({"t": protocol.ABORT, "reason": reason})
            await run_to_end(s.channel.flush_and_close, 1.0)
        self._release_guard(s)
        await self._remove_pod(s)
        metrics.migrations.labels("destination", label.upper()).inc()

    # ------------------------------------------------------------------ undo

    async def _undo(self, s: _Session, held: DirHandle, error: errors.ShimError) -> None:
        """A failure before RestorePod answered: the source hears it (and thaws, or fences first
        if `go` was sent), the new pod and the received archive go."""
        _stop(s.heartbeat)
        if s.channel is not None:
            s.channel.send({"t": protocol.ABORT, "reason": error.message})
            await run_to_end(s.channel.flush_and_close, 1.0)
        if s.listener is not None:
            s.listener.close()
        if s.go:
            await run_to_end(guard.kill_cgroups, s.cgroups)
            for cid in s.containers.values():
                with contextlib.suppress(errors.ShimError):
                    await self.restorer.lazy.fail(
                        cid, f"live migration from {s.source} failed: {error.message}", "migration"
                    )
        self._release_guard(s)
        await self._remove_pod(s)
        with contextlib.suppress(OSError, errors.ShimError):
            await run_to_end(held.clear)
        metrics.migrations.labels("destination", error.code_name).inc()

    async def _remove_pod(self, s: _Session) -> None:
        for images in s.images:
            self.restorer.lazy.page_servers.pop(images, None)
        if s.sandbox is not None:
            s.sandbox.cancel()
            (made,) = await asyncio.gather(s.sandbox, return_exceptions=True)
            if isinstance(made, errors.ShimError):  # beside the failure that ends the migration
                log.warning("migration: making the new sandbox failed", error=made.message)
        if s.sandbox is not None and not s.sandbox_id and s.rec is not None:
            # asked for and never answered: the upstream may have made it; found by its metadata
            try:
                await self.restorer.rollback_unrecorded(s.metadata, since=s.sandbox_since)
            except errors.ShimError as e:
                log.error("migration: looking for an unanswered sandbox failed", error=e.message)
        if s.sandbox_id:
            try:
                await self.restorer.rollback_sandbox(s.sandbox_id)
            except errors.ShimError as e:
                log.error("migration: removing the new pod failed; kept for recovery", error=e.message)
                return
        if s.rec is not None:
            self.journal.finish(s.rec)
            s.rec = None

    # ------------------------------------------------------------------ the channel

    def _send(self, s: _Session, msg: dict[str, Any]) -> None:
        assert s.channel is not None
        s.channel.send(msg)

    async def _expect(self, s: _Session, kinds: set[str]) -> dict[str, Any]:
        """The next message of one of `kinds` within MIGRATION_STEP (heartbeats meanwhile)."""
        end = time.monotonic() + MIGRATION_STEP
        while time.monotonic() < end:
            msg = await self._next(s)
            if msg is None:
                continue
            if isinstance(msg, bytes):
                raise _Refused(errors.Internal("the source sent data where a message was due"))
            if msg["t"] in kinds:
                return msg
            raise _Refused(
                errors.Internal(f"the source sent {msg['t']!r} where {'/'.join(sorted(kinds))} was due")
            )
        raise _Refused(errors.DeadlineExceeded(f"the source said nothing useful for {MIGRATION_STEP:.0f}s"))


def _stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()


class _Lost(Exception):
    def __init__(self, reason: str, label: str) -> None:
        super().__init__(reason)
        self.reason, self.label = reason, label


def _as_error(e: BaseException, s: _Session) -> errors.ShimError:
    if isinstance(e, _Refused):
        return e.error
    if isinstance(e, _Lost):
        return errors.Aborted(f"the migration from {s.source} ended: {e.reason}")
    if isinstance(e, wire.LinkLost):
        return errors.Unavailable(
            f"the link to the source {s.source} was lost ({e.reason}); nothing runs here"
        )
    if isinstance(e, TimeoutError):
        return errors.DeadlineExceeded(
            f"the migration from {s.source} did not finish within the caller's deadline"
        )
    if isinstance(e, errors.ShimError):
        return e
    if isinstance(e, asyncio.CancelledError):
        return errors.Aborted("the migration was cancelled")
    return errors.Internal(f"the migration from {s.source} failed: {e!r}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _create(held: DirHandle, parent: str, name: str) -> int:
    if not parent:
        return held.create(name)
    with held.sub(parent, create=True) as d:
        return d.create(name)


# ---------------------------------------------------------------------- recovery


async def recover(rec: OpRecord, restorer: PodRestorer) -> None:
    """A migration into this node that a crash interrupted before the source acknowledged: the
    source thaws its copy after the lease, so the new pod (and its containers) is removed and the
    received archive cleared."""
    data: MigrationDestinationRecord = rec.data
    if data.sandbox_id:
        await restorer.rollback_sandbox(data.sandbox_id)
    elif data.sandbox_metadata:
        await restorer.rollback_unrecorded(data.sandbox_metadata, since=rec.started)
    if data.checkpoint_path:
        with contextlib.suppress(OSError, errors.NotFound):
            await run_to_end(clear_dir_contents, Path(data.checkpoint_path))
    log.warning(
        "migration into this node recovered: the new pod was removed", source=data.source, phase=rec.phase
    )
