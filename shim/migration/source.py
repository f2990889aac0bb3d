"""The source node of a live migration: CheckpointPod with the option `lazy-migration=HOST:PORT`
(the destination's migration listener). It offers the pod, freezes it, dumps it without its pages
(served from CRIU's page servers), sends the archive, grants `go`, and kills its pod once every
page arrived; until `go` a failure thaws the pod, after it the pod is thawed only once the
destination's lease has run out (docs/design/migration.md (Live migration))."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from shim import __version__, errors, faults, logs, metrics
from shim.aio import run_to_end, undo_to_end
from shim.archive import compat, layout, manifest
from shim.cgroups import PodCut, thaw_paths
from shim.config import Config
from shim.criu.lazy import wait_status
from shim.criu.log import criu_error_lines
from shim.criu.options import criu_path_env
from shim.criu.runtime import binary_version
from shim.deadlines import (
    CHECK_MARGIN,
    CLEANUP_MARGIN,
    DEFAULT_DEADLINE,
    FREEZE_TIMEOUT,
    LAZY_READY_TIMEOUT,
    MIGRATION_CONNECT,
    MIGRATION_FENCE_MARGIN,
    MIGRATION_HEARTBEAT,
    MIGRATION_LEASE,
    MIGRATION_STEP,
)
from shim.migration import protocol, wire
from shim.migration.credentials import NodeCredentials
from shim.migration.lazy_dumps import (
    WORK_DIR,
    LazyDump,
    copy_logs,
    end_dumps,
    freeze_again,
    kill_frozen,
    wait_dumps,
)
from shim.ops.checkpoint_pod import CheckpointOptions, PodCheckpointer, recorded_containers
from shim.sandbox import PodView
from shim.state import Journal
from shim.state.records import MigrationSourceRecord
from shim.upstream import Upstream, is_not_found

log = logs.get("shim.migration.source")

OPTION = "lazy-migration"  # CheckpointPod: the destination's HOST:PORT
KIND = "migration-source"
FILE_READ = 1 << 20


class MigrationFailed(Exception):
    """The migration cannot go on: `error` is what the caller gets."""

    def __init__(self, error: errors.ShimError) -> None:
        super().__init__(error.message)
        self.error = error


def credentials(config: Config) -> NodeCredentials:
    """This node's migration credentials (FAILED_PRECONDITION naming the keys when unset)."""
    files = (config.migration_cert_file, config.migration_key_file, config.migration_ca_file)
    if not all(files):
        raise errors.FailedPrecondition(
            "live migration needs this node's credentials: set [migration] cert_file, key_file and ca_file"
        )
    return NodeCredentials(*files)


def criu_congestion_argv(config: Config) -> list[str]:
    """The lazy-pages daemon's option for the pages' TCP congestion control (CRIU patch 0010;
    the dump's is the same in its config file), none for the host's default
    (docs/design/migration.md (Live migration))."""
    name = config.migration_tcp_congestion
    return ["--tcp-congestion", name] if name else []


class _Archiver(PodCheckpointer):
    """CheckpointPod's steps, the archive never encrypted: the node key stays on this node, and the
    link to the destination is encrypted already."""

    def node_key(self) -> None:
        return None


@dataclass
class _Session:
    migration: str
    destination: str
    pod: PodView
    channel: wire.Channel | None = None
    dumps: list[LazyDump] = field(default_factory=list)
    cut: PodCut | None = None
    rec: Any = None
    handed_over: bool = False  # `go` sent: the destination may run
    timings: dict[str, float] = field(default_factory=dict)
    address: str = ""  # this node's address as the destination reaches it (the page servers')
    peer: str = ""  # the destination's address, as connected
    heartbeat: asyncio.Task[None] | None = None


class MigrationSource:
    def __init__(self, config: Config, upstream: Upstream, journal: Journal) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = journal
        self.archiver = _Archiver(config, upstream, journal)
        self.creds: NodeCredentials | None = None

    async def checkpoint(self, req: cri.CheckpointPodRequest, deadline: float | None) -> manifest.Manifest:
        """Migrate the pod; returns once the destination has every page and this pod is stopped and
        its containers removed. `deadline`: the caller's remaining seconds (None: DEFAULT_DEADLINE),
        for the whole migration."""
        loop = asyncio.get_running_loop()
        caller_end = loop.time() + (deadline if deadline is not None else DEFAULT_DEADLINE)
        destination = req.options[OPTION].strip()
        wire.split_address(destination)  # INVALID_ARGUMENT before anything else
        plain = cri.CheckpointPodRequest()
        plain.CopyFrom(req)
        del plain.options[OPTION]
        self.creds = credentials(self.config)
        ctx = await run_to_end(self.creds.client_context)
        try:
            async with asyncio.timeout_at(caller_end - CHECK_MARGIN):
                # a migration carries no volumes (docs/limits.md): the /dev/shm check stays
                opts, out, pod, selected, held, _ = await self.archiver._check(plain, carry_volumes=False)
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"the caller's deadline passed while checking the migration of pod {req.pod_sandbox_id}; "
                "nothing was frozen"
            ) from None
        s = _Session(secrets.token_hex(8), destination, pod)
        archive = layout.ArchiveLayout(out, held)
        # the transfer and the fence must fit the caller's deadline: after `go` a failure costs the
        # lease and its margin before the thaw
        end = caller_end - CLEANUP_MARGIN - MIGRATION_LEASE - MIGRATION_FENCE_MARGIN
        try:
            async with asyncio.timeout_at(end):
                return await self._run(s, ctx, opts, archive, selected)
        except BaseException as e:
            # to its end, even when the caller is cancelled meanwhile: the thaw (or the fence) is not
            # cut short, and the pod's lock is held until the pod runs here again
            error = _as_error(e, s)
            await undo_to_end(self._fail(s, archive, error))
            if isinstance(e, asyncio.CancelledError):
                raise
            raise error from None
        finally:
            held.close()

    # ------------------------------------------------------------------ the steps

    async def _run(
        self,
        s: _Session,
        ctx: ssl.SSLContext,
        opts: CheckpointOptions,
        archive: layout.ArchiveLayout,
        selected: list[Any],
    ) -> manifest.Manifest:
        assert archive.dir is not None  # output_path held open (checkpoint)
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        s.channel = await self._connect(s, ctx, loop)
        host = await run_to_end(self._host_info)  # also loads pycriu: not inside the freeze
        containers = [
            {
                "name": c.name,
                "image": c.image,
                "image_ref": c.status.image_ref,
                "checkpointed": c in selected,
            }
            for c in recorded_containers(s.pod, selected)
        ]
        md = s.pod.status.metadata
        pod = {"name": md.name, "namespace": md.namespace, "uid": md.uid}
        self._send(s, protocol.offer(s.migration, pod, containers, host))
        reply = await self._expect(s, {protocol.ACCEPT, protocol.REFUSE}, MIGRATION_STEP)
        if reply["t"] == protocol.REFUSE:
            raise MigrationFailed(
                errors.FailedPrecondition(
                    f"the destination {s.destination} refused the migration of pod {md.namespace}/{md.name}: "
                    f"{reply.get('reason', '')}; nothing was frozen"
                )
            )
        s.timings["negotiate"] = time.monotonic() - started
        work_root = Path(self.config.state_dir) / WORK_DIR / s.migration
        paused = set(await run_to_end(_self_frozen, [c.cgroups_path for c in selected]))
        ours = [c.cgroups_path for c in selected if c.cgroups_path not in paused]
        s.rec = await run_to_end(
            self.journal.begin,
            KIND,
            s.pod.id,
            MigrationSourceRecord(
                output_path=str(archive.root),
                cgroups=[s.pod.cgroup_parent, *ours],
                work_dir=str(work_root),
                destination=s.destination,
                container_ids=[c.id for c in selected],
            ),
        )
        work = await run_to_end(self.archiver._prepare, s.pod, selected, archive)
        s.dumps = [LazyDump(w, work_root / w.view.name) for w in work]
        await run_to_end(_make_dirs, [d.work_dir for d in s.dumps])
        s.cut = PodCut(s.pod.cgroup_parent, [w.view.cgroups_path for w in work], timeout=FREEZE_TIMEOUT)
        await run_to_end(self.journal.update, s.rec, "frozen")
        await run_to_end(s.cut.freeze)
        freeze_start = time.monotonic()
        await faults.hit_async("migration.after-freeze")
        log.info("migration: pod frozen", pod=s.pod.id, migration=s.migration, destination=s.destination)
        order = sorted(s.dumps, key=lambda d: d.work.memory, reverse=True)
        dumps = [asyncio.ensure_future(self._dump(s, d, opts)) for d in order]
        diffs = [asyncio.ensure_future(self.archiver._diff(w, opts)) for w in work]
        try:
            await asyncio.gather(*dumps, *diffs)
        except BaseException:
            for t in dumps + diffs:
                t.cancel()
            await asyncio.gather(*dumps, *diffs, return_exceptions=True)
            raise
        s.timings["dump"] = time.monotonic() - freeze_start
        # CRIU thaws a cgroup it found frozen once it holds the tasks by ptrace, and freezes it
        # again only when it ends: while it serves the pages the pod is held by CRIU alone, and a
        # CRIU that dies (killed at a failure, a crash) would let it run beside the destination's
        # copy. Frozen again here, the pod stays frozen whatever becomes of the dumps.
        await run_to_end(freeze_again, s.cut)
        archive.dir.check_in_place("output path", "the migration")
        stop = threading.Event()
        m = await run_to_end(
            self.archiver._finish_archive,
            s.pod,
            work,
            archive,
            opts,
            cri.POST_CHECKPOINT_STATE_STOPPED,
            s.timings,
            stop,
            {manifest.PAGES_OPTION: manifest.PAGES_SERVED_BY_SOURCE},
            stop=stop,
        )
        s.timings["archive"] = time.monotonic() - freeze_start - s.timings["dump"]
        await faults.hit_async("migration.before-transfer")
        await run_to_end(self._send_archive, s, archive, m, stop, stop=stop)
        self._send(s, {"t": protocol.ARCHIVED, "pages": {d.name: d.port for d in s.dumps}})
        await run_to_end(self.journal.update, s.rec, "served")
        s.timings["metadata_sent"] = time.monotonic() - freeze_start
        log.info(
            "migration: archive sent, pages served",
            pod=s.pod.id,
            migration=s.migration,
            seconds=round(s.timings["metadata_sent"], 4),
        )
        return await self._serve(s, archive, m, freeze_start)

    async def _connect(
        self, s: _Session, ctx: ssl.SSLContext, loop: asyncio.AbstractEventLoop
    ) -> wire.Channel:
        """The control channel; the destination's listener may open a moment after this call
        (both calls are made at once): connection refused is retried for MIGRATION_CONNECT."""
        greeting = {"t": protocol.CONTROL, "migration": s.migration}
        end = time.monotonic() + MIGRATION_CONNECT
        while True:
            try:
                tls = await run_to_end(wire.connect, s.destination, ctx, greeting, MIGRATION_STEP)
                break
            except ConnectionRefusedError:
                if time.monotonic() > end:
                    raise MigrationFailed(
                        errors.Unavailable(
                            f"the destination {s.destination} did not listen for the migration within "
                            f"{MIGRATION_CONNECT:.0f}s (is RestorePod with lazy-migration-from running?); "
                            "nothing was frozen"
                        )
                    ) from None
                await asyncio.sleep(0.2)
            except (OSError, ssl.SSLError) as e:
                raise MigrationFailed(
                    errors.Unavailable(
                        f"cannot reach the destination {s.destination}: {e}; nothing was frozen"
                    )
                ) from None
        s.address, s.peer = tls.getsockname()[0], tls.getpeername()[0]
        ch = wire.Channel(tls, loop, f"to-{s.destination}").start()
        s.heartbeat = asyncio.ensure_future(ch.heartbeat(MIGRATION_HEARTBEAT))
        return ch

    def _host_info(self) -> manifest.HostInfo:
        with contextlib.suppress(ImportError):  # the archive's stats read it: 0.3 s, not in the freeze
            import pycriu  # noqa: F401
        rt = self.config.runtime
        return manifest.HostInfo(
            podshim_version=__version__,
            criu_version=binary_version(rt.criu),
            runtime_name=os.path.basename(rt.binary),
            runtime_version=binary_version(rt.binary),
            cgroup_version=compat.cgroup_version(),
            cpuinfo=compat.cpuinfo(rt.criu),
        )

    async def _dump(self, s: _Session, d: LazyDump, opts: CheckpointOptions) -> None:
        """Start the container's lazy dump and wait until its page server listens (the images but
        the pages are then complete)."""
        w = d.work
        assert self.creds is not None
        with socket.socket() as probe:  # a free port; CRIU binds it right after
            probe.bind((s.address, 0))
            d.port = probe.getsockname()[1]
        conf = d.work_dir / "criu.conf"
        # on the address the destination reaches this node at (CRIU's RPC takes the port, not the
        # address), with CRIU's TLS and the node's credentials: a client certificate of the CA is
        # required (whose name CRIU would compare with its own address: not checked; podshim checks
        # the connection's peer is the destination, _check_page_peers)
        lines = [
            *opts.criu.dump_config_lines(),
            f"address {s.address}",
            "tls",
            f"tls-cacert {self.creds.ca_file}",
            f"tls-cert {self.creds.cert_file}",
            f"tls-key {self.creds.key_file}",
            "tls-no-cn-verify",
        ]
        if self.config.migration_tcp_congestion:  # the pages' congestion control (CRIU patch 0010)
            lines.append(f"tcp-congestion {self.config.migration_tcp_congestion}")
        await run_to_end(conf.write_text, "\n".join(lines) + "\n")
        argv = w.runtime.checkpoint_argv(w.view.id, Path(w.images.proc), d.work_dir, opts.criu, True)
        read_end, write_end = os.pipe()
        argv = [
            *argv[:-1],
            "--lazy-pages",
            "--page-server",
            f"{_host_port(s.address, d.port)}",
            "--status-fd",
            str(write_end),
            argv[-1],
        ]
        started = time.monotonic()
        try:
            with open(d.work_dir / "runc.log", "wb") as out:
                d.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # so that end() kills runc and the CRIU it started
                    # the configured CRIU first on runc's PATH: runc >= 1.2 takes it from there
                    env={**os.environ, **criu_path_env(w.runtime.criu), "CRIU_CONFIG_FILE": str(conf)},
                    pass_fds=(w.images.fd, write_end),
                )
        finally:
            os.close(write_end)
        ready = await wait_status(read_end, LAZY_READY_TIMEOUT)
        if ready != b"\0":
            detail = "; ".join(criu_error_lines(d.work_dir / "dump.log")) or _tail(d.work_dir / "runc.log")
            raise MigrationFailed(
                errors.Internal(
                    f"the lazy dump of container {d.name!r} failed: {detail} (log: {d.work_dir}/dump.log)"
                )
            )
        w.dump_seconds = time.monotonic() - started
        d.serving = True
        log.info("container dumped without its pages", container=d.name, seconds=round(w.dump_seconds, 4))

    def _send_archive(
        self, s: _Session, archive: layout.ArchiveLayout, m: manifest.Manifest, stop: threading.Event
    ) -> None:
        """Every member of the archive, manifest.json last (in a worker thread: it blocks while
        the channel's buffer is full)."""
        assert s.channel is not None and archive.dir is not None
        names = sorted(m.files) + [layout.MANIFEST_FILE]
        for rel in names:
            if stop.is_set():
                return
            fd = archive.dir.open_read(rel)
            try:
                size = os.fstat(fd).st_size
                s.channel.send({"t": protocol.FILE, "rel": rel, "size": size})
                left = size
                while left:
                    chunk = os.read(fd, min(FILE_READ, left))
                    if not chunk:
                        raise errors.Internal(f"{rel} shrank while it was sent")
                    s.channel.send_bytes_waiting(chunk, MIGRATION_STEP)
                    left -= len(chunk)
            finally:
                os.close(fd)

    async def _serve(
        self, s: _Session, archive: layout.ArchiveLayout, m: manifest.Manifest, freeze_start: float
    ) -> manifest.Manifest:
        """Until `done` (or a failure): heartbeats, and `go` when the destination asks."""
        while True:
            msg = await self._expect(
                s, {protocol.CREATED, protocol.READY, protocol.RUNNING, protocol.DONE}, None
            )
            kind = msg["t"]
            if kind == protocol.CREATED:
                log.info("migration: destination created the pod", pod=s.pod.id, migration=s.migration)
            elif kind == protocol.READY:
                # journaled before it is sent: from here on a restart never thaws without the fence
                await run_to_end(self.journal.update, s.rec, "handed-over")
                await faults.hit_async("migration.before-go")
                s.handed_over = True
                self._send(s, {"t": protocol.GO})
                s.timings["go"] = time.monotonic() - freeze_start
                log.info("migration: destination may run", pod=s.pod.id, migration=s.migration)
            elif kind == protocol.RUNNING:
                s.timings["destination_running"] = time.monotonic() - freeze_start
                await run_to_end(_check_page_peers, s)
            else:
                return await self._commit(s, archive, m, freeze_start)

    async def _commit(
        self, s: _Session, archive: layout.ArchiveLayout, m: manifest.Manifest, freeze_start: float
    ) -> manifest.Manifest:
        """The destination has every page: this pod's processes are killed while frozen, its
        containers stopped and removed, then `ack`."""
        assert s.cut is not None and s.channel is not None
        await run_to_end(self.journal.update, s.rec, "committed")
        s.timings["pages"] = time.monotonic() - freeze_start
        await faults.hit_async("migration.committed")
        # the dumps end by themselves once their connections closed (the daemons are done)
        await run_to_end(wait_dumps, s.dumps, MIGRATION_STEP)
        s.timings["dumps_ended"] = time.monotonic() - freeze_start
        await run_to_end(kill_frozen, [d.work.view.cgroups_path for d in s.dumps])
        s.cut.thaw_all()  # the SIGKILLs land (a frozen task dies once thawed)
        self._send(s, {"t": protocol.ACK})
        _stop(s.heartbeat)
        await run_to_end(s.channel.flush_and_close, MIGRATION_STEP)
        s.timings["acked"] = time.monotonic() - freeze_start
        await _remove_containers(self.upstream, s.pod, [d.work.view.id for d in s.dumps])
        s.timings["removed"] = time.monotonic() - freeze_start
        m.timings.update({k: round(v, 6) for k, v in s.timings.items()})
        m.timings["total"] = time.monotonic() - freeze_start
        await run_to_end(copy_logs, s.dumps, archive)
        await run_to_end(shutil.rmtree, Path(self.config.state_dir) / WORK_DIR / s.migration, True)
        self.journal.finish(s.rec)
        metrics.migrations.labels("source", "OK").inc()
        log.info(
            "migration complete",
            pod=s.pod.id,
            migration=s.migration,
            destination=s.destination,
            **{k: round(v, 4) for k, v in s.timings.items()},
        )
        return m

    # ------------------------------------------------------------------ failure

    async def _fail(self, s: _Session, archive: layout.ArchiveLayout, error: errors.ShimError) -> None:
        """Undo: tell the destination, end the dumps (their page servers), wait the destination's lease
        when it may have run (`go` was sent), thaw, clear the partial archive, close the record."""
        assert archive.dir is not None  # output_path held open (checkpoint)
        metrics.migrations.labels("source", error.code_name).inc()
        _stop(s.heartbeat)
        if s.channel is not None:
            s.channel.send({"t": protocol.ABORT, "reason": error.message})
            await run_to_end(s.channel.flush_and_close, 1.0)
        await run_to_end(end_dumps, s.dumps)
        if s.handed_over:
            # the destination kills its copy when it hears nothing for MIGRATION_LEASE: counted
            # from now, when nothing is sent any more (the channel is closed)
            wait = MIGRATION_LEASE + MIGRATION_FENCE_MARGIN
            log.warning(
                "migration failed after the destination may have run: waiting for its lease before the thaw",
                pod=s.pod.id,
                migration=s.migration,
                seconds=round(max(wait, 0.0), 3),
                error=error.message,
            )
            if wait > 0:
                await asyncio.sleep(wait)
        if s.cut is not None:
            s.cut.thaw_all()
            await run_to_end(thaw_paths, [s.cut.parent, *s.cut.frozen])
        if s.rec is not None:
            with contextlib.suppress(OSError, errors.ShimError):
                await run_to_end(archive.dir.clear)
            await run_to_end(shutil.rmtree, Path(self.config.state_dir) / WORK_DIR / s.migration, True)
            self.journal.finish(s.rec)
        log.error(
            "migration failed; the pod runs on here", pod=s.pod.id, migration=s.migration, error=error.message
        )

    # ------------------------------------------------------------------ the channel

    def _send(self, s: _Session, msg: dict[str, Any]) -> None:
        assert s.channel is not None
        s.channel.send(msg)

    async def _expect(self, s: _Session, kinds: set[str], timeout: float | None) -> dict[str, Any]:
        """The next message of one of `kinds`, sending heartbeats meanwhile; the link's end, an
        `abort`, silence for MIGRATION_LEASE or `timeout` raise."""
        ch = s.channel
        assert ch is not None
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = await asyncio.wait_for(ch.inbox.get(), MIGRATION_HEARTBEAT)
            except TimeoutError:
                item = None
            if isinstance(item, wire.LinkLost):
                raise item
            if isinstance(item, dict):
                if item["t"] == protocol.ABORT:
                    raise MigrationFailed(
                        errors.Aborted(f"the destination {s.destination} gave up: {item.get('reason', '')}")
                    )
                if item["t"] in kinds:
                    return item
                raise MigrationFailed(
                    errors.Internal(
                        f"the destination sent {item['t']!r} where {'/'.join(sorted(kinds))} was due"
                    )
                )
            if isinstance(item, bytes):
                raise MigrationFailed(errors.Internal("the destination sent data where a message was due"))
            now = time.monotonic()
            if now - ch.last_received > MIGRATION_LEASE:
                raise wire.LinkLost(f"nothing from the destination for {MIGRATION_LEASE:.0f}s")
            if not s.handed_over and any(d.proc is not None and d.proc.poll() is not None for d in s.dumps):
                raise MigrationFailed(errors.Internal("a lazy dump ended before the destination ran"))
            if end is not None and now > end:
                raise MigrationFailed(
                    errors.DeadlineExceeded(f"the destination did not answer within {timeout:.0f}s")
                )


def _stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()


def _as_error(e: BaseException, s: _Session) -> errors.ShimError:
    after = "; the destination may have run: the pod was thawed after its lease" if s.handed_over else ""
    if isinstance(e, MigrationFailed):
        return e.error
    if isinstance(e, wire.LinkLost):
        return errors.Unavailable(f"the link to the destination {s.destination} was lost ({e.reason}){after}")
    if isinstance(e, TimeoutError):
        return errors.DeadlineExceeded(
            f"the migration of pod {s.pod.name} to {s.destination} did not end within the caller's deadline; "
            f"the pod runs on here{after}"
        )
    if isinstance(e, errors.ShimError):
        return e
    if isinstance(e, asyncio.CancelledError):
        return errors.Aborted(f"the migration of pod {s.pod.name} was cancelled; the pod runs on here{after}")
    return errors.Internal(f"the migration of pod {s.pod.name} failed: {e!r}")


# ---------------------------------------------------------------------- helpers (threads)


def _self_frozen(cgroups: list[str]) -> list[str]:
    from shim.ops.checkpoint_pod import self_frozen

    return self_frozen(cgroups)


def _make_dirs(dirs: list[Path]) -> None:
    for d in dirs:
        d.mkdir(mode=0o700, parents=True, exist_ok=False)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()[-400:]
    except OSError:
        return ""


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_page_peers(s: _Session) -> None:
    """Each page server accepts one connection, from any certificate of the CA: it must come from
    the destination's address (else the migration stops before this node ever commits)."""
    for d in s.dumps:
        peers = _established_peers(d.port)
        if any(ip != s.peer for ip in peers):
            raise MigrationFailed(
                errors.Internal(
                    f"the page server of container {d.name!r} served {', '.join(peers)}, not the destination "
                    f"{s.peer}: the migration was stopped"
                )
            )


def _established_peers(port: int) -> list[str]:
    """The remote addresses of the established TCP connections (IPv4) whose local port is `port`, in
    this network namespace (/proc/net/tcp)."""
    out = []
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                local, remote, st = fields[1], fields[2], fields[3]
                if st == "01" and int(local.split(":")[1], 16) == port:
                    raw = bytes.fromhex(remote.split(":")[0])
                    out.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
    except OSError:
        pass
    return out


async def _remove_containers(upstream: Upstream, pod: PodView, ids: list[str]) -> None:
    """The migrated pod's containers stopped (their processes are dead) and removed, its sandbox
    stopped: what is left for the kubelet is a NOT_READY sandbox it removes like any other."""
    for cid in ids:
        for call in (upstream.stop_container, upstream.remove_container):
            try:
                await call(cid)
            except errors.ShimError as e:
                if not is_not_found(e):
                    log.warning(
                        "migration: removing a migrated container failed", container=cid, error=e.message
                    )
    try:
        await upstream.stop_pod_sandbox(pod.id)
    except errors.ShimError as e:
        log.warning("migration: stopping the migrated pod's sandbox failed", pod=pod.id, error=e.message)
