"""`checkpointpod --keep`'s prune (shim/cli/keep.py): only its own complete checkpoints of the pod
are removed; look-alikes, interrupted runs and directories that change under it are kept and
reported, never fatal. The end-to-end run through podshim is tests/test_periodic.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shim.archive import fsutil, layout
from shim.archive.manifest import FORMAT, ContainerEntry, HostInfo, Manifest, SandboxInfo, write_manifest
from shim.cli import keep

POD = "a1b2c3d4e5f6" * 5


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    return tmp_path / "periodic" / "counter"


def kept(prefix: Path, stamp: str, pod: str = POD, complete: bool = True) -> Path:
    """A complete checkpoint of `pod` as `--keep` leaves it: the directory and its marker."""
    d = prefix.with_name(f"{prefix.name}-{stamp}")
    d.parent.mkdir(parents=True, exist_ok=True)
    d.mkdir()
    lay = layout.ArchiveLayout(d).create()
    fsutil.write_private_file(lay.sandbox_config, b"{}")
    c = lay.container("counter").create()
    fsutil.write_private_file(c.config_dump, json.dumps({"image": "counter"}).encode())
    (c.checkpoint_dir / "pages-1.img").write_bytes(os.urandom(64 << 10))
    m = Manifest(
        sandbox=SandboxInfo(id=pod, metadata={"name": "counter"}, config={}),
        containers=[
            ContainerEntry(
                name="counter",
                id="c1",
                image="counter",
                state="CONTAINER_RUNNING",
                restart_count=0,
                checkpointed=True,
                dir=c.rel,
            )
        ],
        host=HostInfo(),
    )
    write_manifest(d, m)
    if complete:
        keep.complete(d, pod)
    return d


def stamp(i: int) -> str:
    return f"20200101T0000{i:02d}.000000Z"


def test_keeps_the_newest_and_removes_the_older_complete_ones(prefix: Path) -> None:
    dirs = [kept(prefix, stamp(i)) for i in range(4)]
    out = keep.prune(prefix, POD, 2)
    assert out.removed == [str(d) for d in dirs[:2]] and out.skipped == []
    assert [d.exists() for d in dirs] == [False, False, True, True]
    assert not keep.marker_of(dirs[0]).exists() and keep.marker_of(dirs[3]).exists()


def test_a_marker_of_an_older_podshim_counts_as_complete(prefix: Path) -> None:
    old = kept(prefix, stamp(1), complete=False)
    keep.marker_of(old).write_text(json.dumps({"pod": POD}))
    kept(prefix, stamp(2))
    assert keep.prune(prefix, POD, 1).removed == [str(old)]


def test_a_look_alike_with_the_users_files_is_never_removed(prefix: Path) -> None:
    """A manifest of only the format and the sandbox id, a marker naming the pod, a user's file."""
    fake = prefix.with_name(f"{prefix.name}-{stamp(3)}")
    fake.mkdir(parents=True)
    (fake / "manifest.json").write_text(json.dumps({"format": FORMAT, "sandbox": {"id": POD}}))
    (fake / "precious.txt").write_text("mine")
    keep.marker_of(fake).write_text(json.dumps({"pod": POD}))
    kept(prefix, stamp(4))
    out = keep.prune(prefix, POD, 1)
    assert out.removed == []
    assert [s["path"] for s in out.skipped] == [str(fake)]
    assert "not a complete checkpoint" in out.skipped[0]["reason"], out.skipped
    assert (fake / "precious.txt").read_text() == "mine"


def test_a_real_manifest_with_a_missing_container_dir_or_an_extra_file_is_kept(prefix: Path) -> None:
    missing = kept(prefix, stamp(1))
    shutil.rmtree(missing / "containers" / "counter")
    extra = kept(prefix, stamp(2))
    (extra / "precious.txt").write_text("mine")
    wrong_pod = kept(prefix, stamp(3), pod="f" * 64)
    keep.marker_of(wrong_pod).write_text(json.dumps({"pod": POD, "state": "complete"}))
    kept(prefix, stamp(4))
    out = keep.prune(prefix, POD, 1)
    assert out.removed == []
    reasons = {s["path"]: s["reason"] for s in out.skipped}
    assert "missing" in reasons[str(missing)], reasons
    assert "precious.txt" in reasons[str(extra)], reasons
    assert "of pod ffffffffffff" in reasons[str(wrong_pod)], reasons
    assert (extra / "precious.txt").exists()


def test_a_directory_without_a_marker_or_of_another_pod_is_kept(prefix: Path) -> None:
    bare = kept(prefix, stamp(1), complete=False)
    other = kept(prefix, stamp(2), pod="e" * 64)
    kept(prefix, stamp(3))
    out = keep.prune(prefix, POD, 1)
    assert out.removed == []
    assert [s["path"] for s in out.skipped] == [str(bare)]  # the other pod's is not ours to report
    assert bare.exists() and other.exists()


def test_a_symlink_in_place_of_a_kept_directory_is_skipped_and_its_target_kept(
    prefix: Path, tmp_path: Path
) -> None:
    old = kept(prefix, stamp(1))
    target = tmp_path / "elsewhere"
    old.rename(target)
    old.symlink_to(target)
    kept(prefix, stamp(2))
    out = keep.prune(prefix, POD, 1)
    assert out.removed == [] and "symlink" in out.skipped[0]["reason"], out.skipped
    assert (target / "manifest.json").is_file()


def test_swaps_while_pruning_are_never_fatal_and_never_follow_the_swap(prefix: Path, tmp_path: Path) -> None:
    """An old kept directory swapped for a symlink and back while prunes run: every prune returns,
    and what the symlink points at is never touched."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious.txt").write_text("mine")
    for round_ in range(20):
        old = kept(prefix, f"2020010{1 + round_ // 10}T0000{round_ % 10:02d}.000000Z")
        parked = tmp_path / f"parked-{round_}"
        newest = kept(prefix, f"2030010{1 + round_ // 10}T0000{round_ % 10:02d}.000000Z")
        stop = threading.Event()

        def swap(old: Path = old, parked: Path = parked, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                try:
                    old.rename(parked)
                    old.symlink_to(target)
                    old.unlink()
                    parked.rename(old)
                except OSError:
                    pass

        t = threading.Thread(target=swap)
        t.start()
        try:
            out = keep.prune(prefix, POD, 1)
        finally:
            stop.set()
            t.join()
        assert (target / "precious.txt").read_text() == "mine"
        assert str(newest) not in out.removed
        for p in (old, parked):
            if p.is_symlink():
                p.unlink()
            elif p.exists():
                shutil.rmtree(p)
            keep.marker_of(p).unlink(missing_ok=True)
        assert newest.exists()
        shutil.rmtree(newest)
        keep.marker_of(newest).unlink()


def test_a_run_that_died_leaves_what_the_next_run_cleans(prefix: Path) -> None:
    """A run killed after its marker (directory missing, or made and empty) is cleaned by the next;
    one killed with something in its directory is reported, not removed; a live run is left alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(dead.stdout)
    abandoned = {"pod": POD, "state": "in-progress", "pid": dead_pid, "start": 1}
    gone = prefix.with_name(f"{prefix.name}-{stamp(1)}")
    empty = prefix.with_name(f"{prefix.name}-{stamp(2)}")
    partial = prefix.with_name(f"{prefix.name}-{stamp(3)}")
    live = prefix.with_name(f"{prefix.name}-{stamp(4)}")
    prefix.parent.mkdir(parents=True)
    for d in (gone, empty, partial):
        keep.marker_of(d).write_text(json.dumps(abandoned))
    keep.begin(live, POD)  # this process: alive
    empty.mkdir()
    partial.mkdir()
    (partial / "sandbox").mkdir()
    live.mkdir()
    kept(prefix, stamp(5))
    out = keep.prune(prefix, POD, 1)
    assert sorted(out.removed) == sorted([str(empty)]), out
    assert not keep.marker_of(gone).exists() and not empty.exists() and not keep.marker_of(empty).exists()
    assert [s["path"] for s in out.skipped] == [str(partial)] and "not empty" in out.skipped[0]["reason"]
    assert live.exists() and keep.marker_of(live).exists()


@pytest.mark.parametrize("kill_after", [0.0, 0.002, 0.005, 0.01, 0.02, 0.05])
def test_a_cli_killed_at_any_moment_leaves_nothing_the_next_run_cannot_clean(
    prefix: Path, kill_after: float
) -> None:
    """The CLI's own steps around the call (marker, directory, completion), killed with SIGKILL
    at a range of moments: the next prune leaves only complete checkpoints and skips nothing."""
    prefix.parent.mkdir(parents=True)
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from shim.cli import keep\n"
        "from shim.cli.base import make_output_dir\n"
        f"p = keep.keep_name(Path({str(prefix)!r}))\n"
        f"keep.begin(p, {POD!r})\n"
        "make_output_dir(p)\n"
        "time.sleep(0.02)\n"  # the CheckpointPod call: the daemon removes what it wrote when cancelled
        "keep.abandon(p)\n"
    )
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1])
        try:
            proc.wait(timeout=kill_after + 0.3)
        except subprocess.TimeoutExpired:
            pass
        proc.kill()
        proc.wait()
    newest = kept(prefix, "20300101T000000.000000Z")
    out = keep.prune(prefix, POD, 1)
    assert out.skipped == [], out.skipped
    left = sorted(os.listdir(prefix.parent))
    assert left == [keep.marker_of(newest).name, newest.name], left
