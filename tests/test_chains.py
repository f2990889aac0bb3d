"""Chains of checkpoints and restores, end to end with runc and crun: a restored pod is
checkpointed again, and that checkpoint restored, for three generations, each restore checked to
continue the count where its checkpoint left it and to hold the counter's whole memory pattern,
and each checkpointed pod checked to keep running afterwards with no task left stopped.

The chain mixes the three restores: eager (the bed's podshim), lazy (runc only: crun has no lazy
restore, its chain restores eagerly there) and encrypted (a second podshim with a node key in front
of the same containerd, as tests/test_encryption_e2e.py runs one; its state dir lies in the bed's
checkpoint root so that the bed's podshim-runc accepts its decrypted dirs). The other links:
CheckpointContainer of a restored container and the restore of that tar; CheckpointPod of a pod
restored from a container tar; CheckpointPod of a pod restored with `start=true`.

The bug this guards against: podshim-runc's restore handed CRIU its options (`tcp-close`,
`leave-stopped`) through a file the container's `org.criu.config` named, which runc keeps with the
container and passes to every later dump: the next CheckpointPod answered OK and left every task
of the pod stopped (docs/design/checkpoint-pod.md (Task states after a checkpoint)).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import _sys, pods, resume
from testbed.bed import TestBed

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 120
MEM_MIB = 8  # small: the chain is about the links, not the size
ARGS = ["--mem-mib", str(MEM_MIB), "--interval-ms", "50"]
LAZY = {"lazy-pages": "true"}
RESUMED_METRIC = "podshim_checkpoint_tasks_resumed_total"


# ---------------------------------------------------------------------------- the keyed podshim


@dataclass
class Keyed:
    rt: Stub
    metrics_port: int

    def resumed(self) -> float:
        """podshim_checkpoint_tasks_resumed_total, all labels summed."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == RESUMED_METRIC
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def keyed(bed: TestBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    tmp = tmp_path_factory.mktemp("chain-podshim")
    key_file = tmp / "checkpoint.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    state_dir = Path(bed.checkpoint_root) / f"chain-state-{secrets.token_hex(3)}"
    port = _free_port()
    overrides = {
        "server": {"state_dir": str(state_dir), "metrics_address": f"127.0.0.1:{port}"},
        "checkpoint": {"encryption_key_file": str(key_file)},
    }
    try:
        with bed.extra_podshim(tmp, **overrides) as (sock, _log):
            channel = grpc.insecure_channel(f"unix://{sock}")
            try:
                yield Keyed(api_pb2_grpc.RuntimeServiceStub(channel), port)
            finally:
                channel.close()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


# ---------------------------------------------------------------------------- one link


@dataclass
class Running:
    """A running counter pod of the chain (its one container is `counter`)."""

    pod_id: str
    cid: str
    log: Path
    cgroup_parent: str


@dataclass
class Taken:
    path: Path
    first: int  # the count the checkpointed counter prints first after the cut (testbed/resume.py)


def log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def stopped_tasks(cgroup_parent: str) -> list[str]:
    """Tasks (threads included) of the pod's cgroup in a stopped or traced state (T, t)."""
    out = []
    for pid in _sys.cgroup_pids(cgroup_parent):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, IndexError):
                    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    state = stat.rsplit(")", 1)[1].split()[0]
                    if state in ("T", "t"):
                        out.append(f"{tid} ({state})")
    return out


def keeps_running(r: Running) -> None:
    """After its checkpoint: no task stopped, and the counter goes on counting."""
    assert stopped_tasks(r.cgroup_parent) == [], "a task of the checkpointed pod was left stopped"
    now = pods.counts(r.log)[-1]
    pods.wait_count(r.log, now + 5, timeout=20)
    assert stopped_tasks(r.cgroup_parent) == []


def checkpoint_pod(rt: Stub, bed: TestBed, r: Running, archives: list[Path], tag: str) -> Taken:
    def take() -> Path:
        out = Path(bed.checkpoint_root) / f"chain-{tag}-{secrets.token_hex(3)}"
        out.mkdir(mode=0o700)
        archives.append(out)
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=r.pod_id, container_ids=pods.running_ids(rt, r.pod_id), output_path=str(out)
            ),
            timeout=RPC_TIMEOUT,
        )
        assert (out / "manifest.json").is_file()
        return out

    out, first = resume.checkpoint_exactly(take, {"counter": r.log})
    taken = Taken(out, first["counter"])
    # the dump read podshim's own CRIU config, never the one of the restore before it (CRIU logs
    # each file it parses; an encrypted archive's log is not readable here)
    dump_log = (out / "containers" / "counter" / "dump.log").read_bytes()
    parsed = [line for line in dump_log.splitlines() if b"Parsing config file" in line]
    assert not [line for line in parsed if b"podshim-restore" in line or b"/lazy/" in line], parsed
    if '"encryption"' not in (out / "manifest.json").read_text():
        assert [line for line in parsed if b"podshim-criu-" in line], parsed  # podshim's own
    keeps_running(r)
    return taken


def restore_pod(
    rt: Stub,
    taken: Taken,
    log_root: Path,
    cleanup: list[str],
    handler: str,
    options: dict[str, str] | None = None,
) -> Running:
    """RestorePod + StartContainer (unless `start=true` did it): the count continues from the
    checkpoint and the whole memory pattern is intact."""
    config = pods.pod_config(f"chain-{secrets.token_hex(3)}", log_root)
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(taken.path),
            config=config,
            container_configs=[pods.container_config("counter", args=ARGS)],
            runtime_handler=handler,
            options=options or {},
        ),
        timeout=RPC_TIMEOUT,
    )
    cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    if (options or {}).get("start") != "true":
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    r = Running(
        resp.pod_sandbox_id, cid, Path(config.log_directory) / "counter" / "0.log", config.linux.cgroup_parent
    )
    resumes(rt, r, taken)
    return r


def resumes(rt: Stub, r: Running, taken: Taken) -> None:
    resume.assert_exact_resume({"counter": r.log}, {"counter": taken.first})
    verify_memory(rt, r)


def verify_memory(rt: Stub, r: Running) -> None:
    """SIGUSR1: the counter checks every word of its memory (a lazy restore faults it all in)."""
    seen = log_text(r.log).count("verify ")
    res = rt.ExecSync(cri.ExecSyncRequest(container_id=r.cid, cmd=["kill", "-USR1", "1"], timeout=30))
    assert res.exit_code == 0, res.stderr
    pods.wait_for(lambda: log_text(r.log).count("verify ") > seen, timeout=60, what="the verify line")
    text = log_text(r.log)
    assert f"verify ok mem_mib={MEM_MIB}" in text and "verify FAILED" not in text, text[-600:]


def start_counter(rt: Stub, log_root: Path, cleanup: list[str], handler: str) -> Running:
    src = pods.run_pod(
        rt,
        f"chain-src-{secrets.token_hex(3)}",
        log_root,
        {"counter": pods.container_config("counter", args=ARGS)},
        runtime_handler=handler,
    )
    cleanup.append(src.id)
    pods.wait_count(src.log_path("counter"), 5, timeout=30)
    return Running(src.id, src.containers["counter"], src.log_path("counter"), src.config.linux.cgroup_parent)


def drop(rt: Stub, r: Running) -> None:
    """Remove a pod of the chain once its checkpoint is taken (memory on the 2-core VM)."""
    with contextlib.suppress(Exception):
        pods.remove_pod(rt, r.pod_id)


# ---------------------------------------------------------------------------- chains


def test_three_generations(
    rt: Stub,
    bed: TestBed,
    keyed: Keyed,
    runtime_handler: str,
    log_root: Path,
    pod_cleanup: list[str],
    archives: list[Path],
) -> None:
    """run → checkpoint → [restore → checkpoint] × 3: eager, then lazy (crun: eager), then
    encrypted; every checkpoint of a restored pod leaves it running, every restore resumes."""
    resumed_before = keyed.resumed()
    src = start_counter(rt, log_root, pod_cleanup, runtime_handler)
    a0 = checkpoint_pod(rt, bed, src, archives, "g0")
    drop(rt, src)

    g1 = restore_pod(rt, a0, log_root, pod_cleanup, runtime_handler)  # eager
    a1 = checkpoint_pod(rt, bed, g1, archives, "g1")
    drop(rt, g1)

    lazy = LAZY if runtime_handler != "crun" else {}
    g2 = restore_pod(rt, a1, log_root, pod_cleanup, runtime_handler, lazy)
    a2 = checkpoint_pod(keyed.rt, bed, g2, archives, "g2")  # encrypted, by the keyed podshim
    drop(rt, g2)
    assert '"encryption"' in (a2.path / "manifest.json").read_text()

    g3 = restore_pod(keyed.rt, a2, log_root, pod_cleanup, runtime_handler)  # decrypted, eager
    a3 = checkpoint_pod(keyed.rt, bed, g3, archives, "g3")
    drop(rt, g3)
    g4 = restore_pod(keyed.rt, a3, log_root, pod_cleanup, runtime_handler, lazy)
    keeps_running(g4)
    # nothing was left stopped for podshim to repair: the cause is gone, not papered over
    assert keyed.resumed() == resumed_before


def checkpoint_container(rt: Stub, bed: TestBed, r: Running, archives: list[Path]) -> Taken:
    def take() -> Path:
        d = Path(bed.checkpoint_root) / f"chain-tar-{secrets.token_hex(3)}"
        d.mkdir(mode=0o700)
        archives.append(d)
        rt.CheckpointContainer(
            cri.CheckpointContainerRequest(container_id=r.cid, location=str(d / "counter.tar")),
            timeout=RPC_TIMEOUT,
        )
        return d / "counter.tar"

    tar, first = resume.checkpoint_exactly(take, {"counter": r.log})
    taken = Taken(tar, first["counter"])
    keeps_running(r)
    return taken


def restore_from_tar(rt: Stub, taken: Taken, log_root: Path, cleanup: list[str], handler: str) -> Running:
    """The CRI-O way: a new sandbox, CreateContainer with the tar as image, StartContainer."""
    config = pods.pod_config(f"chain-tar-{secrets.token_hex(3)}", log_root)
    pod_id = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config, runtime_handler=handler)).pod_sandbox_id
    cleanup.append(pod_id)
    cc = pods.container_config("counter", image=str(taken.path), args=[])  # args from the tar
    cid = rt.CreateContainer(
        cri.CreateContainerRequest(pod_sandbox_id=pod_id, config=cc, sandbox_config=config),
        timeout=RPC_TIMEOUT,
    ).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    r = Running(pod_id, cid, Path(config.log_directory) / cc.log_path, config.linux.cgroup_parent)
    resumes(rt, r, taken)
    return r


def test_container_checkpoint_links(
    rt: Stub,
    bed: TestBed,
    runtime_handler: str,
    log_root: Path,
    pod_cleanup: list[str],
    archives: list[Path],
) -> None:
    """A restored pod's container → CheckpointContainer → its tar restored into a new sandbox →
    CheckpointPod of that pod → RestorePod: every link resumes, every checkpointed pod runs on."""
    src = start_counter(rt, log_root, pod_cleanup, runtime_handler)
    a0 = checkpoint_pod(rt, bed, src, archives, "c0")
    drop(rt, src)
    g1 = restore_pod(rt, a0, log_root, pod_cleanup, runtime_handler)
    tar = checkpoint_container(rt, bed, g1, archives)
    drop(rt, g1)
    g2 = restore_from_tar(rt, tar, log_root, pod_cleanup, runtime_handler)
    a2 = checkpoint_pod(rt, bed, g2, archives, "c2")
    drop(rt, g2)
    g3 = restore_pod(rt, a2, log_root, pod_cleanup, runtime_handler)
    keeps_running(g3)


@pytest.mark.core  # the chain's link on every containerd of `make test` (tests/conftest.py)
def test_pod_restored_with_start_is_checkpointed_again(
    rt: Stub,
    bed: TestBed,
    runtime_handler: str,
    log_root: Path,
    pod_cleanup: list[str],
    archives: list[Path],
) -> None:
    """RestorePod start=true (the containers started by podshim) → CheckpointPod → RestorePod."""
    src = start_counter(rt, log_root, pod_cleanup, runtime_handler)
    a0 = checkpoint_pod(rt, bed, src, archives, "s0")
    drop(rt, src)
    g1 = restore_pod(rt, a0, log_root, pod_cleanup, runtime_handler, {"start": "true"})
    a1 = checkpoint_pod(rt, bed, g1, archives, "s1")
    drop(rt, g1)
    g2 = restore_pod(rt, a1, log_root, pod_cleanup, runtime_handler, {"start": "true"})
    keeps_running(g2)
