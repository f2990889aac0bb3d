"""podshim's own eager-restore overhead, the parts a unit test can pin: what
RestorePod and StartContainer no longer ask the upstream or a subprocess, and the checksum pass
split so that it can run beside the new sandbox (docs/design/restore-pod.md (RestorePod) step 1).
The figures themselves live in bench/restore.py (eager_overhead_ratio); no timing here."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from shim import errors
from shim.archive import compat, manifest
from shim.checks.wiring import WiringChecker, confirm_restored
from shim.config import Config, RuntimeConfig
from shim.contract import RESTORED_MARKER
from shim.ops.restore_pod import PodRestorer
from shim.state import Journal
from tests.fakes import FakeUpstream

# ---------------------------------------------------------------------------- StartContainer


async def test_confirm_restored_asks_the_upstream_nothing_when_the_marker_is_under_a_known_root(
    tmp_path: Path,
) -> None:
    root = tmp_path / "runc" / "k8s.io"
    (root / "c1").mkdir(parents=True)
    (root / "c1" / RESTORED_MARKER).write_text("/ckpt")
    cfg = Config(state_dir=str(tmp_path / "state"), runtime=RuntimeConfig(root=str(root)))
    up = FakeUpstream()
    await confirm_restored(up, cfg, "c1")  # type: ignore[arg-type]
    assert up.calls == []


async def test_confirm_restored_still_asks_where_the_marker_is_not_under_a_known_root(tmp_path: Path) -> None:
    """No marker under podshim's roots: the upstream's own root for the container is asked, as
    before (here it has none either and no state dir: the check made before creating stands)."""
    cfg = Config(state_dir=str(tmp_path / "state"), runtime=RuntimeConfig(root=str(tmp_path / "none")))
    up = FakeUpstream()
    from api.runtime.v1 import api_pb2 as cri

    up.containers["c1"] = cri.ContainerStatus(id="c1")
    await confirm_restored(up, cfg, "c1")  # type: ignore[arg-type]
    assert up.names() == ["ContainerStatus"]


def test_the_restore_hook_imports_no_asyncio_logging_or_crypto() -> None:
    """podshim-runc-hook runs on every restore's StartContainer before `runc restore`: what its
    restore() imports (shim/wrapper/restore.py) must not pull in asyncio (and ssl, socket),
    structlog, concurrent.futures, random or shim/archive/crypto (~50-100 ms of start-up on this
    VM; docs/design/runtime-wrapper.md (The runtime wrapper))."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from shim.wrapper import main, restore\n"
        "from shim import config, contract, faults, errors\n"
        "from shim.archive import layout, paths, rootfs_diff, fsutil\n"
        "from shim.criu.log import criu_error_lines\n"
        "from shim.criu.options import CriuOptions\n"
        "from shim.criu.runtime import OciRuntime\n"
        "CriuOptions.from_record('file-locks')\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    heavy = {"asyncio", "ssl", "socket", "structlog", "logging", "concurrent.futures", "random"}
    heavy.add("shim.archive.crypto")
    assert not heavy & loaded


# ---------------------------------------------------------------------------- RestorePod's checks


def _counting_binary(tmp_path: Path, version: str) -> tuple[Path, Path]:
    calls = tmp_path / "calls"
    exe = tmp_path / "fake-runc"
    exe.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'runc version {version}'\n")
    exe.chmod(0o755)
    return exe, calls


def test_per_binary_asks_a_binary_once_until_it_changes(tmp_path: Path) -> None:
    from shim.criu.runtime import binary_version

    exe, calls = _counting_binary(tmp_path, "1.1.5")
    assert compat.per_binary(binary_version, str(exe)) == "runc version 1.1.5"
    assert compat.per_binary(binary_version, str(exe)) == "runc version 1.1.5"
    assert calls.read_text().count("x") == 1
    # an upgrade rewrites (or replaces) the file: asked again
    exe.write_text(exe.read_text().replace("1.1.5", "1.2.0"))
    os.utime(exe, ns=(1, 1))
    assert compat.per_binary(binary_version, str(exe)) == "runc version 1.2.0"
    assert calls.read_text().count("x") == 2
    # a bare name (not a file podshim can stat) is never remembered
    assert compat.per_binary(lambda b: b.upper(), "runc") == "RUNC"


async def test_the_handler_check_reads_the_wiring_checks_cached_status(tmp_path: Path) -> None:
    """An unknown runtime_handler is INVALID_ARGUMENT from the upstream's verbose Status; the
    wiring check right after reads the same cached answer: one Status call per restore, not two."""
    up = FakeUpstream()
    up.runtime_info = {"config": json.dumps({"containerd": {"runtimes": {"runc": {}}}})}
    cfg = Config(state_dir=str(tmp_path / "state"))
    wiring = WiringChecker(up)  # type: ignore[arg-type]
    r = PodRestorer(cfg, up, Journal(cfg.state_dir), wiring)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument, match="runtime_handler 'ghost'"):
        await r.checks._check_upstream_handler("ghost")
    await r.checks._check_upstream_handler("runc")
    await wiring.check("runc")
    assert up.names().count("Status") == 1


# ---------------------------------------------------------------------------- the checksum pass


def _archive(tmp_path: Path, files: dict[str, bytes]) -> tuple[Path, manifest.Manifest]:
    root = tmp_path / "a"
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    m = manifest.Manifest(sandbox=manifest.SandboxInfo(id="s", metadata={}, config={}))
    m.files = {rel: manifest.FileEntry(len(d), hashlib.sha256(d).hexdigest()) for rel, d in files.items()}
    return root, m


def test_read_verified_checks_the_bytes_it_returns(tmp_path: Path) -> None:
    root, m = _archive(tmp_path, {"containers/c/config.dump": b'{"a": 1}'})
    assert manifest.read_verified(root, m, "containers/c/config.dump") == b'{"a": 1}'
    (root / "containers/c/config.dump").write_bytes(b'{"a": 2}')  # same size, other bytes
    with pytest.raises(errors.DataLoss, match="config.dump has sha256"):
        manifest.read_verified(root, m, "containers/c/config.dump")
    with pytest.raises(errors.DataLoss, match="not listed"):
        manifest.read_verified(root, m, "containers/c/spec.dump")


def test_check_tree_then_verify_digests_is_verify_files(tmp_path: Path) -> None:
    big = os.urandom(3 << 20)
    root, m = _archive(tmp_path, {"containers/c/checkpoint/pages-1.img": big, "sandbox/config.json": b"{}"})
    manifest.check_tree(root, m)
    manifest.verify_digests(root, m, list(m.files), workers=2)
    manifest.verify_files(root, m, workers=2)
    flipped = bytearray(big)
    flipped[len(big) // 2] ^= 1
    (root / "containers/c/checkpoint/pages-1.img").write_bytes(bytes(flipped))
    manifest.check_tree(root, m)  # sizes agree: only the checksum pass can tell
    manifest.verify_digests(root, m, ["sandbox/config.json"])  # not the member that differs
    with pytest.raises(errors.DataLoss, match="pages-1.img has sha256"):
        manifest.verify_digests(root, m, list(m.files), workers=2)


def test_decryption_checks_each_file_against_the_manifest_in_its_own_read(tmp_path: Path) -> None:
    """RestorePod does not hash what it decrypts in a pass of its own: decrypt_members hashes the
    ciphertext as it reads it. A file another archive encrypted with the same key under the same
    name authenticates (AES-GCM) but is not this archive's: DataLoss naming it, from its sha256."""
    from shim.archive import crypto

    key_file = tmp_path / "key"
    key_file.write_bytes(os.urandom(crypto.KEY_SIZE))
    key_file.chmod(0o600)
    key = crypto.load_key(str(key_file))
    rel = "containers/c/checkpoint/pages-1.img"
    archive = tmp_path / "a"
    (archive / "containers/c/checkpoint").mkdir(parents=True)
    (archive / rel).write_bytes(os.urandom(3 << 20))
    crypto.encrypt_file(archive / rel, rel, key)
    ciphertext = (archive / rel).read_bytes()
    expect = {rel: (len(ciphertext), hashlib.sha256(ciphertext).hexdigest())}
    out = tmp_path / "out1"
    out.mkdir(mode=0o700)
    crypto.decrypt_members(archive, [rel], "containers/c", out, key, 2, None, expect)
    assert (out / "checkpoint/pages-1.img").stat().st_size == 3 << 20
    # the same member of another checkpoint with the same key: authentic, but not this one
    (archive / rel).write_bytes(os.urandom(3 << 20))
    crypto.encrypt_file(archive / rel, rel, key)
    out2 = tmp_path / "out2"
    out2.mkdir(mode=0o700)
    with pytest.raises(errors.DataLoss, match="pages-1.img has sha256"):
        crypto.decrypt_members(archive, [rel], "containers/c", out2, key, 2, None, expect)
