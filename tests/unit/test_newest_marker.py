"""The newest-runtime pass selects every test NEWEST names (tests/conftest.py): a renamed or
mistyped id would otherwise drop its feature from that pass without a word."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import NEWEST

TESTS = Path(__file__).resolve().parents[1]


def test_every_newest_id_is_collected() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--collect-only",
            "-m",
            "newest",
            "-p",
            "no:cacheprovider",
            str(TESTS),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS.parent,
    ).stdout
    collected = {line.split("tests/", 1)[1] for line in out.splitlines() if line.startswith("tests/")}
    assert collected == set(NEWEST), out[-2000:]
