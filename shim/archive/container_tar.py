"""The container checkpoint tar (CheckpointContainer, KEP-2008): its format name, the names of its
members, the limits a reader applies and its manifest, podshim-manifest.json
(docs/design/checkpoint-container.md (CheckpointContainer)). Shared by the daemon
(shim/ops/checkpoint_container.py, restore_container.py) and `podshim inspect`
(shim/cli/commands/inspect.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shim.archive import layout
from shim.archive.dirfd import DirHandle, held
from shim.archive.fsutil import hash_file
from shim.archive.manifest import FileEntry, rfc3339_now
from shim.errors import DataLoss, FailedPrecondition, Internal

FORMAT = "podshim.container-checkpoint.v1"
MANIFEST_FILE = "podshim-manifest.json"
# Written first in the tar, so that inspectors find the metadata without reading the images.
# The manifest comes last: it holds the checksums computed while the tar is written.
LEADING_MEMBERS = (layout.CONFIG_DUMP_FILE, layout.SPEC_DUMP_FILE, layout.STATUS_DUMP_FILE)
# The entries the Kubernetes node e2e check requires (test/e2e_node/checkpoint_container.go).
REQUIRED_MEMBERS = (layout.SPEC_DUMP_FILE, layout.CONFIG_DUMP_FILE, f"{layout.CHECKPOINT_DIR}/inventory.img")
MAX_METADATA_BYTES = 64 << 20  # config.dump, spec.dump, manifest: read whole, so bounded


def tar_error(e: BaseException) -> str:
    """tarfile's reason on one line ("r:*" lists every compression it tried)."""
    text = str(e)
    if "could not be opened successfully" in text:
        return "not a tar archive (plain, gzip, bzip2 or xz)"
    if "unexpected end of data" in text:
        return "truncated (unexpected end of data)"
    return " ".join(text.split())


# ---------------------------------------------------------------------------- its manifest


@dataclass
class ContainerTarManifest:
    """podshim-manifest.json, the last member of a container checkpoint tar (CheckpointContainer,
    docs/design/checkpoint-container.md (CheckpointContainer); the tar's member names above):
    what was checkpointed, on which host, its timings, CRIU stats and options, and size + sha256
    of every other member. Written by shim/ops/checkpoint_container.py, checked by
    shim/ops/restore_container.py and `podshim inspect`."""

    # id, name, image, image_ref, restart_count, state
    container: dict[str, Any] = field(default_factory=dict)
    pod: dict[str, Any] = field(default_factory=dict)  # id, name, namespace, uid
    host: dict[str, Any] = field(default_factory=dict)  # HostInfo's fields
    timings: dict[str, float] = field(default_factory=dict)  # seconds, e.g. "freeze_window"
    criu_stats: dict[str, Any] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)  # CriuOptions.switches_record
    files: dict[str, FileEntry] = field(default_factory=dict)  # member -> size, sha256
    created: str = field(default_factory=rfc3339_now)
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "created": self.created,
            "host": self.host,
            "container": self.container,
            "pod": self.pod,
            "timings": self.timings,
            "criu_stats": self.criu_stats,
            "options": self.options,
            "files": {k: {"size": v.size, "sha256": v.sha256} for k, v in sorted(self.files.items())},
        }

    def to_json(self) -> bytes:
        return layout.json_bytes(self.to_dict())

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ContainerTarManifest:
        """Parse a decoded podshim-manifest.json (`where`: the tar, for messages). A shape podshim
        never writes is DataLoss; the format is checked apart (check_format), so that `podshim
        inspect` still shows another version's tar."""
        bad = DataLoss(f"{where}: {MANIFEST_FILE} is malformed")
        if not isinstance(d, dict) or not isinstance(d.get("files"), dict):
            raise bad
        objects = ("container", "pod", "host", "timings", "criu_stats", "options")
        shapes_ok = all(isinstance(d.get(k, {}), dict) for k in objects)
        if not shapes_ok or not isinstance(d.get("format", ""), str):
            raise bad
        files = {}
        for rel, fe in d["files"].items():
            size, digest = (fe.get("size"), fe.get("sha256")) if isinstance(fe, dict) else (None, None)
            if not isinstance(size, int) or isinstance(size, bool) or not isinstance(digest, str):
                raise DataLoss(f"{where} is corrupt: {rel} differs from its manifest (size or sha256)")
            files[rel] = FileEntry(size=size, sha256=digest)
        return cls(
            files=files,
            created=str(d.get("created", "")),
            format=d.get("format", ""),
            **{k: d.get(k, {}) for k in objects},
        )

    def check_format(self, where: str) -> None:
        """FailedPrecondition unless this podshim reads the tar's format."""
        if self.format != FORMAT:
            raise FailedPrecondition(
                f"{where}: format {self.format!r} is not supported (this podshim reads {FORMAT})"
            )

    def check_files(self, actual: dict[str, FileEntry], where: str) -> None:
        """The tar's members (but the manifest) are exactly the listed ones, each with its size and
        sha256: DataLoss naming the first that is not."""
        odd = sorted(set(actual) ^ set(self.files))
        if odd:
            raise DataLoss(f"{where} does not match its manifest: {', '.join(odd[:5])} missing or extra")
        for rel, fe in sorted(self.files.items()):
            if actual[rel] != fe:
                raise DataLoss(f"{where} is corrupt: {rel} differs from its manifest (size or sha256)")


def container_tar_files(
    tree: Path | DirHandle, check: Callable[[], None] | None = None
) -> dict[str, FileEntry]:
    """size + sha256 of every regular file under `tree` but the manifest (what it lists), listed
    and read through descriptors (dirfd.HeldTree); anything else is a bug (Internal). `check` runs
    before each file (a cancellation point)."""
    entries = {}
    with (
        held(tree) as h,
        h.tree(lambda msg: Internal(f"unexpected entry in a container checkpoint: {msg}")) as t,
    ):
        for rel in sorted(t.files):
            if rel == MANIFEST_FILE:
                continue
            if check is not None:
                check()
            size, digest = hash_file(t.path(rel))
            entries[rel] = FileEntry(size=size, sha256=digest)
    return entries
