"""The package installed as an operator installs it (docs/design/install.md (Installing a
node)): `make deb`'s package in a fresh Debian root (testbed/debroot.py: an overlay on the set-up's
debootstrapped root, in namespaces of its own), on a node whose containerd runs: `apt-get install`
changes no running service, the manual pages are there (`man -w podshim-checkpointpod`, else the
installed .gz and its .TH), `podshim node setup` wires containerd, `podshim doctor` passes, the
demo flow runs with the installed binaries only (the counter resumes after CheckpointPod and
RestorePod), and `apt-get remove` / `dpkg --purge` leave only the operator's files
(tests/package/node.sh). PODSHIM_TEST_DEBIAN picks the release (bookworm, the default; trixie in
`make test-matrix`); PODSHIM_TEST_DEB names a built package (default: built here by
scripts/build-deb.sh)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from testbed import debroot

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / ".testbed" / "images"  # built by the bed (images/build.py)

pytestmark = [pytest.mark.e2e, pytest.mark.package]


def package(tmp_path: Path) -> Path:
    given = os.environ.get("PODSHIM_TEST_DEB")
    if given:
        return Path(given)
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-deb.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    print(res.stdout)
    return next(tmp_path.glob("podshim_*.deb"))


def test_the_package_installs_wires_a_node_and_restores(tmp_path: Path) -> None:
    release = os.environ.get("PODSHIM_TEST_DEBIAN", "bookworm")
    deb = package(tmp_path)
    subprocess.run(
        ["python3", str(REPO / "images" / "build.py"), str(IMAGES)], check=True, capture_output=True
    )
    images = [IMAGES / e["file"] for e in json.loads((IMAGES / "images.json").read_text())]
    rc, out = debroot.run_node(release, deb, images, timeout=1200)
    print(out)
    assert rc == 0 and out.rstrip().endswith("PASS"), out[-6000:]
    pages = out.split("==> the manual pages", 1)[1].split("==> ", 1)[0]
    assert "man page: /usr/share/man/man1/podshim-checkpointpod.1.gz" in pages, pages
    assert "man page: /usr/share/man/man5/podshim-config.toml.5.gz" in pages, pages
    assert "FAIL " not in out.split("==> podshim doctor\n", 1)[1].split("==> the demo flow", 1)[0], out
    left = out.split("(the operator's: backups of containerd's config, the checkpoint):\n", 1)[1]
    names = [line.strip() for line in left.splitlines() if line.startswith("    /")]
    assert names and all(".podshim-backup-" in n for n in names), names
