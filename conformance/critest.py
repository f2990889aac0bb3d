"""critest (cri-tools v1.37.0, built by the set-up) against a CRI endpoint, offline.

critest pulls its test images from public registries. Here every one of them comes from a
loopback registry (testbed/registry.py, no auth) that a bed's containerd uses as the mirror of
every registry (``TestBed(registry_mirror=...)``): `serve_images` builds the stand-ins
(images/build.py --critest) and pushes them under their repository paths, and critest's
test-images file points its default and web server images at the project's own names. No registry
host is named anywhere.

critest leaves nothing on the host: its temporary dirs go to the run's work dir (TMPDIR), and the
SysV shared memory segment its HostIpc specs make on the host with `ipcmk` (and never remove) is
recorded by an `ipcmk` first on its PATH and removed after the run. With ``parallel`` > 1 critest
runs its specs on that many ginkgo processes (the ginkgo CLI the set-up builds), its serial specs
last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from testbed.registry import Registry
from testbed.tools import go_tool

REPO = Path(__file__).resolve().parent.parent
IMAGE_CACHE = REPO / ".testbed" / "images"
CRITEST_DEFAULT = "podshim/busybox:1"  # images/build.py's CRITEST_DEFAULT / CRITEST_WEBSERVER
CRITEST_WEBSERVER = "podshim/webserver:1"


def serve_images(workdir: Path) -> Registry:
    """A started loopback registry (no auth) holding critest's images; stop() it when done."""
    res = subprocess.run(
        [sys.executable, str(REPO / "images" / "build.py"), str(IMAGE_CACHE), "--critest"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        raise RuntimeError(f"building critest's images failed:\n{res.stdout}\n{res.stderr}")
    listed = json.loads((IMAGE_CACHE / "critest.json").read_text())
    reg = Registry(workdir, auth=False)
    reg.start()
    try:
        for entry in listed:
            reg.push_archive(IMAGE_CACHE / entry["file"], entry["ref"])
    except BaseException:
        reg.stop()
        raise
    return reg


def images_file(path: Path, mirror: str) -> Path:
    """critest's test-images file: the default and web server images by the mirror's names."""
    path.write_text(
        f"defaultTestContainerImage: {mirror}/{CRITEST_DEFAULT}\n"
        f"webServerTestImage: {mirror}/{CRITEST_WEBSERVER}\n"
    )
    return path


def remove_segments(record: Path) -> None:
    """ipcrm the shared memory segments critest's ipcmk made (its lines `Shared memory id: N`)."""
    try:
        lines = record.read_text().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        shmid = line.rpartition(":")[2].strip()
        if shmid.isdigit():
            subprocess.run(["ipcrm", "-m", shmid], capture_output=True)


@dataclass
class CritestRun:
    returncode: int
    seconds: float
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # spec -> first line of its failure
    skipped: list[str] = field(default_factory=list)
    output: Path | None = None

    def summary(self) -> str:
        counts = f"{len(self.passed)} passed, {len(self.failed)} failed, {len(self.skipped)} skipped"
        return f"{counts} in {self.seconds:.0f} s"


IPCMK = """#!/bin/sh
# critest's ipcmk (its HostIpc specs): the real one, each segment it made recorded for removal
out=$(/usr/bin/ipcmk "$@") || exit $?
echo "$out"
echo "$out" >> "{record}"
"""


def run(
    endpoint: str,
    mirror: str,
    workdir: Path,
    *,
    parallel: int = 1,
    focus: str = "",
    skip: str = "",
    timeout: float = 1800,
) -> CritestRun:
    """The default critest suite against ``endpoint``; its junit report parsed."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "junit.xml"
    output = workdir / "critest.log"
    bin_dir, tmp, record = workdir / "bin", workdir / "tmp", workdir / "ipcmk-segments"
    bin_dir.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    (bin_dir / "ipcmk").write_text(IPCMK.format(record=record))
    (bin_dir / "ipcmk").chmod(0o755)
    argv = [
        str(go_tool("critest")),
        f"--runtime-endpoint={endpoint}",
        f"--image-endpoint={endpoint}",
        f"--test-images-file={images_file(workdir / 'test-images.yaml', mirror)}",
        f"--ginkgo.junit-report={report}",
        "--ginkgo.no-color",
    ]
    if parallel > 1:  # ginkgo's processes; with 1, critest runs the specs itself
        argv.append(f"--parallel={parallel}")
    if focus:
        argv.append(f"--ginkgo.focus={focus}")
    if skip:
        argv.append(f"--ginkgo.skip={skip}")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CONTAINER_RUNTIME_ENDPOINT", "IMAGE_SERVICE_ENDPOINT")
    }
    env["PATH"] = f"{bin_dir}:{go_tool('ginkgo').parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["TMPDIR"] = str(tmp)
    start = time.monotonic()
    try:
        with open(output, "wb") as out:
            proc = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=env, timeout=timeout
            )
    finally:
        remove_segments(record)
    result = CritestRun(proc.returncode, time.monotonic() - start, output=output)
    if not report.exists():
        raise RuntimeError(f"critest wrote no report (exit {proc.returncode}); see {output}")
    for tc in ET.parse(report).getroot().iter("testcase"):
        name = (tc.get("name") or "").strip()
        if name.startswith(
            ("[BeforeSuite]", "[AfterSuite]", "[SynchronizedBeforeSuite]", "[ReportAfterSuite]")
        ):
            if tc.find("failure") is not None or tc.find("error") is not None:
                result.failed[name] = "suite set-up failed"
            continue
        failure = tc.find("failure")
        if failure is None:
            failure = tc.find("error")
        if failure is not None:
            text = (failure.get("message") or failure.text or "").strip()
            result.failed[name] = text.splitlines()[0][:300] if text else "failed"
        elif tc.find("skipped") is not None or tc.get("status") == "skipped":
            result.skipped.append(name)
        else:
            result.passed.append(name)
    return result
