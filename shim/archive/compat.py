"""Can this node restore that checkpoint? RestorePod compares what the archive recorded of the
checkpointing node (manifest.json `host`) with this node before anything is created (architecture,
CPU features, kernel, CRIU and runtime, cgroup version, images) and refuses with one
FAILED_PRECONDITION naming every mismatch (docs/design/distribution.md (Checkpoints through a
registry), docs/design/restore-pod.md (RestorePod) step 1)."""

from __future__ import annotations

import base64
import functools
import os
import platform
import re
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from shim.archive.manifest import HostInfo, Manifest
from shim.deadlines import CPUINFO_TIMEOUT
from shim.errors import FailedPrecondition

CGROUP_MOUNT = "/sys/fs/cgroup"
CPUINFO_IMG = "cpuinfo.img"
MEMO_SIZE = 64  # answers per_binary keeps (the versions of a few binaries, the CPU checks of archives)

T = TypeVar("T")
_memo: dict[tuple[Any, ...], Any] = {}
_memo_lock = threading.Lock()


def per_binary(fn: Callable[..., T], binary: str, *args: Any) -> T:
    """fn(binary, *args), remembered while the file `binary` stays the same (device, inode, size,
    mtime, ctime: an upgrade replaces or rewrites it). What RestorePod asks of CRIU and the OCI
    runtime (their versions, `criu cpuinfo check` of an archive's CPU) is a subprocess each time
    otherwise, tens of milliseconds on every restore. A binary that cannot be stat'ed (a bare
    name) is asked every time."""
    try:
        st = os.stat(binary)
    except (OSError, ValueError):
        return fn(binary, *args)
    key = (fn, binary, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, *args)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    value = fn(binary, *args)
    with _memo_lock:
        if len(_memo) >= MEMO_SIZE:
            _memo.clear()
        _memo[key] = value
    return value


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of the first "N.N" in a version line ("runc version 1.1.5+ds1", "6.18.4-x")."""
    found = re.search(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def cgroup_version(mountinfo: str = "/proc/self/mountinfo") -> str:
    """ "2" when /sys/fs/cgroup is the unified hierarchy, "1" for v1 or hybrid ("" if unknown)."""
    try:
        with open(mountinfo) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) > 4 and fields[4] == CGROUP_MOUNT:
                    return "2" if right.split()[0] == "cgroup2" else "1"
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=4)
def cpuinfo(criu: str) -> str:
    """This node's `criu cpuinfo dump` image, base64 ("" when CRIU cannot write it)."""
    with tempfile.TemporaryDirectory(prefix="podshim-cpuinfo-") as d:
        try:
            subprocess.run(
                [criu, "cpuinfo", "dump", "-D", d],
                capture_output=True,
                timeout=CPUINFO_TIMEOUT,
                check=True,
            )
            with open(os.path.join(d, CPUINFO_IMG), "rb") as f:
                return base64.b64encode(f.read(1 << 20)).decode()
        except (OSError, subprocess.SubprocessError):
            return ""


def cpuinfo_problem(recorded: str, criu: str) -> str | None:
    """What `criu cpuinfo check` says of the recorded image on this node (None: compatible)."""
    try:
        data = base64.b64decode(recorded, validate=True)
    except ValueError:
        return "the recorded CPU description (host.cpuinfo) is not base64"
    with tempfile.TemporaryDirectory(prefix="podshim-cpuinfo-") as d:
        with open(os.path.join(d, CPUINFO_IMG), "wb") as f:
            f.write(data)
        try:
            r = subprocess.run(
                [criu, "cpuinfo", "check", "-D", d], capture_output=True, text=True, timeout=CPUINFO_TIMEOUT
            )
        except (OSError, subprocess.SubprocessError) as e:
            return f"CRIU could not compare the CPUs ({type(e).__name__})"
    if r.returncode == 0:
        return None
    said = [
        re.sub(r"^.*?\): (cpu: )?", "", ln).strip()
        for ln in (r.stdout + r.stderr).splitlines()
        if "Error" in ln
    ]
    return "; ".join(said[:3]) or f"criu cpuinfo check exited {r.returncode}"


def _cpu_check(criu: str, recorded: str) -> str | None:
    return cpuinfo_problem(recorded, criu)


@dataclass(frozen=True)
class Node:
    """This node's facts, as a checkpoint records them."""

    criu_version: str
    runtime_name: str
    runtime_version: str
    arch: str = ""
    kernel: str = ""
    cgroup_version: str = ""
    criu: str = ""  # CRIU's binary, for the CPU check ("": not checked)

    @classmethod
    def here(cls, criu_version: str, runtime_name: str, runtime_version: str, criu: str = "") -> Node:
        return cls(
            criu_version,
            runtime_name,
            runtime_version,
            platform.machine(),
            platform.release(),
            cgroup_version(),
            criu,
        )


def host_mismatches(host: HostInfo, node: Node) -> list[str]:
    """Each way the checkpointing host differs from `node` in a way a restore cannot bridge."""
    out = []
    if host.arch and host.arch != node.arch:
        out.append(
            f"checkpoint was taken on {host.arch}, this node is {node.arch}: restore it on a {host.arch} node"
        )
    cpu = getattr(host, "cpuinfo", "")
    if cpu and node.criu and (not host.arch or host.arch == node.arch):
        problem = per_binary(_cpu_check, node.criu, cpu)
        if problem:
            out.append(f"this node's CPU lacks features the checkpointed processes may use ({problem})")
    if host.kernel and node.kernel and major_minor(host.kernel) > major_minor(node.kernel):
        out.append(
            f"checkpoint was taken on kernel {host.kernel}, this node runs the older {node.kernel}: "
            "restore it on a node with a kernel at least as new"
        )
    if major_minor(host.criu_version) > major_minor(node.criu_version):
        out.append(
            f"checkpoint was written by CRIU {host.criu_version}, this node has CRIU {node.criu_version}: "
            "upgrade CRIU on this node"
        )
    if host.runtime_name and host.runtime_name != node.runtime_name:
        out.append(
            f"checkpoint was taken with the OCI runtime {host.runtime_name}, the restore would use "
            f"{node.runtime_name}: restore it with a runtime_handler whose runtime is {host.runtime_name}"
        )
    elif host.runtime_version and major_minor(host.runtime_version) > major_minor(node.runtime_version):
        out.append(
            f"checkpoint was taken with {host.runtime_version}, this node has {node.runtime_version}: "
            f"upgrade {node.runtime_name} on this node"
        )
    cg = getattr(host, "cgroup_version", "")
    if cg and node.cgroup_version and cg != node.cgroup_version:
        out.append(f"checkpoint was taken on cgroup v{cg}, this node runs cgroup v{node.cgroup_version}")
    return out


def image_mismatch(
    container: str, image: str, present: Sequence[str] | None, recorded_ref: str
) -> str | None:
    """`present`: what ImageStatus gave for `image` on this node, its id first, then its repo
    digests (None: not present). The checkpoint's `image_ref` is one of those forms (containerd
    reports a repo digest when the image has one, else the id)."""
    if present is None:
        return (
            f"container {container!r}: image {image} is not on this node"
            + (f" (the checkpoint ran {recorded_ref})" if recorded_ref else "")
            + ": pull it first"
        )
    if recorded_ref and recorded_ref not in present:
        return (
            f"container {container!r}: image {image} is {present[0] if present else '?'} on this node, "
            "the checkpoint ran "
            f"{recorded_ref}: pull the checkpointed image"
        )
    return None


def refuse(problems: Sequence[str]) -> None:
    if problems:
        n = len(problems)
        raise FailedPrecondition(
            f"this node cannot restore the checkpoint ({n} mismatch{'es' if n > 1 else ''}): "
            + "; ".join(problems)
            + "; nothing was created"
        )


def check(m: Manifest, node: Node) -> None:
    refuse(host_mismatches(m.host, node))
