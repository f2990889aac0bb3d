"""Where the set-up put the Go programs the tests drive (scripts/gotools.sh, set-up step 3c):
``$PODSHIM_GO_CACHE/bin/<name>/<binary>`` (default /var/cache/podshim/go)."""

from __future__ import annotations

import os
from pathlib import Path

GO_CACHE = Path(os.environ.get("PODSHIM_GO_CACHE") or "/var/cache/podshim/go")
# the cluster test bed's control plane (testbed/cluster.py): TOOLS entries named like their binary
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")


class ToolMissing(RuntimeError):
    pass


def go_tool(name: str, binary: str | None = None) -> Path:
    """The built program ``binary`` (default ``name``) of TOOLS entry ``name``; ToolMissing if the
    set-up has not built it."""
    path = GO_CACHE / "bin" / name / (binary or name)
    if not os.access(path, os.X_OK):
        raise ToolMissing(f"{path} is missing: run the set-up (scripts/gotools.sh {name})")
    return path


def missing(names: tuple[str, ...] | list[str]) -> list[str]:
    """Which of the TOOLS entries ``names`` (each built as the binary of the same name) are not built."""
    return [n for n in names if not os.access(GO_CACHE / "bin" / n / n, os.X_OK)]
