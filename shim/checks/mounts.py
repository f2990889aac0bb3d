"""The bind mounts a restore must be given (docs/design/checkpoint-container.md
(CheckpointContainer) and docs/design/restore-pod.md (RestorePod) step 1): CRIU restores a
container's checkpointed mount namespace and needs a source for every bind mount its spec.dump
holds; without one it fails deep in StartContainer ("mnt: No mapping for …"). Both restores
(RestorePod, CreateContainer from a container tar) refuse such a request up front, with the same
code and wording, before anything is created.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from shim import errors

# Bind mounts the upstream adds to a container itself when the request has none there (containerd's
# CRI: the sandbox's hostname, hosts and resolv.conf files and its /dev/shm): a restore needs no
# mount of them in the request. Measured: a kubelet container's tar restored without /etc/hosts in
# the request resumes; without its termination-log or service-account token mount CRIU fails.
UPSTREAM_MOUNTS = frozenset({"/etc/hostname", "/etc/hosts", "/etc/resolv.conf", "/dev/shm"})


def missing_mounts(spec: Mapping[str, Any], req: cri.ContainerConfig) -> list[str]:
    """The destinations of the checkpoint's bind mounts (its spec.dump) that the container config
    `req` does not mount. The ones the upstream provides itself (UPSTREAM_MOUNTS) and the
    runtime's own (proc, sysfs, tmpfs, devpts, mqueue, cgroup: no bind mounts) need none."""
    given = {os.path.normpath(m.container_path) for m in req.mounts if m.container_path}
    mounts = spec.get("mounts")
    missing = []
    for m in mounts if isinstance(mounts, list) else []:
        if not isinstance(m, dict):
            continue
        options = m.get("options")
        options = {o for o in options if isinstance(o, str)} if isinstance(options, list) else set()
        if m.get("type") != "bind" and not {"bind", "rbind"} & options:
            continue
        dest = os.path.normpath(str(m.get("destination") or "/"))
        if dest not in UPSTREAM_MOUNTS and dest not in given and dest not in missing:
            missing.append(dest)
    return missing


def refuse_missing(missing: Mapping[str, Sequence[str]], checkpoint: str) -> None:
    """FAILED_PRECONDITION naming, per container, every bind mount of `checkpoint` its config lacks
    (as CRI-O's restore: "expects following bind mounts defined"); nothing when none is missing.

    FAILED_PRECONDITION, not INVALID_ARGUMENT (docs/design/errors.md (Errors)): the request is
    a valid config, and mounts are restore-time settings the caller may change (a new host path);
    what is missing is a source the checkpointed process needs, as the image a node lacks."""
    named = [f"container {name!r}: {', '.join(dests)}" for name, dests in missing.items() if dests]
    if named:
        raise errors.FailedPrecondition(
            f"checkpoint {checkpoint} was taken with bind mount(s) the request lacks ({'; '.join(named)}): "
            "give each container config a mount for each (container_path as listed; the host path may "
            "be new), as CRIU restores the container's mounts; nothing was created"
        )
