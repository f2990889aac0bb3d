"""The pod's network namespace locked once for all its dumps, as CRIU would lock it for each
container's (docs/design/checkpoint-pod.md (The freeze window))."""

from __future__ import annotations

import os
import subprocess

from shim import errors
from shim.deadlines import NETLOCK_TIMEOUT

# CRIU's own network lock (criu/net.c, iptables_network_lock_internal and its unlock), taken by
# podshim once per pod instead of once per container: every packet in or out of the pod's netns
# dropped but those CRIU's TCP repair marks (SOCCR_MARK 0xC114).
_LOCK_RULES = (
    "*filter\n:CRIU - [0:0]\n-I INPUT -j CRIU\n-I OUTPUT -j CRIU\n"
    "-A CRIU -m mark --mark 0xC114 -j ACCEPT\n-A CRIU -j DROP\nCOMMIT\n"
)
_UNLOCK_RULES = "*filter\n:CRIU - [0:0]\n-D INPUT -j CRIU\n-D OUTPUT -j CRIU\n-X CRIU\nCOMMIT\n"


class NetnsLock:
    """The pod's network namespace locked as CRIU locks it for a dump of established TCP
    connections, once for every container (docs/design/checkpoint-pod.md (The freeze window)):
    `lock` before the dumps, `unlock` (idempotent, run in a `finally`) after the last one."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self.locked: list[str] = []  # the tools whose tables hold the lock

    def _restore(self, tool: str, rules: str) -> None:
        argv = ["nsenter", f"--net={self.netns}", tool, "-w", "--noflush"]
        try:
            res = subprocess.run(argv, input=rules, capture_output=True, text=True, timeout=NETLOCK_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise errors.Internal(
                f"cannot run {tool} in the pod's network namespace {self.netns}: {e}"
            ) from e
        if res.returncode != 0:
            raise errors.Internal(
                f"{tool} in the pod's network namespace {self.netns} exited {res.returncode}: "
                f"{(res.stderr or res.stdout).strip()[-300:]}"
            )

    @staticmethod
    def _tools() -> list[str]:
        # as CRIU: IPv6 too when the kernel has it
        return ["iptables-restore", *(["ip6tables-restore"] if os.path.exists("/proc/net/if_inet6") else [])]

    def lock(self) -> None:
        """Lock IPv4 and IPv6 (one iptables-restore transaction each); a failure leaves what was
        locked to `unlock`."""
        for tool in self._tools():
            self._restore(tool, _LOCK_RULES)
            self.locked.append(tool)

    def unlock(self) -> None:
        """Undo `lock`; Internal naming the netns if that fails (the pod's network would stay
        dropped)."""
        failures = []
        for tool in self.locked:
            try:
                self._restore(tool, _UNLOCK_RULES)
            except errors.Internal as e:
                failures.append(e.message)
        self.locked = []
        if failures:
            raise errors.Internal(
                f"could not unlock the pod's network namespace {self.netns} after the dumps: "
                f"{'; '.join(failures)}; remove the CRIU chain there by hand (iptables -D INPUT -j CRIU; "
                "iptables -D OUTPUT -j CRIU; iptables -X CRIU)"
            )

    @classmethod
    def unlock_leftover(cls, netns: str) -> bool:
        """Remove a lock that a crashed CheckpointPod left in `netns` (recovery): every table that
        still has the CRIU chain is unlocked; a netns that is gone has nothing to unlock. True if
        a lock was found. Internal if one is there and cannot be removed (recovery retries)."""
        if not os.path.exists(netns):
            return False
        lock = cls(netns)
        for tool in cls._tools():
            lister = tool.replace("-restore", "")  # iptables / ip6tables
            argv = ["nsenter", f"--net={netns}", lister, "-w", "-S", "CRIU"]
            try:
                res = subprocess.run(argv, capture_output=True, timeout=NETLOCK_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise errors.Internal(f"cannot look for a netns lock left in {netns}: {e}") from e
            if res.returncode == 0:  # the chain exists
                lock.locked.append(tool)
        found = bool(lock.locked)
        lock.unlock()
        return found
