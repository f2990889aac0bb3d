"""A real kubelet (v1.37, built by the set-up) in a test bed: standalone, static pods only.

    with KubeletBed() as kb:                      # a TestBed + its kubelet, pointed at podshim
        kb.kubelet.add_static_pod(manifest)       # a Pod manifest (dict) into its staticPodPath
        kb.kubelet.wait_running("web", ["app"])   # its /pods API says the containers run
        kb.kubelet.api("POST", "/checkpoint/default/web-<node>/app")

The kubelet has no API server (no kubeconfig): it runs the pods of its ``staticPodPath`` and
serves its own API (anonymous auth, ``AlwaysAllow``) on a loopback port. It leaves the host alone
(docs/design/testbed.md (The kubelet in the test bed)):

* the bed's containerd, podshim and the kubelet share a private mount namespace
  (testbed/mntns.py) in which ``/var/lib/kubelet`` is the bed's ``kubelet/root``: the kubelet
  keeps its stock root dir (its checkpoint API writes to ``/var/lib/kubelet/checkpoints``, as on
  a node) and podshim its stock ``allowed_roots``, and nothing appears in the host's /var/lib;
* the sysctls it sets (``vm.overcommit_memory``, ``kernel.panic``, ``kernel.panic_on_oops``, ...)
  are files of the bed bind-mounted over ``/proc/sys`` in that namespace;
* its PATH has no iptables (it creates no chains), ``volumePluginDir`` is in the bed, its cgroups
  are under the bed's cgroup root (cgroupfs driver; ``failCgroupV1: false`` on a v1 host);
* its log goes to ``<base>/logs/kubelet.log``; ``stop()`` ends its own pid only.

The kubelet removes every pod it did not create within ~2 s (orphans), so a bed with a kubelet
is for the kubelet's pods only: other CRI clients use their own bed, or stop the kubelet first.

With a ``Registration`` the kubelet registers with an API server instead (testbed/cluster.py):
it serves on the node's address with a CA-signed cert and authenticates its API's clients by
certificate and the API server's webhook.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import ssl
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from testbed import _sys
from testbed.bed import TestBed, TestBedError
from testbed.mntns import NodeMounts
from testbed.tools import go_tool

# What the kubelet's container manager writes unless the value is already there
# (pkg/kubelet/cm/container_manager_linux.go setupKernelTunables): covered by files of the bed.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
KUBELET_PATH = "/usr/bin"  # mount/umount, no iptables (/usr/sbin): the kubelet makes no chains
ROOT_IN_NODE = Path("/var/lib/kubelet")  # the stock root dir, the bed's kubelet/root in the node
NAMESPACE = "default"


def node_mounts() -> NodeMounts:
    """The node's mount namespace for a bed that runs a kubelet."""
    return NodeMounts(var_lib={"kubelet": "kubelet/root"}, proc_sys=dict(KUBELET_SYSCTLS))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KubeletError(RuntimeError):
    pass


@dataclass(frozen=True)
class Registration:
    """What a kubelet registered with an API server needs (testbed/cluster.py): its kubeconfig
    (the node's credentials), the address it serves on and reports as its InternalIP (not
    loopback: the kubelet refuses a loopback node IP and the API server's node proxy a loopback
    node address), a serving cert for that IP, the CA its API trusts for client certs, and a client
    cert its own API accepts (the tests' and ``api()``'s; authorized by the API server's webhook)."""

    kubeconfig: Path
    node_ip: str
    serving_cert: Path
    serving_key: Path
    client_ca: Path
    api_client_cert: Path
    api_client_key: Path


class Kubelet:
    """One kubelet process for ``bed`` (which must have been made with ``node_mounts()``)."""

    def __init__(
        self,
        bed: TestBed,
        *,
        endpoint: str | os.PathLike[str] | None = None,
        node_name: str | None = None,
        config: dict[str, Any] | None = None,
        verbosity: int = 2,
        timeout: float = 90.0,
        registration: Registration | None = None,
    ) -> None:
        """
        endpoint: the CRI socket (default: the bed's podshim, else its containerd).
        config: KubeletConfiguration fields merged over the bed's (e.g. ``{"maxPods": 250}``).
        registration: register with an API server as a node (default: standalone, static pods
            only, its API anonymous on loopback).
        """
        if bed.node_mounts is None or "kubelet" not in bed.node_mounts.var_lib:
            raise KubeletError(
                "the bed needs the kubelet's mount namespace: TestBed(node_mounts=kubelet.node_mounts())"
            )
        self.bed = bed
        self.endpoint = Path(endpoint) if endpoint else None
        self.node_name = node_name or f"podshim-node-{bed.base_dir.name.rsplit('-', 1)[-1]}".lower()
        self.extra_config = dict(config or {})
        self.verbosity = verbosity
        self.timeout = timeout
        self.registration = registration
        self.api_host = registration.node_ip if registration else "127.0.0.1"
        self.dir = bed.base_dir / "kubelet"
        self.root = self.dir / "root"  # /var/lib/kubelet in the node
        self.manifests = self.dir / "manifests"
        self.pod_logs = self.dir / "pod-logs"
        self.config_file = self.dir / "config.json"
        self.log = bed.log_dir / "kubelet.log"
        self.port = 0
        self.healthz_port = 0
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ssl = ssl.create_default_context()
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE  # its self-signed serving cert (in <root>/pki)
        if registration is not None:  # its API authenticates clients by certificate
            self._ssl.load_cert_chain(registration.api_client_cert, registration.api_client_key)

    # ------------------------------------------------------------------ paths

    @property
    def cgroup_root(self) -> str:
        return f"{self.bed.cgroup_root}/kubelet"

    def host_path(self, node_path: str | os.PathLike[str]) -> Path:
        """The bed's path of a path the kubelet (or podshim) names in the node's namespace."""
        p = Path(node_path)
        if _sys.is_under(str(p), str(ROOT_IN_NODE)):
            return self.root / p.relative_to(ROOT_IN_NODE)
        return p

    def full_name(self, pod: str) -> str:
        """The name the kubelet gives a static pod (``<name>-<node>``)."""
        return f"{pod}-{self.node_name}"

    # ------------------------------------------------------------------ life cycle

    def config(self) -> dict[str, Any]:
        endpoint = "unix://" + str(self.endpoint or self.bed.default_socket)
        cfg: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "staticPodPath": str(self.manifests),
            "fileCheckFrequency": "2s",
            "syncFrequency": "10s",
            "podLogsDir": str(self.pod_logs),
            "address": "127.0.0.1",
            "port": self.port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "registerNode": False,
            "containerRuntimeEndpoint": endpoint,
            "imageServiceEndpoint": endpoint,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "failCgroupV1": False,  # this host is cgroup v1
            "failSwapOn": False,
            "protectKernelDefaults": False,  # it writes its sysctls: into the bed's files
            "volumePluginDir": str(self.dir / "volume-plugins"),
            "resolvConf": "/etc/resolv.conf",
            # the bed's images are imported, never pulled: no image GC, no eviction on a full disk
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "containerLogMaxSize": "64Ki",
            "containerLogMaxFiles": 3,
            "containerLogMonitorInterval": "3s",
            "maxPods": 150,
        }
        reg = self.registration
        if reg is not None:
            cfg.update(
                {
                    "address": reg.node_ip,
                    "tlsCertFile": str(reg.serving_cert),
                    "tlsPrivateKeyFile": str(reg.serving_key),
                    "rotateCertificates": False,
                    "serverTLSBootstrap": False,
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": True},
                        "x509": {"clientCAFile": str(reg.client_ca)},
                    },
                    "authorization": {"mode": "Webhook"},
                    "registerNode": True,
                }
            )
        cfg.update(self.extra_config)
        return cfg

    def start(self) -> None:
        if self.pid is not None and _sys.alive(self.pid):
            raise KubeletError(f"kubelet {self.pid} is running")
        for d in (self.root, self.manifests, self.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        self._make_cgroup_root()
        self.port, self.healthz_port = _free_port(), _free_port()
        self.config_file.write_text(json.dumps(self.config(), indent=2) + "\n")
        argv = [
            str(go_tool("kubelet")),
            f"--config={self.config_file}",
            f"--hostname-override={self.node_name}",
            f"--v={self.verbosity}",
        ]
        if self.registration is not None:
            argv += [f"--kubeconfig={self.registration.kubeconfig}", f"--node-ip={self.registration.node_ip}"]
        assert self.bed.node_mounts is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "PODSHIM_"))}
        env["PATH"] = KUBELET_PATH
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(
                self.bed.node_mounts.command(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.dir,
                start_new_session=True,
            )
        self.pid = self._proc.pid
        self._wait_healthy()

    def _make_cgroup_root(self) -> None:
        """The kubelet refuses a cgroupRoot that does not exist in every hierarchy; cpuset cgroups
        start empty on v1 and get their parent's cpus and mems."""
        parts = self.cgroup_root.strip("/").split("/")
        for h in _sys.cgroup_hierarchies():
            path = h
            for part in parts:
                parent, path = path, path / part
                path.mkdir(exist_ok=True)
                for name in ("cpuset.cpus", "cpuset.mems"):
                    f = path / name
                    if f.exists() and not f.read_text().strip():
                        f.write_text((parent / name).read_text())

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        last = ""
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise KubeletError(
                    f"the kubelet exited ({self._proc.returncode}); log tail:\n{self.log_tail()}"
                )
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.healthz_port, timeout=2)
                conn.request("GET", "/healthz")
                resp = conn.getresponse()
                body = resp.read().decode(errors="replace")
                conn.close()
                # its QoS cgroups (<cgroupRoot>/kubepods) come a moment after /healthz says ok
                qos = _sys.cgroup_dirs(f"{self.cgroup_root}/kubepods")
                if resp.status == 200 and self.api_ready() and qos:
                    return
                last = f"{resp.status} {body.strip()}"
            except OSError as e:
                last = str(e)
            time.sleep(0.3)
        raise KubeletError(
            f"the kubelet is not healthy after {self.timeout}s ({last}); log tail:\n{self.log_tail()}"
        )

    def api_ready(self) -> bool:
        try:
            return self.api("GET", "/healthz", timeout=2)[0] == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self.pid is not None and self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the kubelet (its pods keep running, as on a node), SIGKILL after ``timeout``."""
        _sys.stop_child(self._proc, timeout)
        self._proc = None
        self.pid = None

    def restart(self) -> None:
        self.stop()
        self.start()

    # ------------------------------------------------------------------ static pods

    def add_static_pod(self, manifest: dict[str, Any]) -> str:
        """Write a Pod manifest into the static pod dir (atomically); returns its name."""
        name = str(manifest["metadata"]["name"])
        tmp = self.manifests / f".{name}.tmp"  # the kubelet ignores dot files
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, self.manifests / f"{name}.json")
        return name

    def remove_static_pod(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.manifests / f"{name}.json").unlink()

    # ------------------------------------------------------------------ its API

    def api(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        query: dict[str, Any] | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, bytes]:
        """One HTTPS request to the kubelet's API; returns (status, body)."""
        if query:
            path += "?" + urllib.parse.urlencode(query, doseq=True)
        conn = http.client.HTTPSConnection(self.api_host, self.port, timeout=timeout, context=self._ssl)
        try:
            conn.request(method, path, body=body)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def api_json(self, path: str, **kw: Any) -> Any:
        status, body = self.api("GET", path, **kw)
        if status != 200:
            raise KubeletError(f"GET {path}: {status} {body[:500]!r}")
        return json.loads(body)

    def pods(self) -> list[dict[str, Any]]:
        return list(self.api_json("/pods").get("items") or [])

    def pod(self, name: str) -> dict[str, Any] | None:
        """The kubelet's view of static pod ``name`` (its /pods), or None."""
        full = self.full_name(name)
        return next((p for p in self.pods() if p["metadata"]["name"] == full), None)

    def container_statuses(self, name: str, init: bool = False) -> dict[str, dict[str, Any]]:
        pod = self.pod(name) or {}
        key = "initContainerStatuses" if init else "containerStatuses"
        return {c["name"]: c for c in (pod.get("status") or {}).get(key) or []}

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 60.0, every: float = 0.5) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
            except (OSError, KubeletError, ValueError):
                value = None
            if value:
                return value
            if time.monotonic() >= deadline:
                raise KubeletError(
                    f"timed out after {timeout}s waiting for {what}; kubelet log tail:\n{self.log_tail()}"
                )
            time.sleep(every)

    def wait_running(
        self, name: str, containers: list[str], timeout: float = 90.0
    ) -> dict[str, dict[str, Any]]:
        """Wait until the kubelet reports each of ``containers`` of pod ``name`` running (and ready
        when it has a readiness probe); returns their statuses."""

        def check() -> dict[str, dict[str, Any]] | None:
            st = self.container_statuses(name)
            if all(
                "running" in (st.get(c) or {}).get("state", {}) and st[c].get("ready") for c in containers
            ):
                return st
            return None

        return self.wait_for(f"pod {name} running {containers}", check, timeout)


class KubeletBed:
    """A TestBed made for a kubelet (its mount namespace, podshim's stock checkpoint roots) and
    the kubelet itself, pointed at podshim (``via_podshim=False``: at containerd)."""

    __test__ = False

    def __init__(
        self, base_dir: str | os.PathLike[str] | None = None, *, via_podshim: bool = True, **kubelet: Any
    ) -> None:
        self.bed = TestBed(base_dir, node_mounts=node_mounts(), stock_checkpoint_roots=True)
        self.via_podshim = via_podshim
        self._kubelet_args = kubelet
        self.kubelet: Kubelet

    def start(self) -> None:
        self.bed.start()
        try:
            endpoint = self.bed.podshim_socket if self.via_podshim else self.bed.containerd_socket
            self.kubelet = Kubelet(self.bed, endpoint=endpoint, **self._kubelet_args)
            self.kubelet.start()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise

    def stop(self) -> None:
        errors = []
        if hasattr(self, "kubelet"):
            try:
                self.kubelet.stop()
            except Exception as e:  # noqa: BLE001 - the bed's stop must still run
                errors.append(f"kubelet: {e}")
        try:
            self.bed.stop()
        except TestBedError as e:
            errors.append(str(e))
        if errors:
            raise TestBedError("; ".join(errors))

    def __enter__(self) -> KubeletBed:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def pod_manifest(
    name: str,
    containers: list[dict[str, Any]],
    *,
    init_containers: list[dict[str, Any]] | None = None,
    namespace: str = NAMESPACE,
    **spec: Any,
) -> dict[str, Any]:
    """A static Pod manifest (restartPolicy Always, no service account: standalone; a 2 s grace
    period: `sleep` as a container's pid 1 ignores SIGTERM)."""
    body: dict[str, Any] = {
        "containers": containers,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 2,
        **spec,
    }
    if init_containers:
        body["initContainers"] = init_containers
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def iter_lines(path: Path) -> Iterator[str]:
    """The lines of a CRI log file (``<time> <stream> <tag> <text>``), text only."""
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4:
                yield parts[3]


# ---------------------------------------------------------------------------- /exec over a websocket

WS_PROTOCOLS = "v5.channel.k8s.io, v4.channel.k8s.io"


def _ws_read_frame(sock: ssl.SSLSocket) -> tuple[int, bytes]:
    """One websocket frame from the server (never masked): (opcode, payload)."""

    def read(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("websocket closed mid-frame")
            buf += chunk
        return buf

    b0, b1 = read(2)
    length = b1 & 0x7F
    if length == 126:
        length = int.from_bytes(read(2), "big")
    elif length == 127:
        length = int.from_bytes(read(8), "big")
    return b0 & 0x0F, read(length)


def exec_stream(
    kubelet: Kubelet, pod: str, container: str, cmd: list[str], timeout: float = 30.0
) -> dict[str, Any]:
    """The kubelet's streaming ``/exec`` (what ``kubectl exec`` uses) over a websocket with the
    channel protocol: returns {"stdout", "stderr", "status" (the v4 error channel's JSON),
    "protocol"}."""
    query = urllib.parse.urlencode([("command", c) for c in cmd] + [("output", "1"), ("error", "1")])
    path = f"/exec/{NAMESPACE}/{kubelet.full_name(pod)}/{container}?{query}"
    key = base64.b64encode(os.urandom(16)).decode()
    raw = socket.create_connection((kubelet.api_host, kubelet.port), timeout=timeout)
    sock = kubelet._ssl.wrap_socket(raw, server_hostname=kubelet.api_host)
    try:
        sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: {kubelet.api_host}:{kubelet.port}\r\nConnection: Upgrade\r\n"
                f"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
                f"Sec-WebSocket-Protocol: {WS_PROTOCOLS}\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)
            if not chunk:
                raise KubeletError(f"/exec: connection closed during the handshake: {head!r}")
            head += chunk
        status_line, *header_lines = head.decode(errors="replace").split("\r\n")
        if " 101 " not in status_line + " ":
            raise KubeletError(f"/exec: {status_line}: {sock.recv(4096)!r}")
        headers = {h.split(":", 1)[0].lower(): h.split(":", 1)[1].strip() for h in header_lines if ":" in h}
        out = {1: b"", 2: b"", 3: b""}
        while True:
            opcode, payload = _ws_read_frame(sock)
            if opcode == 8:  # close
                break
            if opcode in (1, 2) and payload:
                channel = payload[0]
                if channel in out:
                    out[channel] += payload[1:]
        status = json.loads(out[3]) if out[3].strip() else {}
        return {
            "stdout": out[1].decode(errors="replace"),
            "stderr": out[2].decode(errors="replace"),
            "status": status,
            "protocol": headers.get("sec-websocket-protocol", ""),
        }
    finally:
        sock.close()
