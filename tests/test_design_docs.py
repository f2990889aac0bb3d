"""The design notes in docs/design/ stay small and citable: no note is over 40 KB, every citation
`docs/design/<file>.md (<Section heading>)` in the tree names a note that exists and a heading of
it, and nothing cites the single design document the notes replaced (by its name or by a `§`
number)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design"
MAX_BYTES = 40 * 1000
SKIPPED_DIRS = {".git", ".venv", "node_modules", "site", "__pycache__", ".pytest_cache", ".testbed"}
SUFFIXES = {".py", ".c", ".h", ".go", ".sh", ".md", ".toml", ".yaml", ".yml", ".txt", ".1", ".5"}
# a citation may wrap: a line break and a comment prefix (#, *, //) between its parts
SEP = r"(?:[ \t]*\n[ \t]*(?:#|\*|//)?[ \t]*|[ \t]+)"
NAME = r"\(([^()]*(?:\([^()]*\)[^()]*)*)\)"
CITATION = re.compile(r"docs/design/([\w-]+\.md)" + SEP + NAME)
NOTE = re.compile(r"docs/design/([\w-]+\.md)")
QUOTED = re.compile(r"docs/design/[\w-]+\.md,?\s+\"")
OLD = re.compile(r"architecture\.md|§\s?\d")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def _flat(text: str) -> str:
    return " ".join(re.sub(SEP, " ", text).split())


def _files() -> list[Path]:
    """The tree's text files, but the CRIU patches: their bytes are hashed into the set-up's stamp
    (scripts/setup.sh criu_patch_id), so an edit of one rebuilds CRIU on every machine."""
    out = []
    for top, dirs, names in os.walk(ROOT):
        if Path(top) == ROOT / "scripts":
            dirs[:] = [d for d in dirs if d != "patches"]
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in names:
            path = Path(top) / name
            if (path.suffix in SUFFIXES or name == "Makefile") and path.is_file():
                out.append(path)
    return sorted(out)


def _text(path: Path) -> str:
    return path.read_text(errors="replace")


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def headings(note: Path) -> list[str]:
    """The headings of a note, outside fenced code."""
    out = []
    fence = False
    for line in note.read_text().splitlines():
        if FENCE.match(line):
            fence = not fence
            continue
        m = HEADING.match(line)
        if m and not fence:
            out.append(m.group(2))
    return out


def names_heading(name: str, heading: str) -> bool:
    """A citation names a heading in full, or up to the parenthesis the heading goes on with:
    `(CheckpointContainer)` for "CheckpointContainer (KEP-2008) and restore from a container
    archive"."""
    return heading == name or heading.startswith(name + " (")


def test_no_note_is_over_the_limit() -> None:
    notes = sorted(DESIGN.glob("*.md"))
    assert notes, "docs/design/ holds no note"
    big = [f"{p.name}: {p.stat().st_size} bytes" for p in notes if p.stat().st_size > MAX_BYTES]
    assert not big, f"notes over {MAX_BYTES} bytes: {big}"


def test_every_citation_names_a_note_and_its_heading() -> None:
    notes = {p.name: headings(p) for p in DESIGN.glob("*.md")}
    wrong = []
    for path in _files():
        text = _text(path)
        for m in NOTE.finditer(text):
            if m.group(1) not in notes:
                wrong.append(f"{path.relative_to(ROOT)}:{_line(text, m.start())}: no note {m.group(1)}")
        for m in CITATION.finditer(text):
            note, name = m.group(1), _flat(m.group(2))
            if note in notes and not any(names_heading(name, h) for h in notes[note]):
                where = f"{path.relative_to(ROOT)}:{_line(text, m.start())}"
                wrong.append(f"{where}: {note} has no heading ({name})")
    assert not wrong, "\n".join(wrong)


def test_the_citation_checks_see_a_wrapped_citation() -> None:
    note = "docs/" + "design/"  # spelt apart: this source is scanned too
    text = f"# see {note}restore-pod.md (Lazy\n    # restore) and {note}proxy.md\n# (The proxy)"
    found = [(m.group(1), _flat(m.group(2))) for m in CITATION.finditer(text)]
    assert found == [("restore-pod.md", "Lazy restore"), ("proxy.md", "The proxy")]
    assert names_heading("CheckpointContainer", "CheckpointContainer (KEP-2008) and restore")
    assert not names_heading("Checkpoint", "CheckpointContainer (KEP-2008) and restore")


def test_no_citation_by_a_quoted_name() -> None:
    """`docs/design/<file>.md "Name"` would not be checked against the headings."""
    found = [
        f"{path.relative_to(ROOT)}:{_line(text, m.start())}"
        for path in _files()
        for text in [_text(path)]
        for m in QUOTED.finditer(text)
    ]
    assert not found, "cite docs/design/<file>.md (<Section heading>) instead: " + ", ".join(found)


def test_nothing_cites_the_old_design_document() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{_line(text, m.start())}: {m.group(0)!r}"
        for path in _files()
        if path != Path(__file__)
        for text in [_text(path)]
        for m in OLD.finditer(text)
    ]
    assert not found, "cite docs/design/<file>.md (<Section heading>) instead:\n" + "\n".join(found)
