"""What an archive needs of the node and the request it is restored with (no bed): RestorePod's
host check, a container tar's bind mounts."""

from __future__ import annotations

import platform

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim.archive.manifest import HostInfo, Manifest, SandboxInfo
from shim.checks.mounts import missing_mounts, refuse_missing
from shim.errors import FailedPrecondition
from shim.ops.restore_checks import check_host

HERE = platform.machine()
OTHER_ARCH = "riscv64" if HERE != "riscv64" else "x86_64"
RUNC, CRUN = "runc version 1.1.5+ds1", "crun version 1.21"


def archive(**host: str) -> Manifest:
    info = HostInfo(criu_version="4.1.1", runtime_name="runc", runtime_version="runc version 1.1.5+ds1")
    for k, v in host.items():
        setattr(info, k, v)
    return Manifest(sandbox=SandboxInfo(id="x", metadata={}, config={}), host=info)


@pytest.mark.parametrize(
    ("host", "criu", "name", "version"),
    [
        ({}, "4.1.1", "runc", "runc version 1.1.5+ds1"),
        ({}, "4.2", "runc", "runc version 1.2.0"),  # newer here: fine
        ({"runtime_name": "", "runtime_version": ""}, "4.1", "crun", "crun version 1.21"),  # unknown: fine
        ({"runtime_name": "crun", "runtime_version": CRUN}, "4.1.1", "crun", CRUN),
    ],
)
def test_compatible_hosts(host: dict[str, str], criu: str, name: str, version: str) -> None:
    check_host(archive(**host), criu, name, version)


@pytest.mark.parametrize(
    ("host", "criu", "name", "version", "needle"),
    [
        ({"arch": OTHER_ARCH}, "4.1.1", "runc", RUNC, "node"),
        ({"criu_version": "4.2.0"}, "4.1.1", "runc", "runc version 1.1.5", "upgrade CRIU"),
        ({}, "4.1.1", "crun", "crun version 1.21", "OCI runtime runc, the restore would use crun"),
        ({"runtime_version": "runc version 1.3.0"}, "4.1.1", "runc", RUNC, "upgrade runc"),
    ],
    ids=["arch", "older-criu", "other-runtime", "older-runtime"],
)
def test_incompatible_hosts(host: dict[str, str], criu: str, name: str, version: str, needle: str) -> None:
    with pytest.raises(FailedPrecondition) as err:
        check_host(archive(**host), criu, name, version)
    assert needle in err.value.message, err.value.message


def test_container_tar_restore_needs_the_checkpoint_bind_mounts() -> None:
    """mounts.missing_mounts: the checkpoint's bind mounts the request lacks, but not
    the runtime's own mounts nor those the upstream adds itself; a hostile spec.dump is no crash."""
    spec = {
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "options": ["nosuid"]},
            {"destination": "/etc/hosts", "type": "bind", "options": ["rbind", "rw"]},
            {"destination": "/etc/hostname", "type": "bind", "options": ["rbind"]},
            {"destination": "/etc/resolv.conf", "type": "bind", "options": ["rbind"]},
            {"destination": "/dev/shm", "type": "bind", "options": ["rbind"]},
            {"destination": "/dev/termination-log", "type": "bind", "options": ["rbind", "rw"]},
            {"destination": "/data/", "options": ["rbind", "ro"]},  # a bind mount without a type
            {"destination": "/data", "options": ["rbind"]},
        ]
    }
    assert missing_mounts(spec, cri.ContainerConfig()) == ["/dev/termination-log", "/data"]
    given = cri.ContainerConfig(mounts=[cri.Mount(container_path="/data", host_path="/srv")])
    assert missing_mounts(spec, given) == ["/dev/termination-log"]
    for hostile in ({"mounts": 3}, {"mounts": ["x", {"options": [{}], "type": 1}]}, {}):
        assert missing_mounts(hostile, cri.ContainerConfig()) == []


def test_missing_bind_mounts_are_named_per_container() -> None:
    """mounts.refuse_missing: one FAILED_PRECONDITION naming each container and what it lacks (what
    RestorePod and a container tar's CreateContainer answer); nothing when every one is mounted."""
    refuse_missing({"a": [], "b": []}, "/ck")
    with pytest.raises(FailedPrecondition) as err:
        refuse_missing({"app": ["/dev/termination-log", "/data"], "side": [], "log": ["/var/log"]}, "/ck")
    msg = err.value.message
    named = ("container 'app': /dev/termination-log, /data", "container 'log': /var/log")
    for needle in ("checkpoint /ck", *named):
        assert needle in msg, msg
    assert "'side'" not in msg and "nothing was created" in msg, msg
