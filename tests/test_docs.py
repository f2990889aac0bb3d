"""docs/design/index.md stays the map of the code: its module map lists every module of shim/ and
no module that is gone (docs/design/index.md (Module map)). The citations of the design notes are
checked by tests/test_design_docs.py. Every module of shim/ has a short docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "design" / "index.md"


def test_module_map_lists_every_module() -> None:
    text = DOC.read_text()
    start = text.index("## Module map")
    header = text.index("| module |", start)
    end = text.find("\n\n", header)
    table = text[start : end if end != -1 else len(text)]
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    modules = {
        str(p.relative_to(ROOT)) for p in (ROOT / "shim").rglob("*.py") if "__pycache__" not in p.parts
    }
    assert not modules - listed, f"modules missing from the map: {sorted(modules - listed)}"
    gone = {p for p in listed if not (ROOT / p).exists()}
    assert not gone, f"the map lists modules that do not exist: {sorted(gone)}"


MAX_HEAD_LINES = 12


def test_module_heads_are_short() -> None:
    """A module's docstring says what it is for and names its design note; the explanation lives
    in the note."""
    missing = []
    long = []
    for path in sorted((ROOT / "shim").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = str(path.relative_to(ROOT))
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc is None:
            missing.append(rel)
            continue
        lines = doc.count("\n") + 1
        if lines > MAX_HEAD_LINES:
            long.append(f"{rel} ({lines} lines)")
    assert not missing, f"modules without a docstring: {missing}"
    assert not long, f"module docstrings over {MAX_HEAD_LINES} lines: {long}"
