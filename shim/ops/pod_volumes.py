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
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shim import errors, logs
from shim.archive import crypto, layout, manifest, volumes
from shim.archive.dirfd import DirHandle
from shim.sandbox import ContainerView, PodView

log = logs.get("shim.ops.pod_volumes")

LIMIT_KEY = "checkpoint.volume_limit"


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
    pod: PodView, containers: Sequence[ContainerView], limit: int, stop: threading.Event | None = None
) -> PodVolumes:
    """The emptyDirs `containers` mount and the pod's /dev/shm, with what their tars take:
    FAILED_PRECONDITION over `limit` bytes together."""
    dirs = tuple(volumes.find_empty_dirs([(c.name, c.spec) for c in containers], pod.status.metadata.uid))
    shm = volumes.dev_shm_source(pod.spec)
    sizes = {d.name: volumes.tree_bytes(d.host_path, stop) for d in dirs}
    if shm is not None:
        sizes[volumes.DEV_SHM] = volumes.tree_bytes(shm, stop)
    volumes.check_limit(sizes, limit, LIMIT_KEY)
    return PodVolumes(dirs, shm, sizes)


def capture(found: PodVolumes, archive: DirHandle, stop: threading.Event | None = None) -> dict[str, int]:
    """Inside the freeze: tar every volume that holds anything into the held archive's sandbox/,
    and write sandbox/volumes.json when one did. Returns the bytes of file data per volume."""
    summaries: dict[str, volumes.Summary] = {}
    shm: tuple[str, volumes.Summary] | None = None
    with archive.sub(layout.SANDBOX_DIR) as sb:
        held: DirHandle | None = None
        try:
            for d in found.empty_dirs:
                if volumes.is_empty(d.host_path):
                    continue
                if held is None:
                    held = sb.mkdir(volumes.EMPTY_DIRS_DIR)
                summaries[d.name] = volumes.capture(d.host_path, held.at(f"{d.name}.tar"), stop)
        finally:
            if held is not None:
                held.close()
        if found.dev_shm is not None and not volumes.is_empty(found.dev_shm):
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


def fill(
    root: Path,
    m: manifest.Manifest,
    rec: volumes.Record,
    where: Targets,
    key: crypto.NodeKey | None,
    state_dir: str,
    stop: threading.Event | None = None,
    only_empty: bool = False,
) -> dict[str, int]:
    """Fill the new pod's volumes from the archive, before its first container is created (an
    encrypted archive's tars decrypted, each checked against the manifest as it is read, into a
    private directory removed afterwards). `only_empty`: a volume already holding anything is
    left as it is (a kubelet's restore: an earlier container of the pod filled it). Returns the
    bytes written per volume."""
    jobs: list[tuple[str, str, str]] = [
        (n, f"{layout.SANDBOX_DIR}/{volumes.EMPTY_DIRS_DIR}/{n}.tar", p) for n, p in where.empty_dirs.items()
    ]
    if where.dev_shm is not None:
        jobs.append((volumes.DEV_SHM, f"{layout.SANDBOX_DIR}/{volumes.DEV_SHM_TAR}", where.dev_shm))
    if only_empty:
        jobs = [j for j in jobs if volumes.is_empty(j[2])]
    if not jobs:
        return {}
    written: dict[str, int] = {}
    plain_dir: Path | None = None
    try:
        if m.encryption is not None:
            assert key is not None  # load_and_check refused an encrypted archive without one
            plain_dir = crypto.new_decrypted_dir(state_dir, root, "volumes")
        for name, rel, target in jobs:
            tar = root / rel
            if plain_dir is not None and key is not None:
                tar = plain_dir / f"{len(written)}.tar"
                f = m.files[rel]
                crypto.decrypt_file(root / rel, tar, rel, key, stop, expect=(f.size, f.sha256))
                volumes.check_tar(tar)
            written[name] = volumes.apply(tar, Path(target), stop).bytes
            log.info("volume filled", volume=name, target=target, bytes=written[name])
    finally:
        if plain_dir is not None:
            with contextlib.suppress(OSError):
                crypto.remove_decrypted(plain_dir)
    return written
