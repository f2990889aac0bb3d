"""shim/cni: pod network facts read from a real network namespace (made here with `ip netns`)."""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim import cni
from shim.errors import Internal

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a network namespace")


@pytest.fixture
def netns() -> Iterator[str]:
    """A namespace with lo up and a veth end (10.77.0.2/24, default route via 10.77.0.1)."""
    name = f"podshim-test-{secrets.token_hex(3)}"
    host_end = f"psv{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(
            ["ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", name], check=True
        )
        for args in (
            ["link", "set", "lo", "up"],
            ["addr", "add", "10.77.0.2/24", "dev", "eth0"],
            ["link", "set", "eth0", "up"],
            ["route", "add", "default", "via", "10.77.0.1"],
        ):
            subprocess.run(["ip", "-n", name, *args], check=True)
        yield f"/var/run/netns/{name}"
    finally:
        subprocess.run(["ip", "link", "del", host_end], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_read_facts_of_a_namespace(netns: str) -> None:
    facts = cni.read_facts(netns)
    nics = {i["name"]: i for i in facts["interfaces"]}
    assert set(nics) == {"lo", "eth0"}
    assert "10.77.0.2/24" in nics["eth0"]["addresses"] and nics["eth0"]["mac"]
    assert {"dst": "default", "gateway": "10.77.0.1", "dev": "eth0"} in facts["routes"]
    assert cni.addresses(facts) == ["10.77.0.2/24"]
    # the calling thread never left its own namespace (and the host has no eth0 address here)
    host = cni.read_facts(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net")
    assert "10.77.0.2/24" not in cni.addresses(host)


def test_missing_namespace_is_internal(tmp_path: Path) -> None:
    with pytest.raises(Internal, match="network namespace"):
        cni.read_facts(str(tmp_path / "nope"))


def test_missing_interfaces_and_netns_path() -> None:
    recorded = {"interfaces": [{"name": "lo"}, {"name": "eth0"}, {"name": "net1"}]}
    assert cni.missing_interfaces(recorded, {"interfaces": [{"name": "lo"}, {"name": "eth0"}]}) == ["net1"]
    assert cni.missing_interfaces({"interfaces": [{"name": "lo"}]}, {"interfaces": []}) == []
    spec = {"linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/var/run/netns/x"}]}}
    assert cni.netns_path(spec, 42) == "/var/run/netns/x"
    assert cni.netns_path({}, 42) == "/proc/42/ns/net"
    assert cni.netns_path({}, 0) is None
