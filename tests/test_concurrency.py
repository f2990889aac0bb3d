"""Concurrency, end to end through podshim.

* checkpoints of 8 different pods at once all succeed, each archive verifies, every pod runs on;
* a second request on a pod (or an output path) in flight gets ABORTED and touches nothing;
* CheckpointPod and RestorePod of the same archive never overlap, also through aliases of its
  path ("D/.", "D//", a symlink): a restore from a directory being written sees ABORTED or
  NOT_FOUND (never a half-written archive), a checkpoint into an archive being restored sees
  ABORTED or INVALID_ARGUMENT (never writes into it);
* the first operation is held by a failpoint (`wait:<file>`) while the others are made, so they
  overlap it on a machine of any speed: a checkpoint once CRIU ended (`checkpoint.dump-ended`, on
  the event loop: the loop goes on answering), a restore while its tasks are held stopped
  (`runc-wrapper.held-stopped`);
* proxied calls stay responsive during a 1 GiB checkpoint (the event loop never blocks on CRIU
  or file I/O): ListPodSandbox p99 under 100 ms (or ten times the idle p99 on a slower machine),
  figures printed.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from faults.helpers import (
    FAILPOINTS_ENV,
    Call,
    CounterPod,
    Rt,
    assert_empty_dir,
    assert_thawed_and_counting,
    checkpoint,
    containerd_env,
    fresh_rt,
    journal_files,
    new_output_dir,
    start_counter_pod,
    tree_listing,
)

from api.runtime.v1 import api_pb2 as cri
from shim.archive import manifest as mf
from testbed import pods, resume
from testbed.bed import TestBed

pytestmark = pytest.mark.e2e


def held_checkpoint(tmp: Path) -> tuple[str, Path]:
    """The failpoints of a podshim whose CheckpointPods hold once CRIU ended (the pod frozen, the
    images written, the pod and path locks held) until the file returned exists. The failpoint is
    awaited on the event loop, so that podshim answers every other call meanwhile."""
    go = tmp / "go"
    return f"checkpoint.dump-ended=wait:{go}", go


def wait_in_flight(out: Path, call: Call, timeout: float = 30.0) -> None:
    """Until the checkpoint into `out` has begun writing (and has not finished)."""
    deadline = time.monotonic() + timeout
    while not any(out.glob("containers/*/checkpoint/*.img")):
        assert call.is_alive(), f"the checkpoint ended before the test could overlap it: {call.error}"
        assert time.monotonic() < deadline, "the checkpoint never started writing"
        time.sleep(0.005)
    assert call.is_alive(), f"the checkpoint ended before the test could overlap it: {call.error}"


def test_eight_pods_at_once(rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path]) -> None:
    cps = [start_counter_pod(rt, bed, f"par{i}", pod_cleanup, mem_mib=16) for i in range(8)]
    outs = [new_output_dir(bed, f"par{i}") for i in range(8)]
    archives.extend(outs)
    barrier = threading.Barrier(8)

    def one(i: int) -> float:
        stub = fresh_rt(bed)  # one channel per caller, as 8 kubelet workers would have
        barrier.wait()
        start = time.monotonic()
        checkpoint(stub, cps[i].id, outs[i], timeout=300)
        return time.monotonic() - start

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        seconds = list(pool.map(one, range(8)))
    wall = time.monotonic() - start
    print(f"8 concurrent CheckpointPod: wall {wall:.2f}s, per call {min(seconds):.2f}..{max(seconds):.2f}s")
    for cp, out in zip(cps, outs, strict=True):
        m = mf.load_and_verify(out, [str(bed.checkpoint_root)])
        assert m.sandbox.id == cp.id and m.container("counter").checkpointed
        assert_thawed_and_counting(rt, cp)


def test_second_request_on_busy_pod_is_aborted(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path], tmp_path: Path
) -> None:
    busy = start_counter_pod(rt, bed, "busy", pod_cleanup, mem_mib=512)
    other = start_counter_pod(rt, bed, "other", pod_cleanup, mem_mib=8)
    out, out2, out3 = new_output_dir(bed, "busy"), new_output_dir(bed, "busy2"), new_output_dir(bed, "busy3")
    archives += [out, out2, out3]
    failpoints, go = held_checkpoint(tmp_path)
    seen = []
    with bed.extra_podshim(tmp_path, failpoints=failpoints) as (sock, _log):
        held = pods.stubs(sock)[0]
        call = Call(pods.stubs(sock)[0], busy.id, out)
        call.start()
        try:
            wait_in_flight(out, call)
            # same pod; same pod named by a unique prefix of its id (the upstream accepts one); same path
            for pod_id, path in ((busy.id, out2), (busy.id[:12], out3), (other.id, out)):
                with pytest.raises(grpc.RpcError) as err:
                    checkpoint(held, pod_id, path, timeout=30)
                assert err.value.code() == grpc.StatusCode.ABORTED, err.value.details()
                assert "in progress" in (err.value.details() or "")
                seen.append(err.value.details())
            assert call.is_alive(), f"the first checkpoint ended during the second requests: {call.error}"
        finally:
            go.touch()  # the first checkpoint goes on
            call.join(120)
    assert call.error is None, call.error
    print("ABORTED:", *seen, sep="\n  ")
    assert_empty_dir(out2)
    assert_empty_dir(out3)
    mf.load_and_verify(out, [str(bed.checkpoint_root)])
    assert_thawed_and_counting(rt, busy)
    assert_thawed_and_counting(rt, other)


def _restore_request(path: str, name: str, args: list[str], log_root: Path) -> cri.RestorePodRequest:
    cc = pods.container_config("counter", args=args)
    return cri.RestorePodRequest(
        checkpoint_path=path, config=pods.pod_config(name, log_root), container_configs=[cc]
    )


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for rel in tree_listing(root):
        h.update(rel.encode())
        p = root / rel
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def first_counts(archive: Path, source_log: Path) -> range:
    """The counts a restore of `archive` may print first: the one after the last the checkpointed
    counter printed (testbed/resume.py), or, in the rare cut its source's log cannot settle (a line
    made just as the pod froze: resume.AmbiguousCut), each of the counts it may have been."""
    try:
        first = resume.firsts_after_cut(archive, {"counter": source_log})["counter"]
    except resume.AmbiguousCut as e:
        cut = resume.Cut.of_archive(archive)
        lines = resume.lines(source_log)
        last = [x.count for x in lines if x.logged_at < cut.thaw_asked_at][-1]
        after = next(x.count for x in lines if x.ts > cut.frozen_at)
        print(f"\n{e}: the restore resumes at one of {last + 1}..{after}")
        return range(last + 1, after + 1)
    return range(first, first + 1)


def test_restore_never_reads_an_archive_being_written(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], archives: list[Path], tmp_path: Path
) -> None:
    """RestorePod of a directory CheckpointPod is writing, by the same path and by aliases of it:
    ABORTED (the path lock holds the resolved path) or NOT_FOUND (no manifest yet), never a
    half-read archive (DATA_LOSS, INTERNAL, a restored pod). Each alias is tried while the
    checkpoint is held once CRIU ended (ABORTED, by construction), then in a loop until the
    checkpoint ends. The requests use a deliberately mismatched container config, so a complete
    archive answers INVALID_ARGUMENT (args) instead of creating a pod. The archive then restores,
    and the counter resumes exactly where it was checkpointed."""
    args = ["--mem-mib", "256", "--interval-ms", "100"]
    cp = start_counter_pod(rt, bed, "ckpt-vs-restore", pod_cleanup, mem_mib=256)
    out = new_output_dir(bed, "ckpt-vs-restore")
    archives.append(out)
    link = Path(bed.checkpoint_root) / f"link-{secrets.token_hex(3)}"
    link.symlink_to(out)
    archives.append(link)
    aliases = [
        str(out),
        f"{out}/",
        f"{out}/.",
        str(out).replace("/checkpoints/", "/checkpoints//"),
        str(link),
    ]
    outcomes: Counter[str] = Counter()
    aborted: Counter[str] = Counter()

    def try_restore(stub: Rt, alias: str) -> grpc.StatusCode:
        req = _restore_request(alias, f"never-{secrets.token_hex(3)}", ["--wrong"], log_root)
        try:
            resp = stub.RestorePod(req, timeout=60)
            pod_cleanup.append(resp.pod_sandbox_id)
            pytest.fail("a restore with a mismatched config created a pod")
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert "args differs" in details, details  # only once the archive is complete
            assert (out / "manifest.json").is_file()
        else:
            assert code in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND), f"{code}: {details}"
        outcomes[code.name] += 1
        aborted[alias] += code == grpc.StatusCode.ABORTED
        return code

    failpoints, go = held_checkpoint(tmp_path)
    with bed.extra_podshim(tmp_path, failpoints=failpoints) as (sock, _log):
        held = pods.stubs(sock)[0]
        call = Call(pods.stubs(sock)[0], cp.id, out)
        call.start()
        try:
            try:
                wait_in_flight(out, call)
                for alias in aliases * 2:
                    code = try_restore(held, alias)
                    assert code == grpc.StatusCode.ABORTED, f"{alias}: {code.name} during the checkpoint"
                assert call.is_alive(), f"the checkpoint ended while the restores were made: {call.error}"
            finally:
                go.touch()  # the checkpoint goes on: thaw, manifest
            i = 0
            while call.is_alive():
                try_restore(held, aliases[i % len(aliases)])
                i += 1
        finally:
            call.join(120)
    assert call.error is None, call.error
    print(f"RestorePod during CheckpointPod: {dict(outcomes)}")
    assert all(aborted[a] for a in aliases), f"an alias escaped the path lock: {dict(aborted)}"

    # the archive is whole, and now restores: the counter resumes at the count after the last one
    # it printed before the freeze
    firsts = first_counts(out, cp.pod.log_path("counter"))
    config = pods.pod_config(f"after-{secrets.token_hex(3)}", log_root)
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(out),
            config=config,
            container_configs=[pods.container_config("counter", args=args)],
            options={"start": "true"},
        ),
        timeout=120,
    )
    pod_cleanup.append(resp.pod_sandbox_id)
    log = Path(config.log_directory) / "counter" / "0.log"
    first = pods.wait_for(lambda: pods.counts(log), what="restored output")[0]
    assert first in firsts, f"the restored counter printed {first} first, not {list(firsts)}"
    resume.assert_exact_resume({"counter": log}, {"counter": first})


def test_checkpoint_never_writes_into_an_archive_being_restored(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], archives: list[Path], tmp_path: Path
) -> None:
    """CheckpointPod into an archive RestorePod is reading: ABORTED while the restore runs (it holds
    the path), INVALID_ARGUMENT (not empty) otherwise; the archive never changes. The restore
    (start=true) is held with its tasks stopped for the page check (podshim-runc's
    `runc-wrapper.held-stopped`) while the checkpoints are tried, so they overlap it by
    construction; then it goes on, and they are tried until it ends."""
    args = ["--mem-mib", "256", "--interval-ms", "100"]
    cp = start_counter_pod(rt, bed, "restore-vs-ckpt", pod_cleanup, mem_mib=256)
    out = new_output_dir(bed, "restore-vs-ckpt")
    archives.append(out)
    checkpoint(rt, cp.id, out)
    digest = _digest(out)
    result: dict[str, object] = {}
    codes: Counter[str] = Counter()

    def try_checkpoint(path: str) -> grpc.StatusCode:
        try:
            checkpoint(rt, cp.id, Path(path), timeout=30)
            pytest.fail("a checkpoint was written into an existing archive")
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert "not empty" in details, details
        else:
            assert code == grpc.StatusCode.ABORTED, f"{code}: {details}"
        codes[code.name] += 1
        return code

    go = tmp_path / "go"
    with containerd_env(bed, {FAILPOINTS_ENV: f"runc-wrapper.held-stopped=wait:{go}"}):

        def restore() -> None:
            req = _restore_request(str(out), f"restored-{secrets.token_hex(3)}", args, log_root)
            req.options["start"] = "true"  # the tasks' restore is part of the call: held in it
            try:
                result["resp"] = fresh_rt(bed).RestorePod(req, timeout=120)
            except grpc.RpcError as e:
                result["error"] = e

        t = threading.Thread(target=restore)
        t.start()
        try:
            try:
                # the restore holds the path from its start; its journal record shows it got past the
                # archive's verification (attempts before that could win the path and ABORT it)
                pods.wait_for(lambda: any("restore" in f for f in journal_files(bed)) or not t.is_alive(), 60)
                assert t.is_alive(), f"the restore ended before the test could overlap it: {result}"
                for _ in range(3):
                    for path in (str(out), f"{out}/."):
                        code = try_checkpoint(path)
                        assert code == grpc.StatusCode.ABORTED, f"{path}: {code.name} during the restore"
                assert t.is_alive(), f"the restore ended while the checkpoints were made: {result}"
            finally:
                go.touch()  # the restored tasks are continued
            while t.is_alive():
                for path in (str(out), f"{out}/."):
                    try_checkpoint(path)
        finally:
            t.join(180)
    assert "error" not in result, result.get("error")
    pod_cleanup.append(result["resp"].pod_sandbox_id)  # type: ignore[attr-defined]
    print(f"CheckpointPod during RestorePod: {dict(codes)}")
    assert codes["ABORTED"], "no checkpoint attempt overlapped the restore"
    assert _digest(out) == digest, "the archive changed"
    assert_thawed_and_counting(rt, cp)


def test_proxy_responsive_during_1gib_checkpoint(
    rt: Rt, bed: TestBed, pod_cleanup: list[str], archives: list[Path]
) -> None:
    cp = start_counter_pod(rt, bed, "big", pod_cleanup, mem_mib=1024, ready_timeout=120)
    out = new_output_dir(bed, "big")
    archives.append(out)
    stub = fresh_rt(bed)
    req = cri.ListPodSandboxRequest()

    def sample(stop: threading.Event | None, n: int = 0) -> list[float]:
        lat = []
        while (stop is not None and not stop.is_set()) or len(lat) < n:
            t0 = time.perf_counter()
            stub.ListPodSandbox(req, timeout=10)
            lat.append((time.perf_counter() - t0) * 1000)
        return lat

    sample(None, 50)  # warm-up
    idle = sample(None, 300)
    stop = threading.Event()
    during: list[float] = []
    sampler = threading.Thread(target=lambda: during.extend(sample(stop)))
    sampler.start()
    start = time.monotonic()
    try:
        checkpoint(rt, cp.id, out, timeout=300)
    finally:
        stop.set()
        sampler.join()
    seconds = time.monotonic() - start

    def p(v: list[float], q: float) -> float:
        return statistics.quantiles(v, n=100, method="inclusive")[int(q) - 1]

    print(
        f"ListPodSandbox via podshim, idle: n={len(idle)} p50={p(idle, 50):.2f}ms p99={p(idle, 99):.2f}ms; "
        f"during a 1 GiB CheckpointPod ({seconds:.1f}s): n={len(during)} p50={p(during, 50):.2f}ms "
        f"p99={p(during, 99):.2f}ms max={max(during):.2f}ms"
    )
    assert len(during) >= 20, "too few calls during the checkpoint to say anything"
    # a loop blocked on CRIU or on the archive's I/O stalls the calls for hundreds of milliseconds;
    # the bound scales with this machine's own idle figure, measured just before
    bound = max(100.0, 10 * p(idle, 99))
    assert p(during, 99) < bound, f"p99 {p(during, 99):.1f} ms during the checkpoint (bound {bound:.0f} ms)"
    assert_thawed_and_counting(rt, cp)


def test_busy_pod_pairs(rt: Rt, bed: TestBed, pod_cleanup: list[str]) -> None:
    """Two requests on one pod issued at the same instant: exactly one runs, the other ABORTED."""
    cp: CounterPod = start_counter_pod(rt, bed, "pair", pod_cleanup, mem_mib=64)
    outs = [new_output_dir(bed, f"pair{i}") for i in range(2)]
    barrier = threading.Barrier(2)

    def one(out: Path) -> str:
        stub = fresh_rt(bed)
        barrier.wait()
        try:
            checkpoint(stub, cp.id, out, timeout=120)
            return "OK"
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.ABORTED, e.details()
            return "ABORTED"

    try:
        with ThreadPoolExecutor(2) as pool:
            results = sorted(pool.map(one, outs))
        assert results == ["ABORTED", "OK"], results
        done = [o for o in outs if (o / "manifest.json").exists()]
        assert len(done) == 1
        assert_empty_dir(next(o for o in outs if o not in done))
    finally:
        for o in outs:
            shutil.rmtree(o, ignore_errors=True)
