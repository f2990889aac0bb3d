"""The on-disk layout of a pod checkpoint (docs/design/archive.md (Archive layout)): one place for
every name.

Per-container file names are those of checkpointctl (`lib/metadata.go`) and go-criu, so a
`containers/<name>/` directory reads like a CRI-O/containerd container checkpoint.

    <output_path>/
      manifest.json            completion marker, written last
      sandbox/{config.json,status.json,network.json}
      containers/<name>/{config.dump,spec.dump,status.dump,checkpoint/,rootfs-diff.tar,
                         deleted.files,dump.log,stats-dump}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shim.archive.dirfd import DirHandle

# the modes belong to the layout contract (files 0600, dirs 0700): re-exported here
from shim.archive.fsutil import DIR_MODE as DIR_MODE
from shim.archive.fsutil import FILE_MODE as FILE_MODE
from shim.archive.fsutil import make_private_dir
from shim.archive.paths import check_component

MANIFEST_FILE = "manifest.json"


def json_bytes(value: Any) -> bytes:
    """How podshim writes its JSON members (*.dump, sandbox/*.json): indented, sorted, one
    trailing newline; values JSON cannot hold become strings."""
    return (json.dumps(value, indent=1, sort_keys=True, default=str) + "\n").encode()


SANDBOX_DIR = "sandbox"
SANDBOX_CONFIG_FILE = "config.json"  # PodSandboxConfig as JSON
SANDBOX_STATUS_FILE = "status.json"  # PodSandboxStatus (+ verbose info) as captured
SANDBOX_NETWORK_FILE = "network.json"  # network facts (shim/cni)

CONTAINERS_DIR = "containers"

# checkpointctl lib/metadata.go names
CONFIG_DUMP_FILE = "config.dump"
SPEC_DUMP_FILE = "spec.dump"
STATUS_DUMP_FILE = "status.dump"
NETWORK_STATUS_FILE = "network.status"
CHECKPOINT_DIR = "checkpoint"
ROOTFS_DIFF_TAR = "rootfs-diff.tar"
DELETED_FILES_FILE = "deleted.files"
DUMP_LOG_FILE = "dump.log"
RESTORE_LOG_FILE = "restore.log"
DEVSHM_CHECKPOINT_TAR = "devshm-checkpoint.tar"
# go-criu stats/types.go names
STATS_DUMP_FILE = "stats-dump"
STATS_RESTORE_FILE = "stats-restore"


@dataclass(frozen=True)
class ContainerLayout:
    """Paths of one container's directory inside an archive."""

    root: Path  # <archive>/containers/<name>
    rel: str  # "containers/<name>", the form stored in the manifest

    @property
    def config_dump(self) -> Path:
        return self.root / CONFIG_DUMP_FILE

    @property
    def spec_dump(self) -> Path:
        return self.root / SPEC_DUMP_FILE

    @property
    def status_dump(self) -> Path:
        return self.root / STATUS_DUMP_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / CHECKPOINT_DIR

    @property
    def rootfs_diff_tar(self) -> Path:
        return self.root / ROOTFS_DIFF_TAR

    @property
    def deleted_files(self) -> Path:
        return self.root / DELETED_FILES_FILE

    @property
    def dump_log(self) -> Path:
        return self.root / DUMP_LOG_FILE

    @property
    def stats_dump(self) -> Path:
        return self.root / STATS_DUMP_FILE

    def create(self) -> ContainerLayout:
        """Create the container dir and its empty checkpoint/ dir, both 0700."""
        make_private_dir(self.root)
        make_private_dir(self.checkpoint_dir)
        return self


@dataclass(frozen=True)
class ArchiveLayout:
    """Paths of a pod checkpoint rooted at `root` (an already validated directory); `dir`: that
    directory held open, what every write goes through while it is made (dirfd.py)."""

    root: Path
    dir: DirHandle | None = field(default=None, compare=False)

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_FILE

    @property
    def sandbox_dir(self) -> Path:
        return self.root / SANDBOX_DIR

    @property
    def sandbox_config(self) -> Path:
        return self.sandbox_dir / SANDBOX_CONFIG_FILE

    @property
    def sandbox_status(self) -> Path:
        return self.sandbox_dir / SANDBOX_STATUS_FILE

    @property
    def sandbox_network(self) -> Path:
        return self.sandbox_dir / SANDBOX_NETWORK_FILE

    @property
    def containers_dir(self) -> Path:
        return self.root / CONTAINERS_DIR

    def container(self, name: str) -> ContainerLayout:
        """Layout of container `name`; InvalidArgument if the name is not a safe dir name."""
        check_component(name, "container name")
        return ContainerLayout(root=self.containers_dir / name, rel=f"{CONTAINERS_DIR}/{name}")

    def create(self) -> ArchiveLayout:
        """Create sandbox/ and containers/ (0700) inside the existing root."""
        make_private_dir(self.sandbox_dir)
        make_private_dir(self.containers_dir)
        return self
