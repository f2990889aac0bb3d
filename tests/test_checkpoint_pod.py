"""CheckpointPod end to end: podshim's socket in front of the test bed's containerd + runc + CRIU.

Every test runs real pods (the counter workload of images/counter.c), calls CheckpointPod
through podshim like a kubelet would, and checks what a checkpoint must give: the archive on disk, the
pod still running and unfrozen, the freeze being one pod-wide cut, and each refusal with its
gRPC code, a message naming the problem, the pod untouched and the output directory empty.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import stat
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from faults.helpers import HELD_DEADLINE, HOLD_DUMP

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.archive import manifest as mf
from shim.deadlines import CLEANUP_MARGIN
from testbed import pods, resume
from testbed.bed import TestBed
from testbed.checks import FREEZER, container_cgroup, expect_error, freezer_state, verbose_info

pytestmark = pytest.mark.e2e

CALL_TIMEOUT = 60.0
PODSHIM = Path(__file__).resolve().parents[1] / ".venv/bin/podshim"

Rt = api_pb2_grpc.RuntimeServiceStub


# ---------------------------------------------------------------------------- helpers


def counter(name: str, mem_mib: int = 8, interval_ms: int = 100, extra: list[str] | None = None) -> Any:
    args = ["--mem-mib", str(mem_mib), "--interval-ms", str(interval_ms), *(extra or [])]
    return pods.container_config(name, args=args)


def busybox(name: str, script: str) -> Any:
    return pods.container_config(name, image=pods.BUSYBOX_IMAGE, command=["sh", "-c", script], args=[])


def start_pod(
    rt: Rt, name: str, log_root: Path, cleanup: list[str], containers: dict[str, Any], handler: str = ""
) -> pods.Pod:
    pod = pods.run_pod(
        rt, f"{name}-{secrets.token_hex(3)}", log_root, containers=containers, runtime_handler=handler
    )
    cleanup.append(pod.id)
    return pod


def wait_counting(pod: pods.Pod, name: str, ticks: int = 3, timeout: float = 20.0) -> int:
    """Wait until the counter of `name` printed `ticks` more lines than it has now."""
    now = pods.counts(pod.log_path(name))
    start = now[-1] if now else -1
    return pods.wait_count(pod.log_path(name), start + ticks, timeout=timeout)


def empty_dir(bed: TestBed, name: str) -> Path:
    d = Path(bed.checkpoint_root) / f"{name}-{secrets.token_hex(4)}"
    d.mkdir(mode=0o700)
    return d


def checkpoint(
    rt: Rt,
    pod_id: str,
    out: Path | str,
    timeout: float = CALL_TIMEOUT,
    **fields: Any,
) -> cri.CheckpointPodResponse:
    """CheckpointPod of the pod's running containers (as the kubelet lists them), unless `fields`
    give container_ids."""
    return rt.CheckpointPod(pods.checkpoint_request(rt, pod_id, out, **fields), timeout=timeout)


def container_state(rt: Rt, container_id: str) -> int:
    return rt.ContainerStatus(cri.ContainerStatusRequest(container_id=container_id)).status.state


def assert_pod_alive(rt: Rt, pod: pods.Pod, counters: list[str]) -> None:
    """The pod is READY, its containers RUNNING, their cgroups and the pod's THAWED, and every
    counter keeps counting."""
    st = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id)).status
    assert st.state == cri.SANDBOX_READY
    assert freezer_state(pod.config.linux.cgroup_parent) == "THAWED"
    for name in counters:
        cid = pod.containers[name]
        assert container_state(rt, cid) == cri.CONTAINER_RUNNING, name
        assert freezer_state(container_cgroup(rt, cid)) == "THAWED", name
    for name in counters:
        wait_counting(pod, name, ticks=2, timeout=10)


def assert_empty(d: Path) -> None:
    assert d.is_dir() and not d.is_symlink()
    assert list(d.iterdir()) == []


def root_listing(bed: TestBed) -> set[str]:
    return {p.name for p in Path(bed.checkpoint_root).iterdir()}


def walk_modes(root: Path) -> tuple[list[str], list[str]]:
    """Relative paths under root whose mode is not 0600 (files) / 0700 (dirs); also the root."""
    bad_files, bad_dirs = [], []
    if stat.S_IMODE(root.stat().st_mode) != 0o700:
        bad_dirs.append(".")
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames:
            p = Path(dirpath) / n
            if stat.S_IMODE(p.lstat().st_mode) != 0o700:
                bad_dirs.append(f"{p.relative_to(root)} {oct(stat.S_IMODE(p.lstat().st_mode))}")
        for n in filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) != 0o600:
                bad_files.append(f"{p.relative_to(root)} {oct(st.st_mode)}")
    return bad_files, bad_dirs


def verified(bed: TestBed, out: Path) -> mf.Manifest:
    """The archive's manifest after checking every listed file's size and sha256 (and that no
    file is unlisted), and every file 0600, every directory 0700."""
    m = mf.load_and_verify(out, [str(bed.checkpoint_root)])
    assert m.format == "podshim.checkpoint.v1"
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["format"] == "podshim.checkpoint.v1"
    assert raw["files"] and all(set(f) == {"size", "sha256"} for f in raw["files"].values())
    bad_files, bad_dirs = walk_modes(out)
    assert (bad_files, bad_dirs) == ([], []), "\n".join(bad_files + bad_dirs)
    assert_no_pending_ops(bed)
    return m


def assert_no_pending_ops(bed: TestBed) -> None:
    """Every operation was closed in podshim's journal (nothing left for crash recovery)."""
    assert list((Path(bed.podshim_state_dir) / "ops").glob("*.json")) == []


def counter_pid(rt: Rt, container_id: str) -> int:
    return int(verbose_info(rt, container_id)["pid"])


def assert_memory_intact(rt: Rt, pod: pods.Pod, name: str) -> None:
    """SIGUSR1 makes the counter check every word of its memory pattern and print the result."""
    log = pod.log_path(name)
    seen = log.read_bytes().count(b"verify ")
    os.kill(counter_pid(rt, pod.containers[name]), signal.SIGUSR1)
    pods.wait_for(lambda: log.read_bytes().count(b"verify ") > seen, timeout=20, what=f"{name} verify")
    assert log.read_bytes().count(b"verify ok") > seen, log.read_bytes()[-300:]


def assert_dumped(out: Path, m: mf.Manifest, name: str) -> None:
    """Container `name` has a complete dump: CRIU images, dumps, diff, log, stats."""
    c = out / "containers" / name
    for f in ("spec.dump", "config.dump", "status.dump", "rootfs-diff.tar", "dump.log", "stats-dump"):
        assert (c / f).is_file(), f"{name}: {f} missing"
        assert f"containers/{name}/{f}" in m.files
    images = c / "checkpoint"
    assert (images / "inventory.img").is_file(), f"{name}: no inventory.img"
    assert list(images.glob("pages-*.img")), f"{name}: no pages-*.img"
    assert m.container(name).checkpointed


# ---------------------------------------------------------------------------- success paths


def test_single_counter_pod(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    c = {"counter": counter("counter", mem_mib=16)}
    pod = start_pod(rt, "single", log_root, pod_cleanup, c, runtime_handler)
    wait_counting(pod, "counter", 3)
    out = empty_dir(bed, "single")
    checkpoint(rt, pod.id, out)
    after_call = pods.counts(pod.log_path("counter"))[-1]

    # the pod keeps counting after the call returned, unfrozen
    assert_pod_alive(rt, pod, ["counter"])
    assert pods.wait_count(pod.log_path("counter"), after_call + 3) > after_call

    m = verified(bed, out)
    assert [c.name for c in m.containers] == ["counter"]
    assert m.container("counter").id == pod.containers["counter"]
    assert m.post_checkpoint_state == "RUNNING"
    assert_dumped(out, m, "counter")
    # the runtime's /dev (a tmpfs with mounts on it) read through a detached copy, not a temporary
    # directory whose removal waits for a discard (CRIU patch 0012; docs/design/checkpoint-pod.md
    # (The freeze window))
    assert b"by open_tree" in (out / "containers" / "counter" / "dump.log").read_bytes()
    for f in ("sandbox/config.json", "sandbox/status.json", "sandbox/network.json"):
        assert f in m.files
    # the pod's network as its namespace had it (pyroute2), beside the upstream's CNI result
    network = json.loads((out / "sandbox/network.json").read_text())
    ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id)).status.network.ip
    nics = {i["name"]: i for i in network["netns"]["interfaces"]}
    assert {"lo", "eth0"} <= set(nics), nics
    assert any(a.startswith(ip + "/") for a in nics["eth0"]["addresses"]), (ip, nics["eth0"])
    assert any(r["dst"] == "default" and r["dev"] == "eth0" for r in network["netns"]["routes"]), network
    assert network["cni_result"], "the upstream's CNI result is missing"

    assert {"freeze_window", "dump", "rootfs_diff", "total"} <= set(m.timings)
    assert 0 < m.timings["freeze_window"] < m.timings["total"]
    stats = m.criu_stats["counter"]
    assert stats["pages_written"] > 0
    assert stats["frozen_time"] > 0
    assert m.host.criu_version and m.host.runtime_version and m.host.kernel and m.host.arch
    assert m.host.runtime_name == (runtime_handler or "runc")


def test_page_images_written_back_while_frozen(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], tmp_path: Path
) -> None:
    # `writeback_ahead = "always"`: a thread starts the writeback of the page images while CRIU
    # writes them (docs/design/checkpoint-pod.md (The freeze window)); the archive is the same
    c = {"a": counter("a", mem_mib=48), "b": counter("b", mem_mib=48)}
    pod = start_pod(rt, "ahead", log_root, pod_cleanup, c)
    wait_counting(pod, "a", 2, timeout=60)
    wait_counting(pod, "b", 2, timeout=60)
    out = empty_dir(bed, "ahead")
    with bed.extra_podshim(tmp_path, checkpoint={"writeback_ahead": "always"}) as (sock, log):
        checkpoint(pods.stubs(sock)[0], pod.id, out)
        lines = [json.loads(x) for x in log.read_text().splitlines() if "images written back" in x]
    # every whole 8 MiB step of each container's 48 MiB of pages (the rest: the archive's fsync)
    assert [x["mib"] >= 2 * 48 - 2 * 8 for x in lines] == [True], lines
    assert list((tmp_path / "state" / "ops").glob("*.json")) == []
    m = verified(bed, out)
    assert_dumped(out, m, "a")
    assert_dumped(out, m, "b")
    assert_pod_alive(rt, pod, ["a", "b"])
    assert_memory_intact(rt, pod, "a")


def test_failure_with_images_written_back(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], tmp_path: Path
) -> None:
    # a failure after the dumps while the writeback thread may still be in its last look (it is
    # joined after the thaw, docs/design/checkpoint-pod.md (The freeze window)): INTERNAL, output_path
    # left empty, the pod thawed and running
    c = {"a": counter("a", mem_mib=48)}
    pod = start_pod(rt, "ahead-fail", log_root, pod_cleanup, c)
    wait_counting(pod, "a", 2, timeout=60)
    out = empty_dir(bed, "ahead-fail")
    overrides = {"checkpoint": {"writeback_ahead": "always"}}
    with bed.extra_podshim(tmp_path, failpoints="checkpoint.before-thaw=error", **overrides) as (sock, log):
        with pytest.raises(grpc.RpcError) as e:
            checkpoint(pods.stubs(sock)[0], pod.id, out)
        assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
        assert "images written back during the dumps" in log.read_text()
    assert list(out.iterdir()) == []
    assert list((tmp_path / "state" / "ops").glob("*.json")) == []
    assert_pod_alive(rt, pod, ["a"])


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="hashing during the dumps needs a core they leave idle")
def test_page_images_hashed_during_the_dumps(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], tmp_path: Path
) -> None:
    # one dump on a node of two or more cores: the page image is hashed by the follower as CRIU
    # writes it (docs/design/checkpoint-pod.md (The freeze window)), and the manifest's digest is the
    # file's (every file read again by load_and_verify)
    c = {"a": counter("a", mem_mib=48)}
    pod = start_pod(rt, "hashed-ahead", log_root, pod_cleanup, c)
    wait_counting(pod, "a", 2, timeout=60)
    out = empty_dir(bed, "hashed-ahead")
    with bed.extra_podshim(tmp_path) as (sock, log):
        checkpoint(pods.stubs(sock)[0], pod.id, out)
        lines = [
            json.loads(x) for x in log.read_text().splitlines() if "images written back during the dumps" in x
        ]
    assert lines and lines[-1]["hashed_mib"] >= 40, lines
    m = verified(bed, out)
    pages = [rel for rel in m.files if re.search(r"/pages-[0-9]+\.img$", rel)]
    assert pages and max(m.files[rel].size for rel in pages) >= 40 << 20
    assert_pod_alive(rt, pod, ["a"])


def test_rootfs_diff_has_written_and_deleted_files(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    c = counter("counter", interval_ms=20, extra=["--state-file", "/tmp/state"])
    pod = start_pod(rt, "diff", log_root, pod_cleanup, {"counter": c})
    cid = pod.containers["counter"]
    r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["rm", "/bin/ls"], timeout=10))
    assert r.exit_code == 0, r.stderr
    wait_counting(pod, "counter", 10)

    def take() -> Path:
        out = empty_dir(bed, "diff")
        checkpoint(rt, pod.id, out)
        return out

    # the count the counter printed first after the thaw, exactly: from the manifest's cut and the
    # counter's own log (testbed/resume.py; a cut the log cannot place is taken again)
    out, first = resume.checkpoint_exactly(take, {"counter": pod.log_path("counter")})
    wait_counting(pod, "counter", 5)

    verified(bed, out)
    tar_path = out / "containers/counter/rootfs-diff.tar"
    with tarfile.open(tar_path) as tar:
        names = tar.getnames()
    assert "tmp/state" in names
    assert "bin/.wh.ls" in names
    assert "bin/busybox" not in names  # only the writable layer, not the image
    assert "/bin/ls" in json.loads((out / "containers/counter/deleted.files").read_text())

    # the diff is the frozen state: the counter prints a count, then saves it, so the state file
    # holds the last count printed before the freeze (or the one before, when the freeze fell
    # between that print and the rename)
    saved = saved_state(out, "counter")
    last = first["counter"] - 1
    assert saved in (last, last - 1), (saved, last)


def saved_state(out: Path, name: str) -> int:
    """The counter's --state-file as captured in the archive's rootfs diff."""
    with tarfile.open(out / "containers" / name / "rootfs-diff.tar") as tar:
        f = tar.extractfile("tmp/state")
        assert f is not None
        return int(f.read())


def test_post_checkpoint_state_stopped(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    c = counter("counter", interval_ms=20, extra=["--state-file", "/tmp/state"])
    pod = start_pod(rt, "stopped", log_root, pod_cleanup, {"counter": c}, runtime_handler)
    cid = pod.containers["counter"]
    wait_counting(pod, "counter", 5)
    out = empty_dir(bed, "stopped")
    checkpoint(rt, pod.id, out, post_checkpoint_state=cri.POST_CHECKPOINT_STATE_STOPPED)

    status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    assert status.state == cri.CONTAINER_EXITED
    assert status.exit_code == 137  # SIGKILLed while frozen, not a SIGTERM it could react to
    m = verified(bed, out)
    assert m.post_checkpoint_state == "STOPPED"
    assert_dumped(out, m, "counter")
    # nothing ran past the checkpoint (testbed/resume.py): the counter prints a count, then saves
    # it, so the count the frozen state file holds was printed before the freeze, and at most one
    # more (the freeze fell between that print and the rename); no line was made after the cut
    # (the manifest's frozen_at; a thaw before the kill would have let it print on), and no
    # "stopping" line (not a SIGTERM)
    cut = resume.Cut.of_archive(out)
    saved = saved_state(out, "counter")
    log = pod.log_path("counter")
    pods.wait_for(lambda: saved in pods.counts(log), what=f"the saved count {saved} in {log}")
    lines = resume.lines(log)
    ran = [x for x in lines if x.ts > cut.frozen_at]
    assert not ran, f"the counter printed after the cut ({cut.frozen_at:.3f}): {ran[:3]}"
    assert lines[-1].count in (saved, saved + 1), (lines[-3:], saved)
    assert b"stopping" not in log.read_bytes()
    assert freezer_state(pod.config.linux.cgroup_parent) == "THAWED"


HOLD_THAW = 0.5  # seconds the pod is held frozen past its dumps: many of the counters' 20 ms ticks


def test_three_containers_frozen_in_one_cut(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str, tmp_path: Path
) -> None:
    names = ["a", "b", "c"]
    containers = {n: counter(n, mem_mib=64, interval_ms=20) for n in names}
    pod = start_pod(rt, "three", log_root, pod_cleanup, containers, runtime_handler)
    for n in names:
        wait_counting(pod, n, 10)
    calls: dict[Path, tuple[float, float, float]] = {}  # archive -> wall clock called, answered; seconds
    # a second podshim holds the pod frozen HOLD_THAW s after the dumps: a freeze long enough to be
    # seen in every container's log, however fast the machine dumps
    with bed.extra_podshim(tmp_path, failpoints=f"checkpoint.before-thaw=sleep:{HOLD_THAW}") as (sock, _log):
        held = pods.stubs(sock)[0]

        def take() -> Path:
            out = empty_dir(bed, "three")
            wall, start = time.time(), time.monotonic()
            checkpoint(held, pod.id, out)
            calls[out] = (wall, time.time(), time.monotonic() - start)
            return out

        # one cut (testbed/resume.py): each container's log holds no line made between the
        # manifest's frozen_at and thaw_asked_at, and a pause at least that long around them; the
        # span is the same for all three, so all three stood still through all of it at once, not
        # one after the other (a cut the logs cannot place is taken again)
        out, _first = resume.checkpoint_exactly(take, {n: pod.log_path(n) for n in names})
    assert list((tmp_path / "state" / "ops").glob("*.json")) == []
    assert_pod_alive(rt, pod, names)

    m = verified(bed, out)
    assert [c.name for c in m.containers] == names
    for n in names:
        assert_dumped(out, m, n)
    cut = resume.Cut.of_archive(out)
    called, answered, took = calls[out]
    # the cut's instants in order, within the call; the hold lies between the cut and the thaw
    assert called <= m.timings["freeze_asked_at"] <= cut.frozen_at <= cut.thaw_asked_at <= answered, m.timings
    frozen = cut.thaw_asked_at - cut.frozen_at
    assert frozen >= HOLD_THAW, m.timings
    # the reported window runs from the cut to the last container thawed: the frozen span (which
    # no container's pause is shorter than, above) and then the thaw's own time. That last part
    # happens inside podshim, after the first thaw write; no workload's line can bound it, only the
    # call's answer, which comes after it
    thaw = cut.window - frozen
    assert 0 <= thaw and cut.window <= took, (cut, took)
    # no container's CRIU locked the pod's shared netns (docs/design/checkpoint-pod.md (The freeze
    # window)): nothing established to keep still, so each dump's inventory says "skip"
    for n in names:
        assert inventory(out, n).get("network_lock_method") == NETWORK_LOCK_SKIP, inventory(out, n)


NETWORK_LOCK_SKIP = 2  # CRIU's enum NETWORK_LOCK_METHOD: iptables 0, nftables 1, skip 2


def inventory(out: Path, name: str) -> dict:
    """A container's CRIU inventory.img, decoded with pycriu."""
    import pycriu

    with open(out / "containers" / name / "checkpoint" / "inventory.img", "rb") as f:
        return pycriu.images.load(f)["entries"][0]


def test_exited_container_is_recorded_not_dumped(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    pod = start_pod(
        rt,
        "exited",
        log_root,
        pod_cleanup,
        {"done": busybox("done", "exit 0"), "counter": counter("counter")},
        runtime_handler,
    )
    done = pod.containers["done"]
    pods.wait_for(lambda: container_state(rt, done) == cri.CONTAINER_EXITED, what="done to exit")
    wait_counting(pod, "counter", 2)
    out = empty_dir(bed, "exited")
    checkpoint(rt, pod.id, out)
    assert_pod_alive(rt, pod, ["counter"])

    m = verified(bed, out)
    assert {c.name for c in m.containers} == {"done", "counter"}
    entry = m.container("done")
    assert not entry.checkpointed and entry.state == "CONTAINER_EXITED" and entry.id == done
    d = out / "containers/done"
    assert (d / "config.dump").is_file() and (d / "status.dump").is_file() and (d / "spec.dump").is_file()
    assert (
        json.loads((d / "status.dump").read_text())["state"] == cri.CONTAINER_EXITED
    )  # as containerd writes it
    assert not (d / "checkpoint").exists()
    assert not (d / "rootfs-diff.tar").exists()
    assert_dumped(out, m, "counter")


def test_container_ids_select_one_of_two(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    pod = start_pod(rt, "select", log_root, pod_cleanup, {"one": counter("one"), "two": counter("two")})
    wait_counting(pod, "one", 2)
    wait_counting(pod, "two", 2)
    out = empty_dir(bed, "select")
    checkpoint(rt, pod.id, out, container_ids=[pod.containers["two"]])
    assert_pod_alive(rt, pod, ["one", "two"])

    m = verified(bed, out)
    assert [c.name for c in m.containers] == ["two"]
    assert_dumped(out, m, "two")
    assert sorted(p.name for p in (out / "containers").iterdir()) == ["two"]
    assert not any(f.startswith("containers/one/") for f in m.files)
    assert set(m.criu_stats) == {"two"}


# ---------------------------------------------------------------------------- failure paths


def assert_refused_cleanly(
    rt: Rt,
    bed: TestBed,
    pod: pods.Pod,
    out: Path,
    code: grpc.StatusCode,
    call: Callable[[], Any],
    *words: str,
    counters: tuple[str, ...] = ("counter",),
) -> str:
    """The call fails with `code` and a message naming the problem; nothing is left behind in
    the output dir or the checkpoint root; the pod keeps running, thawed."""
    before = root_listing(bed)
    details = expect_error(code, call, *words)
    assert root_listing(bed) == before
    assert_empty(out)
    assert_no_pending_ops(bed)
    assert_pod_alive(rt, pod, list(counters))
    return details


def test_deadline_too_short(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], tmp_path: Path
) -> None:
    # small: its dump ends well within HELD_DEADLINE (a CRIU still dumping at the deadline is let
    # finish first, and podshim's answer then comes after it: tests/test_dump_given_up.py)
    pod = start_pod(rt, "deadline", log_root, pod_cleanup, {"counter": counter("counter", mem_mib=64)})
    wait_counting(pod, "counter", 2, timeout=60)
    out = empty_dir(bed, "deadline")
    # shorter than the cleanup margin podshim keeps from it: refused before anything is frozen
    # (9/10 of it: gRPC's timeout header rounds up, the server may see ~1 % more than was set)
    assert_refused_cleanly(
        rt,
        bed,
        pod,
        out,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        lambda: checkpoint(rt, pod.id, out, timeout=0.9 * CLEANUP_MARGIN),
        "deadline leaves no time",
        pod.config.metadata.name,
    )
    # a deadline that runs out in the dump step (runc and CRIU ended, the pod frozen): the pod
    # thawed, the partial files removed, nothing left in the journal of the podshim that ran it
    out2 = empty_dir(bed, "deadline-mid")
    with bed.extra_podshim(tmp_path, failpoints=HOLD_DUMP) as (sock, log):
        held = pods.stubs(sock)[0]
        details = assert_refused_cleanly(
            rt,
            bed,
            pod,
            out2,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            lambda: checkpoint(held, pod.id, out2, timeout=HELD_DEADLINE),
            "did not finish within the caller's deadline",
            pod.config.metadata.name,
        )
        assert list((tmp_path / "state" / "ops").glob("*.json")) == []
        assert '"event": "pod frozen"' in log.read_text()  # it ran out after the freeze: in the dump
    assert "thawed" in details and "partial files removed" in details
    # the dump was abandoned: the process is intact, every page of it
    assert_memory_intact(rt, pod, "counter")


def test_criu_failure_is_internal_and_cleaned(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str
) -> None:
    # An established TCP connection inside the pod: CRIU refuses it without tcp-established.
    # Real CRIU, real reason, no fake binary. The counter has enough memory that its dump may
    # still run when the other one fails: it is let finish (CRIU holds the counter: killing it
    # could kill the counter, tests/test_dump_given_up.py), discarded and the container thawed.
    script = (
        f"sleep 1000 | nc -l -p 7777 & {pods.until_listening(7777)}; "
        "exec nc 127.0.0.1 7777 </dev/zero >/dev/null"
    )
    pod = start_pod(
        rt,
        "criu-fail",
        log_root,
        pod_cleanup,
        {"tcp": busybox("tcp", script), "counter": counter("counter", mem_mib=192)},
        runtime_handler,
    )
    wait_counting(pod, "counter", 3, timeout=60)
    out = empty_dir(bed, "criu-fail")
    details = assert_refused_cleanly(
        rt,
        bed,
        pod,
        out,
        grpc.StatusCode.INTERNAL,
        lambda: checkpoint(rt, pod.id, out),
        "'tcp'",
        "CRIU log",
    )
    assert "--tcp-established" in details  # CRIU's own reason, from its log
    assert container_state(rt, pod.containers["tcp"]) == cri.CONTAINER_RUNNING
    # the CRIU log the message names outlives the removed archive
    named = re.search(r"CRIU log: (/\S+)\)", details)
    assert named, details
    kept = Path(named.group(1))
    assert not kept.is_relative_to(out)
    assert "Connected TCP socket" in kept.read_text()
    assert_memory_intact(rt, pod, "counter")  # its dump was given up


@pytest.fixture
def counter_pod(rt: Rt, log_root: Path, pod_cleanup: list[str]) -> pods.Pod:
    pod = start_pod(rt, "guard", log_root, pod_cleanup, {"counter": counter("counter")})
    wait_counting(pod, "counter", 1)
    return pod


def test_bad_options_and_hostile_paths(rt: Rt, bed: TestBed, counter_pod: pods.Pod, tmp_path: Path) -> None:
    """Refused before anything is touched: nothing is created, followed or removed anywhere."""
    root = Path(bed.checkpoint_root)
    outside = tmp_path / "outside"
    outside.mkdir()
    link = root / f"escape-{secrets.token_hex(4)}"
    link.symlink_to(outside)
    full = empty_dir(bed, "full")
    (full / "keep").write_text("caller data")
    good = empty_dir(bed, "good")  # a valid path, for the cases that are about something else
    INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    cases: list[tuple[grpc.StatusCode, str, dict[str, Any], list[str]]] = [
        (INVALID, "checkpoints/x", {}, ["not absolute"]),
        (INVALID, f"{good}/../{good.name}", {}, ["'..'"]),
        (INVALID, str(link), {}, ["symlink", "outside the allowed"]),
        (INVALID, str(link) + "/", {}, ["symlink", "outside the allowed"]),
        (INVALID, str(outside), {}, ["outside the allowed"]),
        (INVALID, str(root), {}, ["checkpoint root", "itself"]),
        (INVALID, str(full), {}, ["not empty", "keep"]),
        (INVALID, "", {}, ["empty"]),
        (NOT_FOUND, str(root / "no-such-dir"), {}, ["does not exist"]),
        (INVALID, str(good), {"options": {"tcp-establishd": "true"}}, ["tcp-establishd", "tcp-established"]),
        (INVALID, str(good), {"options": {"rootfs-compression": "zstd"}}, ["rootfs-compression", "zstd"]),
        (INVALID, str(good), {"post_checkpoint_state": 7}, ["post_checkpoint_state"]),
    ]
    for code, path, fields, words in cases:
        before = root_listing(bed)
        expect_error(code, lambda p=path, f=fields: checkpoint(rt, counter_pod.id, p, **f), *words)
        assert root_listing(bed) == before, path
        assert list(outside.iterdir()) == [], path
        assert [p.name for p in full.iterdir()] == ["keep"], path
        assert (full / "keep").read_text() == "caller data"
        assert_empty(good)
    assert not (root / "no-such-dir").exists()
    assert link.is_symlink()
    assert_pod_alive(rt, counter_pod, ["counter"])


def test_unknown_sandbox(rt: Rt, bed: TestBed) -> None:
    out = empty_dir(bed, "unknown")
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        lambda: checkpoint(rt, "no-such-pod-" + secrets.token_hex(4), out),
        "not found",
    )
    assert_empty(out)


def test_not_ready_sandbox(rt: Rt, bed: TestBed, counter_pod: pods.Pod) -> None:
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=counter_pod.id))
    out = empty_dir(bed, "notready")
    expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: checkpoint(rt, counter_pod.id, out),
        "not ready",
        counter_pod.config.metadata.name,
    )
    assert_empty(out)


def test_bad_container_ids(rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]) -> None:
    pod = start_pod(
        rt, "ids", log_root, pod_cleanup, {"counter": counter("counter"), "gone": counter("gone")}
    )
    other = start_pod(rt, "ids-other", log_root, pod_cleanup, {"counter": counter("counter")})
    gone = pod.containers["gone"]
    rt.StopContainer(cri.StopContainerRequest(container_id=gone, timeout=2))
    assert container_state(rt, gone) == cri.CONTAINER_EXITED
    wait_counting(pod, "counter", 1)
    mine = pod.containers["counter"]
    foreign = other.containers["counter"]
    cases = [
        # the released API: non-empty; never "all running" (test_empty_container_ids_...)
        ("empty", grpc.StatusCode.INVALID_ARGUMENT, [], ["container_ids is empty", "running: counter"]),
        ("stopped", grpc.StatusCode.FAILED_PRECONDITION, [mine, gone], ["'gone'", "not running"]),
        ("foreign", grpc.StatusCode.NOT_FOUND, [mine, foreign], [foreign, "not a container of pod"]),
        ("duplicate", grpc.StatusCode.INVALID_ARGUMENT, [mine, mine], [mine, "more than once"]),
    ]
    for _what, code, ids, words in cases:
        out = empty_dir(bed, "ids")
        assert_refused_cleanly(
            rt, bed, pod, out, code, lambda i=ids, o=out: checkpoint(rt, pod.id, o, container_ids=i), *words
        )
    assert_pod_alive(rt, other, ["counter"])


def test_empty_container_ids_is_invalid_and_nothing_is_frozen(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    """The released API (k8s.io/cri-api v0.37.2): "The list must be non-empty ... otherwise the
    runtime must fail the request without producing a checkpoint". An empty container_ids used to
    checkpoint every running container; it is INVALID_ARGUMENT naming the pod's running ones, with
    the pod never frozen, output_path empty and nothing journaled. Listed, as the kubelet lists
    them, the same request succeeds."""
    pod = start_pod(rt, "empty-ids", log_root, pod_cleanup, {"one": counter("one"), "two": counter("two")})
    wait_counting(pod, "one", 2)
    wait_counting(pod, "two", 2)
    out = empty_dir(bed, "empty-ids")
    mark = bed.podshim_log.stat().st_size
    assert_refused_cleanly(
        rt,
        bed,
        pod,
        out,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: checkpoint(rt, pod.id, out, container_ids=[]),
        "container_ids is empty",
        "running: one, two",
        pod.config.metadata.name,
        "nothing was frozen or written",
        counters=("one", "two"),
    )
    with open(bed.podshim_log, "rb") as f:
        f.seek(mark)
        logged = [line for line in f.read().splitlines() if pod.id.encode() in line]
    assert not [line for line in logged if b'"pod frozen"' in line or b'"checkpoint prepared"' in line], (
        logged
    )

    checkpoint(rt, pod.id, out, container_ids=[pod.containers["one"], pod.containers["two"]])
    m = verified(bed, out)
    assert sorted(c.name for c in m.containers) == ["one", "two"]
    assert_pod_alive(rt, pod, ["one", "two"])


def test_cli_without_container_lists_the_running_containers(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    """`podshim checkpointpod POD PATH` needs no container list: the command lists the pod's running
    containers and sends them (an exited one is recorded, not dumped, as before). With none
    running it refuses before creating PATH."""
    pod = start_pod(
        rt,
        "cli-ids",
        log_root,
        pod_cleanup,
        {"done": busybox("done", "exit 0"), "counter": counter("counter")},
    )
    done = pod.containers["done"]
    pods.wait_for(lambda: container_state(rt, done) == cri.CONTAINER_EXITED, what="done to exit")
    wait_counting(pod, "counter", 2)
    out = Path(bed.checkpoint_root) / f"cli-ids-{secrets.token_hex(4)}"
    res = podshim_cli(bed, "checkpointpod", pod.id[:12], str(out))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["outputPath"] == str(out)
    m = verified(bed, out)
    assert m.container("counter").checkpointed and not m.container("done").checkpointed
    assert_dumped(out, m, "counter")
    assert_pod_alive(rt, pod, ["counter"])

    rt.StopContainer(cri.StopContainerRequest(container_id=pod.containers["counter"], timeout=2))
    none = Path(bed.checkpoint_root) / f"cli-ids-none-{secrets.token_hex(4)}"
    res = podshim_cli(bed, "checkpointpod", pod.id, str(none))
    assert res.returncode == 1 and "has no running container to checkpoint" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not none.exists()


def podshim_cli(bed: TestBed, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(PODSHIM), "-r", f"unix://{bed.podshim_socket}", "-o", "json", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=CALL_TIMEOUT + 30)


def test_concurrent_requests_on_one_pod(rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]) -> None:
    pod = start_pod(rt, "concurrent", log_root, pod_cleanup, {"counter": counter("counter", mem_mib=512)})
    wait_counting(pod, "counter", 2, timeout=60)
    outs = [empty_dir(bed, "concurrent-a"), empty_dir(bed, "concurrent-b")]
    results: list[Any] = [None, None]
    go = threading.Barrier(2)

    def call(i: int) -> None:
        go.wait()
        try:
            results[i] = checkpoint(rt, pod.id, outs[i])
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT + 5)
    errs = [r for r in results if isinstance(r, grpc.RpcError)]
    oks = [i for i, r in enumerate(results) if isinstance(r, cri.CheckpointPodResponse)]
    assert len(oks) == 1 and len(errs) == 1, results
    assert errs[0].code() == grpc.StatusCode.ABORTED
    assert "another operation" in (errs[0].details() or "") and pod.id in (errs[0].details() or "")
    winner, loser = outs[oks[0]], outs[1 - oks[0]]
    assert_empty(loser)
    assert_dumped(winner, verified(bed, winner), "counter")
    assert_pod_alive(rt, pod, ["counter"])


def test_exec_session_is_refused(rt: Rt, bed: TestBed, counter_pod: pods.Pod) -> None:
    cid = counter_pod.containers["counter"]
    cgroup = FREEZER / container_cgroup(rt, cid).lstrip("/")
    before = set((cgroup / "cgroup.procs").read_text().split())
    result: list[Any] = []

    def exec_sleep() -> None:
        try:
            result.append(rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["sleep", "5"], timeout=20)))
        except grpc.RpcError as e:
            result.append(e)

    t = threading.Thread(target=exec_sleep)
    t.start()
    pids: set[str] = set()
    try:
        pids = pods.wait_for(
            lambda: set((cgroup / "cgroup.procs").read_text().split()) - before, what="the exec process"
        )
        out = empty_dir(bed, "exec")
        assert_refused_cleanly(
            rt,
            bed,
            counter_pod,
            out,
            grpc.StatusCode.FAILED_PRECONDITION,
            lambda: checkpoint(rt, counter_pod.id, out),
            "'counter'",
            "exec session",
        )
    finally:
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        t.join(20)


def test_short_exec_session_is_waited_for(
    rt: Rt, bed: TestBed, counter_pod: pods.Pod, archives: list[Path]
) -> None:
    """An exec session that ends within EXEC_SESSION_WAIT (a kubelet exec probe) does not fail
    the checkpoint: podshim waits for it, then checkpoints."""
    cid = counter_pod.containers["counter"]
    cgroup = FREEZER / container_cgroup(rt, cid).lstrip("/")
    before = set((cgroup / "cgroup.procs").read_text().split())
    done: list[Any] = []

    def exec_short() -> None:
        # its last act: print the wall clock (busybox ts: microseconds; its date has no %N)
        cmd = ["sh", "-c", "sleep 1; echo | ts %.s"]
        try:
            done.append(rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=20)))
        except grpc.RpcError as e:
            done.append(e)

    t = threading.Thread(target=exec_short)
    t.start()
    try:
        pods.wait_for(lambda: set((cgroup / "cgroup.procs").read_text().split()) - before, what="the exec")
        out = empty_dir(bed, "short-exec")
        archives.append(out)
        checkpoint(rt, counter_pod.id, out)
    finally:
        t.join(20)
    # the exec's answer comes back through containerd after the session ended, in its own time:
    # read once it has arrived
    assert not t.is_alive() and len(done) == 1, done
    r = done[0]
    assert isinstance(r, cri.ExecSyncResponse) and r.exit_code == 0, r
    m = verified(bed, out)
    # the session's last instant of running code came before podshim even asked for the freeze
    ended = float(r.stdout)
    assert ended < m.timings["freeze_asked_at"] <= m.timings["frozen_at"], (ended, m.timings)
    assert_dumped(out, m, "counter")
    assert_pod_alive(rt, counter_pod, ["counter"])


def test_detached_daemon_is_refused_with_what_to_do(
    rt: Rt, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    """A daemon that detached into the pod's shared PID namespace (its parent is now the pause
    process) sits in the container's cgroup outside its process tree and never ends: the refusal
    names it (pid, comm, parent) and says to stop it or move it out, not to wait for it."""
    config = pods.pod_config(f"stray-{secrets.token_hex(3)}", log_root)
    config.linux.security_context.namespace_options.pid = cri.POD
    pod_id = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config)).pod_sandbox_id
    pod_cleanup.append(pod_id)
    cc = busybox("app", "(sleep 1000 &); exec sleep 1001")
    cc.linux.security_context.namespace_options.pid = cri.POD
    cid = rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config)
    ).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    pod = pods.Pod(pod_id, config, {"app": cid})
    cgroup = FREEZER / container_cgroup(rt, cid).lstrip("/")

    def daemon() -> int | None:
        for pid in (cgroup / "cgroup.procs").read_text().split():
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"1000"]:
                return int(pid)
        return None

    stray = pods.wait_for(daemon, what="the detached daemon")
    out = empty_dir(bed, "stray")
    details = assert_refused_cleanly(
        rt,
        bed,
        pod,
        out,
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: checkpoint(rt, pod_id, out),
        "'app'",
        f"process {stray} (sleep), child of",
        "(pause)",
        "outside its process tree",
        "will not end by itself",
        "stop it, or move it out of the container's cgroup",
        counters=(),
    )
    assert "retry when it has ended" not in details and "exec session" not in details
