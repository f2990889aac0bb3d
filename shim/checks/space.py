"""Will the checkpoint fit? An estimate of its size, checked before anything is frozen.

A full disk is handled cleanly, but only after the pod was frozen and dumped: that freeze is
the cost the workload pays for nothing. So CheckpointPod and CheckpointContainer estimate the
archive first (docs/design/checkpoint-pod.md (CheckpointPod) step 1): the resident memory of the
selected containers' processes (what CRIU writes, file-backed pages overcounted a little) plus
their writable layers (the overlay upper dirs the rootfs diff tars), plus a margin, and refuse
with RESOURCE_EXHAUSTED when the file system of the directory podshim holds has less free.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from shim import errors
from shim.archive import fsutil
from shim.archive.dirfd import DirHandle
from shim.cgroups import cgroup_procs
from shim.sandbox import ContainerView

MARGIN_FRACTION = 0.10  # of the estimate: CRIU's own images, logs, the manifest, tar headers
MARGIN_BYTES = 64 << 20  # and a floor: a pod of tiny processes still needs some room
MiB = 1 << 20


@dataclass(frozen=True)
class Estimate:
    memory: int  # resident memory of the containers' processes
    layers: int  # their writable layers, as tarred
    margin: int
    volumes: int = 0  # the pod's emptyDirs and /dev/shm, as tarred

    @property
    def total(self) -> int:
        return self.memory + self.layers + self.volumes + self.margin


def memory_bytes(c: ContainerView) -> int:
    """Resident memory (RSS) of every process in the container's cgroup."""
    import psutil

    total = 0
    for pid in cgroup_procs(c.cgroups_path):
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue  # ended meanwhile
    return total


def layer_bytes(upper: Path | None, stop: threading.Event | None = None) -> int:
    """What the rootfs diff of the overlay upper dir `upper` takes: regular files' sizes plus a
    header per entry."""
    if upper is None:
        return 0
    return fsutil.tar_tree_bytes(upper, lambda st: st.st_size, stop)


def estimate(
    containers: list[ContainerView], stop: threading.Event | None = None, volumes: int = 0
) -> Estimate:
    memory = sum(memory_bytes(c) for c in containers)
    layers = sum(layer_bytes(c.upperdir(), stop) for c in containers)
    margin = int((memory + layers + volumes) * MARGIN_FRACTION) + MARGIN_BYTES
    return Estimate(memory, layers, margin, volumes)


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def check_fits(
    d: DirHandle,
    containers: list[ContainerView],
    what: str,
    stop: threading.Event | None = None,
    volumes: int = 0,
) -> Estimate:
    """ResourceExhausted, saying how much is needed and how much is free, when the file system
    of `d` (statvfs of the descriptor podshim holds) cannot hold the checkpoint (`volumes`: the
    bytes of the pod's volumes it carries)."""
    est = estimate(containers, stop, volumes)
    free = d.free_bytes()
    if free < est.total:
        raise errors.ResourceExhausted(
            f"{what} has {_mib(free)} free, the checkpoint needs about {_mib(est.total)} "
            f"(memory {_mib(est.memory)} + writable layers {_mib(est.layers)}"
            + (f" + volumes {_mib(est.volumes)}" if est.volumes else "")
            + f" + margin {_mib(est.margin)}); "
            "nothing was frozen: free space there or choose a path on a larger file system"
        )
    return est
