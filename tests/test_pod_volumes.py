"""A pod's emptyDir volumes and its /dev/shm travel with its checkpoint, end to end.

Two containers map one POSIX shared memory file of the pod's /dev/shm and take numbers from the
counter it holds (`/sharer shmcount`: an atomic add, one sequence for both); one of them also
mounts an emptyDir holding what an init container would have rendered. CheckpointPod (STOPPED:
the source is killed frozen at the cut, so its logs end there) and RestorePod into a new pod
with fresh, empty volumes: the emptyDir comes back byte for byte (modes, a sparse file, a
symlink), and the restored containers go on taking numbers from the same mapping: every number
printed by the source and the restored pod together is 0..N once each, none lost, none repeated,
and the two restored containers still share one sequence.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.archive import crypto
from testbed import pods
from testbed.bed import TestBed

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 120
SHM_RE = re.compile(rb"shm (\d+) ")
SEGMENT = "podshim-pod-seg"


def empty_dir(bed: TestBed, uid: str, name: str) -> Path:
    return pods.empty_dir(Path(bed.base_dir) / "kubelet", uid, name)


def render_config(d: Path) -> None:
    """What an init container leaves in an emptyDir: a rendered config, a subdirectory, a sparse
    file, a symlink."""
    (d / "msg").write_text("rendered by the init container\n")
    (d / "conf.d").mkdir(mode=0o750)
    (d / "conf.d" / "app.conf").write_text("listen = 8080\n")
    (d / "conf.d" / "app.conf").chmod(0o640)
    with open(d / "sparse", "wb") as f:
        f.seek(8 << 20)
        f.write(b"end")
    os.symlink("conf.d/app.conf", d / "current")


def tree(d: Path) -> dict[str, tuple[int, int, str]]:
    """relative path -> (mode, size, content or link target)."""
    out: dict[str, tuple[int, int, str]] = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        rel = p.relative_to(d).as_posix()
        if p.is_symlink():
            out[rel] = (st.st_mode, 0, os.readlink(p))
        elif p.is_file():
            data = p.read_bytes()
            out[rel] = (st.st_mode, st.st_size, data.rstrip(b"\0").decode(errors="replace")[-40:])
        else:
            out[rel] = (st.st_mode, 0, "")
    return out


def sharer(name: str, volume: Path | None = None) -> cri.ContainerConfig:
    cc = pods.container_config(name, command=["/sharer"], args=["shmcount", SEGMENT])
    if volume is not None:
        cc.mounts.append(cri.Mount(host_path=str(volume), container_path="/config"))
    return cc


def numbers(log: Path) -> list[int]:
    return [int(m.group(1)) for m in SHM_RE.finditer(log.read_bytes())] if log.exists() else []


def test_empty_dir_and_dev_shm_travel_with_the_pod(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], runtime_handler: str, archives: list[Path]
) -> None:
    tag = f"vols-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    src_config = pods.pod_config(tag, log_root)
    src_dir = empty_dir(bed, src_config.metadata.uid, "config")
    render_config(src_dir)
    want = tree(src_dir)
    src = pods.run_pod(
        rt,
        tag,
        log_root,
        {"alpha": sharer("alpha", src_dir), "beta": sharer("beta")},
        runtime_handler=runtime_handler,
        config=src_config,
    )
    pod_cleanup.append(src.id)
    for name in ("alpha", "beta"):
        pods.wait_for(lambda n=name: len(numbers(src.log_path(n))) >= 5, what=f"{name} to take numbers")

    out = Path(bed.checkpoint_root) / tag
    out.mkdir(mode=0o700)
    archives.append(out)
    req = pods.checkpoint_request(rt, src.id, out)
    req.post_checkpoint_state = cri.POST_CHECKPOINT_STATE_STOPPED  # the source's logs end at the cut
    rt.CheckpointPod(req, timeout=RPC_TIMEOUT)
    record = json.loads((out / "sandbox" / "volumes.json").read_text())
    assert [e["name"] for e in record["empty_dirs"]] == ["config"], record
    assert record["dev_shm"] is not None and record["dev_shm"]["files"] == 1, record
    listed = json.loads((out / "manifest.json").read_text())["files"]
    assert {"sandbox/volumes.json", "sandbox/empty-dirs/config.tar", "sandbox/dev-shm.tar"} <= set(listed)
    before = numbers(src.log_path("alpha")) + numbers(src.log_path("beta"))
    pods.remove_pod(rt, src.id)

    config = pods.pod_config(f"{tag}-new", log_root)
    new_dir = empty_dir(bed, config.metadata.uid, "config")
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(out),
            config=config,
            container_configs=[sharer("alpha", new_dir), sharer("beta")],
            runtime_handler=runtime_handler,
        ),
        timeout=RPC_TIMEOUT,
    )
    pod_cleanup.append(resp.pod_sandbox_id)
    assert tree(new_dir) == want  # filled before any container existed: nothing wrote it since
    assert os.stat(new_dir / "sparse").st_blocks * 512 < 1 << 20, "the sparse file came back dense"
    for c in resp.restored_containers:
        rt.StartContainer(cri.StartContainerRequest(container_id=c.container_id), timeout=RPC_TIMEOUT)
    logs = {n: Path(config.log_directory) / n / "0.log" for n in ("alpha", "beta")}
    for name, log in logs.items():
        pods.wait_for(lambda lg=log: len(numbers(lg)) >= 10, what=f"restored {name} to take numbers")
    after = {n: numbers(log) for n, log in logs.items()}
    assert b"ready" not in logs["alpha"].read_bytes(), "alpha ran its start-up again: not restored"

    # one sequence across the cut and both containers: every number once, none lost
    taken = before + after["alpha"] + after["beta"]
    assert sorted(taken) == list(range(len(taken))), (sorted(before)[-3:], after)
    # and still one mapping after the restore: each container's numbers skip the other's
    assert set(after["alpha"]) & set(after["beta"]) == set()
    assert min(after["alpha"] + after["beta"]) == max(before) + 1


def test_a_recorded_empty_dir_the_request_does_not_mount_is_refused(
    rt: Stub, bed: TestBed, log_root: Path, pod_cleanup: list[str], archives: list[Path]
) -> None:
    """RestorePod of an archive holding an emptyDir no container config mounts (the path is
    mounted, from a directory that is no emptyDir of the new pod): FAILED_PRECONDITION naming it,
    before anything is created."""
    tag = f"vols-miss-{secrets.token_hex(2)}"
    src_config = pods.pod_config(tag, log_root)
    d = empty_dir(bed, src_config.metadata.uid, "cache")
    (d / "warm").write_text("x")
    cc = pods.container_config("app")
    cc.mounts.append(cri.Mount(host_path=str(d), container_path="/cache"))
    src = pods.run_pod(rt, tag, log_root, {"app": cc}, config=src_config)
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("app"), 3, timeout=30)
    out = Path(bed.checkpoint_root) / tag
    out.mkdir(mode=0o700)
    archives.append(out)
    rt.CheckpointPod(pods.checkpoint_request(rt, src.id, out), timeout=RPC_TIMEOUT)
    before = {s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items}
    config = pods.pod_config(f"{tag}-new", log_root)
    other = Path(bed.base_dir) / f"{tag}-not-an-empty-dir"  # /cache mounted, but from no emptyDir
    other.mkdir()
    new = pods.container_config("app")
    new.mounts.append(cri.Mount(host_path=str(other), container_path="/cache"))
    with pytest.raises(grpc.RpcError) as e:
        rt.RestorePod(
            cri.RestorePodRequest(checkpoint_path=str(out), config=config, container_configs=[new]),
            timeout=RPC_TIMEOUT,
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert "'cache'" in (e.value.details() or "") and "nothing was created" in (e.value.details() or "")
    assert {s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items} == before


def test_volumes_of_an_encrypted_checkpoint_are_ciphertext_and_restore(
    bed: TestBed, log_root: Path, archives: list[Path], tmp_path: Path
) -> None:
    """With a node key the volume tars are encrypted like every member (no plaintext of the
    emptyDir or of /dev/shm in the archive) and RestorePod decrypts them into the new pod, leaving
    no plaintext behind."""
    from tests.test_encryption_e2e import keyed_podshim

    key_file = tmp_path / "checkpoint.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    secret = b"rendered-secret-" + secrets.token_hex(8).encode()
    with keyed_podshim(bed, tmp_path, key_file) as keyed:
        rt = keyed.rt
        cleanup: list[str] = []
        try:
            tag = f"vols-enc-{secrets.token_hex(2)}"
            src_config = pods.pod_config(tag, log_root)
            src_dir = empty_dir(bed, src_config.metadata.uid, "config")
            (src_dir / "msg").write_bytes(secret)
            src = pods.run_pod(rt, tag, log_root, {"alpha": sharer("alpha", src_dir)}, config=src_config)
            cleanup.append(src.id)
            pods.wait_for(lambda: len(numbers(src.log_path("alpha"))) >= 3, what="alpha to take numbers")
            out = Path(bed.checkpoint_root) / tag
            out.mkdir(mode=0o700)
            archives.append(out)
            rt.CheckpointPod(pods.checkpoint_request(rt, src.id, out), timeout=RPC_TIMEOUT)
            for f in (out / "sandbox").rglob("*"):
                assert not f.is_file() or secret not in f.read_bytes(), f"plaintext in {f}"
            assert (out / "sandbox" / "dev-shm.tar").is_file()
            pods.remove_pod(rt, src.id)

            config = pods.pod_config(f"{tag}-new", log_root)
            new_dir = empty_dir(bed, config.metadata.uid, "config")
            resp = rt.RestorePod(
                cri.RestorePodRequest(
                    checkpoint_path=str(out), config=config, container_configs=[sharer("alpha", new_dir)]
                ),
                timeout=RPC_TIMEOUT,
            )
            cleanup.append(resp.pod_sandbox_id)
            assert (new_dir / "msg").read_bytes() == secret
            cid = resp.restored_containers[0].container_id
            rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
            log = Path(config.log_directory) / "alpha" / "0.log"
            pods.wait_for(lambda: len(numbers(log)) >= 3, what="restored alpha to take numbers")
            assert numbers(log)[0] > 0 and b"ready" not in log.read_bytes()
            left = [
                d
                for d, marker, _ in crypto.list_decrypted(keyed.state_dir)
                if (marker or {}).get("container") == "volumes"
            ]
            assert left == [], f"the volumes' plaintext outlived the restore: {left}"
        finally:
            for pod_id in cleanup:
                pods.remove_pod(rt, pod_id)
