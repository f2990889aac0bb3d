"""A private containerd (+ podshim) for end-to-end tests.

``TestBed`` runs its own containerd with its own root, state, sockets, runc root, CNI bridge and
cgroup subtree under one base directory, imports the locally built test images (``images/``),
optionally starts podshim in front of it, and on ``stop()`` removes everything it created, even
when containerd died on the way.  See ``TestBed.__init__`` for the knobs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from testbed import _sys, bed_files
from testbed._cri import CriClient, target
from testbed.bed_stop import REPO, BedStop, _api
from testbed.errors import TestBedError
from testbed.mntns import NodeMounts
from testbed.versions import (
    CONTAINERD_VERSIONS,
    CRIU_BINARIES,
    DEFAULT_CONTAINERD,
    DEFAULT_CRIU,
    DEFAULT_RUNC,
    RUNC_BINARIES,
    built,
    containerd_bin_dir,
    containerd_version_from_env,
    criu_binary,
    criu_version_from_env,
    runc_version_from_env,
)

VENV_BIN = REPO / ".venv" / "bin"
DEFAULT_IMAGE_CACHE = REPO / ".testbed" / "images"
DEBIAN_DEBS = "/var/cache/podshim/debs"  # the set-up's download of the real-workload images' packages
NAMESPACE = "k8s.io"

PAUSE_IMAGE = "localhost/podshim/pause:1"
BUSYBOX_IMAGE = "localhost/podshim/busybox:1"
COUNTER_IMAGE = "localhost/podshim/counter:1"
IMAGES = (PAUSE_IMAGE, BUSYBOX_IMAGE, COUNTER_IMAGE)

UNIX_PATH_MAX = 107


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no {path})"
    return "\n".join(text.splitlines()[-lines:])


def _module_exists(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (REPO / rel).with_suffix(".py").is_file() or (REPO / rel / "__init__.py").is_file()


def podshim_runc_available() -> bool:
    """Whether the repo's ``podshim-runc`` wrapper is installed and has its module (the set-up
    installs the compiled wrapper there, next to its Python hook ``podshim-runc-hook``)."""
    return (VENV_BIN / "podshim-runc").is_file() and _module_exists("shim.wrapper.main")


def podshim_available() -> bool:
    """Whether the repo's ``podshim`` command is installed and has its module."""
    return (VENV_BIN / "podshim").is_file() and _module_exists("shim.cli")


class TestBed(BedStop):
    """A private containerd with the CRI plugin (and optionally podshim in front of it).

    Use as a context manager (``with TestBed() as bed: ...``) or call ``start()``/``stop()``.
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(
        self,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        start_podshim: bool = True,
        runc_binary: str | os.PathLike[str] | None = None,
        crun_binary: str | os.PathLike[str] | None = None,
        crun_runtime: str | os.PathLike[str] | None = None,
        podshim_command: list[str] | None = None,
        import_images: bool = True,
        image_cache: str | os.PathLike[str] | None = None,
        timeout: float = 60.0,
        log_level: str = "info",
        save_logs_to: str | os.PathLike[str] | None = None,
        extra_env: dict[str, str] | None = None,
        containerd: str | None = None,
        node_mounts: NodeMounts | None = None,
        stock_checkpoint_roots: bool = False,
        registry_mirror: str | None = None,
        netns: str | None = None,
        podshim_sections: dict[str, dict[str, Any]] | None = None,
        runc: str | None = None,
        criu: str | None = None,
        container_annotations: list[str] | None = None,
        restore_via_create: bool = False,
    ) -> None:
        """
        base_dir: where everything lives; must not exist or be empty; removed by ``stop()``.
            Default ``/run/podshim-testbed-<random>``.
        start_podshim: also start ``podshim serve`` in front of containerd.
        runc_binary: ``BinaryName`` of the ``runc`` runtime handler.  Default: the repo's
            ``.venv/bin/podshim-runc`` when its module exists, else a generated script in the
            base dir that execs the real runc (``runc``).
        crun_binary: ``BinaryName`` of a second runtime handler ``crun`` (Root ``<base>/crun``);
            None: no such handler.  It may be the real crun or ``.venv/bin/podshim-runc``.
        crun_runtime: the real crun, written to podshim.toml as ``[runtimes.crun] binary`` when
            the crun handler exists (default: ``crun`` on PATH, else /usr/local/bin/crun).
        podshim_command: the podshim command (default ``[.venv/bin/podshim]``); ``serve --config
            <base>/podshim.toml`` is appended.
        import_images: build (``images/build.py``, cached in ``image_cache``) and import the
            pause, busybox and counter images.
        image_cache: where built image tarballs are kept (default ``<repo>/.testbed/images``).
        timeout: bound on each wait at start-up (sockets answering, images visible).
        log_level: containerd's log level.
        save_logs_to: before ``stop()`` removes the base dir, copy the containerd/podshim logs
            and the pod logs to ``<save_logs_to>/<base dir name>/`` (default: the environment
            variable ``PODSHIM_TESTBED_LOGS``, else the logs go with the base dir).
        extra_env: environment variables added for containerd (and so its shims and
            podshim-runc) and podshim, e.g. ``PODSHIM_FAILPOINTS``. The attribute may be changed
            between ``stop_containerd()`` and ``start_containerd()`` (or a podshim restart).
        containerd: the upstream version, one of ``CONTAINERD_VERSIONS`` (default: the variable
            ``PODSHIM_TEST_CONTAINERD``, else 1.6, the system's). 1.7 and 2.1 run from the set-up's
            private prefix, first on containerd's PATH so that it finds their runc shim; 2.x gets
            config version 3.
        node_mounts: run containerd and podshim in a private mount namespace showing these
            (testbed/mntns.py), e.g. a kubelet's stock /var/lib/kubelet (testbed/kubelet.py).
        stock_checkpoint_roots: leave ``[checkpoint] allowed_roots`` out of podshim's config, so
            podshim's built-in default applies (else: ``<base>/checkpoints``).
        registry_mirror: ``host:port`` of a plain-HTTP registry (testbed/registry.py) from which
            containerd pulls the images of every registry (critest's: conformance/critest.py).
        netns: a network namespace (a bind-mounted nsfs file) podshim runs in (testbed/nodes.py:
            migration between two beds); containerd and the pods stay in the host's.
        podshim_sections: further sections of podshim.toml, {section: {key: value}}.
        runc: the real runc, one of ``RUNC_BINARIES`` (default: ``PODSHIM_TEST_RUNC``, else 1.1):
            podshim's ``[runtime] binary`` and what the plain wrapper script execs.
        criu: the CRIU, one of ``CRIU_BINARIES`` (default: ``PODSHIM_TEST_CRIU``, else 4.1, the
            binary ``PODSHIM_TEST_CRIU_BIN`` names when set):
            podshim's ``[runtime] criu`` (and crun's) and containerd 1.x's ``CriuPath``; containerd's
            PATH keeps /usr/local/sbin's (podshim puts its own first for the runtimes it runs).
        container_annotations: the runtime handlers' ``container_annotations`` (default
            ``["podshim.*"]``; a bed wired wrong lets other ones through).
        restore_via_create: containerd 2.x's own restore of a checkpoint tar given to
            CreateContainer as the image (``enable_experimental_restore_via_create``, which 2.2 has
            off by default); off by default here too. containerd 1.x has no such restore.
        """
        self.base_dir = Path(base_dir or f"/run/podshim-testbed-{secrets.token_hex(4)}").absolute()
        self.start_podshim = start_podshim
        self.crun_binary = Path(crun_binary) if crun_binary else None
        self.crun_runtime = Path(crun_runtime or shutil.which("crun") or "/usr/local/bin/crun")
        self.podshim_command = podshim_command or [str(VENV_BIN / "podshim")]
        self.import_images = import_images
        self.image_cache = Path(image_cache) if image_cache else DEFAULT_IMAGE_CACHE
        self.timeout = timeout
        self.log_level = log_level
        logs_env = os.environ.get("PODSHIM_TESTBED_LOGS")
        self.save_logs_to = Path(save_logs_to) if save_logs_to else Path(logs_env) if logs_env else None
        self.namespace = NAMESPACE
        self.extra_env = dict(extra_env or {})
        self.netns = netns
        self.podshim_sections = dict(podshim_sections or {})
        self.containerd_version = containerd or containerd_version_from_env()
        if self.containerd_version not in CONTAINERD_VERSIONS:
            raise TestBedError(
                f"containerd {self.containerd_version!r}: must be one of {', '.join(CONTAINERD_VERSIONS)}"
            )
        if restore_via_create and not self.containerd_at_least("2.0"):
            raise TestBedError(f"containerd {self.containerd_version} has no restore via CreateContainer")
        self.restore_via_create = restore_via_create
        self.containerd_bin_dir = containerd_bin_dir(self.containerd_version)
        self.node_mounts = node_mounts
        self.stock_checkpoint_roots = stock_checkpoint_roots
        self.registry_mirror = registry_mirror
        self.runc_version = runc or runc_version_from_env()
        self.criu_version = criu or criu_version_from_env()
        if self.runc_version not in RUNC_BINARIES or self.criu_version not in CRIU_BINARIES:
            raise TestBedError(f"runc {self.runc_version!r} / CRIU {self.criu_version!r}: unknown")
        self.real_runc = built(RUNC_BINARIES[self.runc_version], f"runc {self.runc_version}")
        self.criu = (
            criu_binary(self.criu_version)
            if criu is None
            else built(CRIU_BINARIES[self.criu_version], f"CRIU {self.criu_version}")
        )

        b = self.base_dir
        self.containerd_socket = b / "containerd.sock"
        self.podshim_socket = b / "podshim.sock"
        self.containerd_config = b / "containerd.toml"
        self.podshim_config = b / "podshim.toml"
        self.containerd_root = b / "containerd" / "root"
        self.containerd_state = b / "containerd" / "state"
        self.runc_root_base = b / "runc"  # the runc options' Root ...
        self.runc_root = self.runc_root_base / NAMESPACE  # ... which the shim suffixes with the ns
        self.crun_root_base = b / "crun"
        self.crun_root = self.crun_root_base / NAMESPACE
        self.checkpoint_root = b / "checkpoints"
        self.podshim_state_dir = b / "podshim-state"
        self.log_dir = b / "logs"
        self.pod_logs_dir = b / "pod-logs"
        self.containerd_log = self.log_dir / "containerd.log"
        self.podshim_log = self.log_dir / "podshim.log"
        self.cni_conf_dir = b / "cni" / "net.d"
        self.cni_ipam_dir = b / "cni" / "ipam"
        self.runc_binary = Path(runc_binary) if runc_binary else None
        self.container_annotations = ["podshim.*"] if container_annotations is None else container_annotations

        # network and cgroup identity, chosen at start
        self.bed_id = ""
        self.bridge = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self.cni_network = ""
        self.cgroup_root = ""

        self._containerd: subprocess.Popen[bytes] | None = None
        self._podshim: subprocess.Popen[bytes] | None = None
        self._containerd_pid: int | None = None
        self._podshim_pid: int | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._container_cgroups: set[str] = set()
        self._started = False

    # ------------------------------------------------------------------ public API

    def containerd_at_least(self, version: str) -> bool:
        """Whether the bed's upstream is containerd ``version`` ("1.7", "2.0", ...) or newer."""

        def key(v: str) -> tuple[int, ...]:
            return tuple(int(p) for p in v.split("."))

        return key(self.containerd_version) >= key(version)

    @property
    def log_paths(self) -> dict[str, Path]:
        return {"containerd": self.containerd_log, "podshim": self.podshim_log}

    @property
    def podshim_running(self) -> bool:
        return self._podshim_pid is not None and _sys.alive(self._podshim_pid)

    @property
    def containerd_running(self) -> bool:
        return self._containerd_pid is not None and _sys.alive(self._containerd_pid)

    @property
    def containerd_pid(self) -> int | None:
        return self._containerd_pid

    @property
    def podshim_pid(self) -> int | None:
        return self._podshim_pid

    @property
    def default_socket(self) -> Path:
        """podshim's socket when podshim was started, else containerd's."""
        return self.podshim_socket if self._podshim_pid is not None else self.containerd_socket

    def cgroup_parent(self, pod_uid: str) -> str:
        """A kubelet-like (cgroupfs) ``linux.cgroup_parent`` for a pod, inside this bed's subtree."""
        return f"{self.cgroup_root}/pod{pod_uid}"

    def pod_log_dir(self, name: str) -> Path:
        """A fresh ``log_directory`` for a pod, under the base dir."""
        d = self.pod_logs_dir / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def channel(self, socket: str | os.PathLike[str] | None = None) -> grpc.Channel:
        """A cached gRPC channel to ``socket`` (default ``default_socket``); closed by ``stop()``."""
        t = target(socket or self.default_socket)
        if t not in self._channels:
            self._channels[t] = grpc.insecure_channel(t)
        return self._channels[t]

    def runtime_stub(self, socket: str | os.PathLike[str] | None = None) -> Any:
        """``api_pb2_grpc.RuntimeServiceStub`` on ``socket`` (default ``default_socket``)."""
        return _api()[1].RuntimeServiceStub(self.channel(socket))

    def image_stub(self, socket: str | os.PathLike[str] | None = None) -> Any:
        """``api_pb2_grpc.ImageServiceStub`` on ``socket`` (default ``default_socket``)."""
        return _api()[1].ImageServiceStub(self.channel(socket))

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against this bed's containerd in namespace k8s.io."""
        ctr = str(self.containerd_bin_dir / "ctr") if self.containerd_bin_dir else "ctr"
        cmd = [ctr, "--address", str(self.containerd_socket), "-n", self.namespace, *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and res.returncode != 0:
            raise TestBedError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def import_image(self, tarball: str | os.PathLike[str]) -> None:
        """Import an OCI/docker archive into namespace k8s.io (names from the archive)."""
        self.ctr("images", "import", "--all-platforms", os.fspath(tarball))

    def import_debian_image(self, file: str) -> str:
        """One of the real-workload images (images/debian.py: "postgres", "node", "jre"), built into the
        image cache from the packages the set-up downloaded, imported; returns its name."""
        cmd = [sys.executable, str(REPO / "images" / "debian.py"), str(self.image_cache), file]
        cmd += ["--debs", DEBIAN_DEBS]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise TestBedError(f"building the {file} image failed:\n{res.stdout}\n{res.stderr}")
        name, tarball, _digest = res.stdout.strip().split("\t")
        self.import_image(tarball)
        return name

    def __enter__(self) -> TestBed:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        if self._started:
            raise TestBedError("test bed already started")
        if os.geteuid() != 0:
            raise TestBedError("the test bed needs root")
        self._started = True
        try:
            self._make_base_dir()
            if self.node_mounts is not None:
                self.node_mounts.create(self.base_dir)
            images = self._build_images() if self.import_images else []
            _sys.sweep_stale_pod_roots()  # what a killed test run left running
            self._setup_network()
            self._write_files()
            self._start_containerd()
            for tarball in images:
                self.import_image(tarball)
            if images:
                self._wait_images()
            if self.start_podshim:
                self._start_podshim()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise

    def _make_base_dir(self) -> None:
        b = self.base_dir
        if b == Path("/") or len(b.parts) < 3:
            raise TestBedError(f"refusing base dir {b}")
        if b.exists() and (not b.is_dir() or any(b.iterdir())):
            raise TestBedError(f"base dir {b} exists and is not an empty directory")
        longest = str(self.containerd_socket) + ".ttrpc"
        if len(longest) > UNIX_PATH_MAX:
            raise TestBedError(f"base dir {b} too long for unix sockets ({longest})")
        b.mkdir(parents=True, exist_ok=True)
        os.chmod(b, 0o711)
        for d in (
            self.log_dir,
            self.pod_logs_dir,
            self.cni_conf_dir,
            self.cni_ipam_dir,
            self.checkpoint_root,
            self.podshim_state_dir,
            self.runc_root_base,
        ):
            d.mkdir(parents=True, exist_ok=True)

    def _build_images(self) -> list[Path]:
        cmd = [sys.executable, str(REPO / "images" / "build.py"), str(self.image_cache)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise TestBedError(f"building test images failed:\n{res.stdout}\n{res.stderr}")
        listing = json.loads((self.image_cache / "images.json").read_text())
        return [self.image_cache / entry["file"] for entry in listing]

    def _setup_network(self) -> None:
        """Pick a free bridge name / cgroup name / 10.x.y.0/24 and create the bridge with its
        gateway address right away, so that a concurrent bed sees both as taken."""
        rng = random.SystemRandom()
        for _ in range(500):
            bed_id = secrets.token_hex(2)
            bridge = f"psbr{bed_id}"
            if _sys.link_exists(bridge) or _sys.cgroup_dirs(f"/podshim-test-{bed_id}"):
                continue
            subnet = ipaddress.IPv4Network(f"10.{rng.randrange(100, 200)}.{rng.randrange(256)}.0/24")
            if any(subnet.overlaps(n) for n in _used_networks()):
                continue
            if subprocess.run(
                ["ip", "link", "add", bridge, "type", "bridge"], capture_output=True
            ).returncode:
                continue  # lost a race for the name
            self.bed_id, self.bridge, self.subnet = bed_id, bridge, subnet
            gateway = f"{subnet.network_address + 1}/{subnet.prefixlen}"
            _sys.ip("addr", "add", gateway, "dev", bridge)
            _sys.ip("link", "set", bridge, "up")
            if any(subnet.overlaps(n) for n in _used_networks(exclude_dev=bridge)):
                _sys.delete_link(bridge)  # lost a race for the subnet
                self.bridge = ""
                continue
            self.cni_network = f"podshim-{bridge}"
            self.cgroup_root = f"/podshim-test-{bed_id}"
            return
        raise TestBedError("no free bridge name / subnet found")

    def _runc_binary(self) -> Path:
        if self.runc_binary is None:
            if podshim_runc_available():
                self.runc_binary = VENV_BIN / "podshim-runc"
            else:
                script = self.base_dir / "runc-wrapper"
                script.write_text(f'#!/bin/sh\nexec {self.real_runc} "$@"\n')
                script.chmod(0o755)
                self.runc_binary = script
        return self.runc_binary

    def _write_files(self) -> None:
        """The CNI conflist, containerd's config and podshim.toml (testbed/bed_files.py), and
        bed.json."""
        assert self.subnet is not None
        conflist = bed_files.cni_conflist(self.cni_network, self.bridge, self.subnet, self.cni_ipam_dir)
        (self.cni_conf_dir / "10-podshim.conflist").write_text(conflist)
        runtimes = [("runc", self._runc_binary(), self.runc_root_base)]
        if self.crun_binary is not None:
            runtimes.append(("crun", self.crun_binary, self.crun_root_base))
        self.containerd_config.write_text(
            bed_files.containerd_toml(
                version=self.containerd_version,
                runtimes=runtimes,
                container_annotations=self.container_annotations,
                runc_criu=self.criu if self.runc_version == "1.1" else None,
                root=self.containerd_root,
                state=self.containerd_state,
                socket=self.containerd_socket,
                log_level=self.log_level,
                opt_dir=self.base_dir / "containerd" / "opt",
                cni_conf_dir=self.cni_conf_dir,
                pause_image=PAUSE_IMAGE,
                registry_mirror=self.registry_mirror,
                hosts_dir=self.base_dir / "certs.d",
                restore_via_create=self.restore_via_create,
            )
        )
        self.podshim_config.write_text(
            bed_files.podshim_toml(
                socket=self.podshim_socket,
                state_dir=self.podshim_state_dir,
                containerd_socket=self.containerd_socket,
                runc=self.real_runc,
                runc_root=self.runc_root,
                criu=self.criu,
                crun=(self.crun_runtime, self.crun_root) if self.crun_binary is not None else None,
                checkpoint_roots=None if self.stock_checkpoint_roots else [str(self.checkpoint_root)],
                sections=self.podshim_sections,
            )
        )
        (self.base_dir / "bed.json").write_text(json.dumps(self.describe(), indent=2) + "\n")

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PODSHIM_CONFIG"] = str(self.podshim_config)
        path = env.get("PATH", "")
        for p in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
            if p not in path.split(":"):
                path = f"{path}:{p}" if path else p
        # not the bed's CRIU first on PATH: podshim names its own to runc and crun (as on a node where
        # the distribution's criu comes first); containerd 2.x's own CheckpointContainer takes PATH's
        if self.containerd_bin_dir is not None:
            path = f"{self.containerd_bin_dir}:{path}"  # containerd finds its runc shim on PATH
        env["PATH"] = path
        # podshim and podshim-runc-hook (started by containerd for every restore) keep their
        # compiled modules in the bed, as an installed podshim has them (pip compiles them): with
        # PYTHONDONTWRITEBYTECODE inherited, every hook compiled ~20 modules again, 0.05-0.15 s of
        # each restore's StartContainer (bench-restore's eager_overhead_ratio)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(self.base_dir / "pycache")
        env.update(self.extra_env)
        return env

    def _in_node(self, cmd: list[str]) -> list[str]:
        return self.node_mounts.command(cmd) if self.node_mounts is not None else cmd

    def _spawn(self, cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
        cmd = self._in_node(cmd)
        with open(log, "ab") as out:
            return subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env(),
                cwd=self.base_dir,
                start_new_session=True,  # survives the launcher; no terminal signals
                close_fds=True,
            )

    def _wait_version(self, socket: Path, name: str, pid: int, log: Path) -> None:
        deadline = time.monotonic() + self.timeout
        last = ""
        while True:
            if not _sys.alive(pid):
                raise TestBedError(f"{name} exited during start-up; log tail:\n{_tail(log)}")
            if socket.exists():
                with CriClient(socket) as c:
                    try:
                        c.runtime.Version(_api()[0].VersionRequest(), timeout=2.0)
                        return
                    except grpc.RpcError as e:
                        last = f"{e.code()}: {e.details()}"
            if time.monotonic() >= deadline:
                raise TestBedError(
                    f"{name} did not answer CRI Version on {socket} within {self.timeout}s "
                    f"(last error: {last or 'no socket'}); log tail:\n{_tail(log)}"
                )
            time.sleep(0.1)

    def _start_containerd(self) -> None:
        binary = str(self.containerd_bin_dir / "containerd") if self.containerd_bin_dir else "containerd"
        cmd = [binary, "--config", str(self.containerd_config)]
        self._containerd = self._spawn(cmd, self.containerd_log)
        self._containerd_pid = self._containerd.pid
        self._save_description()
        self._wait_version(self.containerd_socket, "containerd", self._containerd_pid, self.containerd_log)

    def _wait_images(self) -> None:
        deadline = time.monotonic() + self.timeout
        with CriClient(self.containerd_socket) as c:
            while True:
                missing = [i for i in IMAGES if not c.image_present(i)]
                if not missing:
                    return
                if time.monotonic() >= deadline:
                    raise TestBedError(f"CRI does not see imported images {missing}")
                time.sleep(0.1)

    def _start_podshim(self) -> None:
        cmd = [*self.podshim_command, "serve", "--config", str(self.podshim_config)]
        if self.netns:  # nsenter execs podshim: the same pid
            cmd = ["nsenter", f"--net={self.netns}", *cmd]
        self._podshim = self._spawn(cmd, self.podshim_log)
        self._podshim_pid = self._podshim.pid
        self._save_description()
        self._wait_version(self.podshim_socket, "podshim", self._podshim_pid, self.podshim_log)

    # ------------------------------------------------------------------ restarts (tests)

    def stop_containerd(self) -> None:
        """Stop containerd only (its shims and containers keep running, as on a real node)."""
        self._stop_containerd()
        self._containerd = None

    def start_containerd(self) -> None:
        """Start containerd again after stop_containerd(); it picks up its running containers."""
        self._start_containerd()

    def kill_podshim(self, sig: int = signal.SIGKILL) -> None:
        """Kill podshim (SIGKILL by default: a crash) and wait until it is gone."""
        pid = self._podshim_pid
        if pid is not None and self._own_pid(pid, str(self.podshim_config)):
            os.kill(pid, sig)
            if _sys.wait_gone({pid}, timeout=15.0):
                raise TestBedError(f"podshim {pid} did not die on signal {sig}")
        if self._podshim is not None:
            with contextlib.suppress(Exception):
                self._podshim.wait(timeout=1)

    def start_podshim_again(self) -> None:
        """Start podshim again (after kill_podshim), with the same config and state dir."""
        self._start_podshim()

    @contextlib.contextmanager
    def extra_podshim(
        self,
        workdir: str | os.PathLike[str],
        failpoints: str = "",
        env: dict[str, str] | None = None,
        **overrides: dict[str, Any],
    ) -> Iterator[tuple[Path, Path]]:
        """A second podshim in front of this bed's containerd, configured like the bed's own but
        with its own socket and state dir under `workdir`, and `overrides` merged per TOML section
        (e.g. `checkpoint={"encryption_key_file": ...}`), `failpoints` its PODSHIM_FAILPOINTS
        (shim/faults.py), `env` added to its environment. Yields (socket, log path) once it answers
        Version; stopped (SIGTERM) on exit."""
        workdir = Path(workdir)
        with open(self.podshim_config, "rb") as f:
            config = tomllib.load(f)
        config["server"].update(socket=str(workdir / "podshim.sock"), state_dir=str(workdir / "state"))
        for section, values in overrides.items():  # may move the state dir too
            config.setdefault(section, {}).update(values)
        path = workdir / "podshim.toml"
        path.write_text(bed_files.toml_dump(config))
        log = workdir / "podshim.log"
        environ = {k: v for k, v in self._env().items() if k not in ("PODSHIM_CONFIG", "PODSHIM_FAILPOINTS")}
        if failpoints:
            environ["PODSHIM_FAILPOINTS"] = failpoints
        environ.update(env or {})
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self._in_node([*self.podshim_command, "serve", "--config", str(path)]),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environ,
                start_new_session=True,
            )
        try:
            self._wait_version(Path(config["server"]["socket"]), "extra podshim", proc.pid, log)
            yield Path(config["server"]["socket"]), log
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    # ------------------------------------------------------------------ state (for the CLI)

    def describe(self) -> dict[str, Any]:
        """What ``attach()`` needs to find and tear down this bed from another process."""
        return {
            "base_dir": str(self.base_dir),
            "podshim_socket": str(self.podshim_socket),
            "containerd_socket": str(self.containerd_socket),
            "bed_id": self.bed_id,
            "bridge": self.bridge,
            "subnet": str(self.subnet) if self.subnet else "",
            "cni_network": self.cni_network,
            "cgroup_root": self.cgroup_root,
            "containerd_pid": self._containerd_pid,
            "podshim_pid": self._podshim_pid,
            "start_podshim": self.start_podshim,
            "runc_binary": str(self.runc_binary) if self.runc_binary else None,
            "crun_binary": str(self.crun_binary) if self.crun_binary else None,
            "crun_runtime": str(self.crun_runtime),
            "containerd_version": self.containerd_version,
            "runc_version": self.runc_version,
            "criu_version": self.criu_version,
        }

    def _save_description(self) -> None:
        with contextlib.suppress(OSError):
            (self.base_dir / "bed.json").write_text(json.dumps(self.describe(), indent=2) + "\n")

    @classmethod
    def attach(cls, description: dict[str, Any]) -> TestBed:
        """A handle on a bed started by another process (from ``describe()``), e.g. to stop it."""
        bed = cls(
            description["base_dir"],
            start_podshim=bool(description.get("start_podshim")),
            runc_binary=description.get("runc_binary"),
            crun_binary=description.get("crun_binary"),
            crun_runtime=description.get("crun_runtime"),
            containerd=description.get("containerd_version") or DEFAULT_CONTAINERD,
            runc=description.get("runc_version") or DEFAULT_RUNC,
            criu=description.get("criu_version") or DEFAULT_CRIU,
        )
        bed.bed_id = description.get("bed_id", "")
        bed.bridge = description.get("bridge", "")
        subnet = description.get("subnet")
        bed.subnet = ipaddress.IPv4Network(subnet) if subnet else None
        bed.cni_network = description.get("cni_network", "")
        bed.cgroup_root = description.get("cgroup_root", "")
        bed._containerd_pid = description.get("containerd_pid")
        bed._podshim_pid = description.get("podshim_pid")
        bed._started = True
        return bed

    # ------------------------------------------------------------------ stop


# ---------------------------------------------------------------------------- helpers


def _used_networks(exclude_dev: str = "") -> Iterator[ipaddress.IPv4Network]:
    """IPv4 networks in use on the host: interface addresses and routes."""
    for entry in json.loads(_sys.ip("-j", "-4", "addr", "show")):
        if entry.get("ifname") == exclude_dev:
            continue
        for a in entry.get("addr_info", []):
            yield ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False)
    for r in json.loads(_sys.ip("-j", "-4", "route", "show", "table", "all")):
        dst, dev = r.get("dst", ""), r.get("dev", "")
        if dev == exclude_dev or dst in ("", "default") or r.get("type") in ("local", "broadcast"):
            continue
        with contextlib.suppress(ValueError):
            yield ipaddress.IPv4Network(dst, strict=False)
