"""The released CRI API on the wire: tools/go/cri-client (k8s.io/cri-api v0.37.2's generated Go
stubs, the kubelet's CRI client code) against podshim and straight at containerd. podshim's
api/runtime/v1/api.proto must read whatever the released stubs write (docs/design/testbed.md
(The released API's Go client))."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from testbed.bed import BUSYBOX_IMAGE, TestBed
from testbed.tools import go_tool

pytestmark = pytest.mark.e2e


def cri_client(*args: str) -> dict[str, Any]:
    res = subprocess.run([str(go_tool("cri-client")), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode in (0, 3), f"cri-client {args[0]}: exit {res.returncode}: {res.stderr}"
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def test_environment_values_are_bytes(bed: TestBed, log_root: Path) -> None:
    """The released API's KeyValue.value is `bytes`: a value that is not UTF-8 is accepted through
    podshim as straight at containerd, and the container sees the same (containerd 1.6 writes the
    OCI spec as JSON, which turns each invalid byte into U+FFFD). podshim decodes CreateContainer
    to check it; with a proto whose value was a `string` it refused the request as malformed."""
    seen = {}
    for via, socket in (("containerd", bed.containerd_socket), ("podshim", bed.podshim_socket)):
        log_dir = log_root / f"env-bytes-{via}"
        log_dir.mkdir(exist_ok=True)
        seen[via] = cri_client(
            "env-bytes",
            f"--endpoint=unix://{socket}",
            f"--image={BUSYBOX_IMAGE}",
            f"--log-dir={log_dir}",
            f"--cgroup-parent={bed.cgroup_parent('envbytes' + via)}",
        )
    assert seen["containerd"]["code"] == "OK" and seen["containerd"]["sent"] == "ff78fe", seen
    assert seen["podshim"] == seen["containerd"], seen
