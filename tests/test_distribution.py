"""Checkpoints that travel: a pod checkpoint pushed to a real OCI registry (Debian's
docker-registry, basic auth, on a loopback port: testbed/registry.py), pulled on another node
(a second TestBed: its own containerd + podshim and roots) and restored there; hostile pulls
refused with the documented code and nothing left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim.archive import compat
from shim.archive import manifest as mf
from shim.distribution import artifact, pull, push
from shim.distribution.registry_auth import client_for
from shim.errors import DataLoss, InvalidArgument, NotFound, Unavailable
from testbed import pods
from testbed.bed import VENV_BIN, TestBed
from testbed.registry import Registry, registry_available
from testbed.versions import CRIU
from tests.test_compat import foreign_cpu
from tests.test_restore_pod import SMALL_ARGS, Checkpoint, assert_resumed, counter_config, take_checkpoint

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 120
PODSHIM = str(VENV_BIN / "podshim")


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    if not registry_available():
        pytest.fail("docker-registry / htpasswd missing: scripts/setup.sh installs them")
    with Registry(tmp_path_factory.mktemp("registry")) as reg:
        old = os.environ.get("PODSHIM_REGISTRY_AUTH")
        os.environ.update(reg.auth_env())  # the library reads the credentials from the environment
        try:
            yield reg
        finally:
            if old is None:
                os.environ.pop("PODSHIM_REGISTRY_AUTH", None)
            else:
                os.environ["PODSHIM_REGISTRY_AUTH"] = old


@pytest.fixture(scope="module")
def node_b() -> Iterator[TestBed]:
    """The second node: its own containerd + podshim, roots, bridge and cgroups."""
    with TestBed() as b:
        yield b


@pytest.fixture(scope="module")
def rt_b(node_b: TestBed) -> Stub:
    return pods.stubs(node_b.podshim_socket)[0]


@pytest.fixture(scope="module")
def source(rt: Stub, bed: TestBed) -> Iterator[Checkpoint]:
    """A running 4 MiB counter on node A and its CheckpointPod archive."""
    created: list[str] = []
    try:
        yield take_checkpoint(
            rt,
            bed,
            Path(bed.base_dir) / "pod-logs",
            f"travel-{secrets.token_hex(2)}",
            {"counter": counter_config("counter", SMALL_ARGS)},
            created,
        )
    finally:
        for pod_id in created:
            with contextlib.suppress(Exception):
                pods.remove_pod(rt, pod_id)


@pytest.fixture(scope="module")
def pushed(source: Checkpoint, registry: Registry) -> push.PushResult:
    return push.push(source.path, registry.ref("pods/travel", "plain"))


@pytest.fixture
def cleanup_b(rt_b: Stub) -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for pod_id in ids:
        with contextlib.suppress(Exception):
            pods.remove_pod(rt_b, pod_id)


# ---------------------------------------------------------------------------- helpers


def target(node: TestBed, tag: str) -> Path:
    d = Path(node.checkpoint_root) / f"pulled-{tag}-{secrets.token_hex(3)}"
    d.mkdir(mode=0o700)
    return d


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PODSHIM, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def restore_and_start(rt_b: Stub, node_b: TestBed, path: Path, cleanup: list[str], name: str) -> Path:
    """RestorePod of `path` on node B with a kubelet-like config, StartContainer; returns the
    restored counter's log."""
    config = pods.pod_config(name, Path(node_b.base_dir) / "pod-logs")
    resp = rt_b.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(path),
            config=config,
            container_configs=[counter_config("counter", SMALL_ARGS)],
        ),
        timeout=RPC_TIMEOUT,
    )
    cleanup.append(resp.pod_sandbox_id)
    for c in resp.restored_containers:
        rt_b.StartContainer(cri.StartContainerRequest(container_id=c.container_id), timeout=RPC_TIMEOUT)
    return Path(config.log_directory) / "counter" / "0.log"


def assert_empty(d: Path) -> None:
    assert sorted(os.listdir(d)) == [], f"the failed pull left {sorted(os.listdir(d))} in {d}"


def put_artifact(
    reg: Registry,
    ref: str,
    config: bytes,
    layers: list[tuple[str, bytes, int | None]],
    media_type: str = artifact.LAYER_MEDIA_TYPE,
) -> None:
    """A hand-made artifact: `layers` are (title, blob, announced size or None for the real one);
    a title with a `.img` suffix is a file layer (artifact.FILE_MEDIA_TYPE)."""
    client = client_for(ref)
    descs = []
    for title, blob, announced in layers:
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        push._upload(client, blob, digest)
        size = len(blob) if announced is None else announced
        kind = artifact.FILE_MEDIA_TYPE if title.endswith(".img") else media_type
        descs.append(artifact.descriptor(kind, digest, size, {artifact.TITLE: title}))
    cdigest = "sha256:" + hashlib.sha256(config).hexdigest()
    push._upload(client, config, cdigest)
    doc = artifact.oci_manifest(
        artifact.descriptor(artifact.CONFIG_MEDIA_TYPE, cdigest, len(config)), descs, {}
    )
    client.check(
        client.do_request(
            client.url(client.ref.container.manifest_url()),
            "PUT",
            data=json.dumps(doc).encode(),
            headers={"Content-Type": artifact.OCI_MANIFEST},
        ),
        "putting a test manifest",
    )


def layer_tar(archive: Path, title: str, extra: list[tarfile.TarInfo] | None = None) -> bytes:
    """The tar of `archive`'s subtree `title` (as push makes it), plus `extra` members."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for ti in extra or []:
            t.addfile(ti, io.BytesIO(b"x" * ti.size) if ti.isreg() else None)
        for p in sorted((archive / title).rglob("*")):
            t.add(p, arcname=str(p.relative_to(archive)), recursive=False)
    return out.getvalue()


# ---------------------------------------------------------------------------- the journey


def test_checkpoint_on_a_push_pull_restore_on_b_resumes(
    source: Checkpoint,
    pushed: push.PushResult,
    registry: Registry,
    node_b: TestBed,
    rt_b: Stub,
    cleanup_b: list[str],
) -> None:
    """The counter checkpointed on node A continues on node B from its checkpointed count."""
    m = mf.read_manifest(source.path)
    ann = pushed.manifest["annotations"]
    assert ann["org.criu.checkpoint.pod.name"] == m.sandbox.metadata["name"]
    assert ann["io.podshim.checkpoint.containers"] == "counter"
    assert ann["org.criu.checkpoint.criu.version"] == m.host.criu_version
    titles = [x["annotations"][artifact.TITLE] for x in pushed.manifest["layers"]]
    big = sorted(rel for rel, fe in m.files.items() if fe.size >= artifact.RAW_FILE_MIN)
    assert big and all("/pages-" in rel for rel in big)  # the memory images
    assert titles == ["sandbox", "containers/counter", *big]  # each a raw file layer
    for d in pushed.manifest["layers"][2:]:  # its digest is the file's sha256 in manifest.json
        rel = d["annotations"][artifact.TITLE]
        assert d["mediaType"] == artifact.FILE_MEDIA_TYPE
        assert (d["digest"], d["size"]) == ("sha256:" + m.files[rel].sha256, m.files[rel].size)
    dest = target(node_b, "journey")
    result = pull.pull(
        registry.ref("pods/travel", "plain"), dest, allowed_roots=[str(node_b.checkpoint_root)]
    )
    assert result.digest == pushed.digest
    assert (dest / "manifest.json").read_bytes() == (source.path / "manifest.json").read_bytes()
    log = restore_and_start(rt_b, node_b, dest, cleanup_b, f"arrived-{secrets.token_hex(2)}")
    first = assert_resumed(log, source, "counter")
    pods.wait_count(log, first + 3)  # and keeps counting on B


def test_cli_push_zstd_then_restorepod_from_on_b(
    source: Checkpoint, registry: Registry, node_b: TestBed, rt_b: Stub, cleanup_b: list[str]
) -> None:
    """`podshim push --compression zstd` then `podshim restorepod --from REF --start` on node B."""
    ref = registry.ref("pods/travel", "zstd")
    res = cli("push", str(source.path), ref, "--compression", "zstd", "-o", "json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["digest"].startswith("sha256:") and out["storedBytes"] < out["bytes"]
    assert registry.password not in res.stdout + res.stderr  # credentials never printed
    config = pods.pod_config(f"from-{secrets.token_hex(2)}", Path(node_b.base_dir) / "pod-logs")
    cfg_file = Path(node_b.base_dir) / f"pod-{secrets.token_hex(3)}.json"
    from google.protobuf import json_format

    cfg_file.write_text(json_format.MessageToJson(config))
    res = cli(
        "restorepod",
        "--from",
        ref,
        "--config",
        str(cfg_file),
        "--start",
        "-o",
        "json",
        "-r",
        f"unix://{node_b.podshim_socket}",
        "--podshim-config",
        str(node_b.podshim_config),
    )
    assert res.returncode == 0, res.stderr
    resp = json.loads(res.stdout)
    cleanup_b.append(resp["podSandboxId"])
    assert_resumed(Path(config.log_directory) / "counter" / "0.log", source, "counter")


def test_wrong_credentials_are_refused_without_showing_them(source: Checkpoint, registry: Registry) -> None:
    res = cli(
        "push",
        str(source.path),
        registry.ref("pods/travel", "nope"),
        env={"PODSHIM_REGISTRY_AUTH": "podshim:wrong-secret"},
    )
    assert res.returncode == 1
    assert "FAILED_PRECONDITION" in res.stderr and "PODSHIM_REGISTRY_AUTH" in res.stderr, res.stderr
    assert "wrong-secret" not in res.stderr and "Traceback" not in res.stderr


def test_docker_config_file_credentials(source: Checkpoint, registry: Registry, tmp_path: Path) -> None:
    import base64

    cfg = tmp_path / "config.json"
    token = base64.b64encode(f"{registry.user}:{registry.password}".encode()).decode()
    cfg.write_text(json.dumps({"auths": {registry.host: {"auth": token}}}))
    env = {k: v for k, v in os.environ.items() if k != "PODSHIM_REGISTRY_AUTH"}
    res = subprocess.run(
        [
            PODSHIM,
            "push",
            str(source.path),
            registry.ref("pods/travel", "cfg"),
            "--registry-config",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------------------- encrypted


@pytest.fixture(scope="module")
def keyed_nodes(
    bed: TestBed, node_b: TestBed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stub, Stub]]:
    """A keyed podshim on each node, the same node key file (copied to B as an operator would)."""
    tmp = tmp_path_factory.mktemp("keyed-nodes")
    key = os.urandom(32)
    stubs = []
    with contextlib.ExitStack() as stack:
        for node, name in ((bed, "a"), (node_b, "b")):
            key_file = tmp / f"key-{name}"
            key_file.write_bytes(key)
            key_file.chmod(0o600)
            work = tmp / name
            work.mkdir()
            state = Path(node.checkpoint_root) / f"keyed-state-{secrets.token_hex(3)}"
            stack.callback(shutil.rmtree, state, True)
            sock, _log = stack.enter_context(
                node.extra_podshim(
                    work, server={"state_dir": str(state)}, checkpoint={"encryption_key_file": str(key_file)}
                )
            )
            channel = grpc.insecure_channel(f"unix://{sock}")
            stack.callback(channel.close)
            stubs.append(api_pb2_grpc.RuntimeServiceStub(channel))
        yield stubs[0], stubs[1]


def test_encrypted_checkpoint_travels_encrypted_and_restores_with_the_key_on_b(
    bed: TestBed, node_b: TestBed, registry: Registry, keyed_nodes: tuple[Stub, Stub], cleanup_b: list[str]
) -> None:
    rt_a, rt_kb = keyed_nodes
    created: list[str] = []
    try:
        ckpt = take_checkpoint(
            rt_a,
            bed,
            Path(bed.base_dir) / "pod-logs",
            f"enc-travel-{secrets.token_hex(2)}",
            {"counter": counter_config("counter", SMALL_ARGS)},
            created,
        )
        m = mf.read_manifest(ckpt.path)
        assert m.encryption is not None
        ref = registry.ref("pods/encrypted", "v1")
        result = push.push(ckpt.path, ref)
        assert (
            result.manifest["annotations"]["io.podshim.checkpoint.encryption.key-id"] == m.encryption.key_id
        )
        # in the registry the memory images are ciphertext (podshim's header), never plaintext
        layer = next(x for x in result.layers if x.title.endswith("/pages-1.img"))  # a file layer
        data = registry.blob_path(layer.digest).read_bytes()
        assert data.startswith(b"PSHIMENC"), data[:16]
        dest = target(node_b, "enc")
        pull.pull(ref, dest, allowed_roots=[str(node_b.checkpoint_root)])
        log = restore_and_start(rt_kb, node_b, dest, cleanup_b, f"enc-arrived-{secrets.token_hex(2)}")
        assert_resumed(log, ckpt, "counter")
    finally:
        for pod_id in created:
            with contextlib.suppress(Exception):
                pods.remove_pod(rt_a, pod_id)


# ---------------------------------------------------------------------------- hostile or broken pulls


def test_pull_killed_midway_leaves_nothing_complete(
    pushed: push.PushResult, registry: Registry, node_b: TestBed, rt_b: Stub
) -> None:
    """The pulling process SIGKILLed while the counter's layer streams in: no manifest.json (RestorePod
    says NOT_FOUND), only the staging dir; the next pull into the same dir clears it and succeeds."""
    dest = target(node_b, "killed")
    ref = registry.ref("pods/travel", "plain")
    res = cli(
        "pull",
        ref,
        str(dest),
        "--podshim-config",
        str(node_b.podshim_config),
        env={"PODSHIM_FAILPOINTS": "pull.chunk=kill@8"},
    )
    assert res.returncode == -9, (res.returncode, res.stderr)
    left = os.listdir(dest)
    assert "manifest.json" not in left and all(n.startswith(pull.STAGING_PREFIX) for n in left), left
    with pytest.raises(grpc.RpcError) as err:
        rt_b.RestorePod(
            cri.RestorePodRequest(
                checkpoint_path=str(dest),
                config=pods.pod_config("never", Path(node_b.base_dir) / "pod-logs"),
                container_configs=[counter_config("counter", SMALL_ARGS)],
            ),
            timeout=RPC_TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
    res = cli("pull", ref, str(dest), "--podshim-config", str(node_b.podshim_config))
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(dest)) == ["containers", "manifest.json", "sandbox"]


def synthetic_archive(root: Path, mib: int) -> Path:
    """A complete archive (manifest and checksums) of `mib` MiB of random bytes: enough to pull,
    not to restore."""
    root.mkdir(mode=0o700)
    (root / "sandbox").mkdir(mode=0o700)
    (root / "containers/app/checkpoint").mkdir(mode=0o700, parents=True)
    (root / "sandbox/config.json").write_text("{}")
    with open(root / "containers/app/checkpoint/pages-1.img", "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    m = mf.Manifest(
        sandbox=mf.SandboxInfo(id="synthetic", metadata={"name": "synthetic"}, config={}),
        containers=[mf.ContainerEntry("app", "cid", "img", "CONTAINER_RUNNING", 0, True, "containers/app")],
    )
    mf.write_manifest(root, m)
    return root


def test_registry_dying_midway_is_unavailable_and_leaves_nothing(node_b: TestBed, tmp_path: Path) -> None:
    """The registry SIGKILLed once the first MiB of a 96 MiB layer arrived (more than socket buffers
    hold): UNAVAILABLE, the target left empty."""
    archive = synthetic_archive(tmp_path / "synthetic", 96)
    with Registry(tmp_path) as reg:
        env = dict(os.environ)
        os.environ.update(reg.auth_env())
        try:
            ref = reg.ref("pods/dying", "v1")
            push.push(archive, ref)
            dest = target(node_b, "dying")

            def kill_at_half(done: int, total: int) -> None:
                if done > (1 << 20) and reg.running():
                    os.kill(reg.pid, 9)  # type: ignore[arg-type]

            with pytest.raises(Unavailable, match="broke off|unreachable"):
                pull.pull(ref, dest, allowed_roots=[str(node_b.checkpoint_root)], progress=kill_at_half)
            assert_empty(dest)
        finally:
            os.environ.clear()
            os.environ.update(env)


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_artifact_of_the_older_format_still_pulls(
    source: Checkpoint, registry: Registry, node_b: TestBed
) -> None:
    """Before file layers every file travelled in its unit's tar (memory images included)."""
    ref = registry.ref("pods/older", "v1")
    put_artifact(
        registry,
        ref,
        (source.path / "manifest.json").read_bytes(),
        [(title, layer_tar(source.path, title), None) for title in ("sandbox", "containers/counter")],
    )
    dest = target(node_b, "older")
    pull.pull(ref, dest, allowed_roots=[str(node_b.checkpoint_root)])
    assert files_of(dest) == files_of(source.path)
    mf.verify_files(dest, mf.read_manifest(dest))


def test_a_file_layer_not_the_manifests_is_refused_before_fetching(
    source: Checkpoint, registry: Registry, node_b: TestBed
) -> None:
    """A file layer whose digest is not the manifest's sha256 of that file (another file of the
    same size): DATA_LOSS before a byte of it is fetched."""
    m = mf.read_manifest(source.path)
    rel = max(m.files, key=lambda r: m.files[r].size)
    ref = registry.ref("pods/swapped", "v1")
    put_artifact(
        registry,
        ref,
        (source.path / "manifest.json").read_bytes(),
        [
            ("sandbox", layer_tar(source.path, "sandbox"), None),
            ("containers/counter", layer_tar(source.path, "containers/counter"), None),
            (rel, os.urandom(m.files[rel].size), None),
        ],
    )
    dest = target(node_b, "swapped")
    with pytest.raises(DataLoss, match="refused before fetching"):
        pull.pull(ref, dest, allowed_roots=[str(node_b.checkpoint_root)])
    assert_empty(dest)


def test_push_refuses_a_file_whose_bytes_are_not_the_manifests(
    source: Checkpoint, registry: Registry, tmp_path: Path
) -> None:
    """A memory image changed after the checkpoint (same size): the registry refuses its bytes for
    the manifest's digest, push answers DATA_LOSS and no tag names the artifact."""
    copy = tmp_path / "altered"
    shutil.copytree(source.path, copy)
    m = mf.read_manifest(copy)
    rel = max(m.files, key=lambda r: m.files[r].size)
    data = bytearray((copy / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / rel).write_bytes(bytes(data))
    ref = registry.ref("pods/altered", "v1")
    with pytest.raises(DataLoss, match=f"{rel}.*sha256 manifest.json records"):
        push.push(copy, ref)
    (tmp_path / "never").mkdir()
    with pytest.raises(NotFound):
        pull.pull(ref, tmp_path / "never", allowed_roots=[str(tmp_path)])


@pytest.mark.parametrize("kind", ["tar", "file"])
def test_tampered_layer_is_data_loss_and_leaves_nothing(
    kind: str, pushed: push.PushResult, registry: Registry, node_b: TestBed
) -> None:
    """A flipped byte in the middle of a unit's tar or of a file layer (the memory image)."""
    layer = (
        next(x for x in pushed.layers if x.title == "containers/counter")
        if kind == "tar"
        else pushed.layers[-1]
    )
    assert kind == "tar" or "/pages-" in layer.title
    blob = registry.blob_path(layer.digest)
    original = blob.read_bytes()
    at = len(original) // 2
    blob.write_bytes(original[:at] + bytes([original[at] ^ 0xFF]) + original[at + 1 :])
    try:
        dest = target(node_b, "tampered")
        with pytest.raises(DataLoss, match="tampered"):
            pull.pull(registry.ref("pods/travel", "plain"), dest, allowed_roots=[str(node_b.checkpoint_root)])
        assert_empty(dest)
    finally:
        blob.write_bytes(original)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "other-layer", "dir-clash"])
def test_escaping_layer_is_refused_and_writes_nothing_outside(
    kind: str, source: Checkpoint, registry: Registry, node_b: TestBed
) -> None:
    outside = Path(node_b.checkpoint_root) / f"escaped-{secrets.token_hex(3)}"
    ti = tarfile.TarInfo(
        {
            "dotdot": f"sandbox/../../{outside.name}",
            "absolute": str(outside),
            "symlink": "sandbox/link",
            "other-layer": "containers/counter/planted",
            "dir-clash": "sandbox/config.json",  # a directory where the manifest has a file
        }[kind]
    )
    if kind == "symlink":
        ti.type, ti.linkname = tarfile.SYMTYPE, str(outside)
    elif kind == "dir-clash":
        ti.type = tarfile.DIRTYPE
    else:
        ti.size = 4
    ref = registry.ref("pods/escape", kind)
    put_artifact(
        registry,
        ref,
        (source.path / "manifest.json").read_bytes(),
        [
            ("sandbox", layer_tar(source.path, "sandbox", [ti]), None),
            ("containers/counter", layer_tar(source.path, "containers/counter"), None),
        ],
    )
    dest = target(node_b, f"escape-{kind}")
    with pytest.raises(InvalidArgument, match="refused|escapes|absolute"):
        pull.pull(ref, dest, allowed_roots=[str(node_b.checkpoint_root)])
    assert_empty(dest)
    assert not outside.exists() and not os.path.lexists(outside)


def test_layer_larger_than_announced_is_refused_at_once(
    source: Checkpoint, registry: Registry, node_b: TestBed
) -> None:
    """The counter's layer announces 4 KiB but the registry serves all of it: refused as soon as the
    5th KiB arrives (the fetched count stays near the announcement)."""
    ref = registry.ref("pods/liar", "small")
    put_artifact(
        registry,
        ref,
        (source.path / "manifest.json").read_bytes(),
        [
            ("sandbox", layer_tar(source.path, "sandbox"), None),
            ("containers/counter", layer_tar(source.path, "containers/counter"), 4096),
        ],
    )
    dest = target(node_b, "liar")
    seen: list[int] = []
    with pytest.raises(DataLoss, match="larger than the 4096 bytes"):
        pull.pull(
            ref,
            dest,
            allowed_roots=[str(node_b.checkpoint_root)],
            progress=lambda done, total: seen.append(done),
        )
    assert_empty(dest)
    assert max(seen) < total_sandbox(source) + 4096 + (2 << 20)  # stopped within a chunk of the lie


def total_sandbox(source: Checkpoint) -> int:
    return len(layer_tar(source.path, "sandbox")) + (source.path / "manifest.json").stat().st_size


def test_layer_announcing_more_than_its_files_is_refused_before_fetching(
    source: Checkpoint, registry: Registry, node_b: TestBed
) -> None:
    ref = registry.ref("pods/liar", "huge")
    put_artifact(
        registry,
        ref,
        (source.path / "manifest.json").read_bytes(),
        [
            ("sandbox", layer_tar(source.path, "sandbox"), None),
            ("containers/counter", layer_tar(source.path, "containers/counter"), 50 << 30),
        ],
    )
    dest = target(node_b, "huge")
    fetched: list[int] = []
    with pytest.raises(DataLoss, match="refused before fetching"):
        pull.pull(
            ref, dest, allowed_roots=[str(node_b.checkpoint_root)], progress=lambda d, t: fetched.append(d)
        )
    assert_empty(dest)
    assert max(fetched, default=0) <= (source.path / "manifest.json").stat().st_size  # only the config


def test_pull_outside_the_allowed_roots_is_invalid_argument(
    registry: Registry, node_b: TestBed, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgument, match="outside the allowed checkpoint roots"):
        pull.pull(registry.ref("pods/travel", "plain"), tmp_path, allowed_roots=[str(node_b.checkpoint_root)])
    with pytest.raises(NotFound):
        pull.pull(
            registry.ref("pods/absent", "v1"),
            target(node_b, "absent"),
            allowed_roots=[str(node_b.checkpoint_root)],
        )


# ---------------------------------------------------------------------- another node, or a clear refusal


def test_incompatible_node_is_refused_naming_each_mismatch(
    source: Checkpoint, registry: Registry, node_b: TestBed, rt_b: Stub, tmp_path: Path
) -> None:
    """An archive recorded on a newer kernel, a CPU with an xsave state component node B's lacks
    (derived from node B's own CPU, whatever it is: tests/test_compat.py foreign_cpu), the other
    cgroup version, and a container image id node B does not have (a plain archive: its manifest
    is not authenticated, so the edit keeps the checksums right): `restorepod --from` answers
    FAILED_PRECONDITION naming all four, creates no sandbox and removes what it pulled."""
    m = mf.read_manifest(source.path)
    assert m.host.cpuinfo and m.host.cgroup_version in ("1", "2")  # recorded at checkpoint time
    edited = tmp_path / "edited"
    shutil.copytree(source.path, edited)
    dump = edited / "containers/counter/config.dump"
    record = json.loads(dump.read_text())
    other_image = "sha256:" + "0" * 64  # recorded as the image's ID (docs/design/archive.md (Image identity))
    record["image_ref"] = record["image_id"] = other_image
    dump.write_text(json.dumps(record))
    doc = json.loads((edited / "manifest.json").read_text())
    doc["containers"][0]["image_id"] = other_image
    doc["files"]["containers/counter/config.dump"] = {
        "size": dump.stat().st_size,
        "sha256": hashlib.sha256(dump.read_bytes()).hexdigest(),
    }
    cpu, bit = foreign_cpu(doc["host"]["cpuinfo"], compat.cpuinfo(CRIU))
    doc["host"].update(
        kernel="99.1.0",
        cpuinfo=cpu,
        cgroup_version="2" if doc["host"]["cgroup_version"] == "1" else "1",
    )
    (edited / "manifest.json").write_text(json.dumps(doc))
    ref = registry.ref("pods/elsewhere", "v1")
    push.push(edited, ref)
    name = f"refused-{secrets.token_hex(2)}"
    config = pods.pod_config(name, Path(node_b.base_dir) / "pod-logs")
    cfg_file = tmp_path / "pod.json"
    from google.protobuf import json_format

    cfg_file.write_text(json_format.MessageToJson(config))
    before = set(os.listdir(node_b.checkpoint_root))
    res = cli(
        "restorepod",
        "--from",
        ref,
        "--config",
        str(cfg_file),
        "-r",
        f"unix://{node_b.podshim_socket}",
        "--podshim-config",
        str(node_b.podshim_config),
    )
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr
    assert "FAILED_PRECONDITION" in err and "4 mismatches" in err, err
    cpu = f"CPU xfeatures has unsupported bits ({bit:#x})"  # CRIU's own words for the bit added
    for needle in ("kernel 99.1.0", "CPU lacks features", cpu, "cgroup v", "the checkpoint ran sha256:000"):
        assert needle in err, f"{needle!r} not in {err}"
    f = cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.name": name})
    assert list(rt_b.ListPodSandbox(cri.ListPodSandboxRequest(filter=f)).items) == []
    assert set(os.listdir(node_b.checkpoint_root)) == before  # the pulled copy went away again
