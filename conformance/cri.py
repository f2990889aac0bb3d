"""CRI plumbing of the conformance suite: the connection, kubelet-like configs, log reading and
cgroup clean-up. Nothing here knows which runtime is behind the endpoint."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc

DEFAULT_IMAGE = "localhost/podshim/counter:1"
# The counter prints `count=<n> ts=...`; a plain command may print bare numbers. Lines such as
# `ready mem_mib=8` or `stopping count=3` do not match.
DEFAULT_COUNT_PATTERN = r"^(?:count=)?(\d+)\b"
DEFAULT_COUNTER_ARGS = ["--mem-mib", "8", "--interval-ms", "100"]
NAMESPACE = "podshim-conformance"
RUN_LABEL = "conformance.podshim.io/run"
POD_UID_LABEL = "io.kubernetes.pod.uid"
CALL_TIMEOUT = 60.0  # ordinary CRI calls
CGROUP_FS = Path("/sys/fs/cgroup")


class SetupError(RuntimeError):
    """The suite cannot run at all (endpoint unreachable, image missing): exit code 2."""


def rpc_error_text(err: grpc.RpcError) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return f"{code.name if code else 'UNKNOWN'}: {details}"


@dataclass
class Workload:
    """What runs in the suite's containers: an image and a command printing increasing numbers."""

    image: str = DEFAULT_IMAGE
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=lambda: list(DEFAULT_COUNTER_ARGS))
    count_pattern: str = DEFAULT_COUNT_PATTERN

    def __post_init__(self) -> None:
        self.count_re = re.compile(self.count_pattern)


@dataclass
class CgroupLayout:
    """Where pods' cgroups go, as a kubelet would put them for the runtime's cgroup driver."""

    driver: str  # "cgroupfs" or "systemd"
    root: str  # cgroupfs: a path such as /podshim-conformance; systemd: a slice name prefix

    def parent(self, uid: str) -> str:
        if self.driver == "systemd":
            return f"{self.root}-pod{uid.replace('-', '_')}.slice"
        return f"{self.root.rstrip('/')}/pod{uid}"

    def existing_dirs(self, rel: str) -> list[Path]:
        """The directories of a cgroupfs path in every mounted hierarchy (v1) or the unified one."""
        rel = rel.strip("/")
        if not rel or not CGROUP_FS.is_dir():
            return []
        if (CGROUP_FS / "cgroup.controllers").exists():
            candidates = [CGROUP_FS / rel]
        else:
            candidates = [h / rel for h in CGROUP_FS.iterdir() if h.is_dir() and not h.is_symlink()]
        return [c for c in candidates if c.is_dir()]

    def remove_pod(self, parent: str) -> None:
        """Remove a pod-level cgroup the runtime left (the kubelet's job; runtimes keep it)."""
        if self.driver != "cgroupfs":
            return  # systemd removes empty transient slices itself
        for d in self.existing_dirs(parent):
            with contextlib.suppress(OSError):
                d.rmdir()


def new_uid() -> str:
    return secrets.token_hex(8)


class Runtime:
    """A CRI client on one endpoint with kubelet-like request builders."""

    def __init__(
        self,
        endpoint: str,
        workload: Workload,
        cgroups: CgroupLayout | None,
        log_root: Path,
        run_id: str,
        runtime_handler: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.channel = grpc.insecure_channel(
            endpoint, options=[("grpc.max_receive_message_length", 16 << 20)]
        )
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.img = api_pb2_grpc.ImageServiceStub(self.channel)
        self.workload = workload
        self.cgroups = cgroups
        self.log_root = log_root
        self.run_id = run_id
        self.runtime_handler = runtime_handler

    def close(self) -> None:
        self.channel.close()

    # ------------------------------------------------------------------ configs

    def pod_config(self, name: str, uid: str | None = None) -> cri.PodSandboxConfig:
        """A PodSandboxConfig as the kubelet sends it: fresh UID, per-pod log dir and cgroup parent."""
        uid = uid or new_uid()
        log_dir = self.log_root / f"{NAMESPACE}_{name}_{uid}"
        log_dir.mkdir(parents=True, exist_ok=True)
        linux = cri.LinuxPodSandboxConfig(
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.CONTAINER, ipc=cri.POD)
            ),
        )
        if self.cgroups is not None:
            linux.cgroup_parent = self.cgroups.parent(uid)
        return cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=NAMESPACE, attempt=0),
            hostname=name,
            log_directory=str(log_dir),
            labels={
                "io.kubernetes.pod.name": name,
                "io.kubernetes.pod.namespace": NAMESPACE,
                POD_UID_LABEL: uid,
                RUN_LABEL: self.run_id,
            },
            annotations={"kubernetes.io/config.source": "api"},
            linux=linux,
        )

    def container_config(
        self, name: str, pod: cri.PodSandboxConfig, args: list[str] | None = None
    ) -> cri.ContainerConfig:
        """A ContainerConfig as the kubelet sends it for the workload."""
        w = self.workload
        md = pod.metadata
        return cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=0),
            image=cri.ImageSpec(image=w.image),
            command=list(w.command),
            args=list(w.args if args is None else args),
            log_path=f"{name}/0.log",
            labels={
                "io.kubernetes.container.name": name,
                "io.kubernetes.pod.name": md.name,
                "io.kubernetes.pod.namespace": md.namespace,
                POD_UID_LABEL: md.uid,
            },
            annotations={"io.kubernetes.container.restartCount": "0"},
            linux=cri.LinuxContainerConfig(
                security_context=cri.LinuxContainerSecurityContext(
                    namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.CONTAINER, ipc=cri.POD)
                )
            ),
        )

    # ------------------------------------------------------------------ calls

    def version(self) -> cri.VersionResponse:
        return self.rt.Version(cri.VersionRequest(), timeout=10)

    def detect_cgroup_driver(self) -> str:
        """The runtime's cgroup driver from the RuntimeConfig RPC; cgroupfs when it lacks the RPC."""
        try:
            resp = self.rt.RuntimeConfig(cri.RuntimeConfigRequest(), timeout=10)
        except grpc.RpcError:
            return "cgroupfs"
        return "systemd" if resp.linux.cgroup_driver == cri.SYSTEMD else "cgroupfs"

    def ensure_image(self) -> bool:
        """Make sure the workload image is present; True when the suite pulled it."""
        spec = cri.ImageSpec(image=self.workload.image)
        try:
            st = self.img.ImageStatus(cri.ImageStatusRequest(image=spec), timeout=CALL_TIMEOUT)
        except grpc.RpcError as e:
            raise SetupError(f"ImageStatus {self.workload.image}: {rpc_error_text(e)}") from None
        if st.HasField("image") and st.image.id:
            return False
        try:
            self.img.PullImage(cri.PullImageRequest(image=spec), timeout=600)
        except grpc.RpcError as e:
            raise SetupError(
                f"image {self.workload.image} is not on the runtime and pulling it failed "
                f"({rpc_error_text(e)}): load it first or pass --image"
            ) from None
        return True

    def remove_image(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            self.img.RemoveImage(
                cri.RemoveImageRequest(image=cri.ImageSpec(image=self.workload.image)), timeout=CALL_TIMEOUT
            )

    def run_pod(self, config: cri.PodSandboxConfig) -> str:
        return self.rt.RunPodSandbox(
            cri.RunPodSandboxRequest(config=config, runtime_handler=self.runtime_handler), timeout=120
        ).pod_sandbox_id

    def create_container(self, pod_id: str, pod: cri.PodSandboxConfig, cc: cri.ContainerConfig) -> str:
        return self.rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=pod),
            timeout=CALL_TIMEOUT,
        ).container_id

    def start_container(self, cid: str) -> None:
        self.rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=300)

    def pod_status(self, pod_id: str) -> cri.PodSandboxStatus:
        return self.rt.PodSandboxStatus(
            cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id), timeout=CALL_TIMEOUT
        ).status

    def container_status(self, cid: str) -> cri.ContainerStatus:
        return self.rt.ContainerStatus(
            cri.ContainerStatusRequest(container_id=cid), timeout=CALL_TIMEOUT
        ).status

    def containers_of(self, pod_id: str) -> list[cri.Container]:
        f = cri.ContainerFilter(pod_sandbox_id=pod_id)
        return list(
            self.rt.ListContainers(cri.ListContainersRequest(filter=f), timeout=CALL_TIMEOUT).containers
        )

    def sandboxes(self, labels: dict[str, str]) -> list[cri.PodSandbox]:
        f = cri.PodSandboxFilter(label_selector=labels)
        return list(self.rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=f), timeout=CALL_TIMEOUT).items)

    def remove_pod(self, pod_id: str, cgroup_parent: str = "") -> None:
        """Stop and remove a pod (idempotent), then its pod-level cgroup as the kubelet would."""
        for call, req in (
            (self.rt.StopPodSandbox, cri.StopPodSandboxRequest(pod_sandbox_id=pod_id)),
            (self.rt.RemovePodSandbox, cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id)),
        ):
            try:
                call(req, timeout=120)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        if cgroup_parent and self.cgroups is not None:
            self.cgroups.remove_pod(cgroup_parent)

    # ------------------------------------------------------------------ logs

    def counts(self, log_path: str | Path) -> list[int]:
        """Every number the workload printed in a CRI-format log file."""
        try:
            data = Path(log_path).read_text(errors="replace")
        except (FileNotFoundError, IsADirectoryError):
            return []
        out = []
        for line in data.splitlines():
            parts = line.split(" ", 3)  # <timestamp> <stream> <P|F> <content>
            content = parts[3] if len(parts) == 4 else ""
            m = self.workload.count_re.search(content)
            if m:
                out.append(int(m.group(1)))
        return out

    def last_count(self, log_path: str | Path) -> int | None:
        c = self.counts(log_path)
        return c[-1] if c else None

    def wait_count(self, log_path: str | Path, at_least: int, timeout: float = 20.0) -> int:
        """Wait until the log shows a number >= at_least; return the last number."""
        wait_for(
            lambda: (c := self.counts(log_path)) and c[-1] >= at_least,
            timeout,
            what=f"the workload to print a number >= {at_least} in {log_path} "
            f"(last seen: {self.last_count(log_path)})",
        )
        return self.counts(log_path)[-1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def tree_snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Relative path -> (mode, size, mtime_ns) of everything under root (symlinks not followed)."""
    snap: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            snap[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return snap


def listing(root: Path) -> list[str]:
    return sorted(tree_snapshot(root)) if root.is_dir() else []


def describe_diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    parts = []
    for label, items in (("added", added), ("removed", removed), ("changed", changed)):
        if items:
            parts.append(f"{label}: {', '.join(items[:5])}" + (" ..." if len(items) > 5 else ""))
    return "; ".join(parts) or "no difference"


def names(items: Iterable[Any]) -> list[str]:
    return sorted(getattr(i, "name", str(i)) for i in items)
