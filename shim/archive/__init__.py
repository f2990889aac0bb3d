"""On-disk pod checkpoints: layout, manifest + checksums, path confinement, rootfs diffs.

Submodules, one concern each: `paths` (confinement of caller paths and archive members),
`layout` (names, docs/design/archive.md (Archive layout)), `fsutil` (atomic/durable writes,
hashing), `manifest` (format, write, verify), `rootfs_diff` (writable-layer capture and apply) and
`crypto` (encryption at rest). Nothing is imported here: podshim-runc loads only what a restore needs.
"""
