"""Stopping a test bed: ``TestBed.stop()`` and its steps, in the order that leaves nothing of the
bed on the host, even when containerd died on the way (``leftovers()`` says what is left). What
the steps find and remove is in ``testbed/teardown.py``; this is the order and the bed's state."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from testbed import _sys, teardown
from testbed._cri import CriClient
from testbed.errors import TestBedError

REPO = Path(__file__).resolve().parent.parent


class BedStop:
    """The teardown half of ``TestBed`` (testbed/bed.py), whose ``__init__`` sets these."""

    base_dir: Path
    log_dir: Path
    pod_logs_dir: Path
    cni_conf_dir: Path
    cni_network: str
    bridge: str
    cgroup_root: str
    containerd_socket: Path
    containerd_state: Path
    containerd_root: Path
    containerd_config: Path
    podshim_config: Path
    runc_root: Path
    crun_root: Path
    namespace: str
    save_logs_to: Path | None
    _channels: dict[str, grpc.Channel]
    _container_cgroups: set[str]
    _containerd: subprocess.Popen[bytes] | None
    _podshim: subprocess.Popen[bytes] | None
    _containerd_pid: int | None
    _podshim_pid: int | None
    _started: bool

    @property
    def containerd_running(self) -> bool:
        raise NotImplementedError  # TestBed's

    def stop(self) -> None:
        """Tear everything down; raises ``TestBedError`` listing whatever could not be removed."""
        errors: list[str] = []

        def step(name: str, fn: Callable[[], None]) -> None:
            try:
                fn()
            except Exception as e:  # keep cleaning; report at the end
                errors.append(f"{name}: {type(e).__name__}: {e}")

        step("channels", self._close_channels)
        step("podshim", self._stop_podshim)
        # runc's state says where each container's cgroup is, also for pods whose cgroup parent
        # is outside the bed's subtree; runc delete removes that state, so read it first
        step("container cgroups", lambda: self._container_cgroups.update(self._runtime_cgroups()))
        step("pods", self._remove_pods)
        ids = self._known_task_ids()
        shim_sockets = self._shim_sockets(ids)
        netns: set[str] = set()
        step("netns discovery", lambda: netns.update(self._bed_netns(ids)))
        step("containerd", self._stop_containerd)
        step("processes", self._kill_bed_processes)
        step("mounts", self._unmount_base)
        step("netns", lambda: teardown.remove_netns(netns))
        step("cni cache", lambda: self._remove_cni_cache(ids))
        step("shim sockets", lambda: teardown.remove_sockets(shim_sockets))
        step("bridge", lambda: _sys.delete_link(self.bridge) if self.bridge else None)
        step("cgroups", self._remove_cgroups)
        step("save logs", self._save_logs)
        step("base dir", self._remove_base_dir)
        step("shared dirs", teardown.remove_shared_dirs_if_unused)
        self._started = False
        left = self.leftovers()
        if errors or left:
            raise TestBedError("test bed cleanup incomplete:\n  " + "\n  ".join(errors + left))

    def _close_channels(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def _own_pid(self, pid: int | None, marker: str) -> bool:
        """``pid`` is alive and still the process we started (its argv mentions ``marker``)."""
        return pid is not None and _sys.alive(pid) and any(marker in a for a in _sys.read_cmdline(pid))

    def _stop_podshim(self) -> None:
        pid = self._podshim_pid
        if pid is not None and self._own_pid(pid, str(self.podshim_config)):
            left = _sys.terminate({pid}, timeout=10.0)
            if left:
                raise TestBedError(f"podshim {pid} did not die")
        if self._podshim is not None:
            with contextlib.suppress(Exception):
                self._podshim.wait(timeout=1)

    def _remove_pods(self) -> None:
        if not self.containerd_running or not self.containerd_socket.exists():
            return
        pb = _api()[0]
        with CriClient(self.containerd_socket) as c:
            problems = []
            for pod in c.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items:
                try:
                    c.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=60)
                    c.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=60)
                except grpc.RpcError as e:
                    problems.append(f"{pod.id[:12]}: {e.code()}: {e.details()}")
            if problems:
                raise TestBedError("could not remove pods: " + "; ".join(problems))

    def _task_dir(self) -> Path:
        return self.containerd_state / "io.containerd.runtime.v2.task" / self.namespace

    def _known_task_ids(self) -> set[str]:
        """Sandbox and container ids this bed's containerd knows on disk (works when it is dead)."""
        cri = "io.containerd.grpc.v1.cri"
        return teardown.known_task_ids(
            (
                self._task_dir(),
                self.containerd_state / cri / "sandboxes",
                self.containerd_root / cri / "sandboxes",
                self.containerd_root / cri / "containers",
                self.runc_root,
                self.crun_root,
            )
        )

    def _shim_sockets(self, ids: set[str]) -> set[str]:
        return teardown.shim_sockets(self._task_dir(), ids)

    def _bed_pids(self) -> set[int]:
        """Every live process of this bed (teardown.bed_pids)."""
        return teardown.bed_pids(self.base_dir, (self.cgroup_root, *self._container_cgroups))

    def _bed_netns(self, ids: set[str]) -> set[str]:
        """Network namespace files (bind mounts in /run/netns) of this bed's pods."""
        return teardown.bed_netns(self._cni_cache_files(ids), self._bed_pids())

    def _cni_cache_files(self, ids: set[str]) -> list[Path]:
        return teardown.cni_cache_files(self.cni_network, ids)

    def _stop_containerd(self) -> None:
        pid = self._containerd_pid
        if pid is not None and self._own_pid(pid, str(self.containerd_config)):
            if _sys.terminate({pid}, timeout=15.0):
                raise TestBedError(f"containerd {pid} did not die")
        if self._containerd is not None:
            with contextlib.suppress(Exception):
                self._containerd.wait(timeout=1)

    def _kill_bed_processes(self) -> None:
        for _ in range(5):
            pids = self._bed_pids()
            if not pids:
                return
            _sys.thaw_pid_cgroups(pids)
            if self.cgroup_root:
                _sys.thaw(self.cgroup_root)
            for pid in pids:
                _sys.kill(pid, signal.SIGKILL)
            _sys.wait_gone(pids, 5.0)
        left = self._bed_pids()
        if left:
            raise TestBedError(f"processes survived SIGKILL: {sorted(left)}")

    def _unmount_base(self) -> None:
        if self.base_dir.exists():
            left = _sys.unmount_all_under(self.base_dir)
            if left:
                raise TestBedError(f"still mounted: {left}")

    def _remove_cni_cache(self, ids: set[str]) -> None:
        for f in self._cni_cache_files(ids):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()

    def _runtime_cgroups(self) -> set[str]:
        """The cgroups (relative paths) of the containers in the bed's runc/crun roots."""
        return teardown.runtime_cgroups((self.runc_root, self.crun_root))

    def _remove_cgroups(self) -> None:
        left = teardown.remove_cgroups(self._container_cgroups, self.cgroup_root)
        if left:
            raise TestBedError(f"cgroups left: {left}")

    def _save_logs(self) -> None:
        if self.save_logs_to is None or not self.base_dir.exists():
            return
        dest = self.save_logs_to / self.base_dir.name
        for src in (self.log_dir, self.pod_logs_dir):
            if src.is_dir():
                shutil.copytree(src, dest / src.name, dirs_exist_ok=True, symlinks=True)
        for f in (self.containerd_config, self.podshim_config, self.cni_conf_dir / "10-podshim.conflist"):
            if f.is_file():
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dest / f.name)

    def _remove_base_dir(self) -> None:
        if not self.base_dir.exists():
            return
        if _sys.mounts_under(self.base_dir):
            raise TestBedError(f"not removing {self.base_dir}: something is still mounted there")
        shutil.rmtree(self.base_dir)

    def leftovers(self) -> list[str]:
        """Everything of this bed still on the host (empty once ``stop()`` did its job)."""
        left = []
        if self.base_dir.exists():
            left.append(f"base dir {self.base_dir} exists")
        left += [f"mount {m.mount_point}" for m in _sys.mounts_under(self.base_dir)]
        left += [f"process {p}: {' '.join(_sys.read_cmdline(p))[:120]}" for p in sorted(self._bed_pids())]
        if self.bridge and _sys.link_exists(self.bridge):
            left.append(f"link {self.bridge}")
        for rel in filter(None, (self.cgroup_root, *self._container_cgroups)):
            left += [f"cgroup {d}" for d in _sys.cgroup_dirs(rel)]
        if self.cni_network:
            left += [f"cni cache {f}" for f in self._cni_cache_files(set())]
        return left


def _api() -> tuple[Any, Any]:
    """The generated CRI stubs (``api.runtime.v1``)."""
    try:
        from api.runtime.v1 import api_pb2, api_pb2_grpc
    except ImportError:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from api.runtime.v1 import api_pb2, api_pb2_grpc
    return api_pb2, api_pb2_grpc
