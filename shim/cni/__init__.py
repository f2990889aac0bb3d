"""Pod network facts (docs/design/checkpoint-pod.md (CheckpointPod) step 4): the interfaces, addresses and
routes of a pod's network namespace, read with pyroute2. CheckpointPod records them in
`sandbox/network.json` (beside the CNI result the upstream recorded); RestorePod checks the new
pod's namespace against them.

A restored pod gets a new IP from CNI like any new pod (KEP-5823); what must hold is that every
interface the checkpointed processes could have used exists again under the same name, or
CRIU's restore of sockets bound to it would fail obscurely later, at StartContainer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any

from shim import errors

LOOPBACK = "lo"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def netns_path(spec: dict[str, Any], pid: int) -> str | None:
    """The network namespace of a sandbox: its OCI spec's path, else the pause process's."""
    for ns in (spec.get("linux") or {}).get("namespaces") or []:
        if isinstance(ns, dict) and ns.get("type") == "network" and ns.get("path"):
            return str(ns["path"])
    return f"/proc/{pid}/ns/net" if pid > 0 else None


def preload() -> None:
    """Import pyroute2 now (podshim's start-up): imported by the first checkpoint instead, its
    ~0.1 s of module code would hold the GIL and stall the proxy's event loop."""
    import pyroute2  # noqa: F401


def read_facts(netns: str) -> dict[str, Any]:
    """Interfaces (name, MAC, MTU, state, addresses) and routes of the namespace at `netns`.

    A thread of its own enters the namespace (setns affects only the calling thread), opens a
    netlink socket there (it stays bound to that namespace) and goes back; the thread ends
    with the call, so a failure can never leave a pooled thread in a pod's namespace. No fork:
    forking a process that runs gRPC is not safe (pyroute2's NetNS forks).
    """
    result: dict[str, Any] = {}
    t = threading.Thread(target=_read_in_thread, args=(netns, result), name="podshim-netns", daemon=True)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["facts"]


def _read_in_thread(netns: str, result: dict[str, Any]) -> None:
    try:
        ipr = _netlink_in(netns)
        try:
            result["facts"] = _facts(ipr)
        finally:
            ipr.close()
    except errors.ShimError as e:
        result["error"] = e
    except Exception as e:  # noqa: BLE001 - pyroute2 raises OSError or its own errors
        result["error"] = errors.Internal(f"cannot read the pod's network namespace {netns}: {e}")


def _netlink_in(netns: str) -> Any:
    """An IPRoute socket opened inside `netns`; the calling thread is back in its own after."""
    from pyroute2 import IPRoute  # heavy import: only when a checkpoint or restore needs it

    try:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise errors.Internal(f"cannot open the pod's network namespace {netns}: {e.strerror}") from e
    try:
        _setns(target, netns)
        try:
            return IPRoute()
        finally:
            _setns(own, "this thread's own network namespace")
    finally:
        os.close(own)
        os.close(target)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise errors.Internal(f"cannot enter {what}: {os.strerror(err)}")


def _facts(ipr: Any) -> dict[str, Any]:
    names: dict[int, str] = {}
    interfaces: list[dict[str, Any]] = []
    for link in ipr.get_links():
        name = str(link.get_attr("IFLA_IFNAME"))
        names[link["index"]] = name
        interfaces.append(
            {
                "name": name,
                "mac": link.get_attr("IFLA_ADDRESS") or "",
                "mtu": int(link.get_attr("IFLA_MTU") or 0),
                "up": link.get("state") == "up",
                "addresses": [],
            }
        )
    by_name = {i["name"]: i for i in interfaces}
    for addr in ipr.get_addr():
        owner = names.get(addr["index"])
        if owner in by_name:
            by_name[owner]["addresses"].append(f"{addr.get_attr('IFA_ADDRESS')}/{addr['prefixlen']}")
    routes = []
    for r in ipr.get_routes(table=254):  # the main table
        dst = r.get_attr("RTA_DST")
        routes.append(
            {
                "dst": f"{dst}/{r['dst_len']}" if dst else "default",
                "gateway": r.get_attr("RTA_GATEWAY") or "",
                "dev": names.get(r.get_attr("RTA_OIF"), ""),
            }
        )
    return {"interfaces": interfaces, "routes": routes}


def missing_interfaces(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Interfaces (other than loopback) the checkpointed pod had and the new one lacks."""
    have = {i.get("name") for i in now.get("interfaces", [])}
    return [
        str(i.get("name"))
        for i in recorded.get("interfaces", [])
        if isinstance(i, dict) and i.get("name") != LOOPBACK and i.get("name") not in have
    ]


def addresses(facts: dict[str, Any]) -> list[str]:
    """The non-loopback addresses in `facts` (for logs: the restored pod's new IPs)."""
    return [
        a for i in facts.get("interfaces", []) if i.get("name") != LOOPBACK for a in i.get("addresses", [])
    ]
