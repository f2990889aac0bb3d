"""Small checks the end-to-end tests share: errors, verbose status, freezer state, journal, a
pod's network lock."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc

CGROUP_MOUNT = Path("/sys/fs/cgroup")
# A cgroup2-only host (its root cgroup's cgroup.controllers at the mount point) freezes through
# cgroup.freeze in the unified hierarchy; a v1 or hybrid host (this machine: the v1 controllers
# and a controller-less cgroup2 at /sys/fs/cgroup/unified) through the v1 freezer hierarchy, as
# podshim decides (shim/cgroups/freezer.py detect_hierarchy). FREEZER: where a container's cgroup
# (and its cgroup.procs) is for the freezer.
UNIFIED = (CGROUP_MOUNT / "cgroup.controllers").exists()
FREEZER = CGROUP_MOUNT if UNIFIED else CGROUP_MOUNT / "freezer"


def expect_error(code: grpc.StatusCode, call: Callable[[], Any], *words: str) -> str:
    """Run `call`, expect an RpcError with `code` whose message contains every word."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, (err.value.code(), err.value.details())
    details = err.value.details() or ""
    for w in words:
        assert w in details, f"{w!r} not in error message {details!r}"
    return details


def verbose_info(rt: api_pb2_grpc.RuntimeServiceStub, container_id: str) -> dict[str, Any]:
    resp = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=container_id, verbose=True))
    return json.loads(resp.info["info"])


def container_cgroup(rt: api_pb2_grpc.RuntimeServiceStub, container_id: str) -> str:
    return str(verbose_info(rt, container_id)["runtimeSpec"]["linux"]["cgroupsPath"])


def freezer_state(cgroup: str) -> str:
    """THAWED, FREEZING or FROZEN: the kernel's word on `cgroup` (a cgroupfs path), frozen by itself
    or an ancestor. v1: freezer.state; cgroup2: cgroup.events `frozen` (reached), cgroup.freeze
    (asked)."""
    d = FREEZER / cgroup.lstrip("/")
    if not UNIFIED:
        return (d / "freezer.state").read_text().strip()
    if "frozen 1" in (d / "cgroup.events").read_text().splitlines():
        return "FROZEN"
    return "FREEZING" if (d / "cgroup.freeze").read_text().strip() == "1" else "THAWED"


def assert_netns_unlocked(rt: api_pb2_grpc.RuntimeServiceStub, pod_id: str) -> None:
    """The pod's network namespace holds no CRIU network lock (its iptables chain named CRIU),
    after a tcp-established dump that podshim locked it for."""
    st = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True))
    namespaces = json.loads(st.info["info"])["runtimeSpec"]["linux"]["namespaces"]
    netns = next(n["path"] for n in namespaces if n["type"] == "network")
    for tool in ("iptables", "ip6tables"):
        rules = subprocess.run(["nsenter", f"--net={netns}", tool, "-S"], capture_output=True, text=True)
        assert rules.returncode == 0 and "CRIU" not in rules.stdout, (tool, rules.stdout, rules.stderr)


def set_freezer(cgroup: str, state: str) -> None:
    """Freeze (`FROZEN`) or thaw (`THAWED`) `cgroup` as someone other than podshim would (a
    `crictl pause`, an operator)."""
    d = FREEZER / cgroup.lstrip("/")
    if UNIFIED:
        (d / "cgroup.freeze").write_text("1" if state == "FROZEN" else "0")
    else:
        (d / "freezer.state").write_text(state)


def lacks_room(memory_mib: int, disk_mib: int, where: str | os.PathLike[str]) -> str | None:
    """Why this machine cannot run a test that needs `memory_mib` of memory and `disk_mib` free on
    `where`'s file system (None: it can). Its total memory, not what is free at the moment: a shared
    machine's other users must not make a test that fits here skip."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize >> 20
    if total < memory_mib:
        return f"needs {memory_mib} MiB of memory, this machine has {total} MiB"
    if free < disk_mib:
        return f"needs {disk_mib} MiB free in {where}, there are {free} MiB"
    return None


def journal_files(state_dir: str | os.PathLike[str]) -> list[str]:
    """podshim's open operations (journal records) in `state_dir`."""
    ops = Path(state_dir) / "ops"
    return sorted(n for n in os.listdir(ops) if n.endswith(".json")) if ops.is_dir() else []
