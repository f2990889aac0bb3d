"""Two test nodes for live migration (docs/design/migration.md (Live migration)): two TestBeds
(containerd + podshim each) whose podshims run in network namespaces of their own, joined by a
veth pair, with node credentials of one CA. Node-to-node traffic (the migration's control channel
and page relays, and the dumps' page servers and lazy-pages daemons podshim starts) stays inside
those namespaces and crosses the veth; containerd, the pods and their CNI bridge stay on the host.

The namespaces are bind mounts under a private directory (not /run/netns, where the beds look for
their pods' namespaces). `cut()` takes the link down (packets are dropped, no connection is reset:
what a pulled cable does), `mend()` brings it back.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shim.migration import credentials
from testbed import _sys
from testbed.bed import TestBed, TestBedError, _used_networks

MIGRATION_PORT = 9848


@dataclass
class NodeLink:
    """Two network namespaces (a, b) and the veth pair between them."""

    base: Path
    id: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: ipaddress.IPv4Network | None = None

    @property
    def names(self) -> tuple[str, str]:
        return (f"node-a-{self.id}", f"node-b-{self.id}")

    def netns(self, i: int) -> Path:
        return self.base / self.names[i]

    def veth(self, i: int) -> str:
        return f"psm{'ab'[i]}{self.id}"

    def address(self, i: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1 + i)

    def listen(self, i: int) -> str:
        return f"{self.address(i)}:{MIGRATION_PORT}"

    def ns_run(self, i: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", f"--net={self.netns(i)}", *argv],
            capture_output=True,
            text=True,
            check=check,
            timeout=30,
        )

    def create(self) -> None:
        self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
        rng = random.SystemRandom()
        for _ in range(200):
            subnet = ipaddress.IPv4Network(
                f"10.{rng.randrange(200, 250)}.{rng.randrange(256)}.{rng.randrange(0, 256, 4)}/30"
            )
            if not any(subnet.overlaps(n) for n in _used_networks()):
                self.subnet = subnet
                break
        else:
            raise TestBedError("no free /30 for the node link")
        for i in (0, 1):
            self.netns(i).touch()
            subprocess.run(["unshare", f"--net={self.netns(i)}", "true"], check=True, timeout=30)
            self.ns_run(i, "ip", "link", "set", "lo", "up")
        _sys.ip("link", "add", self.veth(0), "type", "veth", "peer", "name", self.veth(1))
        for i in (0, 1):
            _sys.ip("link", "set", self.veth(i), "netns", str(self.netns(i)))
            self.ns_run(i, "ip", "addr", "add", f"{self.address(i)}/30", "dev", self.veth(i))
            self.ns_run(i, "ip", "link", "set", self.veth(i), "up")

    def cut(self) -> None:
        """The link goes down on both ends: nothing passes, no connection is told."""
        for i in (0, 1):
            self.ns_run(i, "ip", "link", "set", self.veth(i), "down")

    def mend(self) -> None:
        for i in (0, 1):
            self.ns_run(i, "ip", "link", "set", self.veth(i), "up")

    def listening(self, i: int) -> list[str]:
        """The TCP listeners of node i's namespace (`ss -ltn`), besides none expected."""
        out = self.ns_run(i, "ss", "-Hltn", check=False).stdout
        return [ln.split()[3] for ln in out.splitlines() if ln.strip()]

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.ns_run(0, "ip", "link", "del", self.veth(0), check=False)
        for i in (0, 1):
            p = self.netns(i)
            if p.exists():
                subprocess.run(["umount", "-l", str(p)], capture_output=True, timeout=30)
                with contextlib.suppress(OSError):
                    p.unlink()
        shutil.rmtree(self.base, ignore_errors=True)


@dataclass
class Nodes:
    a: TestBed
    b: TestBed
    link: NodeLink
    pki: Path

    def peer_name(self, i: int) -> str:
        return self.link.names[i]


def migration_sections(link: NodeLink, pki: Path, i: int) -> dict[str, dict[str, str]]:
    name = link.names[i]
    return {
        "migration": {
            "listen": link.listen(i),
            "cert_file": str(pki / f"{name}.pem"),
            "key_file": str(pki / f"{name}-key.pem"),
            "ca_file": str(pki / "ca.pem"),
        }
    }


@contextlib.contextmanager
def node_pair(migration: dict[str, str] | None = None, **bed_args: object) -> Iterator[Nodes]:
    """Two beds, A and B, in their network namespaces, with credentials; all removed at the end.
    `migration`: further keys of both podshims' [migration] section."""
    link = NodeLink(Path(f"/run/podshim-nodes-{secrets.token_hex(3)}"))
    beds: list[TestBed] = []
    try:
        link.create()
        pki = link.base / "pki"
        credentials.issue(pki, {link.names[i]: [link.address(i)] for i in (0, 1)})
        for i in (0, 1):
            bed = TestBed(
                netns=str(link.netns(i)),
                podshim_sections={
                    "migration": {**migration_sections(link, pki, i)["migration"], **(migration or {})}
                },
                **bed_args,  # type: ignore[arg-type]
            )
            beds.append(bed)
            bed.start()
        yield Nodes(beds[0], beds[1], link, pki)
    finally:
        for bed in reversed(beds):
            with contextlib.suppress(Exception):
                bed.stop()
        link.remove()
