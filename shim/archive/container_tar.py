"""The container checkpoint tar (CheckpointContainer, KEP-2008): its format name, the names of its
members and the limits a reader applies (docs/architecture.md §6 (CheckpointContainer)). Shared by
the daemon (shim/ops/checkpoint_container.py, restore_container.py) and `podshim inspect`
(shim/cli/commands/inspect.py)."""

from __future__ import annotations

from shim.archive import layout

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
