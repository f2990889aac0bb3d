"""Work that outlives its caller, end to end through podshim's socket.

The slow archive: a real checkpoint plus 96 hard links to one 512 MiB file of non-zero data,
each listed in the manifest with its size and sha256: 48 GiB to hash for RestorePod, 512 MiB on
disk (and in the page cache), minutes of work however fast the machine.

* RestorePod with a 3 s deadline on it answers DEADLINE_EXCEEDED and podshim stops reading at
  once: the path lock is free again (a second RestorePod of the path is no longer ABORTED) and
  podshim's read counter (/proc/<pid>/io rchar) stands still;
* seven such restores in flight do not hold up a CheckpointPod of a healthy pod: it completes
  while all seven are still verifying (podshim gives restores threads of their own).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from faults.helpers import CounterPod, Rt, checkpoint, fresh_rt, new_output_dir, start_counter_pod

from api.runtime.v1 import api_pb2 as cri
from testbed import pods
from testbed.bed import TestBed

pytestmark = pytest.mark.e2e

BIG_MIB = 512
LINKS = 96
SLOW = 7  # seven restores at once


@dataclass
class Slow:
    source: CounterPod  # the checkpointed pod (healthy, running)
    big: Path  # the 512 MiB file every slow archive links to
    good: Path  # the plain archive


def _rchar(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar in /proc/{pid}/io")


@pytest.fixture(scope="module")
def slow(rt: Rt, bed: TestBed) -> Iterator[Slow]:
    created: list[str] = []
    made: list[Path] = []
    try:
        cp = start_counter_pod(rt, bed, "slow-src", created)
        good = new_output_dir(bed, "slow-good")
        made.append(good)
        checkpoint(rt, cp.id, good)
        big = Path(bed.checkpoint_root) / f"big-{secrets.token_hex(3)}.bin"
        made.append(big)
        block = os.urandom(1 << 20)
        h = hashlib.sha256()
        with open(big, "wb") as f:
            for _ in range(BIG_MIB):
                f.write(block)
                h.update(block)
        os.chmod(big, 0o600)
        big_entry = {"size": BIG_MIB << 20, "sha256": h.hexdigest()}
        (good / "big.json").write_text(json.dumps(big_entry))  # kept beside, read by slow_copy
        yield Slow(cp, big, good)
    finally:
        for p in made:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        for pod_id in created:
            try:
                pods.remove_pod(rt, pod_id)
            except Exception:  # noqa: BLE001 - best effort
                pass


def slow_copy(bed: TestBed, s: Slow, made: list[Path]) -> Path:
    """A copy of the good archive (hard links) plus LINKS hard links to the big file, every one
    listed in manifest.json (files and members) with its real size and sha256: consistent, slow."""
    d = Path(bed.checkpoint_root) / f"slow-{secrets.token_hex(3)}"
    made.append(d)
    shutil.copytree(s.good, d, copy_function=os.link, ignore=shutil.ignore_patterns("big.json"))
    entry = json.loads((s.good / "big.json").read_text())
    (d / "manifest.json").unlink()  # replaced, not edited through the link
    doc = json.loads((s.good / "manifest.json").read_text())
    c = doc["containers"][0]
    for i in range(LINKS):
        # not named as a page image: an eager restore checks those beside CRIU's restore, not
        # before (docs/design/restore-pod.md (RestorePod) step 4); every other member up front
        name = f"checkpoint/slow-{900 + i}.img"
        os.link(s.big, d / c["dir"] / name)
        doc["files"][f"{c['dir']}/{name}"] = entry
        c.setdefault("members", []).append(name)
    (d / "manifest.json").write_text(json.dumps(doc))
    os.chmod(d / "manifest.json", 0o600)
    return d


@pytest.fixture
def made() -> Iterator[list[Path]]:
    paths: list[Path] = []
    yield paths
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def restore_request(bed: TestBed, path: Path, **fields: object) -> cri.RestorePodRequest:
    config = pods.pod_config(f"slowrestore-{secrets.token_hex(3)}", bed.pod_logs_dir)
    return cri.RestorePodRequest(
        checkpoint_path=str(path),
        config=config,
        container_configs=[pods.container_config("counter", args=["--mem-mib", "8", "--interval-ms", "100"])],
        **fields,  # type: ignore[arg-type]
    )


def path_lock_free(rt: Rt, bed: TestBed, path: Path) -> bool:
    """A RestorePod of `path` with an unknown option fails at once; ABORTED while another
    operation still holds the path."""
    try:
        rt.RestorePod(restore_request(bed, path, options={"no-such-option": "1"}), timeout=10)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.ABORTED:
            return False
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        return True
    raise AssertionError("a RestorePod with an unknown option succeeded")


def test_short_deadline_stops_the_verification(rt: Rt, bed: TestBed, slow: Slow, made: list[Path]) -> None:
    path = slow_copy(bed, slow, made)
    with pytest.raises(grpc.RpcError) as err:
        rt.RestorePod(restore_request(bed, path), timeout=3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    # Hashing all of it takes far longer than this bound (48 GiB); stopping takes one chunk.
    deadline = time.monotonic()
    pods.wait_for(lambda: path_lock_free(rt, bed, path), timeout=10, interval=0.2, what="the path lock")
    print(f"path lock free {time.monotonic() - deadline:.2f}s after the caller's deadline")
    pid = bed.podshim_pid
    assert pid is not None
    before = _rchar(pid)
    time.sleep(1.0)
    read = _rchar(pid) - before
    assert read < 32 << 20, f"podshim read {read >> 20} MiB in the second after the deadline"
    assert not [
        p
        for p in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items
        if p.metadata.name.startswith("slowrestore-")
    ]


def test_slow_restores_do_not_hold_up_a_checkpoint(
    rt: Rt, bed: TestBed, slow: Slow, made: list[Path], archives: list[Path]
) -> None:
    paths = [slow_copy(bed, slow, made) for _ in range(SLOW)]
    stubs = [fresh_rt(bed) for _ in paths]
    calls = [
        stub.RestorePod.future(restore_request(bed, p), timeout=120)
        for stub, p in zip(stubs, paths, strict=True)
    ]
    try:
        time.sleep(2.0)  # let them all reach podshim (not an assertion: they take minutes)
        assert not [c for c in calls if c.done()], [c.exception() for c in calls if c.done()]
        out = new_output_dir(bed, "slow-healthy")
        archives.append(out)
        start = time.monotonic()
        checkpoint(rt, slow.source.id, out, timeout=60)
        print(f"CheckpointPod with {SLOW} slow restores in flight: {time.monotonic() - start:.2f}s")
        assert (out / "manifest.json").is_file()
        still = [c for c in calls if not c.done()]
        assert len(still) == SLOW, "a slow restore ended before the checkpoint: the test proves nothing"
    finally:
        for c in calls:
            c.cancel()
    for c in calls:
        with pytest.raises(grpc.FutureCancelledError):
            c.result()
    # cancelled: podshim stops reading each archive and frees its path
    for p in paths:
        pods.wait_for(
            lambda p=p: path_lock_free(rt, bed, p), timeout=20, interval=0.2, what=f"the lock of {p}"
        )
