"""`make demo` end to end, on the upstream the suite runs against (PODSHIM_TEST_CONTAINERD): the demo
starts its own bed, checkpoints a counter pod, restores it and checks the counter resumed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.versions import containerd_version_from_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_demo_resumes_the_counter() -> None:
    version = containerd_version_from_env()
    res = subprocess.run(
        [sys.executable, "-m", "testbed.demo"],
        cwd=REPO,
        env={**os.environ, "PODSHIM_TEST_CONTAINERD": version},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, f"demo failed on containerd {version}:\n{res.stdout}\n{res.stderr}"
    assert "restored counter resumed at" in res.stdout and "demo OK" in res.stdout, res.stdout
    # the node still looks like a containerd node of that version; podshim is in the build metadata
    line = rf"Version through podshim: containerd v?{re.escape(version)}\.\S*[+.]podshim\."
    assert re.search(line, res.stdout), res.stdout
