"""One set of deadline constants (shim/deadlines.py): no other module of shim/ defines its own
timeout, margin, grace, wait or retry interval, and the module stays importable by the CLI and the
runtime wrapper (it imports nothing)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from shim import deadlines

ROOT = Path(__file__).resolve().parent.parent / "shim"
TIME_NAME = re.compile(r"(TIMEOUT|MARGIN|DEADLINE|GRACE|_WAIT|SETTLE|_SECONDS|^RETRY_[A-Z]+)$")


def _numeric(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    )


def test_no_module_defines_its_own_deadline() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "deadlines.py" or "__pycache__" in path.parts:
            continue
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                if isinstance(t, ast.Name) and TIME_NAME.search(t.id) and _numeric(node.value):  # type: ignore[union-attr]
                    found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {t.id}")
    assert not found, "deadline constants outside shim/deadlines.py:\n" + "\n".join(found)


def test_deadlines_imports_nothing_and_holds_seconds() -> None:
    tree = ast.parse(Path(deadlines.__file__).read_text())
    imports = [
        n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom) and n.module != "__future__"
    ]
    assert not imports
    values = {k: v for k, v in vars(deadlines).items() if k.isupper()}
    assert values and all(isinstance(v, float) and v > 0 for v in values.values())
    # the margins fit in the default deadline, the service stop in systemd's TimeoutStopSec (90 s),
    # a dump let finish (DUMP_FINISH_WAIT) inside the stop's clean-up
    assert deadlines.CHECK_MARGIN < deadlines.CLEANUP_MARGIN < deadlines.RESTORE_CLEANUP_MARGIN < 60
    assert deadlines.DUMP_FINISH_WAIT < deadlines.STOP_CLEANUP
    assert deadlines.STOP_GRACE + deadlines.STOP_CLEANUP < 90
