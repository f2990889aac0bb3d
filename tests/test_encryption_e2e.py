"""Encrypted pod checkpoints end to end: a podshim with a node key in front of the
session bed's containerd + runc + CRIU.

The bed's own podshim has no key, so this module starts a second podshim (as tests/test_metrics.py
does) whose config names a key file. The bed's containerd runs podshim-runc with the bed's
config, which accepts checkpoint dirs inside the bed's checkpoint root: this podshim's state dir
(and so its `decrypted/` dir) is put there. Checked: no plaintext CRIU image in the archive, the
counter resumes with its memory intact, the archive is not modified by a restore, a wrong key,
no key or a flipped byte are refused with their codes, and no plaintext is left in the decrypted
dir after a success, a failure, a deadline, or a restored container removed before it started.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from faults.helpers import HELD_DEADLINE

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.archive import crypto
from shim.deadlines import RESTORE_CLEANUP_MARGIN
from testbed import _sys, pods, resume
from testbed.bed import TestBed

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
PODSHIM = REPO / ".venv" / "bin" / "podshim"
RPC_TIMEOUT = 120
MEM_MIB = 32
ARGS = ["--mem-mib", str(MEM_MIB), "--interval-ms", "50"]
PAGES = "containers/counter/checkpoint/pages-1.img"
# holds RestorePod once a container's files are decrypted, longer than any deadline set here
HOLD_DECRYPTED = "restore.decrypted=sleep:600"
INVENTORY = "containers/counter/checkpoint/inventory.img"

Stub = api_pb2_grpc.RuntimeServiceStub


# ---------------------------------------------------------------------------- the counter's memory


def pattern(offset: int) -> int:
    """images/counter.c's pattern(): the 64-bit word at byte `offset` of its memory."""
    m = (1 << 64) - 1
    z = (offset ^ 0x706F647368696D21) & m
    z = (z + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def page_start(page: int) -> bytes:
    """The first 64 bytes of page `page` of the counter's memory, as they lie in a pages image."""
    return b"".join(pattern(page * 4096 + 8 * i).to_bytes(8, "little") for i in range(8))


NEEDLES = [page_start(p) for p in (1, 100, MEM_MIB * 256 - 1)]


# ---------------------------------------------------------------------------- the keyed podshim


def _toml(value: object) -> str:
    return json.dumps(value)  # JSON strings are valid TOML strings


@dataclass
class KeyedPodshim:
    socket: Path
    key_file: Path
    state_dir: Path
    log: Path
    rt: Stub

    @property
    def decrypted(self) -> Path:
        return self.state_dir / crypto.DECRYPTED_DIR

    def decrypted_dirs(self) -> list[str]:
        try:
            return sorted(os.listdir(self.decrypted))
        except FileNotFoundError:
            return []

    def key(self) -> bytes:
        return self.key_file.read_bytes()


@contextlib.contextmanager
def keyed_podshim(bed: TestBed, tmp: Path, key_file: Path, failpoints: str = "") -> Iterator[KeyedPodshim]:
    """A podshim with the node key `key_file` (and `failpoints`), its state dir inside the bed's
    checkpoint root: the bed's podshim-runc must accept <state_dir>/decrypted."""
    state_dir = Path(bed.checkpoint_root) / f"keyed-state-{secrets.token_hex(3)}"
    overrides = {
        "server": {"state_dir": str(state_dir)},
        "checkpoint": {"encryption_key_file": str(key_file)},
    }
    try:
        with bed.extra_podshim(tmp, failpoints, **overrides) as (sock, log):
            channel = grpc.insecure_channel(f"unix://{sock}")
            try:
                yield KeyedPodshim(sock, key_file, state_dir, log, api_pb2_grpc.RuntimeServiceStub(channel))
            finally:
                channel.close()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def keyed(bed: TestBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedPodshim]:
    tmp = tmp_path_factory.mktemp("keyed-podshim")
    key_file = tmp / "checkpoint.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    with keyed_podshim(bed, tmp, key_file) as k:
        yield k


@dataclass
class Encrypted:
    path: Path
    source: pods.Pod
    first: int  # the count the checkpointed counter prints first after the cut (testbed/resume.py)


@pytest.fixture(scope="module")
def encrypted(keyed: KeyedPodshim, bed: TestBed) -> Iterator[Encrypted]:
    """One encrypted checkpoint of a running 32 MiB counter, taken through the keyed podshim."""
    rt = keyed.rt
    log_root = Path(bed.base_dir) / "pod-logs"
    src = pods.run_pod(rt, f"enc-src-{secrets.token_hex(3)}", log_root, {"counter": counter()})
    made: list[Path] = []

    def take() -> Path:
        out = Path(bed.checkpoint_root) / f"enc-{secrets.token_hex(3)}"
        made.append(out)
        out.mkdir(mode=0o700)
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=src.id, container_ids=pods.running_ids(rt, src.id), output_path=str(out)
            ),
            timeout=RPC_TIMEOUT,
        )
        return out

    try:
        pods.wait_count(src.log_path("counter"), 10)
        out, first = resume.checkpoint_exactly(take, {"counter": src.log_path("counter")})
        yield Encrypted(out, src, first["counter"])
    finally:
        with contextlib.suppress(Exception):
            pods.remove_pod(rt, src.id)
        for out in made:
            shutil.rmtree(out, ignore_errors=True)


# ---------------------------------------------------------------------------- helpers


def counter() -> cri.ContainerConfig:
    return pods.container_config("counter", args=list(ARGS))


def restore(
    rt: Stub, path: Path, config: cri.PodSandboxConfig, timeout: float = RPC_TIMEOUT
) -> cri.RestorePodResponse:
    return rt.RestorePod(
        cri.RestorePodRequest(checkpoint_path=str(path), config=config, container_configs=[counter()]),
        timeout=timeout,
    )


def pods_named(rt: Stub, name: str) -> list[cri.PodSandbox]:
    f = cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.name": name})
    return list(rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=f)).items)


def remove_pod_cgroup(config: cri.PodSandboxConfig) -> None:
    for d in _sys.cgroup_dirs(config.linux.cgroup_parent):  # every hierarchy's, v1 or cgroup2
        with contextlib.suppress(OSError):
            d.rmdir()


def tree_fingerprint(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = Path(d, n).lstat()
            out[str(Path(d, n).relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def expect_refusal(
    rt: Stub,
    keyed: KeyedPodshim,
    log_root: Path,
    cleanup: list[str],
    path: Path,
    code: grpc.StatusCode,
    *needles: str,
    timeout: float = RPC_TIMEOUT,
) -> str:
    """RestorePod fails with `code` and a message holding every needle; no sandbox and no
    decrypted plaintext is left (the rollback may finish just after a deadline answer)."""
    name = f"enc-fail-{secrets.token_hex(3)}"
    config = pods.pod_config(name, log_root)
    try:
        with pytest.raises(grpc.RpcError) as err:
            cleanup.append(restore(rt, path, config, timeout).pod_sandbox_id)
        assert err.value.code() == code, err.value.details()
        for needle in needles:
            assert needle in err.value.details(), (needle, err.value.details())

        def clean() -> bool:
            return not pods_named(rt, name) and not keyed.decrypted_dirs()

        pods.wait_for(clean, timeout=30, what="the failed restore's rollback")
        return err.value.details()
    finally:
        cleanup.extend(p.id for p in pods_named(rt, name))
        remove_pod_cgroup(config)


def flip_byte(src: Path, rel: str, bed: TestBed, tag: str) -> Path:
    copy = Path(bed.checkpoint_root) / f"{src.name}-{tag}-{secrets.token_hex(3)}"
    shutil.copytree(src, copy)
    p = copy / rel
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(bytes(raw))
    return copy


# ---------------------------------------------------------------------------- tests


def test_archive_holds_no_plaintext(encrypted: Encrypted, keyed: KeyedPodshim) -> None:
    import pycriu

    d = encrypted.path
    doc = json.loads((d / "manifest.json").read_text())
    key_id = hashlib.sha256(keyed.key()).hexdigest()[:16]
    assert doc["encryption"]["scheme"] == crypto.SCHEME
    assert doc["encryption"]["key_id"] == key_id
    assert len(doc["encryption"]["mac"]) == 64
    assert doc["timings"]["encrypt"] > 0
    # the encryption is part of the archive step, after the thaw (not in the freeze window)
    assert doc["timings"]["archive"] >= doc["timings"]["encrypt"]
    assert set(doc["files"]) >= {PAGES, INVENTORY, "containers/counter/config.dump", "sandbox/config.json"}
    for rel, entry in doc["files"].items():
        raw = (d / rel).read_bytes()
        assert raw.startswith(crypto.MAGIC), f"{rel} is not encrypted"
        assert entry["size"] == len(raw) and entry["sha256"] == hashlib.sha256(raw).hexdigest()

    key = crypto.NodeKey(keyed.key())
    # the memory pattern of the counter is nowhere in the pages image, but in its plaintext
    pages = (d / PAGES).read_bytes()
    plain_pages = crypto.decrypt_bytes(d / PAGES, PAGES, key, limit=1 << 30)
    assert len(plain_pages) >= MEM_MIB << 20
    for needle in NEEDLES:
        assert needle in plain_pages  # the control: the pattern is what the image holds
        assert needle not in pages
    # CRIU cannot read the encrypted inventory; its plaintext is a CRIU inventory
    with pytest.raises(Exception):  # noqa: B017 - pycriu raises its own magic error types
        with open(d / INVENTORY, "rb") as f:
            pycriu.images.load(f)
    import io

    inventory = pycriu.images.load(io.BytesIO(crypto.decrypt_bytes(d / INVENTORY, INVENTORY, key)))
    assert inventory["magic"] == "INVENTORY"
    # the container's environment (config.dump) is not readable either
    assert b'"config"' not in (d / "containers/counter/config.dump").read_bytes()


def test_restore_resumes_and_leaves_no_plaintext(
    encrypted: Encrypted, keyed: KeyedPodshim, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    rt = keyed.rt
    before = tree_fingerprint(encrypted.path)

    # 1. restored, never started, removed: its decrypted dir waits for the container to go
    first_cfg = pods.pod_config(f"enc-unstarted-{secrets.token_hex(3)}", log_root)
    first = restore(rt, encrypted.path, first_cfg)
    pod_cleanup.append(first.pod_sandbox_id)
    [left] = keyed.decrypted_dirs()
    marker = json.loads((keyed.decrypted / left / crypto.DECRYPTED_MARKER).read_text())
    assert marker["container_id"] == first.restored_containers[0].container_id
    assert marker["archive"] == str(encrypted.path)
    assert (keyed.decrypted / left / "checkpoint" / "inventory.img").is_file()
    pods.remove_pod(rt, first.pod_sandbox_id)
    remove_pod_cgroup(first_cfg)

    # 2. the next restore sweeps it; StartContainer restores from the plaintext and removes it
    config = pods.pod_config(f"enc-restored-{secrets.token_hex(3)}", log_root)
    resp = restore(rt, encrypted.path, config)
    pod_cleanup.append(resp.pod_sandbox_id)
    assert left not in keyed.decrypted_dirs(), "the removed container's plaintext was not swept"
    assert len(keyed.decrypted_dirs()) == 1
    cid = resp.restored_containers[0].container_id
    assert (
        rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state == cri.CONTAINER_CREATED
    )
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    assert keyed.decrypted_dirs() == [], "plaintext images left after the restore"

    new_log = Path(config.log_directory) / "counter" / "0.log"
    resume.assert_exact_resume({"counter": new_log}, {"counter": encrypted.first}, follow=5)
    r = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["kill", "-USR1", "1"], timeout=10))
    assert r.exit_code == 0, r.stderr
    pods.wait_for(lambda: b"verify " in new_log.read_bytes(), what="the verify line")
    assert f"verify ok mem_mib={MEM_MIB}".encode() in new_log.read_bytes()
    assert b"ready mem_mib" not in new_log.read_bytes(), "the restored process started over"

    assert tree_fingerprint(encrypted.path) == before, "the restore modified the archive"


def test_wrong_key_is_data_loss(
    encrypted: Encrypted, keyed: KeyedPodshim, log_root: Path, pod_cleanup: list[str]
) -> None:
    good = keyed.key()
    keyed.key_file.write_bytes(os.urandom(32))  # podshim reads the key file at each operation
    try:
        msg = expect_refusal(
            keyed.rt, keyed, log_root, pod_cleanup, encrypted.path, grpc.StatusCode.DATA_LOSS, "wrong key"
        )
        assert hashlib.sha256(good).hexdigest()[:16] in msg
    finally:
        keyed.key_file.write_bytes(good)


def test_no_key_is_failed_precondition(
    encrypted: Encrypted, keyed: KeyedPodshim, rt: Stub, log_root: Path, pod_cleanup: list[str]
) -> None:
    """The bed's own podshim has no key configured."""
    expect_refusal(
        rt,
        keyed,
        log_root,
        pod_cleanup,
        encrypted.path,
        grpc.StatusCode.FAILED_PRECONDITION,
        "is encrypted",
        "encryption_key_file",
    )


@pytest.mark.parametrize("rel", [PAGES, INVENTORY, "containers/counter/config.dump"])
def test_flipped_byte_is_data_loss(
    rel: str, encrypted: Encrypted, keyed: KeyedPodshim, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    copy = flip_byte(encrypted.path, rel, bed, "flip")
    try:
        expect_refusal(keyed.rt, keyed, log_root, pod_cleanup, copy, grpc.StatusCode.DATA_LOSS, rel)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_tampered_manifest_is_data_loss(
    encrypted: Encrypted, keyed: KeyedPodshim, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    """A flipped byte whose new sha256 is written into the manifest: the manifest's MAC fails."""
    copy = flip_byte(encrypted.path, PAGES, bed, "mac")
    try:
        doc = json.loads((copy / "manifest.json").read_text())
        doc["files"][PAGES]["sha256"] = hashlib.sha256((copy / PAGES).read_bytes()).hexdigest()
        (copy / "manifest.json").write_text(json.dumps(doc, indent=1))
        expect_refusal(
            keyed.rt, keyed, log_root, pod_cleanup, copy, grpc.StatusCode.DATA_LOSS, "MAC does not match"
        )
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_deadline_during_decryption_leaves_no_plaintext(
    encrypted: Encrypted,
    keyed: KeyedPodshim,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    tmp_path: Path,
) -> None:
    """The deadline runs out while the decrypted plaintext is on disk: a podshim with the same key
    holds the restore once a container's files are decrypted (`restore.decrypted`) longer than the
    deadline, whatever this machine's speed. DEADLINE_EXCEEDED; the plaintext and the new sandbox
    are removed."""
    name = f"enc-deadline-{secrets.token_hex(3)}"
    config = pods.pod_config(name, log_root)
    request = cri.RestorePodRequest(
        checkpoint_path=str(encrypted.path), config=config, container_configs=[counter()]
    )
    with keyed_podshim(bed, tmp_path, keyed.key_file, HOLD_DECRYPTED) as held:
        try:
            call = held.rt.RestorePod.future(request, timeout=RESTORE_CLEANUP_MARGIN + HELD_DEADLINE)
            pods.wait_for(lambda: held.decrypted_dirs() or call.done(), timeout=60, what="the plaintext")
            assert held.decrypted_dirs(), f"no plaintext before the call ended: {call.exception()}"
            with pytest.raises(grpc.RpcError) as err:
                call.result()
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
            assert "did not finish within the caller's deadline" in (err.value.details() or "")
            pods.wait_for(
                lambda: not pods_named(held.rt, name) and not held.decrypted_dirs(),
                timeout=30,
                what="the rollback after the deadline",
            )
        finally:
            pod_cleanup.extend(p.id for p in pods_named(keyed.rt, name))
            remove_pod_cgroup(config)
