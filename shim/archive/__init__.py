"""On-disk pod checkpoints: layout, manifest + checksums, path confinement, rootfs diffs.

Submodules, one concern each: `paths` (confinement of caller paths and archive members),
`layout` (names, DESIGN §6), `fsutil` (atomic/durable writes, hashing), `manifest`
(format, write, verify) and `rootfs_diff` (writable-layer capture and apply).
"""

from shim.archive.fsutil import atomic_write, clear_dir_contents, fsync_tree, sha256_file
from shim.archive.layout import ArchiveLayout, ContainerLayout
from shim.archive.manifest import (
    FORMAT,
    ContainerEntry,
    FileEntry,
    HostInfo,
    Manifest,
    SandboxInfo,
    load_and_verify,
    read_manifest,
    write_manifest,
)
from shim.archive.paths import confined_join, validate_archive_dir, validate_output_dir
from shim.archive.rootfs_diff import DiffSummary, apply_rootfs_diff, capture_rootfs_diff

__all__ = [
    "FORMAT",
    "ArchiveLayout",
    "ContainerEntry",
    "ContainerLayout",
    "DiffSummary",
    "FileEntry",
    "HostInfo",
    "Manifest",
    "SandboxInfo",
    "apply_rootfs_diff",
    "atomic_write",
    "capture_rootfs_diff",
    "clear_dir_contents",
    "confined_join",
    "fsync_tree",
    "load_and_verify",
    "read_manifest",
    "sha256_file",
    "validate_archive_dir",
    "validate_output_dir",
    "write_manifest",
]
