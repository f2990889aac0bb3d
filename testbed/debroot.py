"""A fresh Debian root for the package's install test (tests/test_package.py).

An overlay on the pristine root scripts/setup.sh debootstraps (step 3d: minbase plus Debian's
containerd, runc, CNI plugins, iptables), so every run starts from the same untouched node and
leaves nothing: `tests/package/enter.sh` runs in a mount and PID namespace of its own (its mounts
and processes end with it) and the node in a network namespace of its own; afterwards the overlay
is unmounted and removed, and the cgroups the node's pods used are removed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from testbed import _sys

PRISTINE = Path("/var/cache/podshim/debroot")
SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "package"
CRICTL = Path("/var/cache/podshim/go/bin/crictl/crictl")


class DebRootError(RuntimeError):
    pass


@contextlib.contextmanager
def fresh_root(release: str) -> Iterator[Path]:
    """A writable copy of the pristine `release` root (an overlay), removed on exit."""
    lower = PRISTINE / release
    if not (PRISTINE / f".{release}.packages").is_file() or not lower.is_dir():
        raise DebRootError(f"no pristine Debian {release} root in {lower}: run the set-up (PODSHIM_DEBROOTS)")
    base = Path(tempfile.mkdtemp(prefix=f"run-{release}-", dir=PRISTINE))
    root = base / "root"
    for d in ("upper", "work", "root", "scratch"):
        (base / d).mkdir()
    opts = f"lowerdir={lower},upperdir={base / 'upper'},workdir={base / 'work'}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(root)], check=True)
    try:
        yield root
    finally:
        _sys.unmount_all_under(root)
        if root.is_mount():
            subprocess.run(["umount", str(root)], check=False)
        if _sys.mounts_under(base) or root.is_mount():
            raise DebRootError(f"{root} is still mounted: not removing {base}")
        shutil.rmtree(base)


def run_node(release: str, deb: Path, images: list[Path], timeout: float) -> tuple[int, str]:
    """tests/package/node.sh in a fresh `release` root with `deb` to install: its exit code and
    output."""
    cgroup = f"/podshim-deb-{secrets.token_hex(3)}"
    with fresh_root(release) as root:
        var_tmp = root / "var" / "tmp"
        shutil.copy2(deb, var_tmp / "package.deb")
        (var_tmp / "images").mkdir()
        for image in images:
            shutil.copy2(image, var_tmp / "images" / image.name)
        for script in ("enter.sh", "node.sh"):
            shutil.copy2(SCRIPTS / script, var_tmp / script)
        (var_tmp / "node.env").write_text(
            f"CGROUP={cgroup}\nHOLD_ON_FAILURE={os.environ.get('PODSHIM_DEBROOT_HOLD', '')}\n"
        )
        shutil.copy2(CRICTL, root / "usr" / "local" / "bin" / "crictl")
        enter = [str(SCRIPTS / "enter.sh"), "outside", str(root), str(root.parent / "scratch")]
        argv = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "sh", *enter]
        try:
            res = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
            )
            rc, out = res.returncode, res.stdout
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, out = -1, out + f"\n(timed out after {timeout:.0f}s)"
        finally:
            left = _sys.remove_cgroup_tree(cgroup)
        logs = "".join(
            f"\n--- {log}\n{(root / log.lstrip('/')).read_text(errors='replace')[-4000:]}"
            for log in ("/var/log/containerd.log", "/var/log/shim.log")
            if rc != 0 and (root / log.lstrip("/")).is_file()
        )
        if left:
            raise DebRootError(f"cgroups left: {left}")
        return rc, out + logs
