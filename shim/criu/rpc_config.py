"""The CRIU config file runc hands CRIU at a container's dump (`org.criu.config`, else
`/etc/criu/runc.conf`), checked before the freeze: one an older podshim left is removed, any other
that sets an option podshim decides for a dump is FAILED_PRECONDITION
(docs/design/checkpoint-pod.md (Task states after a checkpoint)). crun 1.21 passes no file."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

from shim import contract, errors

RUNC_DEFAULT = "/etc/criu/runc.conf"
RESTORE_CONFIG = "criu.conf"  # podshim-runc's restore config, in contract.WORK_DIR or a lazy dir
# CRIU options (long and short names) a podshim dump sets or relies on: a config file handed to
# CRIU over runc's RPC would override them
DUMP_OPTIONS = frozenset(
    {
        "leave-stopped",
        "s",
        "leave-running",
        "R",
        "tcp-close",
        "tcp-established",
        "ext-unix-sk",
        "file-locks",
        "shell-job",
        "network-lock",
        "ghost-limit",
        "irmap-scan-path",
        "images-dir",
        "D",
        "work-dir",
        "W",
    }
)


def labels(runtime_root: str, container_id: str) -> dict[str, str] | None:
    """The container's labels in runc's state.json (`k=v` strings), None when unreadable."""
    try:
        with open(Path(runtime_root) / container_id / "state.json", "rb") as f:
            state = json.load(f)
        out = {}
        for item in state["config"].get("labels") or []:
            key, _, value = str(item).partition("=")
            out[key] = value
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def is_restore_config(path: Path) -> bool:
    """A CRIU config podshim-runc wrote for a restore."""
    return path.name == RESTORE_CONFIG and (
        path.parent.name == contract.WORK_DIR or path.parent.parent.name == contract.LAZY_DIR
    )


def options(path: Path) -> set[str]:
    """The option names a CRIU config file sets (`name [value]` per line, `#` comments, an
    optional leading `--`, `no-` of a boolean), empty when there is no such file."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return set()
    out = set()
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            name = words[0].lstrip("-")
            out.add(name.removeprefix("no-") if name.removeprefix("no-") in DUMP_OPTIONS else name)
    return out


def check_before_dump(runtime_root: str, is_runc: bool, container_id: str, name: str) -> str | None:
    """Make podshim's options the ones CRIU dumps container `container_id` with (see the module's
    doc). Returns the restore config it removed, if any; FailedPrecondition for a foreign file."""
    if not is_runc:
        return None
    found = labels(runtime_root, container_id)
    if found is None:
        return None  # no state to read: runc itself will say what is wrong
    value = found.get(contract.CRIU_CONFIG_ANNOTATION)
    if value == "":
        return None
    path = Path(value if value is not None else RUNC_DEFAULT)
    if value is not None and is_restore_config(path):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
                return str(path)
        return None
    clash = sorted(options(path) & DUMP_OPTIONS)
    if clash:
        how = (
            f"its {contract.CRIU_CONFIG_ANNOTATION} annotation names"
            if value is not None
            else "runc's default CRIU config file is"
        )
        raise errors.FailedPrecondition(
            f"container {name!r} ({container_id[:13]}): {how} {path}, which runc hands CRIU at every "
            f"checkpoint and which sets {', '.join(clash)}, options podshim decides for the dump: "
            f'remove them from {path} (or set {contract.CRIU_CONFIG_ANNOTATION} to "" for the container)'
        )
    return None
