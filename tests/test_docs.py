"""docs/architecture.md stays the map of the code: its sections are numbered in sequence, every
citation `docs/architecture.md §n (Name)` in the tree names the section numbered n (a `§` always
cites that document), and the module map lists every module of shim/ (docs/architecture.md §2.1
(Module map))."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SCANNED = ("shim", "tests", "bench", "testbed", "native", "scripts", "conformance", "docs")
SUFFIXES = {".py", ".c", ".h", ".sh", ".md", ".toml", ".yaml", ".yml"}
HEADING = re.compile(r"^(##|###) (\d+(?:\.\d+)?)\.? (.+)$", re.M)
# a citation may wrap: the name continues after a newline and a comment prefix (#, *, //)
CITATION = re.compile(r"§(\d+(?:\.\d+)?) \(([^)]*)\)")
PREFIX = re.compile(r"\n\s*(?:#|\*|//)?\s*")


def _headings() -> dict[str, str]:
    return {num: title for _, num, title in HEADING.findall(DOC.read_text())}


def _flat(text: str) -> str:
    return " ".join(PREFIX.sub(" ", text).split())


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "Makefile"]
    for top in SCANNED:
        for p in (ROOT / top).rglob("*"):
            wanted = p.suffix in SUFFIXES or p.name == "Makefile"
            if wanted and p.is_file() and "__pycache__" not in p.parts:
                out.append(p)
    return [p for p in out if p.exists()]


def test_sections_are_numbered_in_sequence() -> None:
    text = DOC.read_text()
    unnumbered = [line for line in text.splitlines() if re.match(r"^##+ (?!\d)", line)]
    assert not unnumbered, f"sections without a number: {unnumbered}"
    top = [int(num) for kind, num, _ in HEADING.findall(text) if kind == "##"]
    assert top == list(range(1, len(top) + 1)), f"## sections numbered {top}: expected 1..{len(top)}"
    parent = 0
    subs: list[int] = []
    for kind, num, _ in HEADING.findall(text):
        if kind == "##":
            parent, subs = int(num), []
            continue
        major, _, minor = num.partition(".")
        assert int(major) == parent and minor, f"### {num} is not inside ## {parent}"
        subs.append(int(minor))
        assert subs == list(range(1, len(subs) + 1)), f"### sections of §{parent} numbered {subs}"


def test_every_citation_names_its_section() -> None:
    headings = _headings()
    wrong = []
    for path in _files():
        text = path.read_text(errors="replace")
        for m in CITATION.finditer(text):
            num, name = m.group(1), _flat(m.group(2))
            title = headings.get(num)
            if title is None or not title.startswith(name):
                line = text.count("\n", 0, m.start()) + 1
                wrong.append(f"{path.relative_to(ROOT)}:{line}: §{num} ({name}) but §{num} is {title!r}")
    assert not wrong, "\n".join(wrong)


def test_no_citation_by_a_quoted_name() -> None:
    """The old form `docs/architecture.md "Name"` breaks silently when a section is renamed."""
    old_form = re.compile(r'architecture\.md,?\s+"')
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
        for path in _files()
        if path != Path(__file__)
        for text in [path.read_text(errors="replace")]
        for m in old_form.finditer(text)
    ]
    assert not found, "cite docs/architecture.md §n (Name) instead: " + ", ".join(found)


def test_module_map_lists_every_module() -> None:
    text = DOC.read_text()
    start = text.index("Module map")
    table = text[start : text.index("\n\n", text.index("| module |", start))]
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    modules = {
        str(p.relative_to(ROOT)) for p in (ROOT / "shim").rglob("*.py") if "__pycache__" not in p.parts
    }
    assert not modules - listed, f"modules missing from the map: {sorted(modules - listed)}"
    gone = {p for p in listed if not (ROOT / p).exists()}
    assert not gone, f"the map lists modules that do not exist: {sorted(gone)}"
