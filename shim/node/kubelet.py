"""The kubelet as the node tools see it: its CRI endpoint and root dir, read from a running
kubelet's command line (`--container-runtime-endpoint`, `--root-dir`) or the KubeletConfiguration
file it names (`--config`: `containerRuntimeEndpoint`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ENDPOINT = "unix:///run/containerd/containerd.sock"  # the kubelet's own default
DEFAULT_ROOT_DIR = "/var/lib/kubelet"
CHECKPOINTS = "checkpoints"  # the kubelet's container checkpoint API writes <root-dir>/checkpoints/*.tar


@dataclass(frozen=True)
class Kubelet:
    pid: int
    endpoint: str
    root_dir: str
    source: str  # where the endpoint came from: the flag, the config file, the default


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def from_argv(pid: int, argv: list[str], fs_root: str = "/", cwd: str = "/") -> Kubelet:
    """What a kubelet with this command line uses (`fs_root`, `cwd`: where its paths resolve)."""
    root_dir = _flag(argv, "--root-dir") or DEFAULT_ROOT_DIR
    flag = _flag(argv, "--container-runtime-endpoint")
    if flag:
        return Kubelet(pid, flag, root_dir, "--container-runtime-endpoint")
    config = _flag(argv, "--config")
    if config:
        path = Path(fs_root, os.path.join(cwd, config).lstrip("/"))
        try:
            import yaml

            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, ValueError, ImportError) as e:
            return Kubelet(pid, "", root_dir, f"{config} unreadable: {e}")
        if isinstance(doc, dict) and doc.get("containerRuntimeEndpoint"):
            return Kubelet(
                pid, str(doc["containerRuntimeEndpoint"]), root_dir, f"{config}: containerRuntimeEndpoint"
            )
    return Kubelet(pid, DEFAULT_ENDPOINT, root_dir, "the kubelet's default")


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def running(pids: list[int] | None = None) -> list[Kubelet]:
    """The kubelets of this node: processes named kubelet whose root file system is ours (a
    kubelet of another root, a chroot's or the host's seen from one, is another node's), or
    exactly the processes `pids`."""
    own_root = os.path.realpath("/proc/self/root")
    found = []
    candidates = pids if pids is not None else [int(p) for p in os.listdir("/proc") if p.isdigit()]
    for pid in candidates:
        argv = _cmdline(pid)
        if not argv or os.path.basename(argv[0]) != "kubelet":
            continue
        try:
            root = os.path.realpath(f"/proc/{pid}/root")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if pids is None and root != own_root:
            continue
        found.append(from_argv(pid, argv, root, cwd))
    return found


def endpoint_notes(want: str) -> list[str]:
    notes = [
        f"kubelet: --container-runtime-endpoint={want} (or containerRuntimeEndpoint: {want} in its "
        "KubeletConfiguration), then restart it after podshim is running"
    ]
    for k in running():
        if k.endpoint != want:
            notes.append(f"the running kubelet (pid {k.pid}) uses {k.endpoint} ({k.source})")
    return notes
