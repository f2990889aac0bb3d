"""`make conformance` as CI runs it (conformance/full.py, its own bed): critest through podshim
and straight at containerd with no regression (a spec that passes straight at containerd and fails
through podshim, in the parallel run and alone), podshim's checkpoint conformance suite and the
crictl tour without a failure. About 4 minutes here (critest on 3 ginkgo processes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.conformance]

REPO = Path(__file__).resolve().parent.parent


def test_make_conformance(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "conformance.full", "--keep", str(tmp_path / "reports")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(res.stdout[-6000:])
    m = re.search(r"^RESULT (.*)$", res.stdout, re.M)
    assert m, f"no RESULT line (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    result = dict(kv.split("=") for kv in m.group(1).split())
    assert result["critest_regressions"] == "0", res.stdout
    assert result["checkpoint_suite_failed"] == "0" and result["crictl_tour_failed"] == "0", res.stdout
    assert res.returncode == 0
