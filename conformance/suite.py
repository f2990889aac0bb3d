"""The conformance tests: the CRI-level items of KEP-5823's test plan, plus CheckpointContainer
(KEP-2008) as the Kubernetes node e2e test checks it.

Every test creates its own pods (or uses the run's shared checkpoint), passes `container_ids`
explicitly as the merged CRI requires, and leaves nothing behind.
"""

from __future__ import annotations

import functools
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from api.runtime.v1 import api_pb2 as cri
from conformance.cri import describe_diff, listing, tree_snapshot, wait_for
from conformance.runner import Context, Pod, conformance_test, shared_context

CP, RP, CC = "CheckpointPod", "RestorePod", "CheckpointContainer"
Code = grpc.StatusCode
UNKNOWN_OPTION = "conformance.podshim.io/no-such-option"
NO_SUCH_HANDLER = "conformance-no-such-handler"


# ---------------------------------------------------------------------------- shared fixture


# Pods are shared by the tests that only read them or take checkpoints of them (the pods keep
# running after a checkpoint); each is made on first use and removed at the end of the run.
SINGLE: dict[str, list[str] | None] = {"workload": None}
PAIR: dict[str, list[str] | None] = {"alpha": None, "beta": None}


def shared_pod(t: Context, key: str, containers: dict[str, list[str] | None]) -> Pod:
    pod = t.suite.shared.get(f"pod:{key}")
    if pod is None:
        pod = shared_context(t.suite, t.case).run_pod(key, containers)
        t.suite.shared[f"pod:{key}"] = pod
    return pod


@dataclass
class SharedCheckpoint:
    """A checkpoint of the shared single-container pod, made once per run."""

    pod: Pod
    path: Path
    snapshot: dict[str, tuple[int, int, int]]
    saved: dict[str, tuple[int, int]]  # per container: last number before / after the checkpoint

    def assert_unchanged(self, why: str) -> None:
        now = tree_snapshot(self.path)
        assert now == self.snapshot, (
            f"{why}: the checkpoint at {self.path} was modified ({describe_diff(self.snapshot, now)})"
        )


def shared_checkpoint(t: Context) -> SharedCheckpoint:
    found = t.suite.shared.get("checkpoint")
    if found is None:
        pod = shared_pod(t, "single", SINGLE)
        out = shared_context(t.suite, t.case).checkpoint_dir("shared")
        saved = checkpoint_and_measure(t, pod, out, list(pod.ids))
        found = SharedCheckpoint(pod, out, tree_snapshot(out), saved)
        t.suite.shared["checkpoint"] = found
    return found


# ---------------------------------------------------------------------------- helpers


def checkpoint_and_measure(t: Context, pod: Pod, out: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    """CheckpointPod the named containers; per container the last number printed before the call
    and right after it returned (the saved state lies in between)."""
    rt = t.runtime
    before = {n: rt.last_count(pod.log_paths[n]) or 0 for n in names}
    t.checkpoint_pod(pod, out, names)
    after = {n: rt.last_count(pod.log_paths[n]) or 0 for n in names}
    assert listing(out), f"CheckpointPod returned OK but wrote nothing into {out}"
    return {n: (before[n], after[n]) for n in names}


def restore_start_and_check(
    t: Context, source: Pod, out: Path, names: list[str], saved: dict[str, tuple[int, int]]
) -> None:
    """RestorePod into a new sandbox; the containers come back CREATED; after StartContainer each
    resumes from its saved state (not from 0); the checkpoint is not modified."""
    rt = t.runtime
    snapshot = tree_snapshot(out)
    config = t.restore_config(source.config)
    resp = t.restore_pod(out, config, [source.configs[n] for n in names])
    assert resp.pod_sandbox_id, "RestorePod returned no pod_sandbox_id"
    assert resp.pod_sandbox_id != source.id, "RestorePod must create a new sandbox"
    restored = {c.name: c.container_id for c in resp.restored_containers}
    assert sorted(restored) == sorted(names), (
        f"restored_containers names {sorted(restored)}, expected {sorted(names)}"
    )
    assert all(restored.values()), f"restored container without an id: {restored}"
    st = rt.pod_status(resp.pod_sandbox_id)
    assert st.state == cri.SANDBOX_READY, f"restored sandbox is {cri.PodSandboxState.Name(st.state)}"
    assert st.metadata.uid == config.metadata.uid, "restored sandbox does not carry the requested UID"
    listed = sorted(c.id for c in rt.containers_of(resp.pod_sandbox_id))
    assert listed == sorted(restored.values()), (
        f"containers of the restored sandbox {listed} differ from restored_containers {restored}"
    )
    for name, cid in restored.items():
        cst = rt.container_status(cid)
        assert cst.state == cri.CONTAINER_CREATED, (
            f"restored container {name} is {cri.ContainerState.Name(cst.state)}; RestorePod must return "
            "containers CREATED (the process state comes back at StartContainer)"
        )
        assert cst.metadata.name == name, f"restored container {cid[:13]} is named {cst.metadata.name!r}"
    for cid in restored.values():  # as the kubelet does, after its pre-start hooks
        rt.start_container(cid)
    for name, cid in restored.items():
        cst = rt.container_status(cid)
        assert cst.state == cri.CONTAINER_RUNNING, (
            f"restored container {name} is {cri.ContainerState.Name(cst.state)} after StartContainer "
            f"({cst.reason}: {cst.message})"
        )
        log = cst.log_path or str(Path(config.log_directory) / source.configs[name].log_path)
        first = wait_for(functools.partial(rt.counts, log), 20, f"output of restored container {name}")[0]
        before, after = saved[name]
        assert first >= before, (
            f"restored container {name} printed {first} first, but {before} was printed before the "
            "checkpoint: it did not resume from the saved state"
        )
        assert first <= after + 5, (
            f"restored container {name} printed {first} first, more than the {after} printed when "
            "CheckpointPod returned: it did not resume from this checkpoint"
        )
        rt.wait_count(log, first + 2, timeout=15)
    now = tree_snapshot(out)
    assert now == snapshot, f"RestorePod modified the checkpoint ({describe_diff(snapshot, now)})"
    t.assert_running(source)


# ---------------------------------------------------------------------------- CheckpointPod + RestorePod


@conformance_test("checkpoint_pod", CP, RP)
def test_single_container_checkpoint_restore(t: Context) -> None:
    """Checkpoint a one-container pod (it keeps running), restore it into a new sandbox (CREATED),
    start it: it resumes from the saved state."""
    shared = shared_checkpoint(t)
    t.assert_running(shared.pod)
    restore_start_and_check(t, shared.pod, shared.path, ["workload"], shared.saved)


@conformance_test("checkpoint_pod", CP, RP)
def test_multi_container_checkpoint_restore(t: Context) -> None:
    """Checkpoint a two-container pod as one cut and restore both containers."""
    pod = shared_pod(t, "pair", PAIR)
    out = t.checkpoint_dir("multi")
    saved = checkpoint_and_measure(t, pod, out, ["alpha", "beta"])
    t.assert_running(pod)
    restore_start_and_check(t, pod, out, ["alpha", "beta"], saved)


@conformance_test("checkpoint_pod", CP, RP)
def test_container_ids_subset(t: Context) -> None:
    """container_ids selects a subset: only it is captured, only it can be (and is) restored."""
    pod = shared_pod(t, "pair", PAIR)
    out = t.checkpoint_dir("subset")
    saved = checkpoint_and_measure(t, pod, out, ["alpha"])
    t.assert_running(pod)
    both = t.restore_config(pod.config)
    t.expect_error(
        (Code.INVALID_ARGUMENT,),
        lambda: t.restore_pod(out, both, [pod.configs["alpha"], pod.configs["beta"]]),
        "RestorePod with a config for beta, which was not checkpointed",
    )
    t.assert_no_sandbox(both, "after the rejected RestorePod")
    restore_start_and_check(t, pod, out, ["alpha"], saved)


@conformance_test("checkpoint_pod", CP)
def test_deadline_exceeded_leaves_pod_running(t: Context) -> None:
    """A tiny deadline gives DEADLINE_EXCEEDED; the pod is thawed and still checkpointable."""
    pod = shared_pod(t, "single", SINGLE)
    out = t.checkpoint_dir("deadline")
    t.expect_error(
        (Code.DEADLINE_EXCEEDED,),
        lambda: t.checkpoint_pod(pod, out, timeout=0.01),
        "CheckpointPod with a 10 ms deadline",
    )
    t.assert_running(pod)
    wait_for(lambda: not listing(out), 15, f"the runtime to remove partial files from {out}")
    assert out.is_dir(), f"the runtime removed the caller's directory {out}"
    again = t.checkpoint_dir("deadline-again")
    deadline = time.monotonic() + 15
    while True:  # the runtime may still be unwinding the first call
        try:
            t.checkpoint_pod(pod, again)
            break
        except grpc.RpcError as e:
            if e.code() != Code.ABORTED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert listing(again), "the checkpoint after the deadline wrote nothing"
    t.assert_running(pod)


@conformance_test("checkpoint_pod", CP)
def test_unknown_option_rejected(t: Context) -> None:
    """An unknown options key is INVALID_ARGUMENT; nothing is written, the pod keeps running."""
    shared = shared_checkpoint(t)
    out = t.checkpoint_dir("option")
    t.expect_error(
        (Code.INVALID_ARGUMENT,),
        lambda: t.checkpoint_pod(shared.pod, out, options={UNKNOWN_OPTION: "true"}),
        f"CheckpointPod with options {{{UNKNOWN_OPTION!r}: 'true'}}",
    )
    assert not listing(out), f"the rejected CheckpointPod wrote {listing(out)} into {out}"
    t.assert_running(shared.pod)


@conformance_test("checkpoint_pod", CP)
def test_unknown_sandbox_not_found(t: Context) -> None:
    """CheckpointPod of a sandbox that does not exist is NOT_FOUND and writes nothing."""
    out = t.checkpoint_dir("nopod")
    missing = f"conformance-no-such-pod-{t.runtime.run_id}"
    t.expect_error(
        (Code.NOT_FOUND,),
        lambda: t.runtime.rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=missing, output_path=str(out), container_ids=[f"{missing}-container"]
            ),
            timeout=t.rpc_timeout,
        ),
        "CheckpointPod of an unknown sandbox",
    )
    assert not listing(out), f"the rejected CheckpointPod wrote {listing(out)} into {out}"


@conformance_test("checkpoint_pod", CP)
def test_non_empty_output_path_rejected(t: Context) -> None:
    """output_path must be empty: a directory holding a caller's file is refused and left as it was."""
    shared = shared_checkpoint(t)
    out = t.checkpoint_dir("nonempty")
    mine = out / "caller-file"
    mine.write_text("the caller's data\n")
    before = tree_snapshot(out)
    t.expect_error(
        (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.ALREADY_EXISTS),
        lambda: t.checkpoint_pod(shared.pod, out),
        "CheckpointPod into a non-empty directory",
    )
    now = tree_snapshot(out)
    assert now == before, f"the rejected CheckpointPod changed {out} ({describe_diff(before, now)})"
    assert mine.read_text() == "the caller's data\n"
    t.assert_running(shared.pod)


# ---------------------------------------------------------------------------- RestorePod errors


@conformance_test("restore_pod", RP)
def test_missing_checkpoint_data(t: Context) -> None:
    """RestorePod of a nonexistent or empty directory is NOT_FOUND or INVALID_ARGUMENT; no sandbox is left."""
    empty = t.checkpoint_dir("empty")
    nowhere = empty.with_name(empty.name + "-does-not-exist")
    for path, what in ((nowhere, "a nonexistent directory"), (empty, "an empty directory")):
        config = t.runtime.pod_config(t.suite.next_name("missing-restored"))
        cc = t.runtime.container_config("workload", config)
        t.expect_error(
            (Code.NOT_FOUND, Code.INVALID_ARGUMENT),
            functools.partial(t.restore_pod, path, config, [cc]),
            f"RestorePod of {what} ({path})",
        )
        t.assert_no_sandbox(config, f"after RestorePod of {what}")
    assert empty.is_dir() and not listing(empty), f"RestorePod changed the empty directory {empty}"
    assert not nowhere.exists(), f"RestorePod created {nowhere}"


def _rejected_restore(t: Context, configs: list[cri.ContainerConfig], what: str) -> None:
    shared = shared_checkpoint(t)
    config = t.restore_config(shared.pod.config)
    t.expect_error(
        (Code.INVALID_ARGUMENT,),
        lambda: t.restore_pod(shared.path, config, configs),
        f"RestorePod with {what}",
    )
    t.assert_no_sandbox(config, f"after RestorePod with {what}")
    shared.assert_unchanged(f"RestorePod with {what}")
    t.assert_running(shared.pod)


@conformance_test("restore_pod", CP, RP)
def test_args_mismatch_rejected(t: Context) -> None:
    """A container config whose args differ from the checkpoint is INVALID_ARGUMENT."""
    shared = shared_checkpoint(t)
    cc = cri.ContainerConfig()
    cc.CopyFrom(shared.pod.configs["workload"])
    cc.args.append("--conformance-mismatch")
    _rejected_restore(t, [cc], "different args")


@conformance_test("restore_pod", CP, RP)
def test_env_mismatch_rejected(t: Context) -> None:
    """A container config whose environment differs from the checkpoint is INVALID_ARGUMENT."""
    shared = shared_checkpoint(t)
    cc = cri.ContainerConfig()
    cc.CopyFrom(shared.pod.configs["workload"])
    cc.envs.append(cri.KeyValue(key="CONFORMANCE_MISMATCH", value=b"1"))
    _rejected_restore(t, [cc], "a different environment")


@conformance_test("restore_pod", CP, RP)
def test_container_set_mismatch_rejected(t: Context) -> None:
    """container_configs must be exactly the checkpointed set: none, or an extra one, is INVALID_ARGUMENT."""
    shared = shared_checkpoint(t)
    _rejected_restore(t, [], "no container configs")
    extra = t.runtime.container_config("not-in-checkpoint", shared.pod.config)
    _rejected_restore(t, [shared.pod.configs["workload"], extra], "an extra container config")


@conformance_test("restore_pod", CP, RP)
def test_unknown_runtime_handler_rejected(t: Context) -> None:
    """RestorePod with an unknown non-empty runtime_handler is rejected; no sandbox is left."""
    shared = shared_checkpoint(t)
    config = t.restore_config(shared.pod.config)
    t.expect_error(
        (Code.INVALID_ARGUMENT, Code.NOT_FOUND),
        lambda: t.restore_pod(
            shared.path,
            config,
            [shared.pod.configs["workload"]],
            runtime_handler=NO_SUCH_HANDLER,
        ),
        f"RestorePod with runtime_handler {NO_SUCH_HANDLER!r}",
    )
    t.assert_no_sandbox(config, "after RestorePod with an unknown runtime handler")
    shared.assert_unchanged("RestorePod with an unknown runtime handler")


# ---------------------------------------------------------------------------- CheckpointContainer


CONTAINER_ARCHIVE_ENTRIES = ("spec.dump", "config.dump", "checkpoint/inventory.img")


@conformance_test("checkpoint_container", CC)
def test_checkpoint_to_file(t: Context) -> None:
    """CheckpointContainer to a file: a tar holding spec.dump, config.dump and checkpoint/inventory.img;
    the container keeps running."""
    pod = shared_pod(t, "single", SINGLE)
    d = t.checkpoint_dir("container")
    location = d / "checkpoint.tar"
    t.runtime.rt.CheckpointContainer(
        cri.CheckpointContainerRequest(
            container_id=pod.ids["workload"], location=str(location), timeout=int(t.rpc_timeout)
        ),
        timeout=t.rpc_timeout,
    )
    assert location.is_file(), f"CheckpointContainer returned OK but {location} is not a file"
    with tarfile.open(location, "r:*") as tar:
        members = {m.name.removeprefix("./").rstrip("/") for m in tar.getmembers()}
    missing = [e for e in CONTAINER_ARCHIVE_ENTRIES if e not in members]
    assert not missing, f"{location} lacks {', '.join(missing)} (has {', '.join(sorted(members)[:12])} ...)"
    t.assert_running(pod)
