"""RestorePod's checks (docs/design/restore-pod.md (RestorePod) step 1): everything verified before
anything is created. The request (options, configs, runtime handler), the archive's manifest, file
set, sizes and the members podshim reads itself (config.dump, spec.dump, network.json: read once,
checksum checked), this node (compat), the upstream's handler and wiring, the container configs,
images and bind mounts against the checkpoint. What reads the whole archive runs later, beside the
new sandbox (shim/ops/restore_pod.py, _verify_rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from shim import errors
from shim.aio import run_to_end
from shim.archive import compat, config_dump, crypto, layout, manifest, paths, volumes
from shim.checks import cri_strings, env, mounts
from shim.checks.wiring import Verdict, WiringChecker
from shim.config import Config
from shim.criu.lazy import check_runtime
from shim.criu.runtime import binary_version
from shim.ops import pod_volumes
from shim.sandbox.images import Images
from shim.upstream import Upstream

INVENTORY = "inventory.img"  # every CRIU image set has one (the node e2e check relies on it)


@dataclass(frozen=True)
class RestoreOptions:
    start: bool = False  # start the containers (the KEP text's older walkthrough)
    lazy_pages: bool = False  # memory through userfaultfd (docs/design/restore-pod.md (Lazy restore))

    KEYS = {
        "start": "true: start the restored containers before returning (default false)",
        "lazy-pages": "true: restore memory lazily (default: the node's [restore] lazy_pages)",
    }

    @classmethod
    def parse(cls, options: dict[str, str], lazy_default: bool = False) -> RestoreOptions:
        unknown = sorted(set(options) - set(cls.KEYS))
        if unknown:
            raise errors.InvalidArgument(
                f"unknown restore option(s) {', '.join(unknown)}; known: {', '.join(sorted(cls.KEYS))}"
            )

        def switch(key: str, default: bool) -> bool:
            value = options.get(key, str(default)).strip().lower()
            if value not in ("true", "false", "1", "0", "yes", "no"):
                raise errors.InvalidArgument(f"option {key}={options[key]!r}: expected true or false")
            return value in ("true", "1", "yes")

        return cls(start=switch("start", False), lazy_pages=switch("lazy-pages", lazy_default))


def check_host(m: manifest.Manifest, criu_version: str, runtime_name: str, runtime_version: str) -> None:
    """The archive must come from a host this one can restore (FAILED_PRECONDITION naming each
    mismatch otherwise): shim/archive/compat.py (architecture, kernel, CRIU and OCI runtime, cgroup
    version; the CPU features with check_this_host, which has CRIU's binary)."""
    compat.check(m, compat.Node.here(criu_version, runtime_name, runtime_version))


def check_this_host(m: manifest.Manifest, criu_binary: str, runtime_binary: str) -> None:
    """check_host with this node's CRIU and OCI runtime binaries (their versions, the CPU check)."""
    compat.refuse(this_host_mismatches(m, criu_binary, runtime_binary))


def this_host_mismatches(m: manifest.Manifest, criu_binary: str, runtime_binary: str) -> list[str]:
    name = os.path.basename(runtime_binary)
    criu, runtime = (compat.per_binary(binary_version, b) for b in (criu_binary, runtime_binary))
    node = compat.Node.here(criu, name, runtime, criu_binary)
    return compat.host_mismatches(m.host, node)


def archived_config(record: dict[str, Any]) -> cri.ContainerConfig:
    return config_dump.container_config(record.get("config") or {})


def _credentials(c: cri.ContainerConfig) -> dict[str, Any]:
    sc = c.linux.security_context
    return {
        "run_as_user": sc.run_as_user.value if sc.HasField("run_as_user") else None,
        "run_as_group": sc.run_as_group.value if sc.HasField("run_as_group") else None,
        "run_as_username": sc.run_as_username,
        "supplemental_groups": list(sc.supplemental_groups),
    }


def config_mismatch(name: str, requested: cri.ContainerConfig, archived: cri.ContainerConfig) -> str | None:
    """The first field in which `requested` disagrees with the checkpoint (image is checked apart)."""
    checks = {
        "command": (list(requested.command), list(archived.command)),
        "args": (list(requested.args), list(archived.args)),
        "working_dir": (requested.working_dir, archived.working_dir),
        # as the upstream stored them: a value that is not UTF-8 comes back from config.dump with
        # U+FFFD in place of each bad byte (shim/checks/env.py); keys in any order: the kubelet
        # builds a pod's service-link variables from a map, in another order at every attempt (a
        # key given twice keeps its values' order: the process sees them so)
        "env": (env.by_key(env.stored_envs(requested.envs)), env.by_key(env.stored_envs(archived.envs))),
        "credentials": (_credentials(requested), _credentials(archived)),
    }
    shown = {"env": [(e.key, e.value) for e in requested.envs]}  # the request's as it was sent
    for field, (want, have) in checks.items():
        if want != have:
            return (
                f"container {name!r}: {field} differs from the checkpoint "
                f"(request {shown.get(field, want)!r}, checkpoint {have!r})"
            )
    return None


def read_member(root: Path, path: Path, m: manifest.Manifest, key: crypto.NodeKey | None) -> bytes:
    """A (small) archive member's bytes, read once and checked against the manifest's size and
    sha256 (manifest.read_verified: RestorePod's checksum pass skips it), decrypted when the
    archive is encrypted."""
    rel = path.relative_to(root).as_posix()
    data = manifest.read_verified(root, m, rel)
    if m.encryption is not None and key is not None:
        return crypto.decrypt_buffer(data, rel, key)
    if crypto.is_encrypted_bytes(data):
        raise errors.DataLoss(
            f"checkpoint {root}: {rel} is encrypted but manifest.json records no encryption: "
            "the manifest was modified; take a new checkpoint"
        )
    return data


def container_record(
    root: Path, cl: layout.ContainerLayout, m: manifest.Manifest, key: crypto.NodeKey | None
) -> dict[str, Any]:
    """A checkpointed container's config.dump; absent or unreadable is DATA_LOSS (the manifest's
    checksums only cover the files it lists)."""
    rel = f"{cl.rel}/{layout.CONFIG_DUMP_FILE}"
    if rel not in m.files or f"{cl.rel}/{layout.CHECKPOINT_DIR}/{INVENTORY}" not in m.files:
        raise errors.DataLoss(
            f"checkpoint {root}: container {cl.root.name!r} is marked checkpointed but the manifest "
            f"lists no {rel} or CRIU images for it: the archive is incomplete; take a new checkpoint"
        )
    return json_member(root, cl.config_dump, m, key)


def json_member(root: Path, path: Path, m: manifest.Manifest, key: crypto.NodeKey | None) -> dict[str, Any]:
    """A JSON object member (config.dump, spec.dump) read once, checked against the manifest
    (read_member); unreadable or not an object is DATA_LOSS."""
    rel = path.relative_to(root).as_posix()
    try:
        doc = json.loads(read_member(root, path, m, key))
    except (ValueError, OSError) as e:
        raise errors.DataLoss(
            f"checkpoint {root}: {rel} is unreadable ({e}): take a new checkpoint"
        ) from None
    if not isinstance(doc, dict):
        raise errors.DataLoss(f"checkpoint {root}: {rel} is not a JSON object: take a new checkpoint")
    return doc


def recorded_images(entry: manifest.ContainerEntry) -> list[str]:
    """The references manifest.json records for a container's image (docs/design/archive.md
    (Image identity)): its ID and user-specified name (absent from older manifests), the name the upstream
    reported."""
    return [r for r in (entry.image_id, entry.image, entry.user_specified_image) if r]


async def check_record(
    root: Path, entry: manifest.ContainerEntry, record: dict[str, Any], images: Images
) -> None:
    """config.dump must name the image manifest.json names (DATA_LOSS: an inconsistent archive,
    refused here rather than when StartContainer restores the container). The same image may go by
    its ID, a digest reference or a name (docs/design/archive.md (Image identity)): only a reference
    this node resolves to another image than the manifest's is refused; one it cannot resolve is
    left to the check that the image is on this node (_missing_images)."""
    refs = {
        "image": record.get("image"),
        "image_id": record.get("image_id"),
        "config.image": archived_config(record).image.image,
    }
    found = await images.disagreeing(refs, recorded_images(entry))
    if found is not None:
        where, image, recorded_id = found
        raise errors.DataLoss(
            f"checkpoint {root} is inconsistent: container {entry.name!r}'s config.dump has {where} "
            f"{image!r}, manifest.json says {entry.image!r} ({recorded_id}), another image; the "
            "archive cannot be trusted, take a new checkpoint"
        )


def upstream_handlers(info: Any) -> set[str] | None:
    """The runtime handlers containerd's verbose Status reports (info["config"]: its CRI config,
    containerd.runtimes), or None when it reports none in that shape (another upstream)."""
    try:
        runtimes = json.loads(info.get("config") or "")["containerd"]["runtimes"]
    except (ValueError, TypeError, KeyError):
        return None
    return set(runtimes) if isinstance(runtimes, dict) else None


@dataclass
class Planned:
    entry: manifest.ContainerEntry
    config: cri.ContainerConfig
    dir: Path
    image_ref: str = ""  # the image the checkpointed container ran: its ID, or config.dump's image_ref


def recorded_network(root: Path, m: manifest.Manifest, key: crypto.NodeKey | None) -> dict[str, Any]:
    """The pod network facts the checkpoint recorded (sandbox/network.json "netns"), or {}."""
    path = layout.ArchiveLayout(root).sandbox_network
    if path.relative_to(root).as_posix() not in m.files:
        return {}
    try:
        doc = json.loads(read_member(root, path, m, key))
    except (OSError, ValueError) as e:
        raise errors.DataLoss(f"checkpoint {root}: sandbox/network.json is unreadable ({e})") from None
    facts = doc.get("netns") if isinstance(doc, dict) else None
    return facts if isinstance(facts, dict) else {}


class Phases:
    """Wall seconds of each step of one RestorePod, logged with its "restore done" line
    (`phases`), so an operator sees where a slow restore spent its time. Steps that run side by
    side each count their own time; a step met twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.monotonic() - start, 4)


@dataclass
class Checked:
    """What RestorePod verified before creating anything."""

    opts: RestoreOptions
    root: Path
    key: crypto.NodeKey | None
    manifest: manifest.Manifest
    plan: list[Planned]
    network: dict[str, Any]  # the pod network facts the checkpoint recorded
    phases: Phases = dc_field(default_factory=Phases)  # the time each check took
    unverified: list[str] = dc_field(default_factory=list)  # members whose sha256 restore_pod checks later
    # eager restore of a plain archive on a handler known to pass podshim's annotations: the page
    # images are checksummed by podshim-runc while CRIU restores (docs/design/restore-pod.md
    # (RestorePod) step 4), not by _verify_rest
    defer_pages: bool = False
    volume_record: volumes.Record | None = None  # the pod's emptyDirs and /dev/shm the archive holds


def container_set_problem(dumped: list[str], recorded_only: set[str], requested: list[str]) -> str | None:
    """Why `requested` (the container configs' names) is not exactly the checkpointed containers
    `dumped` (an INVALID_ARGUMENT), None when it is. RestorePod's rule, and a migration's pre-check
    before the source freezes (docs/design/migration.md (Live migration)): a container that had
    exited at the checkpoint (a completed init container) is recorded, not checkpointed: the
    answer could give it no CREATED container to start, which the merged API wants for every
    config (docs/design/restore-pod.md (RestorePod) step 1)."""
    missing = [n for n in dumped if n not in requested]
    exited = [n for n in requested if n in recorded_only]
    extra = [n for n in requested if n not in dumped and n not in recorded_only]
    if not (missing or extra or exited):
        return None
    return (
        f"container_configs must name exactly the checkpointed containers ({', '.join(dumped)}): "
        + "; ".join(
            part
            for part in (
                f"missing {', '.join(missing)}" if missing else "",
                f"not in the checkpoint {', '.join(extra)}" if extra else "",
                f"{', '.join(exited)} had exited when the pod was checkpointed (recorded, not "
                "checkpointed: it is not run again and has no container to start; leave its config out)"
                if exited
                else "",
            )
            if part
        )
    )


class RestoreChecks:
    """RestorePod's checks before anything is created: the request, the archive, this node, the
    upstream (docs/design/restore-pod.md (RestorePod) step 1)."""

    def __init__(self, config: Config, upstream: Upstream, wiring: WiringChecker | None = None) -> None:
        self.config = config
        self.upstream = upstream
        # docs/design/runtime-wrapper.md (Wiring check): refuse a node wired wrong
        self.wiring = wiring

    def node_key(self) -> crypto.NodeKey | None:
        """The node key (`[checkpoint] encryption_key_file`), None when none is configured."""
        path = self.config.encryption_key_file
        return crypto.load_key(path) if path else None

    async def check(
        self, req: cri.RestorePodRequest, pages_from_source: bool = False, some: bool = False
    ) -> Checked:
        """Everything checked before anything is created: the request, the archive's manifest,
        file set, sizes and the members podshim reads itself (config.dump, network.json: read
        once, checksum checked), this host, the container configs against the checkpoint. The
        checksums of the other members (the memory images) are checked beside the new sandbox
        (restore_pod.py's _verify_rest, docs/design/restore-pod.md (RestorePod) step 1)."""
        opts = RestoreOptions.parse(dict(req.options), self.config.lazy_pages)
        if not req.HasField("config") or not req.config.metadata.name:
            raise errors.InvalidArgument("config (the new PodSandboxConfig with metadata) is required")
        cri_strings.check_sandbox_config(req.config)  # what the upstream could not undo
        for i, cc in enumerate(req.container_configs):
            cri_strings.check_container_config(cc, f"container_configs[{i}]")
        runtime = self.config.runtime_for_handler(req.runtime_handler)
        if runtime is None:
            raise errors.InvalidArgument(
                f"runtime_handler {req.runtime_handler!r} is not configured in podshim "
                f"(known: runc{''.join(', ' + h for h in self.config.runtimes)})"
            )
        if opts.lazy_pages:  # FAILED_PRECONDITION naming a runtime without lazy restore
            await run_to_end(check_runtime, runtime.binary, req.runtime_handler)
        phases = Phases()
        with phases("handler"):
            await self._check_upstream_handler(req.runtime_handler)
        wired = None
        with phases("wiring"):
            if self.wiring is not None:
                doing = "RestorePod refused, nothing was created"
                wired = await self.wiring.require(req.runtime_handler, doing)
        root = await run_to_end(paths.validate_archive_dir, req.checkpoint_path, self.config.allowed_roots)
        key = await run_to_end(self.node_key)
        stop = threading.Event()  # set at the deadline: the sparse-file check stops at its next step
        with phases("manifest"):
            m = await run_to_end(
                manifest.load_and_check,
                root,
                self.config.allowed_roots,
                key,
                stop,
                pages_from_source=pages_from_source,
                stop=stop,
            )
        # docs/design/restore-pod.md (RestorePod) step 1: every way this node differs, in one refusal;
        # CRIU's CPU check (a subprocess) runs while the configs are matched
        host = asyncio.ensure_future(
            run_to_end(this_host_mismatches, m, self.config.runtime.criu, runtime.binary)
        )
        try:
            with phases("plan"):
                archive = layout.ArchiveLayout(root)
                plan = await self._plan(req, m, archive, key, some)
                missing = await self._missing_images(plan)
                network = await run_to_end(recorded_network, root, m, key)
        except BaseException:
            host.cancel()
            await asyncio.gather(host, return_exceptions=True)
            raise
        with phases("host"):
            compat.refuse(await host + missing)
        vrec = await run_to_end(pod_volumes.recorded, root, m, key)
        if vrec is not None:  # every recorded emptyDir has a place in the new pod (some: what it mounts)
            volumes.targets(vrec.empty_dirs, req.container_configs, req.config.metadata.uid, missing_ok=some)
        read = {
            f"{archive.container(p.entry.name).rel}/{name}"
            for p in plan
            for name in (layout.CONFIG_DUMP_FILE, layout.SPEC_DUMP_FILE)
        }
        read.add(archive.sandbox_network.relative_to(root).as_posix())
        if vrec is not None:
            read.add(pod_volumes.record_rel())
        unverified = sorted(set(m.files) - read)
        # deferred only when the annotation is known to reach podshim-runc (dropped, the restore
        # would run on memory nobody checked)
        wired_ok = wired is not None and wired.verdict is Verdict.OK
        defer = m.encryption is None and not opts.lazy_pages and wired_ok
        return Checked(
            opts, root, key, m, plan, network, phases, unverified, defer_pages=defer, volume_record=vrec
        )

    async def _plan(
        self,
        req: cri.RestorePodRequest,
        m: manifest.Manifest,
        archive: layout.ArchiveLayout,
        key: crypto.NodeKey | None = None,
        some: bool = False,
    ) -> list[Planned]:
        """Match the request's container configs to the checkpoint, exactly, before acting.
        `some`: the configs may name only some of the checkpointed containers (a kubelet creates a
        restored pod's containers one CreateContainer at a time, shim/kube/restore.py)."""
        dumped = [c for c in m.containers if c.checkpointed]
        recorded_only = {c.name for c in m.containers if not c.checkpointed}
        by_name: dict[str, cri.ContainerConfig] = {}
        for cc in req.container_configs:
            name = cc.metadata.name
            if not name:
                raise errors.InvalidArgument("a container config has no metadata.name")
            if name in by_name:
                raise errors.InvalidArgument(f"container config {name!r} appears twice")
            by_name[name] = cc
        if some:
            dumped = [c for c in dumped if c.name in by_name]
        problem = container_set_problem([c.name for c in dumped], recorded_only, list(by_name))
        if problem:
            raise errors.InvalidArgument(problem)
        plan = []
        images = Images(self.upstream)
        unmounted: dict[str, list[str]] = {}
        for entry in dumped:
            cl = archive.container(entry.name)
            manifest.check_container_members(archive.root, m, entry)
            record = await run_to_end(container_record, archive.root, cl, m, key)  # off the loop
            await check_record(archive.root, entry, record, images)
            requested = by_name[entry.name]
            problem = config_mismatch(entry.name, requested, archived_config(record))
            if problem is None:
                problem = await self._image_mismatch(entry, requested, record, images)
            if problem:
                raise errors.InvalidArgument(problem)
            spec = await run_to_end(json_member, archive.root, cl.spec_dump, m, key)
            unmounted[entry.name] = mounts.missing_mounts(spec, requested)
            ran = entry.image_id or str(record.get("image_ref") or "")  # the ID, else what 1.x reported
            plan.append(Planned(entry, requested, cl.root, ran))
        # every bind mount of each checkpointed container given a source, or CRIU fails at
        # StartContainer (shim/checks/mounts.py, as for a container tar)
        mounts.refuse_missing(unmounted, str(archive.root))
        return plan

    async def _check_upstream_handler(self, handler: str) -> None:
        """A runtime_handler podshim knows but the upstream does not: INVALID_ARGUMENT before
        anything is created (containerd's verbose Status lists its runtimes). When the upstream
        does not say, RunPodSandbox's own answer is mapped instead (unknown_handler)."""
        if not handler:
            return
        if self.wiring is not None:
            info = await self.wiring.status_info()  # the wiring check's cached answer, read next
        else:
            try:
                info = (await self.upstream.status(verbose=True)).info
            except errors.ShimError:
                return
        if info is None:
            return
        known = upstream_handlers(info)
        if known is not None and handler not in known:
            raise errors.InvalidArgument(
                f"runtime_handler {handler!r} is configured in podshim but not in the upstream "
                f"(it has: {', '.join(sorted(known)) or 'none'}): add it to the upstream's config, "
                "or restore with another runtime_handler; nothing was created"
            )

    async def _missing_images(self, plan: list[Planned]) -> list[str]:
        """Each planned container's image must be on this node with the id the checkpoint ran."""
        out = []
        for p in plan:
            want = p.config.image.image
            st = await self.upstream.image_status(want)
            present = [st.image.id, *st.image.repo_digests] if st.HasField("image") else None
            problem = compat.image_mismatch(p.entry.name, want, present, p.image_ref)
            if problem:
                out.append(problem)
        return out

    @staticmethod
    async def _image_mismatch(
        entry: manifest.ContainerEntry, requested: cri.ContainerConfig, record: dict, images: Images
    ) -> str | None:
        """The request's image must be the checkpoint's: the same reference, or one this node
        resolves to the checkpoint's image ID (docs/design/archive.md (Image identity)); a
        different image is a config mismatch (INVALID_ARGUMENT). Both fields are checked:
        `image.image` (the kubelet's image ID, or a name) and `image.user_specified_image` (the
        name the restored container reports; empty: the checkpoint's), as a container tar's
        restore checks them (restore_container.py). When the checkpoint's image is not on this
        node, _missing_images says so."""
        recorded = [*recorded_images(entry), *(str(record.get(k) or "") for k in ("image_ref", "image_id"))]
        recorded = [r for r in recorded if r]
        spec = requested.image
        fields = [("image", spec.image)]
        if spec.user_specified_image and spec.user_specified_image != spec.image:
            fields.append(("user_specified_image", spec.user_specified_image))
        for field, want in fields:
            found = await images.mismatch(want, recorded)
            if found is None:
                continue
            checkpoint_id, here = found
            what = f"is {here} on this node" if here else "is not on this node"
            named = entry.image or entry.user_specified_image
            return (
                f"container {entry.name!r}: {field} {want!r} differs from the checkpoint's "
                f"{named!r} ({checkpoint_id}): it {what}"
            )
        return None
