"""CheckpointPod's checks before anything is frozen (docs/design/checkpoint-pod.md (CheckpointPod) step 1):
the request's `options` parsed over the node's defaults, the containers to capture (listed, running,
named once, of this pod), what the archive records of the others, and that CRIU can dump each one (no
process in its cgroup outside its tree). Shared with CheckpointContainer (checkpoint_container.py)
and the live migration's source (shim/migration/source.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from api.runtime.v1 import api_pb2 as cri
from shim import contract, deadlines, errors
from shim.cgroups import cgroup_procs
from shim.config import GHOST_LIMIT_AUTO, ROOTFS_COMPRESSIONS, parse_size
from shim.criu.options import CriuOptions
from shim.sandbox import ContainerView, PodView


@dataclass(frozen=True)
class CheckpointOptions:
    """The `options` map of CheckpointPodRequest, parsed over the node's defaults (`[checkpoint]`,
    Config.option_defaults: the kubelet sends none). Unknown keys are rejected."""

    criu: CriuOptions = field(default_factory=CriuOptions)
    compress: bool = False  # gzip the rootfs diff
    # ghost-limit=auto: sized before the freeze from the deleted files the pod holds open, up to
    # this cap (docs/design/checkpoint-pod.md (What the kubelet sends)); 0: no sizing
    ghost_auto_max: int = 0

    KEYS = {
        contract.FILE_LOCKS: "handle file locks (default true)",
        contract.TCP_ESTABLISHED: "dump established TCP connections (default false)",
        contract.EXT_UNIX_SK: "allow external unix sockets (default false)",
        contract.SHELL_JOB: "allow a container attached to a terminal (default false)",
        "rootfs-compression": "none (default) or gzip for rootfs-diff.tar",
        "ghost-limit": "bytes (K/M/G suffix allowed) of a deleted but open file CRIU keeps, or auto "
        "(default: sized before the freeze, up to the node's cap)",
        "irmap-scan-paths": "comma-separated directories (container paths) where CRIU looks for the paths "
        "of files watched with inotify/fanotify (default: none; the watched files' directories are added)",
    }

    @classmethod
    def parse(
        cls, options: dict[str, str], defaults: dict[str, str] | None = None, ghost_cap: int = 0
    ) -> CheckpointOptions:
        """`options` over `defaults` (the same vocabulary); `ghost_cap` bounds ghost-limit=auto."""
        unknown = sorted(set(options) - set(cls.KEYS))
        if unknown:
            known = ", ".join(sorted(cls.KEYS))
            raise errors.InvalidArgument(f"unknown checkpoint option(s) {', '.join(unknown)}; known: {known}")
        values = {**(defaults or {}), **options}

        def flag(key: str, default: bool) -> bool:
            if key not in values:
                return default
            value = values[key].strip().lower()
            if value in ("true", "1", "yes"):
                return True
            if value in ("false", "0", "no"):
                return False
            raise errors.InvalidArgument(f"option {key}={values[key]!r}: expected true or false")

        compression = values.get("rootfs-compression", "none")
        if compression not in ROOTFS_COMPRESSIONS:
            raise errors.InvalidArgument(f"option rootfs-compression={compression!r}: expected none or gzip")
        ghost = values.get("ghost-limit", "").strip()
        auto = ghost.lower() == GHOST_LIMIT_AUTO
        return cls(
            criu=CriuOptions(
                file_locks=flag(contract.FILE_LOCKS, True),
                tcp_established=flag(contract.TCP_ESTABLISHED, False),
                ext_unix_sk=flag(contract.EXT_UNIX_SK, False),
                shell_job=flag(contract.SHELL_JOB, False),
                ghost_limit=0 if auto else _size(ghost),
                irmap_scan_paths=_scan_paths(values.get("irmap-scan-paths", "")),
            ),
            compress=compression == "gzip",
            ghost_auto_max=ghost_cap if auto else 0,
        )


def _size(value: str) -> int:
    """`ghost-limit`: bytes, optionally with a K, M or G suffix (binary, as CRIU reads it); "" is
    0, CRIU's default (1 MiB)."""
    if not value.strip():
        return 0
    try:
        return parse_size(value)
    except ValueError as e:
        raise errors.InvalidArgument(f"option ghost-limit={value!r}: {e} (or auto)") from None


def _scan_paths(value: str) -> tuple[str, ...]:
    """`irmap-scan-paths`: absolute directories as the containers see them, comma-separated."""
    paths = tuple(p.strip() for p in value.split(",") if p.strip())
    for p in paths:
        if not p.startswith("/") or ".." in p.split("/") or any(c in p for c in "\n\0"):
            raise errors.InvalidArgument(
                f"option irmap-scan-paths: {p!r} is not an absolute path inside the container (no '..')"
            )
    return paths


def select_containers(pod: PodView, container_ids: list[str]) -> list[ContainerView]:
    """The running containers to capture: exactly those `container_ids` lists. The released API
    (k8s.io/cri-api v0.37.2) wants the list non-empty, each id once, each a running container of
    the pod, and the request failed without a checkpoint otherwise: an empty list is never read as
    "all running", which would capture containers the caller did not select."""
    if not container_ids:
        running = [c.name for c in pod.containers if c.running]
        raise errors.InvalidArgument(
            "container_ids is empty: list the running containers to checkpoint, CheckpointPod "
            f"captures exactly those (pod {pod.name} ({pod.id[:13]}) has "
            + (f"running: {', '.join(running)}" if running else "none running")
            + "); nothing was frozen or written"
        )
    if len(set(container_ids)) != len(container_ids):
        dup = sorted({c for c in container_ids if container_ids.count(c) > 1})
        raise errors.InvalidArgument(f"container_ids lists {', '.join(dup)} more than once")
    selected = []
    for cid in container_ids:
        if not cid:
            raise errors.InvalidArgument("container_ids contains an empty id")
        c = pod.by_id(cid)
        if c is None:
            raise errors.NotFound(f"container {cid!r} is not a container of pod {pod.name} ({pod.id[:13]})")
        if not c.running:
            raise errors.FailedPrecondition(
                f"container {c.name!r} ({cid[:13]}) is {cri.ContainerState.Name(c.state)}, not running: "
                "only running containers can be checkpointed"
            )
        selected.append(c)
    return selected


def recorded_containers(pod: PodView, selected: list[ContainerView]) -> list[ContainerView]:
    """What the archive records: the selected containers, plus exited ones (completed init
    containers, finished jobs) whose name no running container has — their status is kept,
    they are not dumped. Of several exited attempts of one name the latest wins."""
    running_names = {c.name for c in pod.containers if c.running}
    exited: dict[str, ContainerView] = {}
    for c in pod.containers:  # ordered by creation
        if not c.running and c.name not in running_names:
            exited[c.name] = c
    keep = {c.id for c in selected} | {c.id for c in exited.values()}
    return [c for c in pod.containers if c.id in keep]


def check_dumpable(c: ContainerView, exec_wait: float = deadlines.EXEC_SESSION_WAIT) -> None:
    """Refuse what CRIU cannot dump, before anything is frozen: processes in the container's
    cgroup outside its process tree (exec sessions, detached daemons) would fail the dump. Exec
    sessions alone are waited for up to `exec_wait` seconds: the kubelet's exec probes are such
    sessions, a few every second, each over in milliseconds."""
    import psutil

    from shim.checks import strays

    give_up = time.monotonic() + exec_wait
    while True:
        if not psutil.pid_exists(c.pid):
            raise errors.FailedPrecondition(f"container {c.name!r}: its process {c.pid} is gone")
        # each process's parents read after the cgroup: one forked meanwhile is still in the tree
        extra = strays.outside_tree(c.pid, sorted(cgroup_procs(c.cgroups_path)))
        if not extra:
            return
        only_exec = all(s.exec_session for s in strays.classify(extra))
        if not only_exec or time.monotonic() >= give_up:
            raise strays.refusal(c.name, extra)  # what each is (exec session or not) and what to do
        time.sleep(deadlines.EXEC_SESSION_POLL)
