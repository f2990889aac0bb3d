"""A crash in the middle of an atomic write: the temporary file it leaves.

* manifest.json is written twice by CheckpointPod (then rewritten with the final timings): a
  crash during the rewrite left `.manifest.json.tmp-*` beside a complete archive, which
  recovery kept and RestorePod then refused (DATA_LOSS "... not listed in the manifest").
  Recovery now removes it and the archive restores.
* a crash during a journal update left `.<record>.json.tmp-*` in `<state_dir>/ops` for ever:
  the journal replay at start removes them.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

import pytest

from shim.archive import fsutil
from shim.archive import manifest as mf
from shim.state import Journal
from testbed import pods, resume
from testbed.bed import TestBed

from .helpers import (
    Archive,
    FailpointPodshim,
    Rt,
    assert_thawed_and_counting,
    checkpoint,
    journal_files,
    new_output_dir,
    remove_cgroup_parent,
    restart_podshim,
    restore,
    sandboxes_named,
    start_counter_pod,
    wait_journal_empty,
    wait_serving,
)
from .test_recover import make_engine, root  # noqa: F401 - the `root` fixture

# ---------------------------------------------------------------------------- unit level


def _complete_archive(root: Path) -> Path:  # noqa: F811
    out = root / "roots" / f"out-{secrets.token_hex(3)}"
    (out / "containers" / "app").mkdir(parents=True)
    (out / "containers" / "app" / "dump.log").write_text("log")
    m = mf.Manifest(sandbox=mf.SandboxInfo(id="sb", metadata={}, config={}))
    mf.write_manifest(out, m)
    return out


async def test_recovery_removes_a_manifest_rewrite_leftover(root: Path) -> None:  # noqa: F811
    out = _complete_archive(root)
    left = out / fsutil.temp_name_for("manifest.json")
    left.write_bytes((out / "manifest.json").read_bytes())
    with pytest.raises(Exception, match="not listed"):
        mf.load_and_verify(out, [str(root / "roots")])
    j = Journal(root / "state")
    j.begin("checkpoint", "pod-m", {"output_path": str(out), "cgroups": []})
    await make_engine(root).recover()
    assert not left.exists()
    mf.load_and_verify(out, [str(root / "roots")])  # complete and usable
    assert j.scan().records == []


async def test_recovery_removes_journal_temp_files(root: Path) -> None:  # noqa: F811
    j = Journal(root / "state")
    rec = j.begin("checkpoint", "pod-t", {"output_path": "", "cgroups": []})
    temp = j.ops_dir / fsutil.temp_name_for(rec.path.name)
    temp.write_bytes(rec.to_json())
    other = j.ops_dir / "20990101T000000-checkpoint-deadbeef.json.corrupt"  # not ours to remove
    other.write_text("{")
    await make_engine(root).recover()
    assert sorted(p.name for p in j.ops_dir.iterdir()) == [other.name]


# ---------------------------------------------------------------------------- end to end


@pytest.mark.e2e
def test_killed_during_the_manifest_rewrite(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], log_root: Path
) -> None:
    cp = start_counter_pod(rt, bed, "rewrite", pod_cleanup, mem_mib=8)
    out = new_output_dir(bed, "rewrite")
    archives.append(out)
    with FailpointPodshim(bed, "write-file.manifest.json=kill@2") as fp:
        with pytest.raises(Exception):  # noqa: B017 - UNAVAILABLE or CANCELLED: podshim died
            checkpoint(fp.rt, cp.id, out, timeout=60)
        fp.wait_dead(30)
        temps = [p.name for p in out.iterdir() if fsutil.is_temp_name(p.name)]
        assert temps and (out / "manifest.json").is_file(), sorted(p.name for p in out.iterdir())
        assert journal_files(bed), "the interrupted checkpoint left no journal record"
        # and a journal update interrupted the same way
        ops = Path(bed.podshim_state_dir) / "ops"
        (ops / fsutil.temp_name_for("20990101T000000-restore-0badf00d.json")).write_text("{")
    restart_podshim(bed)
    wait_serving(rt)
    wait_journal_empty(bed)
    assert [p.name for p in ops.iterdir()] == [], "journal temp files left"
    assert not [p for p in out.iterdir() if fsutil.is_temp_name(p.name)]
    mf.load_and_verify(out, [str(bed.checkpoint_root)])
    assert_thawed_and_counting(rt, cp)
    # the archive restores (it used to answer DATA_LOSS "... not listed in the manifest"), and its
    # counter runs on from the cut
    first = resume.possible_firsts(cp.pod.log_path("counter"), resume.Cut.of_archive(out), "counter")
    config = pods.pod_config(f"rewrite-restored-{secrets.token_hex(3)}", log_root)
    configs = [pods.container_config("counter", args=["--mem-mib", "8", "--interval-ms", "100"])]
    try:
        resp = restore(rt, Archive(out, configs), config, {"start": "true"})
        pod_cleanup.append(resp.pod_sandbox_id)
        resume.assert_exact_resume(
            {"counter": Path(config.log_directory) / "counter" / "0.log"}, {"counter": first}
        )
    finally:
        for sid in sandboxes_named(rt, config.metadata.name):
            with contextlib.suppress(Exception):
                pods.remove_pod(rt, sid)
        remove_cgroup_parent(config)
