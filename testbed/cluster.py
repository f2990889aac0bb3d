"""A real Kubernetes v1.37.2 control plane in front of podshim (the programs built by the set-up,
scripts/gotools.sh): etcd, kube-apiserver, kube-controller-manager, kube-scheduler, and a kubelet
registered as a node whose runtime is the bed's podshim.

    with ClusterBed() as cb:                          # the control plane + node 1, Ready
        cb.apply(cluster.pod_manifest("web", [container]))
        cb.wait_pod_running("web")
        cb.kubectl("logs", "web").stdout
        cb.user_kubeconfig("alice", groups=["team-a"])
        cb.kubectl("get", "pods", "-n", "a", user="alice")
        node2 = cb.add_node()                         # its own TestBed (containerd + podshim) + kubelet

Everything listens on loopback, except each kubelet, which serves on its bed's bridge gateway
address: the kubelet refuses a loopback node IP, and the API server's node proxy refuses loopback
node addresses ("address not allowed"), while the gateway is an address of this host whose
traffic stays on it. Authentication is by client certificates of one CA made here
(``cryptography``), authorization ``Node,RBAC`` with ``NodeRestriction``. The API server runs with
``--endpoint-reconciler-type=none`` (it exits when it would advertise 127.0.0.1 otherwise: the
``kubernetes`` Service has no endpoints; nothing here uses it).

Every file lives under the base dir (default ``/run/podshim-cluster-<random>``):

    pki/            the CA, each component's cert and key, the service-account key pair
    kubeconfig/     admin, the controller manager's, the scheduler's, each node's, each user's
    etcd/           etcd's data
    logs/           etcd.log, kube-apiserver.log, kube-controller-manager.log, kube-scheduler.log
    home/           HOME of kubectl (its discovery cache)
    node-<n>/       node n's TestBed (its kubelet in node-<n>/kubelet, log node-<n>/logs/kubelet.log)

``stop()`` ends the kubelets, the node beds (testbed/bed.py: everything they made), then the
control plane, each by its own pid (SIGTERM, SIGKILL after a timeout), and removes the base dir.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import http.client
import ipaddress
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from testbed import _sys
from testbed.bed import TestBed, TestBedError
from testbed.kubelet import Kubelet, Registration, node_mounts
from testbed.tools import CONTROL_PLANE, go_tool

SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service's address: in the API server's cert
CERT_DAYS = 365  # a `make up` cluster may stay up a long time
NAMESPACE = "default"
DAEMON_PATH = "/usr/bin:/bin"


class ClusterError(TestBedError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path})"


# ---------------------------------------------------------------------------- PKI


class Pki:
    """A CA and the certificates it signs, as PEM files in ``directory`` (ECDSA P-256: instant to
    make, accepted by every component)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca_cert = directory / "ca.crt"
        self.ca_key = directory / "ca.key"
        self._ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None

    @staticmethod
    def _key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def _write_key(self, path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    def create_ca(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self._key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "podshim-cluster-ca")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        self._write_key(self.ca_key, key)
        self.ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._ca = (cert, key)

    def issue(
        self,
        name: str,
        common_name: str,
        *,
        orgs: Iterable[str] = (),
        ips: Iterable[str] = (),
        dns: Iterable[str] = (),
        server: bool = False,
        client: bool = False,
    ) -> tuple[Path, Path]:
        """``<name>.crt`` and ``<name>.key`` for subject CN=common_name, O=each of orgs (a user's
        groups), with those IP and DNS SANs; returns their paths."""
        if self._ca is None:
            raise ClusterError("the CA is not made yet")
        ca_cert, ca_key = self._ca
        key = self._key()
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        sans += [x509.DNSName(d) for d in dns]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        crt, keyfile = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        self._write_key(keyfile, key)
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return crt, keyfile

    def service_account_keys(self) -> tuple[Path, Path]:
        """The key pair the API server signs service-account tokens with: (sa.key, sa.pub)."""
        key = self._key()
        priv, pub = self.dir / "sa.key", self.dir / "sa.pub"
        self._write_key(priv, key)
        pub.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return priv, pub


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> Path:
    """A kubeconfig with the CA and the client cert embedded (readable from any mount namespace;
    JSON is YAML)."""

    def data(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "podshim", "cluster": {"server": server, "certificate-authority-data": data(ca)}}
        ],
        "users": [
            {"name": user, "user": {"client-certificate-data": data(cert), "client-key-data": data(key)}}
        ],
        "contexts": [{"name": "podshim", "context": {"cluster": "podshim", "user": user}}],
        "current-context": "podshim",
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------- processes


def _own(pid: int | None, program: str, marker: str) -> bool:
    """``pid`` is alive and still the ``program`` we started (its argv mentions ``marker``)."""
    if pid is None or not _sys.alive(pid):
        return False
    argv = _sys.read_cmdline(pid)
    return bool(argv) and os.path.basename(argv[0]) == program and _sys.mentions_path(argv, marker)


def _end(pid: int, timeout: float) -> None:
    """SIGTERM ``pid``, SIGKILL it after ``timeout``; raise if it survives that."""
    if _sys.terminate({pid}, timeout=timeout):
        raise ClusterError(f"process {pid} survived SIGKILL")


class Daemon:
    """One control-plane process, in its own session, its output in ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path, marker: Path, env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.marker = str(marker)  # a path its argv names: tells our process from a reused pid
        self.env = env
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.running:
            raise ClusterError(f"{self.name} {self.pid} is running")
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.log.parent,
                start_new_session=True,
            )
        self.pid = self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exited(self) -> str | None:
        """Why it is not running (for a wait to give up at once), or None while it runs."""
        if self._proc is not None and self._proc.poll() is not None:
            return f"{self.name} exited ({self._proc.returncode}); log tail:\n{_tail(self.log)}"
        return None

    def stop(self, timeout: float = 20.0) -> None:
        _sys.stop_child(self._proc, timeout)
        self._proc = None
        self.pid = None


# ---------------------------------------------------------------------------- the cluster


@dataclass
class ClusterNode:
    """A node of the cluster: its TestBed (containerd + podshim) and its registered kubelet."""

    name: str
    bed: TestBed
    kubelet: Kubelet
    kubeconfig: Path
    ip: str

    @property
    def user(self) -> str:
        """Its identity in the cluster (the key of its kubeconfig in ``ClusterBed.kubeconfig``)."""
        return f"system:node:{self.name}"

    def stop(self) -> None:
        errors = []
        try:
            self.kubelet.stop()
        except Exception as e:  # noqa: BLE001 - the bed's stop must still run
            errors.append(f"kubelet {self.name}: {e}")
        try:
            self.bed.stop()
        except TestBedError as e:
            errors.append(str(e))
        if errors:
            raise ClusterError("; ".join(errors))


class ClusterBed:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler on loopback, and node 1: a
    TestBed made for a kubelet (testbed/kubelet.py) whose kubelet registers with the API server,
    its runtime the bed's podshim. More nodes: ``add_node()``."""

    __test__ = False

    def __init__(
        self,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        node_name: str = "podshim-node-1",
        podshim_config_extra: dict[str, dict[str, Any]] | None = None,
        bed_options: dict[str, Any] | None = None,
        kubelet_options: dict[str, Any] | None = None,
        timeout: float = 180.0,
        verbosity: int = 1,
    ) -> None:
        """
        node_name: the first node's name.
        podshim_config_extra: sections of the nodes' podshim.toml, {section: {key: value}}, merged
            over the ``[kubernetes]`` section the bed writes (``kubeconfig`` = the node's,
            ``node_name``) and passed to TestBed's ``podshim_sections``.
        bed_options: further TestBed arguments for every node (e.g. ``crun_binary``).
        kubelet_options: further Kubelet arguments for every node (e.g. ``config={...}``).
        timeout: bound on each wait at start-up (each component healthy, the node Ready).
        verbosity: the control plane's ``--v``.
        """
        self.base_dir = Path(base_dir or f"/run/podshim-cluster-{secrets.token_hex(4)}").absolute()
        self.first_node_name = node_name
        self.podshim_config_extra = dict(podshim_config_extra or {})
        self.bed_options = dict(bed_options or {})
        self.kubelet_options = dict(kubelet_options or {})
        self.timeout = timeout
        self.verbosity = verbosity
        b = self.base_dir
        self.pki = Pki(b / "pki")
        self.kubeconfig_dir = b / "kubeconfig"
        self.log_dir = b / "logs"
        self.etcd_dir = b / "etcd"
        self.home = b / "home"
        logs_env = os.environ.get("PODSHIM_TESTBED_LOGS")
        self.save_logs_to = Path(logs_env) if logs_env else None
        # user name -> its kubeconfig: "admin", "node" (node 1's), "system:node:<name>", users
        self.kubeconfig: dict[str, Path] = {}
        self.nodes: list[ClusterNode] = []
        self.timings: dict[str, float] = {}  # seconds from each start to healthy/Ready
        self.etcd_port = self.etcd_peer_port = self.apiserver_port = 0
        self.kcm_port = self.scheduler_port = 0
        self._daemons: dict[str, Daemon] = {}
        self._ssl: ssl.SSLContext | None = None
        self._started = False

    # ------------------------------------------------------------------ what tests use

    @property
    def node(self) -> ClusterNode:
        """Node 1."""
        if not self.nodes:
            raise ClusterError("the cluster has no node yet")
        return self.nodes[0]

    @property
    def node_name(self) -> str:
        return self.node.name

    @property
    def bed(self) -> TestBed:
        """Node 1's TestBed."""
        return self.node.bed

    @property
    def kubelet(self) -> Kubelet:
        """Node 1's kubelet."""
        return self.node.kubelet

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def apiserver_pid(self) -> int | None:
        return self._daemons["kube-apiserver"].pid if "kube-apiserver" in self._daemons else None

    def kubectl(
        self,
        *args: str,
        user: str = "admin",
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """The built kubectl with ``user``'s kubeconfig (a key of ``kubeconfig``); raises
        ClusterError on a non-zero exit unless ``check`` is false."""
        if user not in self.kubeconfig:
            raise ClusterError(f"no kubeconfig for {user!r} (known: {', '.join(self.kubeconfig)})")
        cmd = [str(go_tool("kubectl")), f"--kubeconfig={self.kubeconfig[user]}", *args]
        res = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, env=self._env(), cwd=self.home
        )
        if check and res.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} (as {user}) failed ({res.returncode}): {res.stderr.strip()}"
            )
        return res

    def kubectl_json(self, *args: str, user: str = "admin") -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", user=user).stdout)

    def apply(self, obj: dict[str, Any], user: str = "admin") -> None:
        """``kubectl apply`` of one object (a dict)."""
        self.kubectl("apply", "-f", "-", user=user, input=json.dumps(obj))

    def user_kubeconfig(self, name: str, groups: Iterable[str] = ()) -> Path:
        """A kubeconfig for user ``name`` in ``groups`` (a client cert of the cluster's CA); also
        ``kubeconfig[name]``, so ``kubectl(..., user=name)`` uses it."""
        if name in self.kubeconfig:
            raise ClusterError(f"user {name!r} has a kubeconfig already")
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        crt, key = self.pki.issue(f"user-{safe}", name, orgs=groups, client=True)
        path = write_kubeconfig(
            self.kubeconfig_dir / f"user-{safe}.kubeconfig", self.server, self.pki.ca_cert, crt, key, name
        )
        self.kubeconfig[name] = path
        return path

    def api(
        self, method: str, path: str, body: Any = None, *, timeout: float = 30.0, content_type: str = ""
    ) -> tuple[int, Any]:
        """One request to the API server as the admin: (status, decoded JSON body, else text)."""
        assert self._ssl is not None
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.apiserver_port, timeout=timeout, context=self._ssl
        )
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Accept": "application/json"}
            if data is not None:
                headers["Content-Type"] = content_type or "application/json"
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read().decode(errors="replace")
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path`` (``/api/v1/...``), None when it does not exist."""
        status, body = self.api("GET", path)
        if status == 404:
            return None
        if status != 200:
            raise ClusterError(f"GET {path}: {status} {str(body)[:500]}")
        return dict(body)

    def wait_for(
        self, what: str, check: Callable[[], Any], timeout: float = 120.0, every: float = 0.25
    ) -> Any:
        """Poll ``check`` until it returns something true (which is returned); give up at once when a
        control-plane process died, with its log."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
            except (OSError, http.client.HTTPException, ClusterError, ValueError):
                value = None
            if value:
                return value
            for d in self._daemons.values():
                if (why := d.exited()) is not None:
                    raise ClusterError(f"waiting for {what}: {why}")
            if time.monotonic() >= deadline:
                raise ClusterError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(every)

    def node_ready(self, name: str) -> bool:
        node = self.get(f"/api/v1/nodes/{name}") or {}
        conditions = (node.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def wait_node_ready(self, name: str, timeout: float | None = None) -> None:
        self.wait_for(f"node {name} Ready", lambda: self.node_ready(name), timeout or self.timeout)

    def pod(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        return self.get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def wait_pod_running(
        self, name: str, namespace: str = NAMESPACE, timeout: float = 120.0
    ) -> dict[str, Any]:
        """Wait until pod ``name`` runs with every container ready; returns the pod."""

        def check() -> dict[str, Any] | None:
            pod = self.pod(name, namespace) or {}
            status = pod.get("status") or {}
            statuses = status.get("containerStatuses") or []
            if status.get("phase") == "Running" and statuses and all(c.get("ready") for c in statuses):
                return pod
            return None

        result: dict[str, Any] = self.wait_for(f"pod {namespace}/{name} running", check, timeout)
        return result

    def delete_pod(self, name: str, namespace: str = NAMESPACE, timeout: float = 120.0) -> None:
        """Delete pod ``name`` and wait until it is gone (its node stopped it)."""
        status, body = self.api("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")
        if status not in (200, 202, 404):
            raise ClusterError(f"deleting pod {namespace}/{name}: {status} {str(body)[:300]}")
        self.wait_for(f"pod {namespace}/{name} gone", lambda: self.pod(name, namespace) is None, timeout)

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        if self._started:
            raise ClusterError("the cluster is already started")
        if os.geteuid() != 0:
            raise ClusterError("the cluster bed needs root")
        for name in (*CONTROL_PLANE, "kubelet"):
            go_tool(name)  # ToolMissing names the set-up step
        self._started = True
        try:
            self._make_dirs()
            self._make_pki()
            self._start_etcd()
            self._start_apiserver()
            self._start_controllers()
            self.add_node(self.first_node_name)
            # pods need the namespace's ServiceAccount (the admission plugin refuses them
            # otherwise) and their token volume the kube-root-ca.crt ConfigMap: both kcm's
            self.wait_for(
                "the default ServiceAccount",
                lambda: self.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"),
                self.timeout,
            )
            self.wait_for(
                "the kube-root-ca.crt ConfigMap",
                lambda: self.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/kube-root-ca.crt"),
                self.timeout,
            )
            (self.log_dir / "timings.json").write_text(json.dumps(self.timings, indent=2) + "\n")
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise

    def _make_dirs(self) -> None:
        b = self.base_dir
        if b == Path("/") or len(b.parts) < 3:
            raise ClusterError(f"refusing base dir {b}")
        if b.exists() and (not b.is_dir() or any(b.iterdir())):
            raise ClusterError(f"base dir {b} exists and is not an empty directory")
        b.mkdir(parents=True, exist_ok=True)
        os.chmod(b, 0o711)
        for d in (self.kubeconfig_dir, self.log_dir, self.etcd_dir, self.home):
            d.mkdir(mode=0o700, exist_ok=True)

    def _make_pki(self) -> None:
        p = self.pki
        p.create_ca()
        ips, dns = ["127.0.0.1"], ["localhost"]
        p.issue("etcd-server", "etcd", ips=ips, dns=dns, server=True, client=True)
        p.issue("etcd-client", "kube-apiserver-etcd-client", client=True)
        p.issue(
            "apiserver",
            "kube-apiserver",
            ips=["127.0.0.1", SERVICE_IP],
            dns=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"],
            server=True,
        )
        # the API server's (and the tests') identity towards the kubelets' APIs
        p.issue(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", orgs=["system:masters"], client=True
        )
        p.issue("kcm-serving", "kube-controller-manager", ips=ips, dns=dns, server=True)
        p.issue("scheduler-serving", "kube-scheduler", ips=ips, dns=dns, server=True)
        p.service_account_keys()
        self.etcd_port, self.etcd_peer_port, self.apiserver_port = _free_port(), _free_port(), _free_port()
        self.kcm_port, self.scheduler_port = _free_port(), _free_port()
        for user, cn, orgs in (
            ("admin", "admin", ["system:masters"]),
            ("kube-controller-manager", "system:kube-controller-manager", []),
            ("kube-scheduler", "system:kube-scheduler", []),
        ):
            crt, key = p.issue(user, cn, orgs=orgs, client=True)
            self.kubeconfig[user] = write_kubeconfig(
                self.kubeconfig_dir / f"{user}.kubeconfig", self.server, p.ca_cert, crt, key, cn
            )
        self._ssl = ssl.create_default_context(cafile=str(p.ca_cert))
        self._ssl.load_cert_chain(p.dir / "admin.crt", p.dir / "admin.key")

    def _env(self) -> dict[str, str]:
        return {"PATH": DAEMON_PATH, "HOME": str(self.home), "LANG": "C.UTF-8"}

    def _daemon(self, name: str, args: list[str]) -> Daemon:
        d = Daemon(
            name, [str(go_tool(name)), *args], self.log_dir / f"{name}.log", self.base_dir, self._env()
        )
        self._daemons[name] = d
        return d

    def _wait_healthy(self, daemon: Daemon, port: int, path: str, ctx: ssl.SSLContext) -> float:
        """Wait until ``https://127.0.0.1:<port><path>`` answers ``ok``; returns the seconds since
        ``daemon`` started."""
        t0 = time.monotonic()

        def check() -> bool:
            conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=ctx)
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                body = resp.read().decode(errors="replace").strip()
            finally:
                conn.close()
            if resp.status != 200:
                return False
            if body == "ok":
                return True
            return bool(json.loads(body).get("health") == "true")  # etcd's /health

        self.wait_for(f"{daemon.name} {path}", check, self.timeout, every=0.1)
        return time.monotonic() - t0

    def _start_etcd(self) -> None:
        p = self.pki.dir
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"https://127.0.0.1:{self.etcd_port}"
        d = self._daemon(
            "etcd",
            [
                "--name=podshim",
                f"--data-dir={self.etcd_dir}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=podshim={peer}",
                "--initial-cluster-state=new",
                f"--cert-file={p / 'etcd-server.crt'}",
                f"--key-file={p / 'etcd-server.key'}",
                f"--trusted-ca-file={self.pki.ca_cert}",
                "--client-cert-auth=true",
                "--quota-backend-bytes=1073741824",
                # a throw-away store on a slow disk: an fsync per write slowed every API call
                "--unsafe-no-fsync=true",
                "--log-outputs=stderr",
            ],
        )
        d.start()
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(p / "etcd-client.crt", p / "etcd-client.key")
        self.timings["etcd"] = self._wait_healthy(d, self.etcd_port, "/health", ctx)

    def _apiserver_args(self) -> list[str]:
        p = self.pki.dir
        return [
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # else it exits: "may not be in the loopback range" (the endpoint reconciler's check)
            "--endpoint-reconciler-type=none",
            f"--secure-port={self.apiserver_port}",
            f"--cert-dir={self.base_dir / 'apiserver'}",
            f"--etcd-servers=https://127.0.0.1:{self.etcd_port}",
            f"--etcd-cafile={self.pki.ca_cert}",
            f"--etcd-certfile={p / 'etcd-client.crt'}",
            f"--etcd-keyfile={p / 'etcd-client.key'}",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={self.pki.ca_cert}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={self.pki.ca_cert}",
            # the kubelets serve on their node IP (their serving certs name it), never loopback
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            "--allow-privileged=true",
            "--profiling=false",
            f"--v={self.verbosity}",
        ]

    def _start_apiserver(self) -> None:
        (self.base_dir / "apiserver").mkdir(mode=0o700, exist_ok=True)
        d = self._daemons.get("kube-apiserver") or self._daemon("kube-apiserver", self._apiserver_args())
        d.start()
        assert self._ssl is not None
        self.timings["kube-apiserver"] = self._wait_healthy(d, self.apiserver_port, "/readyz", self._ssl)

    def restart_apiserver(self) -> None:
        """Stop the API server and start it again on the same port, with the same etcd; returns once
        it is ready (the other components reconnect by themselves)."""
        self._daemons["kube-apiserver"].stop()
        self._start_apiserver()

    def _start_controllers(self) -> None:
        p = self.pki.dir
        kcm_kc, sched_kc = self.kubeconfig["kube-controller-manager"], self.kubeconfig["kube-scheduler"]
        kcm = self._daemon(
            "kube-controller-manager",
            [
                f"--kubeconfig={kcm_kc}",
                f"--authentication-kubeconfig={kcm_kc}",
                f"--authorization-kubeconfig={kcm_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.kcm_port}",
                f"--tls-cert-file={p / 'kcm-serving.crt'}",
                f"--tls-private-key-file={p / 'kcm-serving.key'}",
                "--leader-elect=false",
                f"--service-account-private-key-file={p / 'sa.key'}",
                f"--root-ca-file={self.pki.ca_cert}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--cluster-signing-cert-file={self.pki.ca_cert}",
                f"--cluster-signing-key-file={self.pki.ca_key}",
                "--profiling=false",
                f"--v={self.verbosity}",
            ],
        )
        scheduler = self._daemon(
            "kube-scheduler",
            [
                f"--kubeconfig={sched_kc}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.scheduler_port}",
                f"--tls-cert-file={p / 'scheduler-serving.crt'}",
                f"--tls-private-key-file={p / 'scheduler-serving.key'}",
                "--leader-elect=false",
                "--profiling=false",
                f"--v={self.verbosity}",
            ],
        )
        kcm.start()
        scheduler.start()
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        self.timings["kube-controller-manager"] = self._wait_healthy(kcm, self.kcm_port, "/healthz", ctx)
        self.timings["kube-scheduler"] = self._wait_healthy(scheduler, self.scheduler_port, "/healthz", ctx)

    # ------------------------------------------------------------------ nodes

    def add_node(
        self,
        name: str | None = None,
        *,
        podshim_config_extra: dict[str, dict[str, Any]] | None = None,
        bed_options: dict[str, Any] | None = None,
        kubelet_options: dict[str, Any] | None = None,
    ) -> ClusterNode:
        """A node registered with the cluster: a TestBed of its own under ``node-<n>/`` (its
        containerd, podshim, bridge, cgroup root and mount namespace) and a kubelet with the node's
        credentials (CN=system:node:<name>, O=system:nodes) pointed at that podshim; returns once
        the node is Ready. The options default to the cluster's."""
        index = len(self.nodes) + 1
        while (self.base_dir / f"node-{index}").exists():
            index += 1
        name = name or f"podshim-node-{index}"
        if any(n.name == name for n in self.nodes):
            raise ClusterError(f"node {name} exists")
        user = f"system:node:{name}"
        crt, key = self.pki.issue(f"node-{index}", user, orgs=["system:nodes"], client=True)
        kubeconfig = write_kubeconfig(
            self.kubeconfig_dir / f"node-{index}.kubeconfig", self.server, self.pki.ca_cert, crt, key, user
        )
        # podshim reads the node's kubeconfig when it starts: the file exists before the bed does
        sections: dict[str, dict[str, Any]] = {
            "kubernetes": {"kubeconfig": str(kubeconfig), "node_name": name}
        }
        for section, values in (
            self.podshim_config_extra if podshim_config_extra is None else podshim_config_extra
        ).items():
            sections.setdefault(section, {}).update(values)
        options = dict(self.bed_options if bed_options is None else bed_options)
        if self.save_logs_to is not None:
            options.setdefault("save_logs_to", self.save_logs_to / self.base_dir.name)
        bed = TestBed(
            self.base_dir / f"node-{index}",
            node_mounts=node_mounts(),
            stock_checkpoint_roots=True,
            podshim_sections=sections,
            **options,
        )
        bed.start()
        kubelet: Kubelet | None = None
        try:
            assert bed.subnet is not None
            ip = str(bed.subnet.network_address + 1)  # the bed bridge's gateway: on this host
            serving = self.pki.issue(f"node-{index}-serving", name, ips=[ip], dns=[name], server=True)
            p = self.pki.dir
            registration = Registration(
                kubeconfig=kubeconfig,
                node_ip=ip,
                serving_cert=serving[0],
                serving_key=serving[1],
                client_ca=self.pki.ca_cert,
                api_client_cert=p / "apiserver-kubelet-client.crt",
                api_client_key=p / "apiserver-kubelet-client.key",
            )
            kwargs = dict(self.kubelet_options if kubelet_options is None else kubelet_options)
            kwargs.setdefault("timeout", self.timeout)
            kubelet = Kubelet(
                bed, endpoint=bed.podshim_socket, node_name=name, registration=registration, **kwargs
            )
            node = ClusterNode(name=name, bed=bed, kubelet=kubelet, kubeconfig=kubeconfig, ip=ip)
            t0 = time.monotonic()
            kubelet.start()
            self.wait_node_ready(name)
            self.timings[f"{name} Ready"] = time.monotonic() - t0
        except BaseException:
            if kubelet is not None:
                with contextlib.suppress(Exception):
                    kubelet.stop()
            with contextlib.suppress(Exception):
                bed.stop()
            raise
        self.nodes.append(node)
        self.kubeconfig[user] = kubeconfig
        self.kubeconfig.setdefault("node", kubeconfig)
        return node

    def remove_node(self, node: ClusterNode) -> None:
        """Stop ``node`` (its kubelet and bed) and delete its Node object."""
        self.nodes.remove(node)
        try:
            node.stop()
        finally:
            self.kubeconfig.pop(node.user, None)
            status, body = self.api("DELETE", f"/api/v1/nodes/{node.name}")
            if status not in (200, 404):
                raise ClusterError(f"deleting node {node.name}: {status} {str(body)[:300]}")

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """Stop the nodes, then the control plane, each by its pid; remove the base dir."""
        errors: list[str] = []
        for node in reversed(self.nodes):
            try:
                node.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the rest
                errors.append(str(e))
        self.nodes.clear()
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            if name in self._daemons:
                try:
                    self._daemons[name].stop()
                except Exception as e:  # noqa: BLE001
                    errors.append(f"{name}: {e}")
        self._daemons.clear()
        errors += _remove_base_dir(self.base_dir, self.save_logs_to)
        self._started = False
        if errors:
            raise ClusterError("cluster cleanup incomplete:\n  " + "\n  ".join(errors))

    def __enter__(self) -> ClusterBed:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ state (for the CLI)

    def describe(self) -> dict[str, Any]:
        """What ``stop_described()`` needs to stop this cluster from another process."""
        return {
            "base_dir": str(self.base_dir),
            "server": self.server,
            "kubeconfig": {k: str(v) for k, v in self.kubeconfig.items()},
            "daemons": {name: d.pid for name, d in self._daemons.items()},
            "nodes": [
                {
                    "name": n.name,
                    "ip": n.ip,
                    "bed": n.bed.describe(),
                    "kubelet_pid": n.kubelet.pid,
                    "kubelet_config": str(n.kubelet.config_file),
                }
                for n in self.nodes
            ],
        }

    @staticmethod
    def stop_described(description: dict[str, Any]) -> None:
        """Stop a cluster started by another process (from its ``describe()``): each process only
        while its pid still runs our program, then the node beds, then the base dir."""
        errors: list[str] = []
        base_dir = Path(description["base_dir"])
        for node in reversed(description.get("nodes") or []):
            try:
                if _own(node.get("kubelet_pid"), "kubelet", node["kubelet_config"]):
                    _end(int(node["kubelet_pid"]), 20.0)
                TestBed.attach(node["bed"]).stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the rest
                errors.append(f"node {node.get('name')}: {e}")
        daemons = description.get("daemons") or {}
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            pid = daemons.get(name)
            try:
                if pid is not None and _own(pid, name, str(base_dir)):
                    _end(int(pid), 20.0)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name}: {e}")
        logs_env = os.environ.get("PODSHIM_TESTBED_LOGS")
        errors += _remove_base_dir(base_dir, Path(logs_env) if logs_env else None)
        if errors:
            raise ClusterError("cluster cleanup incomplete:\n  " + "\n  ".join(errors))


def _remove_base_dir(base_dir: Path, save_logs_to: Path | None) -> list[str]:
    """Save the control plane's logs when asked, then remove the base dir (the node beds removed
    theirs); returns what went wrong."""
    if not base_dir.exists():
        return []
    if save_logs_to is not None and (base_dir / "logs").is_dir():
        with contextlib.suppress(OSError):
            shutil.copytree(base_dir / "logs", save_logs_to / base_dir.name / "logs", dirs_exist_ok=True)
    if _sys.mounts_under(base_dir):
        return [f"not removing {base_dir}: something is still mounted there"]
    try:
        shutil.rmtree(base_dir)
    except OSError as e:
        return [f"removing {base_dir}: {e}"]
    return []


def pod_manifest(
    name: str, containers: list[dict[str, Any]], *, namespace: str = NAMESPACE, **spec: Any
) -> dict[str, Any]:
    """A Pod for the scheduler to place (no nodeName unless given in ``spec``); a 2 s grace period
    (``sleep`` as a container's pid 1 ignores SIGTERM)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 2, **spec},
    }
