"""The restore contract (shim/contract.py): one spelling for the daemon, the Python wrapper and the
compiled wrapper, and the layering it stands for."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from shim import contract
from shim.criu.options import CriuOptions

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "shim"


def test_native_wrapper_defines_equal_the_contract() -> None:
    source = (ROOT / "native" / "podshim-runc.c").read_text()
    defines = dict(re.findall(r'^#define (\w+) "([^"]*)"', source, re.MULTILINE))
    for name in ("RESTORE_ANNOTATION", "RESTORED_MARKER", "HOOK_NAME", "BROKER_SOCKET", "ABORT_ENV"):
        assert defines.get(name) == getattr(contract, name), name


@pytest.mark.parametrize(
    ("options", "record"),
    [
        ({}, ""),
        ({"file-locks": "true"}, "file-locks"),
        (
            {"file-locks": "false", "tcp-established": "true", "shell-job": "true"},
            "tcp-established,shell-job",
        ),
        (
            {"file-locks": "true", "tcp-established": "true", "ext-unix-sk": "true", "shell-job": "true"},
            "file-locks,tcp-established,ext-unix-sk,shell-job",
        ),
        ({"rootfs-compression": "gzip", "ghost-limit": "5"}, ""),  # not CRIU switches of the restore
    ],
)
def test_record_round_trip(options: dict[str, str], record: str) -> None:
    assert contract.to_record(options) == record
    back = CriuOptions.from_record(record)
    for name, attr in contract.CRIU_SWITCHES.items():
        assert getattr(back, attr) is (options.get(name) == "true"), name
    assert contract.to_record(back.switches_record()) == record


def test_from_record_turns_unnamed_switches_off() -> None:
    # CriuOptions' own default has file locks on (a dump); a restore record without them has them off
    assert CriuOptions().file_locks and not CriuOptions.from_record("").file_locks
    assert CriuOptions.from_record("shell-job,,").flags() == ["--shell-job"]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_daemon_imports_the_wrapper_only_from_its_broker() -> None:
    """podshim runs podshim-runc's restores through its restore broker, shim/ops/restore_broker.py
    (docs/design/runtime-wrapper.md (The runtime wrapper)), with the hook's own restore code; nothing else
    of the daemon reaches into the wrapper."""
    for path in SHIM.rglob("*.py"):
        if path.parent.name == "wrapper" or path == SHIM / "ops" / "restore_broker.py":
            continue
        wrapper = [m for m in _imports(path) if m.startswith("shim.wrapper")]
        assert not wrapper, (path, wrapper)


def test_the_cli_never_imports_daemon_internals() -> None:
    daemon = ("shim.ops", "shim.engine", "shim.checks.wiring", "shim.upstream", "shim.server")
    for path in (SHIM / "cli").rglob("*.py"):
        if path.name == "serve.py":  # `podshim serve` starts the daemon itself
            continue
        bad = [m for m in _imports(path) if m.startswith(daemon)]
        assert not bad, (path, bad)
