"""Fixtures of the hostile corpus: two running pods, a good archive, the canary."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2 as cri
from testbed import pods
from testbed.bed import TestBed

from .corpus import COUNTER_ARGS, Canary, Ctx, Rt


@pytest.fixture(scope="package")
def canary(bed: TestBed) -> Iterator[Canary]:
    d = Path(bed.base_dir) / f"outside-{secrets.token_hex(3)}"  # not under bed.checkpoint_root
    d.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,strictatime,mode=0755", "tmpfs", str(d)], check=True
    )
    try:
        (d / "secret").write_text("do not read me\n")
        (d / "sub").mkdir()
        (d / "sub" / "file").write_text("nor me\n")
        yield Canary(d, d / "secret", d / "sub")
    finally:
        subprocess.run(["umount", str(d)], check=False)
        d.rmdir()


@pytest.fixture(scope="package")
def hostile_pods(rt: Rt, bed: TestBed) -> Iterator[tuple[pods.Pod, pods.Pod, Path]]:
    """The victim pod (with a good archive of it) and another pod."""
    made: list[str] = []
    archive = Path(bed.checkpoint_root) / f"hostile-good-{secrets.token_hex(3)}"
    try:
        victim, other = (
            pods.run_pod(rt, f"{n}-{secrets.token_hex(3)}", bed.pod_logs_dir, {"counter": _counter()})
            for n in ("victim", "other")
        )
        made += [victim.id, other.id]
        pods.wait_count(victim.log_path("counter"), 2)
        archive.mkdir(mode=0o700)
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=victim.id,
                container_ids=pods.running_ids(rt, victim.id),
                output_path=str(archive),
            ),
            timeout=120,
        )
        yield victim, other, archive
    finally:
        shutil.rmtree(archive, ignore_errors=True)
        for pod_id in made:
            with contextlib.suppress(Exception):
                pods.remove_pod(rt, pod_id)


def _counter() -> cri.ContainerConfig:
    return pods.container_config("counter", args=list(COUNTER_ARGS))


@pytest.fixture
def ctx(rt: Rt, bed: TestBed, hostile_pods: tuple[pods.Pod, pods.Pod, Path], canary: Canary) -> Iterator[Ctx]:
    victim, other, archive = hostile_pods
    c = Ctx(rt, bed, victim, other, archive, canary)
    yield c
    for p in reversed(c.made):
        if p.is_symlink() or (p.exists() and not p.is_dir()):
            p.unlink()
        elif p.is_dir():
            for sub in p.rglob("*"):  # a FIFO or device left inside must not stop rmtree
                if sub.is_symlink() or not (sub.is_dir() or sub.is_file()):
                    sub.unlink()
            shutil.rmtree(p, ignore_errors=True)
    assert not [p for p in c.made if os.path.lexists(p)], "the test could not clean up"
