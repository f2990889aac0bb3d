"""A private mount namespace for a test bed's node processes (containerd, podshim, a kubelet).

The namespace is persisted as a bind mount of its nsfs file inside the bed's base dir (so it
outlives the process that made it), and every node process enters it with ``nsenter``. In it,
``/var/lib`` is a fresh tmpfs holding only bind mounts of directories of the bed (e.g. the bed's
``kubelet/`` at ``/var/lib/kubelet``), and files of ``/proc/sys`` can be covered by files of the
bed. So a kubelet runs with its stock root dir and writes its sysctls, and podshim answers with its
stock allowed checkpoint roots, while the host sees none of it: nothing is created under the
host's ``/var/lib``, no sysctl changes, and the host's mounts are private (the namespace's mounts
never propagate out). The namespace dies when its file is unmounted and its last process is gone
(the bed's stop unmounts everything under its base dir): the tmpfs and whatever the node mounted
in it (pod network namespaces, container root file systems) go with it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


class MountNamespaceError(RuntimeError):
    pass


@dataclass
class NodeMounts:
    """What the namespace shows differently from the host.

    var_lib: ``{name: dir}``: ``/var/lib/<name>`` is a bind mount of ``<base_dir>/<dir>`` (created).
    proc_sys: ``{"vm/overcommit_memory": "1", ...}``: those files of ``/proc/sys`` read the value
        (a file of the bed bind-mounted over each; writes land in that file).
    """

    var_lib: dict[str, str] = field(default_factory=dict)
    proc_sys: dict[str, str] = field(default_factory=dict)
    nsfile: Path | None = None  # set by create()

    def create(self, base_dir: Path) -> None:
        """Make the namespace, persisted at ``<base_dir>/mntns``; its files under ``<base_dir>/mntns.d``."""
        files = base_dir / "mntns.d"
        files.mkdir(mode=0o700, exist_ok=True)
        nsfile = base_dir / "mntns"
        nsfile.touch(mode=0o600)
        script = ["set -e", "mount -t tmpfs -o mode=0755,size=64m podshim-var-lib /var/lib"]
        for name, rel in self.var_lib.items():
            if "/" in name or name in ("", ".", ".."):
                raise MountNamespaceError(f"/var/lib/{name}: one path component expected")
            src = base_dir / rel
            src.mkdir(parents=True, exist_ok=True)
            script += [f"mkdir /var/lib/{name}", f"mount --bind {shlex.quote(str(src))} /var/lib/{name}"]
        for i, (key, value) in enumerate(sorted(self.proc_sys.items())):
            target = Path("/proc/sys") / key
            if ".." in Path(key).parts or not target.is_file():
                raise MountNamespaceError(f"no sysctl {key}")
            holder = files / f"sysctl-{i}"
            holder.write_text(f"{value}\n")
            script.append(f"mount --bind {shlex.quote(str(holder))} {shlex.quote(str(target))}")
        res = subprocess.run(
            ["unshare", f"--mount={nsfile}", "--propagation", "private", "sh", "-c", "\n".join(script)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if res.returncode != 0:
            raise MountNamespaceError(f"making the node's mount namespace failed: {res.stderr.strip()}")
        self.nsfile = nsfile

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (nsenter execs it: the pid is the program's)."""
        if self.nsfile is None:
            raise MountNamespaceError("the namespace is not created yet")
        return ["nsenter", f"--mount={self.nsfile}", "--", *argv]

    def sysctl_files(self, base_dir: Path) -> dict[str, Path]:
        """The bed's file standing for each covered sysctl (what a program wrote there)."""
        return {key: base_dir / "mntns.d" / f"sysctl-{i}" for i, key in enumerate(sorted(self.proc_sys))}


def host_sysctl(key: str) -> str:
    """The host's value of ``/proc/sys/<key>`` (read in this process's namespace)."""
    return Path("/proc/sys", key).read_text().strip()


def same_namespace(pid: int) -> bool:
    """Whether ``pid`` shares this process's mount namespace."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False
