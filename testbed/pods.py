"""Kubelet-like CRI requests for tests, benchmarks, the demo and the conformance suite.

The configs mirror what a kubelet sends (cgroup parent per pod, log directory, namespace
options, kubelet labels), so podshim is exercised the way a node exercises it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import _sys

if TYPE_CHECKING:
    from testbed.bed import TestBed

PAUSE_IMAGE = "localhost/podshim/pause:1"
BUSYBOX_IMAGE = "localhost/podshim/busybox:1"
COUNTER_IMAGE = "localhost/podshim/counter:1"
COUNT_RE = re.compile(rb"count=(\d+)")
# Pod cgroups go below it, as under a kubelet's /kubepods: one root per process (a test run, a
# bench), so what a killed run left behind is found and ended by the next bed's start
# (_sys.sweep_stale_pod_roots).
CGROUP_ROOT = f"{_sys.POD_CGROUP_ROOT_PREFIX}{os.getpid()}"


def until_listening(port: int) -> str:
    """A busybox shell loop that ends once something in its network namespace listens on TCP
    `port` (IPv4 or IPv6): a client started after it connects on any machine, where a fixed sleep
    guesses how long the listener takes to start."""
    return f"until grep -qs ':{port:04X} [0-9A-F]*:0000 0A' /proc/net/tcp /proc/net/tcp6; do sleep 0.05; done"


def stubs(socket: str | Path) -> tuple[api_pb2_grpc.RuntimeServiceStub, api_pb2_grpc.ImageServiceStub]:
    channel = grpc.insecure_channel(
        f"unix://{socket}", options=[("grpc.max_receive_message_length", 16 << 20)]
    )
    return api_pb2_grpc.RuntimeServiceStub(channel), api_pb2_grpc.ImageServiceStub(channel)


def pod_config(
    name: str, log_root: str | Path, namespace: str = "default", uid: str | None = None
) -> cri.PodSandboxConfig:
    uid = uid or secrets.token_hex(8)
    log_dir = Path(log_root) / f"{namespace}_{name}_{uid}"
    log_dir.mkdir(parents=True, exist_ok=True)
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
        hostname=name,
        log_directory=str(log_dir),
        labels={
            "io.kubernetes.pod.name": name,
            "io.kubernetes.pod.namespace": namespace,
            "io.kubernetes.pod.uid": uid,
        },
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=f"{CGROUP_ROOT}/pod{uid}",
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.CONTAINER, ipc=cri.POD)
            ),
        ),
    )


def container_config(
    name: str,
    image: str = COUNTER_IMAGE,
    args: list[str] | None = None,
    command: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> cri.ContainerConfig:
    return cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name, attempt=0),
        image=cri.ImageSpec(image=image),
        command=command or [],
        args=args if args is not None else ["--mem-mib", "8", "--interval-ms", "100"],
        envs=[cri.KeyValue(key=k, value=v.encode()) for k, v in (env or {}).items()],
        log_path=f"{name}/0.log",
        labels={"io.kubernetes.container.name": name},
        linux=cri.LinuxContainerConfig(
            security_context=cri.LinuxContainerSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.CONTAINER, ipc=cri.POD)
            )
        ),
    )


# What a kubelet adds to each container (pkg/kubelet/kuberuntime/labels.go, makeMounts): the pod's
# identity in labels, its restart count and termination-log path in annotations, per-pod files.
KUBELET_POD_UID = "io.kubernetes.pod.uid"
KUBELET_POD_NAME = "io.kubernetes.pod.name"
KUBELET_POD_NAMESPACE = "io.kubernetes.pod.namespace"
KUBELET_CONTAINER_NAME = "io.kubernetes.container.name"
TERMINATION_LOG = "/dev/termination-log"


def image_id(img: api_pb2_grpc.ImageServiceStub, name: str) -> str:
    """The ID (sha256:…) of an image on the node, as the kubelet resolves it before CreateContainer."""
    st = img.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=name)))
    if not st.image.id:
        raise LookupError(f"image {name} is not on the node")
    return st.image.id


def kubelet_pod_dir(kubelet_root: str | Path, config: cri.PodSandboxConfig) -> Path:
    """<root-dir>/pods/<uid>: where the kubelet keeps a pod's etc-hosts and termination logs."""
    return Path(kubelet_root) / "pods" / config.metadata.uid


def empty_dir(kubelet_root: str | Path, uid: str, name: str) -> Path:
    """A fresh emptyDir where the kubelet makes it, with the mode it gives one:
    <root-dir>/pods/<uid>/volumes/kubernetes.io~empty-dir/<name>."""
    d = Path(kubelet_root) / "pods" / uid / "volumes" / "kubernetes.io~empty-dir" / name
    d.mkdir(parents=True, mode=0o777)
    d.chmod(0o777)  # not the umask's
    return d


def kubelet_container_config(
    img: api_pb2_grpc.ImageServiceStub,
    config: cri.PodSandboxConfig,
    kubelet_root: str | Path,
    name: str,
    image: str = COUNTER_IMAGE,
    args: list[str] | None = None,
    command: list[str] | None = None,
    attempt: int = 0,
) -> cri.ContainerConfig:
    """A ContainerConfig shaped as the kubelet (v1.37) sends it for a container of the pod
    `config`: `ImageSpec{image: <image ID>, user_specified_image: <name>}`, the pod's identity in
    labels, restart count and termination-message path in annotations, and the per-pod files
    bind-mounted from under `kubelet_root` (`pods/<uid>/etc-hosts` on /etc/hosts, a fresh
    `pods/<uid>/containers/<name>/<random>` on /dev/termination-log), which this creates."""
    md = config.metadata
    pod_dir = kubelet_pod_dir(kubelet_root, config)
    hosts = pod_dir / "etc-hosts"
    if not hosts.exists():
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(
            f"127.0.0.1\tlocalhost\n# Kubernetes-managed hosts file.\n10.0.0.1\t{config.hostname}\n"
        )
    term = pod_dir / "containers" / name / secrets.token_hex(4)
    term.parent.mkdir(parents=True, exist_ok=True)
    term.touch(mode=0o666)
    cc = container_config(name, image=image, args=args, command=command)
    cc.metadata.attempt = attempt
    cc.image.CopyFrom(cri.ImageSpec(image=image_id(img, image), user_specified_image=image))
    cc.log_path = f"{name}/{attempt}.log"
    cc.labels.update(
        {
            KUBELET_POD_NAME: md.name,
            KUBELET_POD_NAMESPACE: md.namespace,
            KUBELET_POD_UID: md.uid,
            KUBELET_CONTAINER_NAME: name,
        }
    )
    cc.annotations.update(
        {
            "io.kubernetes.container.hash": secrets.token_hex(4),
            "io.kubernetes.container.restartCount": str(attempt),
            "io.kubernetes.container.terminationMessagePath": TERMINATION_LOG,
            "io.kubernetes.container.terminationMessagePolicy": "File",
            "io.kubernetes.pod.terminationGracePeriod": "30",
        }
    )
    cc.mounts.extend(
        [
            cri.Mount(host_path=str(hosts), container_path="/etc/hosts"),
            cri.Mount(host_path=str(term), container_path=TERMINATION_LOG),
        ]
    )
    return cc


@dataclass
class Pod:
    id: str
    config: cri.PodSandboxConfig
    containers: dict[str, str]  # name -> container id

    def log_path(self, container: str, attempt: int = 0) -> Path:
        return Path(self.config.log_directory) / container / f"{attempt}.log"


def run_pod(
    rt: api_pb2_grpc.RuntimeServiceStub,
    name: str,
    log_root: str | Path,
    containers: dict[str, cri.ContainerConfig] | None = None,
    runtime_handler: str = "",
    start: bool = True,
    config: cri.PodSandboxConfig | None = None,
) -> Pod:
    """Run a sandbox and create (and start) its containers, as the kubelet does. `config`: the
    pod's config when the containers' configs needed it first (kubelet_container_config)."""
    config = config or pod_config(name, log_root)
    pod_id = rt.RunPodSandbox(
        cri.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler)
    ).pod_sandbox_id
    ids = {}
    if containers is None:
        containers = {"counter": container_config("counter")}
    for cname, cc in containers.items():
        cid = rt.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config)
        ).container_id
        if start:
            rt.StartContainer(cri.StartContainerRequest(container_id=cid))
        ids[cname] = cid
    return Pod(pod_id, config, ids)


def running_ids(rt: api_pb2_grpc.RuntimeServiceStub, pod_id: str) -> list[str]:
    """The pod's running containers, oldest first: a CheckpointPodRequest's container_ids as a
    kubelet fills it in (the released API takes no empty list). [] for an unknown pod."""
    f = cri.ContainerFilter(pod_sandbox_id=pod_id, state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING))
    listed = rt.ListContainers(cri.ListContainersRequest(filter=f)).containers
    return [c.id for c in sorted(listed, key=lambda c: c.created_at)]


def checkpoint_request(
    rt: api_pb2_grpc.RuntimeServiceStub, pod_id: str, output_path: str | Path, **fields: Any
) -> cri.CheckpointPodRequest:
    """A CheckpointPodRequest of the pod's running containers (running_ids) unless `fields` give
    container_ids."""
    fields.setdefault("container_ids", running_ids(rt, pod_id))
    return cri.CheckpointPodRequest(pod_sandbox_id=pod_id, output_path=str(output_path), **fields)


def remove_pod(rt: api_pb2_grpc.RuntimeServiceStub, pod_id: str) -> None:
    """Stop and remove a pod, then its pod-level cgroup (the kubelet's job: containerd leaves it)."""
    parent = ""
    try:
        st = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True))
        parent = (
            json.loads(st.info.get("info", "{}")).get("config", {}).get("linux", {}).get("cgroup_parent", "")
        )
    except (grpc.RpcError, ValueError):
        pass
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod_id))
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id))
    if parent.startswith(CGROUP_ROOT + "/"):
        for d in _sys.cgroup_dirs(parent):  # every hierarchy's, v1 or cgroup2
            with contextlib.suppress(OSError):
                d.rmdir()


def counts(log_path: Path) -> list[int]:
    """Every counter value printed in a CRI log file."""
    try:
        return [int(m) for m in COUNT_RE.findall(log_path.read_bytes())]
    except FileNotFoundError:
        return []


def wait_for(
    predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_count(log_path: Path, at_least: int, timeout: float = 20.0) -> int:
    """Wait until the counter log shows a value >= at_least; return the last value."""
    wait_for(
        lambda: (c := counts(log_path)) and c[-1] >= at_least,
        timeout,
        what=f"count>={at_least} in {log_path}",
    )
    return counts(log_path)[-1]


@contextlib.contextmanager
def digest_reference(bed: TestBed, name: str) -> Iterator[str]:
    """A digest reference (name@sha256:<manifest digest>) of the local image `name`, as a pull
    from a registry leaves one; removed again (the bed's images are shared by the session)."""
    line = next(row for row in bed.ctr("images", "ls").stdout.splitlines() if row.split()[0] == name)
    digest = next(w for w in line.split() if w.startswith("sha256:"))
    ref = f"{name.rsplit(':', 1)[0]}@{digest}"
    bed.ctr("images", "tag", name, ref)
    try:
        yield ref
    finally:
        bed.ctr("images", "rm", ref, check=False)
