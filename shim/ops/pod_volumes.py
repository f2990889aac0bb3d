"""What a pod holds beside its containers' processes and layers: its emptyDir volumes and its
/dev/shm (docs/design/archive.md (Archive layout); the tar format: shim/archive/volumes.py).

CheckpointPod sizes them before the freeze (refused over `checkpoint.volume_limit`, counted in
the space check) and tars what they hold while the pod is frozen, beside the dumps, so the files
are those of the cut; a process's mapping of a /dev/shm file (POSIX shared memory) is dumped by
CRIU as a mapping of that file. RestorePod fills the new pod's volumes before its first container
is created, so the restored processes find their files and their mappings reattach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shim import errors, logs
from shim.aio import run_to_end
from shim.archive import crypto, layout, manifest, volumes
from shim.archive.dirfd import DirHandle
from shim.sandbox import ContainerView, PodView
from shim.state import Journal, OpRecord
from shim.state.records import VolumeFillRecord

log = logs.get("shim.ops.pod_volumes")

LIMIT_KEY = "checkpoint.volume_limit"
KIND = "volume-fill"  # journal kind of a fill outside RestorePod's record (journaled, recover)


@dataclass(frozen=True)
class PodVolumes:
    """A pod's volumes to capture, found and sized before the freeze."""

    empty_dirs: tuple[volumes.EmptyDir, ...] = ()
    dev_shm: str | None = None  # the host path of the pod's own /dev/shm
    sizes: dict[str, int] = field(default_factory=dict)  # name ("/dev/shm" for it) -> tar bytes

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())


def find(
    pod: PodView,
    containers: Sequence[ContainerView],
    limit: int,
    stop: threading.Event | None = None,
    dev_shm: bool = True,
) -> PodVolumes:
    """The emptyDirs `containers` mount and (`dev_shm`) the pod's /dev/shm, with what their tars
    take: FAILED_PRECONDITION over `limit` bytes together."""
    dirs = tuple(volumes.find_empty_dirs([(c.name, c.spec) for c in containers], pod.status.metadata.uid))
    shm = volumes.dev_shm_source(pod.spec) if dev_shm else None
    sizes = {d.name: volumes.tree_bytes(d.host_path, stop) for d in dirs}
    if shm is not None:
        sizes[volumes.DEV_SHM] = volumes.tree_bytes(shm, stop)
    volumes.check_limit(sizes, limit, LIMIT_KEY)
    return PodVolumes(dirs, shm, sizes)


def capture(found: PodVolumes, archive: DirHandle, stop: threading.Event | None = None) -> dict[str, int]:
    """Inside the freeze: tar every volume that holds anything into the held archive's sandbox/,
    and write sandbox/volumes.json when one did (sandbox/ made if need be: a container tar has
    none). Returns the bytes of file data per volume."""
    summaries: dict[str, volumes.Summary] = {}
    shm: tuple[str, volumes.Summary] | None = None
    full = [d for d in found.empty_dirs if not volumes.is_empty(d.host_path)]
    shm_full = found.dev_shm is not None and not volumes.is_empty(found.dev_shm)
    if not (full or shm_full):
        return {}
    with archive.sub(layout.SANDBOX_DIR, create=True) as sb:
        held: DirHandle | None = None
        try:
            for d in full:
                if held is None:
                    held = sb.mkdir(volumes.EMPTY_DIRS_DIR)
                summaries[d.name] = volumes.capture(d.host_path, held.at(f"{d.name}.tar"), stop)
        finally:
            if held is not None:
                held.close()
        if found.dev_shm is not None and shm_full:
            shm = (found.dev_shm, volumes.capture(found.dev_shm, sb.at(volumes.DEV_SHM_TAR), stop))
        if summaries or shm is not None:
            sb.write_file(volumes.VOLUMES_FILE, volumes.record_bytes(found.empty_dirs, summaries, shm))
    out = {n: s.bytes for n, s in summaries.items()}
    if shm is not None:
        out[volumes.DEV_SHM] = shm[1].bytes
    return out


def record_rel() -> str:
    return f"{layout.SANDBOX_DIR}/{volumes.VOLUMES_FILE}"


def recorded(root: Path, m: manifest.Manifest, key: crypto.NodeKey | None) -> volumes.Record | None:
    """The archive's verified volume record, None when it holds no volume."""
    rel = record_rel()
    if rel not in m.files:
        return None
    data = manifest.read_verified(root, m, rel)
    if m.encryption is not None and key is not None:
        data = crypto.decrypt_buffer(data, rel, key)
    rec = volumes.parse_record(data, f"checkpoint {root}: {rel}")
    for t in tar_rels(rec):
        if t not in m.files:
            raise errors.DataLoss(f"checkpoint {root}: {rel} names {t}, which the manifest does not list")
    return rec


def recorded_in_tree(root: Path, what: str) -> volumes.Record | None:
    """The volume record of an extracted container tar (`what` names it), whose members were
    checked against the tar's own manifest as it was loaded; None when it holds no volume."""
    rel = record_rel()
    try:
        data = (root / rel).read_bytes()
    except FileNotFoundError:
        return None
    rec = volumes.parse_record(data, f"{what}: {rel}")
    for t in tar_rels(rec):
        if not (root / t).is_file():
            raise errors.DataLoss(f"{what}: {rel} names {t}, which the archive does not hold")
    return rec


def tar_rels(rec: volumes.Record) -> list[str]:
    """The archive members (relative paths) holding the recorded volumes' tars."""
    sb = layout.SANDBOX_DIR
    rels = [f"{sb}/{volumes.EMPTY_DIRS_DIR}/{n}.tar" for n in rec.empty_dirs]
    return rels + ([f"{sb}/{volumes.DEV_SHM_TAR}"] if rec.dev_shm else [])


def check(root: Path, rec: volumes.Record, encrypted: bool, stop: threading.Event | None = None) -> None:
    """Before anything is created: refuse a tar that fill would refuse for its content (plain
    archives; an encrypted one's tars are checked as they are decrypted, in fill)."""
    if encrypted:
        return
    for rel in tar_rels(rec):
        if stop is not None and stop.is_set():
            return
        volumes.check_tar(root / rel)


@dataclass(frozen=True)
class Targets:
    """The new pod's volumes a restore fills: emptyDir name -> host path, and its /dev/shm."""

    empty_dirs: dict[str, str]
    dev_shm: str | None


def targets(
    rec: volumes.Record,
    configs: Sequence[Any],
    uid: str,
    sandbox_spec: Mapping[str, Any],
    partial: bool = False,
) -> Targets:
    """Where each recorded volume goes in the new pod: its emptyDirs from the request's container
    configs (cri.ContainerConfig), its /dev/shm from the new sandbox's OCI spec. `partial`: one
    container of a pod (a kubelet's restore), filling only the emptyDirs its config mounts."""
    names = list(rec.empty_dirs)
    mounted = volumes.targets(names, configs, uid, missing_ok=partial)
    shm = None
    if rec.dev_shm:
        shm = volumes.dev_shm_source(sandbox_spec)
        if shm is None:
            raise errors.FailedPrecondition(
                "the checkpoint holds the pod's /dev/shm, but the new sandbox has none of its own "
                "(host IPC, or a runtime that mounts none): restore it into a pod with its own IPC "
                "namespace; nothing was created"
            )
    return Targets(mounted, shm)


@dataclass(frozen=True)
class Filled:
    """A volume a restore filled from the archive while it was empty."""

    name: str  # the volume's name ("/dev/shm" for it)
    target: str  # its host path in the new pod
    bytes: int
    prior: volumes.Prior  # the directory as the caller made it


def to_fill(where: Targets) -> list[dict[str, Any]]:
    """The volumes of `where` a fill would write (those still empty), as the journal records them
    before the fill: a restore interrupted by a crash is undone by `empty_recorded`."""
    out = []
    for target in [*where.empty_dirs.values(), *([where.dev_shm] if where.dev_shm else [])]:
        try:
            if volumes.is_empty(target):
                prior = volumes.Prior.of(os.stat(target, follow_symlinks=False))
                out.append({"target": str(target), **dataclasses.asdict(prior)})
        except OSError:
            continue  # the fill itself refuses it, naming why
    return out


@contextlib.contextmanager
def journaled(journal: Journal, pod_key: str, where: Targets) -> Iterator[None]:
    """Around a fill that no record of its own covers (a kubelet's restore of one container, a
    container tar's): the volumes about to be filled, journaled until the fill has ended, filled
    or emptied again by fill itself; a crash meanwhile is undone at the next start (recover), so
    a half-filled volume never passes for a filled one at the caller's retry."""
    recorded = to_fill(where)
    rec = journal.begin(KIND, pod_key, VolumeFillRecord(recorded)) if recorded else None
    try:
        yield
    finally:
        if rec is not None:
            journal.finish(rec)


async def recover(rec: OpRecord) -> None:
    """Undo a fill a crash interrupted (journaled): empty the volumes it was filling. The sandbox
    is its caller's (the kubelet's), left as it is."""
    data: VolumeFillRecord = rec.data
    await run_to_end(empty_recorded, data.volumes)


def empty_recorded(recorded: Sequence[Mapping[str, Any]]) -> None:
    """The recovery of a restore a crash interrupted after `to_fill`'s record: each recorded
    volume emptied and given back its mode and owner (what the fill wrote belongs to the pod the
    recovery removes)."""
    filled = []
    for r in recorded:
        try:
            prior = volumes.Prior(**{k: int(v) for k, v in r.items() if k != "target"})
            filled.append(Filled("", str(r["target"]), 0, prior))
        except (KeyError, TypeError, ValueError) as e:  # a record this version cannot read
            log.error("a recorded volume cannot be emptied: unreadable entry", entry=r, error=str(e))
    empty_again(filled)


def empty_again(filled: Sequence[Filled]) -> None:
    """The undo of `fill` when the restore fails after it: each volume it filled is emptied and
    given back its mode and owner, so that the caller's retry (a kubelet's CreateContainer, a
    second RestorePod into the same pod directory) finds it empty, not holding a failed restore's
    files. Its own errors are logged: the restore's error is the one reported."""
    for f in filled:
        try:
            volumes.clear(f.target, f.prior)
        except FileNotFoundError:
            continue  # the caller removed its pod directory meanwhile
        except OSError as e:
            log.error(
                "volume not emptied after a failed restore", volume=f.name, target=f.target, error=str(e)
            )
        else:
            log.info("volume emptied after a failed restore", volume=f.name, target=f.target)


def fill(
    root: Path,
    m: manifest.Manifest | None,
    rec: volumes.Record,
    where: Targets,
    key: crypto.NodeKey | None,
    state_dir: str,
    stop: threading.Event | None = None,
    only_empty: bool = False,
) -> list[Filled]:
    """Fill the new pod's volumes from the archive, before its first container is created (an
    encrypted archive's tars decrypted, each checked against the manifest as it is read, into a
    private directory removed afterwards; `m` None: a container tar's tree, its members checked
    as it was loaded). `only_empty`: a volume already holding anything is
    left as it is (a kubelet's restore: an earlier container of the pod filled it). Returns what
    it filled; when it fails, what it filled is emptied again first."""
    jobs: list[tuple[str, str, str]] = [
        (n, f"{layout.SANDBOX_DIR}/{volumes.EMPTY_DIRS_DIR}/{n}.tar", p) for n, p in where.empty_dirs.items()
    ]
    if where.dev_shm is not None:
        jobs.append((volumes.DEV_SHM, f"{layout.SANDBOX_DIR}/{volumes.DEV_SHM_TAR}", where.dev_shm))
    if only_empty:
        jobs = [j for j in jobs if volumes.is_empty(j[2])]
    if not jobs:
        return []
    filled: list[Filled] = []
    plain_dir: Path | None = None
    try:
        if m is not None and m.encryption is not None:
            assert key is not None  # load_and_check refused an encrypted archive without one
            plain_dir = crypto.new_decrypted_dir(state_dir, root, "volumes")
        for name, rel, target in jobs:
            tar = root / rel
            if plain_dir is not None and key is not None and m is not None:
                tar = plain_dir / f"{len(filled)}.tar"
                f = m.files[rel]
                crypto.decrypt_file(root / rel, tar, rel, key, stop, expect=(f.size, f.sha256))
                volumes.check_tar(tar)
            s = volumes.apply(tar, Path(target), stop)
            assert s.prior is not None
            filled.append(Filled(name, str(target), s.bytes, s.prior))
            log.info("volume filled", volume=name, target=target, bytes=s.bytes)
    except BaseException:
        empty_again(filled)
        raise
    finally:
        if plain_dir is not None:
            with contextlib.suppress(OSError):
                crypto.remove_decrypted(plain_dir)
    return filled
