"""The tree speaks of the project only: no issue numbers, no people, no work sessions in code,
comments, docs or test names (history lives in git log). A unit test: it reads the tracked files."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what history would say; "GitHub issue" and a TLS "session" are the project's own words
FORBIDDEN = re.compile(r"\bissues? #?[0-9]+|\bengineers?\b|\bthe lead\b|\bthis session\b", re.I)
SKIPPED = (".sum", ".mod", ".png", ".tar", ".gz")


def test_no_history_words_in_the_tree() -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in files:
        path = ROOT / name
        if name.endswith(SKIPPED) or not path.is_file() or path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line) and "github issue" not in line.lower():
                found.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not found, "history in the tree (say in words what the code does):\n" + "\n".join(found)


def test_the_words_are_caught() -> None:
    for line in (
        "see issue 22, item 5",
        "since Issues #3",
        "other engineers' tests",
        "as the lead's note says",
    ):
        assert FORBIDDEN.search(line), line
    for line in ("a GitHub issue", "the TLS session", "a round trip", "tissue 3"):
        assert not FORBIDDEN.search(line) or "github issue" in line.lower(), line
