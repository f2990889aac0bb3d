"""RestorePod (KEP-5823): a new, fully managed pod from a checkpoint (docs/design/restore-pod.md
(RestorePod)).

Validate the archive and the request before touching anything (shim/ops/restore_checks.py); then
RunPodSandbox and one CreateContainer per checkpointed container (in checkpoint order) through the
upstream, each carrying RESTORE_ANNOTATION. The process state comes back at StartContainer, through
podshim-runc. Any failure removes the sandbox (and its containers) this call created.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from datetime import datetime
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from api.runtime.v1 import api_pb2 as cri
from shim import cni, contract, errors, faults, logs
from shim.aio import Steps, run_to_end, undo_to_end, wait_out
from shim.archive import crypto, layout, manifest, rootfs_diff
from shim.checks.wiring import RestoredContainers, WiringChecker, confirm_restored
from shim.config import Config
from shim.contract import RESTORE_ANNOTATION, RESTORE_OPTIONS_ANNOTATION
from shim.criu.lazy import PageCheck, page_images
from shim.deadlines import (
    CHECK_MARGIN,
    DEFAULT_DEADLINE,
    RESTORE_CLEANUP_MARGIN,
    SANDBOX_SETTLE,
    STALE_DECRYPTED_SECONDS,
)
from shim.ops import pod_volumes
from shim.ops.lazy_pages import Daemon, LazyPages
from shim.ops.restore_broker import PageChecks
from shim.ops.restore_checks import Checked, Phases, Planned, RestoreChecks
from shim.sandbox import build_pod_view
from shim.state import Journal, OpRecord
from shim.state.records import RestoreRecord
from shim.upstream import Upstream, is_not_found

log = logs.get("shim.ops.restore_pod")

# The kubelet's record of a container's restart count: what it reads back (pod status, `kubectl get
# pods`), and count + 1 is the attempt of the container it creates next.
RESTART_COUNT_ANNOTATION = "io.kubernetes.container.restartCount"


# RunPodSandbox errors after which the upstream may still have created the sandbox
_NO_ANSWER = frozenset({"CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "UNKNOWN"})


def _epoch(rfc3339: str) -> float:
    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def settle_deadline(rec: OpRecord) -> float:
    """Until when (epoch seconds) a restore record without a sandbox id may still see its
    sandbox appear (see rollback_unrecorded)."""
    since = rec.data.sandbox_unknown_since
    start = since if since is not None else _epoch(rec.updated)
    return start + SANDBOX_SETTLE


def unknown_handler(details: str, handler: str) -> errors.InvalidArgument | None:
    """containerd's answer to RunPodSandbox with a handler it lacks ("no runtime for "ghost" is
    configured", code UNKNOWN) as the INVALID_ARGUMENT it is; None for any other error."""
    if handler and "no runtime for" in details:
        return errors.InvalidArgument(
            f"runtime_handler {handler!r} is configured in podshim but not in the upstream "
            f"({details}): add it to the upstream's config, or restore with another runtime_handler"
        )
    return None


def deferred_pages(m: manifest.Manifest, container_rel: str) -> dict[str, str]:
    """The page images of one container whose sha256 podshim-runc checks while CRIU restores (an
    eager restore of a plain archive, docs/design/restore-pod.md (RestorePod) step 4), by their path
    relative to the container's dir. Only names CRIU gives them (PAGE_IMAGE_RE): any other member,
    whatever its name, is verified before a container exists."""
    prefix = container_rel + "/"
    rels = (r[len(prefix) :] for r in page_images(m, container_rel))
    return {r: m.files[prefix + r].sha256 for r in rels if re.fullmatch(contract.PAGE_IMAGE_RE, r)}


def check_rootfs_diffs(plan: list[Planned], stop: threading.Event | None = None) -> None:
    """Refuse a rootfs diff podshim-runc would refuse, before any sandbox exists (`stop`: the
    caller was cancelled, see rootfs_diff.check_rootfs_diff)."""
    for p in plan:
        cl = layout.ContainerLayout(root=p.dir, rel="")
        if not cl.rootfs_diff_tar.exists():
            continue
        try:
            rootfs_diff.check_rootfs_diff(
                cl.rootfs_diff_tar, rootfs_diff.read_deleted_files(cl.deleted_files), stop
            )
        except errors.ShimError as e:
            raise type(e)(f"container {p.entry.name!r}: {e.message}") from None


@dataclass
class _Run:
    """One RestorePod under way, after its checks (docs/design/restore-pod.md (RestorePod) step 5).

    `undo` holds the undo of every step taken, each registered right after the step it undoes
    (containerd's sandbox_run.go defers one after each step the same way): it runs, last in
    first out, only when the restore fails, in a task of its own. `ends` holds what ends with
    the restore either way (the verification running beside the sandbox is stopped and awaited,
    before any undo runs). `steps` is the stop signal of the restore's threads."""

    rec: Any  # the journal record
    phases: Phases
    undo: contextlib.AsyncExitStack = dc_field(default_factory=contextlib.AsyncExitStack)
    ends: contextlib.AsyncExitStack = dc_field(default_factory=contextlib.AsyncExitStack)
    # the decrypted dirs' undos, run as one undo registered before the sandbox's: the plaintext is
    # removed once the sandbox (and any lazy-pages daemon reading it) is gone
    plaintext: contextlib.AsyncExitStack = dc_field(default_factory=contextlib.AsyncExitStack)
    steps: Steps = dc_field(default_factory=Steps)
    sandbox_id: str = ""
    created: dict[str, str] = dc_field(default_factory=dict)  # container name -> id (the answer)
    filled: list[pod_volumes.Filled] = dc_field(default_factory=list)  # the pod's volumes it filled


async def _stop_and_wait(task: asyncio.Future[Any], steps: Steps) -> None:
    """End a step running beside the restore: its threads stop at their next chunk (steps.cancel)
    and it is awaited to its end, even when the caller is cancelled meanwhile (run_to_end's
    rule), so nothing it does outlives the restore. Its own error is secondary."""
    if not task.done():
        steps.cancel.set()
        task.cancel()
    await wait_out(task)  # the restore's own error, or its cancellation, is the one reported
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: no "never retrieved" warning


class PodRestorer:
    def __init__(
        self,
        config: Config,
        upstream: Upstream,
        journal: Journal,
        wiring: WiringChecker | None = None,
        restored: RestoredContainers | None = None,
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.journal = journal
        # called with the journal record of a rollback that failed (Engine retries it)
        self.on_kept: Callable[[Any], None] | None = None
        self.checks = RestoreChecks(config, upstream, wiring)  # before anything is created
        # docs/design/runtime-wrapper.md (Wiring check): what StartContainer confirms was restored
        self.restored = restored
        self._decrypting: set[Path] = set()  # decrypted dirs of restores in flight
        self.lazy = LazyPages(config, upstream, journal)  # docs/design/restore-pod.md (Lazy restore)
        # page images hashed from here on, taken by podshim-runc's restore (docs/design/runtime-wrapper.md
        # (The runtime wrapper))
        self.page_checks = PageChecks()

    async def restore(
        self,
        req: cri.RestorePodRequest,
        deadline: float | None,
        sandbox_id: str = "",
        pages_from_source: bool = False,
    ) -> cri.RestorePodResponse:
        """Run RestorePod; `deadline` is the caller's remaining seconds (None: none set), counted
        from here: verifying the archive is bounded by it too. `sandbox_id`: a sandbox the caller
        made with the request's config (a migration, before the archive arrived, docs/design/migration.md
        (Live migration)): used instead of a new one, and removed like one on a failure.
        `pages_from_source`: the migration's destination restores an archive whose pages the
        source serves; any other RestorePod of such an archive is refused."""
        loop = asyncio.get_running_loop()
        caller_end = loop.time() + (deadline if deadline is not None else DEFAULT_DEADLINE)
        try:
            async with asyncio.timeout_at(caller_end - CHECK_MARGIN):
                checked = await self.checks.check(req, pages_from_source)
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"the caller's deadline passed while verifying {req.checkpoint_path}; nothing was "
                "created: retry with a longer deadline"
            ) from None
        end = caller_end - RESTORE_CLEANUP_MARGIN
        if end <= loop.time():
            raise errors.DeadlineExceeded("the deadline leaves no time to restore the pod")
        root, plan = checked.root, checked.plan
        md = req.config.metadata
        # The new sandbox's metadata is recorded before RunPodSandbox: a crash before its id is
        # known still lets recovery find and remove it (see rollback_unrecorded).
        rec = self.journal.begin(
            "restore",
            f"{md.namespace}/{md.name}",
            RestoreRecord(checkpoint_path=str(root), sandbox_metadata=json_format.MessageToDict(md)),
        )
        run = _Run(rec, checked.phases)
        # the undos run last in first out: the record is closed (or kept) after all the others,
        # the decrypted plaintext removed after the lazy-pages daemons (lazy-pages=true) ended,
        # which end once the sandbox and its containers are gone, as do the filled volumes
        run.undo.push_async_exit(self._closing(rec))
        run.undo.push_async_exit(run.plaintext)
        # the volumes it filled, emptied once no container of the new pod can write to them
        run.undo.push_async_callback(run_to_end, pod_volumes.empty_again, run.filled)
        run.undo.push_async_callback(self.lazy.abandon_op, rec.op_id)
        try:
            async with asyncio.timeout_at(end), run.ends:
                with run.phases("sweep"):
                    await self._sweep_decrypted()
                await self._create(req, checked, run, sandbox_id)
        except BaseException as e:
            # what failed may be the sandbox itself, stopped or removed by another caller meanwhile
            # (a kubelet giving up on the pod): say so, not only the step's error (CRIU's log tail)
            stopped = await self._stopped_meanwhile(run.sandbox_id) if isinstance(e, errors.ShimError) else ""
            # To its end: when the caller's deadline passes (or it goes away) during the rollback,
            # gRPC cancels this handler, but the sandbox must still be removed and the journal
            # record closed (a hung CRIU restore makes StopPodSandbox take seconds), and the pod's
            # and path's locks held until then: a retry must not start beside the rollback.
            await undo_to_end(run.undo.aclose())
            if stopped and isinstance(e, errors.ShimError):
                raise errors.Aborted(
                    f"the new sandbox {run.sandbox_id[:13]} was {stopped} by another caller during the "
                    f"restore, which then failed: {e.message}; nothing of the restore is left: retry"
                ) from None
            if isinstance(e, TimeoutError):
                raise errors.DeadlineExceeded(
                    f"restore of pod {md.namespace}/{md.name} did not finish within the caller's deadline; "
                    "the new sandbox was removed: retry with a longer deadline"
                ) from None
            raise
        run.undo.pop_all()  # success: nothing to undo
        self.journal.finish(rec)
        self.lazy.forget_op(rec.op_id)  # its daemons (lazy-pages=true) are supervised on their own
        # pages_deferred: the page images are checked by podshim-runc beside CRIU's restore (their
        # time is in its page-check.json, not in `verify`; docs/design/restore-pod.md (RestorePod) step 4)
        deferred = checked.defer_pages
        log.info("restore done", sandbox=run.sandbox_id, phases=run.phases.seconds, pages_deferred=deferred)
        return cri.RestorePodResponse(
            pod_sandbox_id=run.sandbox_id,
            restored_containers=[
                cri.RestoredContainer(name=p.entry.name, container_id=run.created[p.entry.name]) for p in plan
            ],
        )

    async def restore_into(
        self,
        sandbox_id: str,
        sandbox_config: cri.PodSandboxConfig,
        checkpoint_path: str,
        config: cri.ContainerConfig,
        deadline: float | None,
    ) -> str:
        """One checkpointed container, created in a sandbox its caller made (a kubelet restoring a
        Pod that names a checkpoint: shim/kube/restore.py): the same checks as RestorePod for that
        container, its members' checksums, its rootfs diff, then CreateContainer with `config`
        unchanged but for the restore annotations (the kubelet's own labels and hash stay, so it
        neither restarts nor kills the container). Its process comes back at StartContainer."""
        loop = asyncio.get_running_loop()
        end = loop.time() + (deadline if deadline is not None else DEFAULT_DEADLINE) - CHECK_MARGIN
        req = cri.RestorePodRequest(
            config=sandbox_config, checkpoint_path=checkpoint_path, container_configs=[config]
        )
        # the volumes this call filled: emptied again if it fails after, for the kubelet's retry
        filled: list[pod_volumes.Filled] = []
        try:
            return await self._restore_into(
                sandbox_id, sandbox_config, checkpoint_path, config, req, end, filled
            )
        except BaseException:
            await run_to_end(pod_volumes.empty_again, filled)
            raise

    async def _restore_into(
        self,
        sandbox_id: str,
        sandbox_config: cri.PodSandboxConfig,
        checkpoint_path: str,
        config: cri.ContainerConfig,
        req: cri.RestorePodRequest,
        end: float,
        filled: list[pod_volumes.Filled],
    ) -> str:
        try:
            async with asyncio.timeout_at(end):
                checked = await self.checks.check(req, some=True)
                m, p = checked.manifest, checked.plan[0]
                if m.encryption is not None:
                    raise errors.FailedPrecondition(
                        f"checkpoint {checked.root} is encrypted: restore it with RestorePod "
                        "(podshim restorepod), which holds the node key's plaintext in its own directory"
                    )
                # the page images: checksummed by podshim-runc beside CRIU's restore, as RestorePod
                # does (when the annotations are known to reach it)
                deferred = deferred_pages(m, p.entry.dir) if checked.defer_pages else {}
                later = {f"{p.entry.dir}/{r}" for r in deferred}
                rels = [r for r in checked.unverified if r.startswith(p.entry.dir + "/") and r not in later]
                vrec = checked.volume_record
                if vrec is not None:
                    rels += [r for r in pod_volumes.tar_rels(vrec) if r in checked.unverified]
                steps = Steps()
                try:
                    await steps.run(manifest.verify_digests, checked.root, m, rels, 2, steps.cancel)
                    await steps.run(check_rootfs_diffs, [p], steps.cancel)
                    if vrec is not None:  # what this container mounts, still empty: before it exists
                        await steps.run(pod_volumes.check, checked.root, vrec, False, steps.cancel)
                        await self._fill_volumes(
                            checked, [config], sandbox_config, sandbox_id, steps, filled, partial=True
                        )
                finally:
                    steps.cancel.set()
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"the caller's deadline passed while verifying {checkpoint_path}; nothing was created"
            ) from None
        cc = cri.ContainerConfig()
        cc.CopyFrom(config)
        cc.annotations[RESTORE_ANNOTATION] = str(p.dir)
        cc.annotations[RESTORE_OPTIONS_ANNOTATION] = contract.to_record(m.options)
        if deferred:
            cc.annotations[contract.PAGE_DIGESTS_ANNOTATION] = contract.page_digests_record(deferred)
            self.page_checks.start(p.dir, deferred)
        try:
            container_id = await self.upstream.create_container(
                cri.CreateContainerRequest(
                    pod_sandbox_id=sandbox_id, config=cc, sandbox_config=sandbox_config
                ),
                doing=f"creating restored container {p.entry.name!r}",
            )
        except BaseException:
            if deferred:
                self.page_checks.discard(p.dir, deferred)
            raise
        if self.restored is not None:  # StartContainer confirms its restore ran
            await run_to_end(self.restored.add, container_id)
        log.info("restore container created", container=p.entry.name, id=container_id, sandbox=sandbox_id)
        return container_id

    async def _verify_rest(self, checked: Checked, run: _Run) -> None:
        """What reads the whole archive, in a task beside RunPodSandbox (docs/design/restore-pod.md
        (RestorePod) step 1): the sha256 of every member _check did not read, then (encrypted
        archives) the decryption, then the rootfs diffs' checks, then (lazy-pages=true) the start of
        each container's lazy-pages daemon. _create waits for it before it creates any container; a
        failure (DATA_LOSS, a hostile diff) removes the new sandbox."""
        m, rels = checked.manifest, checked.unverified
        if m.encryption is not None:  # what _decrypt reads it hashes in the same pass
            rels = [r for r in rels if not any(r.startswith(p.entry.dir + "/") for p in checked.plan)]
        elif checked.opts.lazy_pages:
            # the page images: checksummed while the daemons serve (docs/design/restore-pod.md (Lazy restore))
            later = {r for p in checked.plan for r in page_images(m, p.entry.dir)}
            rels = [r for r in rels if r not in later]
        elif checked.defer_pages:  # the page images: checksummed by podshim-runc during the restore
            later = {f"{p.entry.dir}/{r}" for p in checked.plan for r in deferred_pages(m, p.entry.dir)}
            rels = [r for r in rels if r not in later]
        with run.phases("verify"):
            await run.steps.run(manifest.verify_digests, checked.root, m, rels, 2, run.steps.cancel)
        if m.encryption is not None:
            with run.phases("decrypt"):
                await self._decrypt(checked, run)
        with run.phases("rootfs_check"):
            # a hostile diff fails here, and a hostile volume tar
            await run.steps.run(check_rootfs_diffs, checked.plan, run.steps.cancel)
            if checked.volume_record is not None:
                encrypted = m.encryption is not None
                await run.steps.run(
                    pod_volumes.check, checked.root, checked.volume_record, encrypted, run.steps.cancel
                )
        # each container's daemon starts beside the sandbox too (docs/design/restore-pod.md (Lazy restore))
        if checked.opts.lazy_pages:
            with run.phases("lazy_daemon"):
                for p in checked.plan:
                    plain = m.encryption is None  # (an encrypted archive's were checked as decrypted)
                    pages = PageCheck(checked.root, m, page_images(m, p.entry.dir)) if plain else None
                    await self.lazy.start_for(p.dir, p.entry.name, run.rec, not plain, pages)

    async def _decrypt(self, checked: Checked, run: _Run) -> None:
        """Decrypt each planned container's files into a private dir of its own
        (`<state_dir>/decrypted/<random>/`) and point its restore there: CRIU reads plaintext and
        the archive is never modified. The dirs go with podshim-runc's restore, a failed
        RestorePod (their undo) or the container (`_sweep_decrypted`)."""
        root, m, key = checked.root, checked.manifest, checked.key
        assert key is not None  # load_and_check refused an encrypted archive without one
        expect = {rel: (f.size, f.sha256) for rel, f in m.files.items()}
        for p in checked.plan:
            # its undo registered before the thread makes it: a deadline while it is being made
            # (run_to_end then drops the thread's result) must still remove the plaintext dir
            d = crypto.decrypted_dir_path(self.config.state_dir)
            run.plaintext.push_async_callback(run_to_end, crypto.remove_decrypted, d)
            self._decrypting.add(d)
            run.ends.callback(self._decrypting.discard, d)
            await run_to_end(crypto.new_decrypted_dir, self.config.state_dir, root, p.entry.name, d.name)
            # the threads stop at their next chunk when cancelled: nothing writes into d after it;
            # each file's sha256 is checked against the manifest in the decryption's own read
            await run.steps.run(
                crypto.decrypt_members, root, list(m.files), p.entry.dir, d, key, 2, run.steps.cancel, expect
            )
            await faults.hit_async("restore.decrypted")  # the plaintext is on disk: a deadline removes it
            p.dir = d
        log.info("restore decrypted", archive=str(root), containers=[p.entry.name for p in checked.plan])

    async def _sweep_decrypted(self) -> None:
        """Remove decrypted dirs nobody will use: their container is gone (removed before it was
        started), or none was recorded after STALE_DECRYPTED_SECONDS (a restore cut short by a
        crash). Never fails the restore."""
        try:
            for d, marker, age in await run_to_end(crypto.list_decrypted, self.config.state_dir):
                if d in self._decrypting:
                    continue
                owner = (marker or {}).get("container_id")
                if not owner:
                    if age > STALE_DECRYPTED_SECONDS:
                        await run_to_end(crypto.remove_decrypted, d)
                        log.info("decrypted checkpoint removed", dir=str(d), reason="interrupted restore")
                    continue
                try:
                    await self.upstream.container_status(str(owner))
                except errors.ShimError as e:
                    if is_not_found(e):
                        await run_to_end(crypto.remove_decrypted, d)
                        log.info("decrypted checkpoint removed", dir=str(d), reason=f"container {owner} gone")
        except Exception:  # noqa: BLE001 - a leftover is swept next time
            log.exception("sweeping decrypted checkpoints failed")

    def _container_config(
        self, p: Planned, criu_flags: str, lazy: Daemon | None = None, page_digests: str = ""
    ) -> cri.ContainerConfig:
        cc = cri.ContainerConfig()
        cc.CopyFrom(p.config)
        if cc.metadata.attempt == 0 and p.entry.restart_count:
            # the restart count continues, in the attempt (the upstream names the container after
            # it) and in the kubelet's annotation alike: the kubelet reads the count back from the
            # annotation and makes its next container attempt count + 1, a name the upstream
            # refuses while this one exists if the two differ (docs/design/restore-pod.md (RestorePod)
            # step 3)
            cc.metadata.attempt = p.entry.restart_count
            cc.annotations[RESTART_COUNT_ANNOTATION] = str(cc.metadata.attempt)
        cc.annotations[RESTORE_ANNOTATION] = str(p.dir)
        cc.annotations[RESTORE_OPTIONS_ANNOTATION] = criu_flags
        if lazy is not None:
            cc.annotations[contract.LAZY_PAGES_ANNOTATION] = str(lazy.work)
        if page_digests:
            cc.annotations[contract.PAGE_DIGESTS_ANNOTATION] = page_digests
        cc.annotations.setdefault(RESTART_COUNT_ANNOTATION, str(cc.metadata.attempt))
        return cc

    async def _create(
        self, req: cri.RestorePodRequest, checked: Checked, run: _Run, sandbox_id: str = ""
    ) -> None:
        """RunPodSandbox beside the rest of the verification, then one CreateContainer per
        checkpointed container; the undo of each step is registered in `run` right after it."""
        m, plan, opts, rec, phases = checked.manifest, checked.plan, checked.opts, run.rec, run.phases
        criu_flags = contract.to_record(m.options)
        verifying = asyncio.ensure_future(self._verify_rest(checked, run))
        run.ends.push_async_callback(_stop_and_wait, verifying, run.steps)
        with phases("sandbox"):
            run.sandbox_id = (
                await self._adopt_sandbox(sandbox_id, run)
                if sandbox_id
                else await self._run_sandbox(req, run)
            )
        log.info("restore sandbox created", sandbox=run.sandbox_id)
        # the page images podshim-runc checks while CRIU restores: hashed from now on, beside the
        # CreateContainers and the wait for StartContainer (docs/design/restore-pod.md (RestorePod)
        # step 4); not beside the sandbox, whose containerd, runc and CNI it would slow down
        deferred = {p.entry.name: deferred_pages(m, p.entry.dir) if checked.defer_pages else {} for p in plan}
        for p in plan:
            if deferred[p.entry.name]:
                self.page_checks.start(p.dir, deferred[p.entry.name])
                run.undo.callback(self.page_checks.discard, p.dir, deferred[p.entry.name])
        resp = cri.RunPodSandboxResponse(pod_sandbox_id=run.sandbox_id)

        async def check_network() -> None:
            with phases("network"):
                await self._check_network(resp.pod_sandbox_id, checked.network)

        # beside the verification's end and the CreateContainers (docs/design/restore-pod.md
        # (RestorePod) step 3): awaited before any start and the answer; a missing interface
        # removes the sandbox with its containers
        network = asyncio.ensure_future(check_network())
        run.ends.push_async_callback(_stop_and_wait, network, run.steps)
        with phases("verify_wait"):  # no container before the archive is verified (and decrypted)
            await verifying
        if checked.volume_record is not None:  # the pod's files before its first container
            with phases("volumes"):
                await self._fill_volumes(
                    checked, req.container_configs, req.config, run.sandbox_id, run.steps, run.filled, run.rec
                )
        created = run.created
        for p in plan:
            # lazy-pages=true: the container's daemon (started by _verify_rest) serves before it exists
            lazy = self.lazy.started(rec.op_id, p.entry.name) if opts.lazy_pages else None
            if opts.lazy_pages and lazy is None:
                raise errors.Internal(f"no lazy-pages daemon was started for container {p.entry.name!r}")
            digests = contract.page_digests_record(deferred[p.entry.name]) if deferred[p.entry.name] else ""
            with phases("create"):
                container_id = await self.upstream.create_container(
                    cri.CreateContainerRequest(
                        pod_sandbox_id=resp.pod_sandbox_id,
                        config=self._container_config(p, criu_flags, lazy, digests),
                        sandbox_config=req.config,
                    ),
                    doing=f"creating container {p.entry.name!r}",
                )
            c = cri.CreateContainerResponse(container_id=container_id)
            created[p.entry.name] = c.container_id
            if lazy is not None:
                self.lazy.attach(lazy, c.container_id)
            if self.restored is not None:  # StartContainer confirms its restore ran
                await run_to_end(self.restored.add, c.container_id)
                # (the container itself goes with the sandbox)
                run.undo.callback(self.restored.discard, c.container_id)
            if m.encryption is not None:  # whose decrypted dir it is, for _sweep_decrypted
                await run_to_end(crypto.set_owner, p.dir, c.container_id)
            faults.hit("restore.after-container")
            log.info("restore container created", container=p.entry.name, id=c.container_id)
        await network
        if opts.start:
            for p in plan:
                try:
                    await self.upstream.start_container(
                        created[p.entry.name], doing=f"starting restored container {p.entry.name!r}"
                    )
                except errors.ShimError as e:
                    # podshim-runc found a page image that differs (docs/design/restore-pod.md
                    # (RestorePod) step 4)
                    if contract.is_page_mismatch(e.upstream_details):
                        raise errors.DataLoss(e.message) from None
                    raise
                cid = created[p.entry.name]
                try:
                    await confirm_restored(self.upstream, self.config, cid, p.entry.name)
                finally:
                    if self.restored is not None:
                        self.restored.discard(cid)

    async def _stopped_meanwhile(self, sandbox_id: str) -> str:
        """ "stopped" or "removed" when the sandbox this restore made is no longer ready, as read
        before the rollback touches it; "" when it is ready, unknown, or none was made yet."""
        if not sandbox_id:
            return ""
        try:
            st = await self.upstream.pod_status(sandbox_id, timeout=5.0)
        except errors.ShimError as e:
            return "removed" if is_not_found(e) else ""
        return "stopped" if st.status.state != cri.SANDBOX_READY else ""

    async def _fill_volumes(
        self,
        checked: Checked,
        configs: Sequence[cri.ContainerConfig],
        sandbox_config: cri.PodSandboxConfig,
        sandbox_id: str,
        steps: Steps,
        filled: list[pod_volumes.Filled],
        journal_rec: OpRecord | None = None,
        partial: bool = False,
    ) -> None:
        """Fill the new pod's emptyDirs and /dev/shm from the archive (shim/ops/pod_volumes.py),
        adding what was filled to `filled` (emptied again if the restore fails after);
        `partial`: one container of a kubelet's pod, which fills what is still empty."""
        rec = checked.volume_record
        assert rec is not None
        spec = (await build_pod_view(self.upstream, sandbox_id)).spec if rec.dev_shm else {}
        where = pod_volumes.targets(rec, configs, sandbox_config.metadata.uid, spec, partial=partial)
        # a crash from here on: recovery empties them (recover); a kubelet's restore has no
        # record of its own, so its fill gets one while it writes (pod_volumes.journaled)
        md = sandbox_config.metadata
        journaled: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if journal_rec is not None:
            to_fill = await run_to_end(pod_volumes.to_fill, where)
            await run_to_end(self.journal.update, journal_rec, "volumes", volumes=to_fill)
        else:
            journaled = pod_volumes.journaled(self.journal, f"{md.namespace}/{md.name}", where)
        with journaled:
            done = await steps.run(
                pod_volumes.fill,
                checked.root,
                checked.manifest,
                rec,
                where,
                checked.key,
                self.config.state_dir,
                steps.cancel,
                only_empty=partial,
            )
        filled += done
        log.info("restore volumes filled", sandbox=sandbox_id, bytes={f.name: f.bytes for f in done})

    async def _adopt_sandbox(self, sandbox_id: str, run: _Run) -> str:
        """The caller's sandbox, journaled and undone like one this restore made."""
        run.undo.push_async_callback(self.rollback_sandbox, sandbox_id)
        await run_to_end(self.journal.update, run.rec, "sandbox", sandbox_id=sandbox_id)
        return sandbox_id

    async def _run_sandbox(self, req: cri.RestorePodRequest, run: _Run) -> str:
        """RunPodSandbox; its undo is registered as soon as its answer (or the lack of one) is
        known: remove the sandbox by id, or look for it by its metadata (rollback_unrecorded)."""
        try:
            sandbox_id = await self.upstream.run_pod_sandbox(
                cri.RunPodSandboxRequest(config=req.config, runtime_handler=req.runtime_handler),
                doing="creating the new sandbox",
            )
        except errors.ShimError as e:
            if e.upstream_code in _NO_ANSWER:
                self._sandbox_unknown(run)
            unknown = unknown_handler(e.upstream_details, req.runtime_handler)
            if unknown is not None:
                raise unknown from None
            raise
        except BaseException:  # cancelled (the caller's deadline) or the like: no answer either
            self._sandbox_unknown(run)
            raise
        try:
            faults.hit("restore.sandbox-answer")  # `error`: as if the answer were lost on the way
        except BaseException:
            self._sandbox_unknown(run)
            raise
        faults.hit("restore.sandbox-unrecorded")
        run.undo.push_async_callback(self.rollback_sandbox, sandbox_id)
        # off the loop (an fsync on a busy disk must not stall the daemons' start beside it);
        # durable before any container is created (docs/design/crash-safety.md (Crash safety))
        await run_to_end(self.journal.update, run.rec, "sandbox", sandbox_id=sandbox_id)
        faults.hit("restore.after-sandbox")
        return sandbox_id

    async def _check_network(self, sandbox_id: str, recorded: dict[str, Any]) -> None:
        """The new pod must have every interface the checkpointed one had (its addresses are
        new, from CNI): otherwise FAILED_PRECONDITION, and the new sandbox is removed."""
        if not recorded.get("interfaces"):
            return  # an archive without namespace facts: nothing to check against
        pod = await build_pod_view(self.upstream, sandbox_id)
        if pod.netns is None:
            return
        now = await run_to_end(cni.read_facts, pod.netns)
        missing = cni.missing_interfaces(recorded, now)
        if missing:
            raise errors.FailedPrecondition(
                f"the new pod's network lacks interface(s) {', '.join(missing)} that the checkpointed pod "
                "had: give the new pod the same networks (CNI configuration) as the source"
            )
        log.info(
            "restore network",
            sandbox=sandbox_id,
            addresses=cni.addresses(now),
            checkpointed_addresses=cni.addresses(recorded),
        )

    def _sandbox_unknown(self, run: _Run) -> None:
        """RunPodSandbox got no answer (cancelled, timed out, connection lost): the upstream may
        have created the sandbox (or still be creating it) without podshim learning its id.
        Recorded, so that the rollback (and recovery after a crash) looks for it by its metadata."""
        rec = run.rec
        try:
            self.journal.update(rec, "sandbox-unknown", sandbox_unknown_since=time.time())
        except errors.ShimError as e:
            log.error("cannot journal the unanswered RunPodSandbox", error=e.message)
            return
        run.undo.push_async_callback(self._rollback_unanswered, rec)

    async def _rollback_unanswered(self, rec: Any) -> None:
        if rec.data.sandbox_metadata is not None:
            await self.rollback_unrecorded(
                rec.data.sandbox_metadata, since=rec.started, settle_until=settle_deadline(rec)
            )

    def _closing(self, rec: Any) -> Callable[..., Awaitable[bool]]:
        """The first undo registered, so the last to run: close the journal record when every
        other undo succeeded; when one failed (ShimError), keep it (podshim retries in the
        background, Engine, and the next start of podshim replays it) and swallow that error:
        the caller gets the restore's own."""

        async def close(exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
            if exc is None:
                self.journal.finish(rec)
                return False
            if isinstance(exc, errors.ShimError):
                log.error(
                    "rollback of restore failed; kept for recovery",
                    sandbox=rec.data.sandbox_id,
                    error=exc.message,
                )
                if self.on_kept is not None:
                    self.on_kept(rec)
                return True
            return False

        return close

    async def recover(self, rec: OpRecord) -> None:
        """Undo a RestorePod a crash interrupted (its journal record): remove the sandbox it
        created, found by its recorded id, else by its recorded metadata, then empty the volumes
        it was filling."""
        data: RestoreRecord = rec.data
        if data.sandbox_id:
            await self.rollback_sandbox(data.sandbox_id)
        elif data.sandbox_metadata is not None:
            await self.rollback_unrecorded(
                data.sandbox_metadata, since=rec.started, settle_until=settle_deadline(rec)
            )
        if data.volumes:  # once no container of the new pod can write to them
            await run_to_end(pod_volumes.empty_recorded, data.volumes)

    async def rollback_unrecorded(
        self, metadata: dict[str, Any], since: str = "", settle_until: float = 0.0
    ) -> None:
        """Remove the sandbox a restore created without learning (or recording) its id: the one
        whose metadata (name, namespace, uid, attempt) is the request's, created after the
        restore began (`since`, RFC 3339). The upstream names sandboxes after their metadata, so
        at most one matches; the restore's pod lock, held until the record is closed, keeps
        podshim from creating another meanwhile. None found before `settle_until` (epoch
        seconds): Unavailable, the RunPodSandbox left without an answer may still create it."""
        want = cri.PodSandboxMetadata()
        json_format.ParseDict(metadata, want)
        after_ns = int((_epoch(since) - 5.0) * 1e9) if since else 0  # slack for clock steps
        items = await self.upstream.list_pod_sandboxes(doing="listing sandboxes for recovery")
        found = [sb for sb in items if sb.metadata == want and sb.created_at >= after_ns]
        for sb in found:
            log.warning("removing the unrecorded sandbox of an interrupted restore", sandbox=sb.id)
            await self.rollback_sandbox(sb.id)
        if not found and time.time() < settle_until:
            raise errors.Unavailable(
                f"no sandbox {want.namespace}/{want.name} yet: the RunPodSandbox left without an "
                "answer may still create it; looking again"
            )

    async def rollback_sandbox(self, sid: str) -> None:
        """Remove a sandbox a restore created (which removes its containers). Raises unless the
        upstream confirms it is gone."""
        for call in (self.upstream.stop_pod_sandbox, self.upstream.remove_pod_sandbox):
            try:
                await call(sid)
            except errors.ShimError as e:
                if not is_not_found(e):
                    log.error("rollback of restore failed", sandbox=sid, error=e.upstream_details)
        try:
            await self.upstream.pod_status(sid)
        except errors.ShimError as e:
            if is_not_found(e):
                return
            raise errors.Unavailable(
                f"cannot confirm sandbox {sid} was removed: {e.upstream_details}"
            ) from None
        raise errors.Internal(f"sandbox {sid} of a failed restore could not be removed")
