"""Encryption at rest of pod checkpoints (shim/archive/crypto.py), without a bed:
the chunked AEAD file format (round trip; wrong key, flipped byte, truncation, swapped chunks,
renamed file, appended data → DATA_LOSS), the authenticated manifest through load_and_verify,
the decrypted dirs, and the node key file checks of the config."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pytest

from shim import config, errors
from shim.archive import crypto
from shim.archive.manifest import (
    ContainerEntry,
    HostInfo,
    Manifest,
    SandboxInfo,
    load_and_verify,
    read_manifest,
    write_manifest,
)
from shim.ops.restore_checks import read_member

CHUNK = crypto.CHUNK_SIZE
BLOCK = CHUNK + crypto.TAG_SIZE
H = crypto.HEADER_SIZE


def make_key(tmp_path: Path, name: str = "node.key", raw: bytes | None = None) -> Path:
    p = tmp_path / name
    p.write_bytes(raw if raw is not None else os.urandom(32))
    p.chmod(0o600)
    return p


@pytest.fixture
def key(tmp_path: Path) -> crypto.NodeKey:
    return crypto.load_key(str(make_key(tmp_path)))


@pytest.fixture
def other_key(tmp_path: Path) -> crypto.NodeKey:
    return crypto.load_key(str(make_key(tmp_path, "other.key")))


def enc(data: bytes, rel: str, key: crypto.NodeKey) -> bytes:
    out = io.BytesIO()
    crypto.encrypt_stream(io.BytesIO(data), out, rel, key)
    return out.getvalue()


def dec(blob: bytes, rel: str, key: crypto.NodeKey) -> bytes:
    return crypto.decrypt_stream(io.BytesIO(blob), None, rel, key)


def expect_loss(blob: bytes, rel: str, key: crypto.NodeKey, *needles: str) -> str:
    with pytest.raises(errors.DataLoss) as e:
        dec(blob, rel, key)
    for n in (rel, *needles):
        assert n in e.value.message, (n, e.value.message)
    return e.value.message


# ---------------------------------------------------------------------------- file format


@pytest.mark.parametrize("size", [0, 1, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 5])
def test_round_trip(size: int, key: crypto.NodeKey) -> None:
    data = os.urandom(size)
    blob = enc(data, "containers/app/checkpoint/pages-1.img", key)
    chunks = max(1, -(-size // CHUNK))
    assert len(blob) == H + size + chunks * crypto.TAG_SIZE
    assert blob.startswith(crypto.MAGIC)
    if size >= 64:
        assert data[:64] not in blob  # no plaintext leaks through
    assert dec(blob, "containers/app/checkpoint/pages-1.img", key) == data


def test_same_plaintext_encrypts_differently(key: crypto.NodeKey) -> None:
    data = b"secret" * 1000
    assert enc(data, "a", key) != enc(data, "a", key)  # a random salt (file key) per file


def test_wrong_key(key: crypto.NodeKey, other_key: crypto.NodeKey) -> None:
    blob = enc(b"memory", "containers/app/config.dump", key)
    expect_loss(blob, "containers/app/config.dump", other_key, "does not authenticate")
    assert key.key_id != other_key.key_id and len(key.key_id) == 16


@pytest.mark.parametrize("where", ["header-salt", "first-chunk", "tag", "last-chunk"])
def test_flipped_byte(where: str, key: crypto.NodeKey) -> None:
    data = os.urandom(2 * CHUNK + 100)
    blob = bytearray(enc(data, "f", key))
    pos = {"header-salt": H - 3, "first-chunk": H + 10, "tag": H + BLOCK - 1, "last-chunk": len(blob) - 30}
    blob[pos[where]] ^= 0x01
    expect_loss(bytes(blob), "f", key)


def test_header_chunk_size_tampered(key: crypto.NodeKey) -> None:
    blob = bytearray(enc(os.urandom(3 * CHUNK), "f", key))
    blob[9:13] = (CHUNK // 2).to_bytes(4, "big")
    expect_loss(bytes(blob), "f", key)
    blob[0:8] = b"NOTMAGIC"
    expect_loss(bytes(blob), "f", key, "bad magic")


@pytest.mark.parametrize(
    "cut",
    [
        lambda b: b[: H + BLOCK],  # the last chunk dropped on a chunk boundary
        lambda b: b[: H + BLOCK + 100],  # cut inside the last chunk
        lambda b: b[:-1],
        lambda b: b[:H],  # header only
        lambda b: b[: H - 1],
        lambda b: b"",
    ],
)
def test_truncated(cut: object, key: crypto.NodeKey) -> None:
    blob = enc(os.urandom(2 * CHUNK + 7), "f", key)
    expect_loss(cut(blob), "f", key)  # type: ignore[operator]


def test_appended_data(key: crypto.NodeKey) -> None:
    blob = enc(os.urandom(CHUNK + 7), "f", key)
    expect_loss(blob + os.urandom(40), "f", key)
    whole = enc(os.urandom(CHUNK), "f", key)  # exactly one chunk: a copy of it appended
    expect_loss(whole + whole[H:], "f", key)


def test_swapped_chunks(key: crypto.NodeKey) -> None:
    blob = enc(os.urandom(3 * CHUNK), "f", key)
    c = [blob[H + i * BLOCK : H + (i + 1) * BLOCK] for i in range(3)]
    expect_loss(blob[:H] + c[1] + c[0] + c[2], "f", key, "chunk 0")
    expect_loss(blob[:H] + c[0] + c[2], "f", key)  # a middle chunk dropped
    # a chunk of another file (same key, same path) does not fit either
    other = enc(os.urandom(3 * CHUNK), "f", key)
    expect_loss(blob[:H] + other[H : H + BLOCK] + c[1] + c[2], "f", key)


def test_renamed_file(key: crypto.NodeKey) -> None:
    blob = enc(b"config of app", "containers/app/config.dump", key)
    expect_loss(blob, "containers/evil/config.dump", key)


def test_encrypt_file_in_place_and_decrypt_bytes(tmp_path: Path, key: crypto.NodeKey) -> None:
    f = tmp_path / "dir" / "stats-dump"
    f.parent.mkdir()
    data = os.urandom(CHUNK + 3)
    f.write_bytes(data)
    size = crypto.encrypt_file(f, "containers/app/stats-dump", key)
    assert size == f.stat().st_size == H + len(data) + 2 * crypto.TAG_SIZE
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert sorted(os.listdir(f.parent)) == ["stats-dump"]  # no temporary file left
    assert crypto.decrypt_bytes(f, "containers/app/stats-dump", key) == data
    with pytest.raises(errors.DataLoss, match="over 10 bytes"):
        crypto.decrypt_bytes(f, "containers/app/stats-dump", key, limit=10)


# ---------------------------------------------------------------------------- archives


def sample_archive(root: Path, key: crypto.NodeKey | None) -> tuple[Path, dict[str, bytes]]:
    """A small pod archive (plain files first), encrypted with `key` when given."""
    d = root / "ckpt"
    files = {
        "sandbox/config.json": b'{"metadata": {"name": "web"}}\n',
        "containers/app/config.dump": json.dumps(
            {"config": {"envs": [{"key": "PW", "value": "s3"}]}}
        ).encode(),
        "containers/app/spec.dump": b"{}",
        "containers/app/checkpoint/inventory.img": b"\x54\x0b\xd0\x58" + os.urandom(100),
        "containers/app/checkpoint/pages-1.img": os.urandom(2 * CHUNK + 11),
        "containers/app/rootfs-diff.tar": os.urandom(5000),
        "containers/app/empty": b"",
    }
    for rel, data in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        p.write_bytes(data)
    m = Manifest(
        sandbox=SandboxInfo(id="sb1", metadata={"name": "web"}, config={"a": 1}),
        containers=[
            ContainerEntry(
                name="app",
                id="c1",
                image="busybox",
                state="CONTAINER_RUNNING",
                restart_count=0,
                checkpointed=True,
                dir="containers/app",
            )
        ],
        host=HostInfo(podshim_version="0.1.0", criu_version="4.1.1", runtime_name="runc"),
        timings={"freeze_window": 0.25},
    )
    if key is not None:
        assert crypto.encrypt_tree(d, key, workers=2) == len(files)
    write_manifest(d, m, workers=2, key=key)
    # CheckpointPod rewrites the manifest once the archive step is timed: it must stay sealed
    m.timings["archive"] = 0.5
    (d / "manifest.json").write_bytes(m.to_json())
    return d, files


def test_encrypted_archive_verifies_and_decrypts(tmp_path: Path, key: crypto.NodeKey) -> None:
    d, files = sample_archive(tmp_path, key)
    doc = json.loads((d / "manifest.json").read_text())
    assert doc["encryption"]["scheme"] == crypto.SCHEME
    assert doc["encryption"]["key_id"] == key.key_id
    assert len(doc["encryption"]["mac"]) == 64
    for rel, data in files.items():
        raw = (d / rel).read_bytes()
        assert raw.startswith(crypto.MAGIC), rel
        assert doc["files"][rel]["size"] == len(raw)  # the checksums cover the encrypted bytes
        if len(data) >= 16:
            assert data[:16] not in raw, rel
    m = load_and_verify(d, [str(tmp_path)], workers=2, key=key)
    assert m.encryption is not None and m.encryption.key_id == key.key_id
    assert m.timings["archive"] == 0.5
    dest = tmp_path / "plain"
    dest.mkdir(mode=0o700)
    crypto.decrypt_members(d, list(m.files), "containers/app", dest, key, workers=2)
    for rel, data in files.items():
        if rel.startswith("containers/app/"):
            out = dest / rel.removeprefix("containers/app/")
            assert out.read_bytes() == data, rel
            assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert not (dest / "sandbox").exists()
    assert stat.S_IMODE((dest / "checkpoint").stat().st_mode) == 0o700
    cfg = json.loads(read_member(d, d / "containers/app/config.dump", m, key))
    assert cfg["config"]["envs"][0]["value"] == "s3"


def test_plain_archive_unchanged(tmp_path: Path, key: crypto.NodeKey) -> None:
    d, files = sample_archive(tmp_path, None)
    assert "encryption" not in json.loads((d / "manifest.json").read_text())
    for rel, data in files.items():
        assert (d / rel).read_bytes() == data
    # a node with a key still restores plain archives, without one too
    assert load_and_verify(d, [str(tmp_path)], key=key).encryption is None
    m = load_and_verify(d, [str(tmp_path)])
    assert read_member(d, d / "containers/app/spec.dump", m, key) == b"{}"


def test_encrypted_archive_without_key_is_failed_precondition(tmp_path: Path, key: crypto.NodeKey) -> None:
    d, _ = sample_archive(tmp_path, key)
    with pytest.raises(
        errors.FailedPrecondition, match=f"encrypted \\(key id {key.key_id}\\).*no checkpoint"
    ):
        load_and_verify(d, [str(tmp_path)])


def test_wrong_key_is_data_loss(tmp_path: Path, key: crypto.NodeKey, other_key: crypto.NodeKey) -> None:
    d, _ = sample_archive(tmp_path, key)
    with pytest.raises(errors.DataLoss, match="wrong key"):
        load_and_verify(d, [str(tmp_path)], key=other_key)


def test_tampered_file_is_data_loss_naming_it(tmp_path: Path, key: crypto.NodeKey) -> None:
    d, _ = sample_archive(tmp_path, key)
    p = d / "containers/app/checkpoint/pages-1.img"
    raw = bytearray(p.read_bytes())
    raw[H + 5] ^= 0x80
    p.write_bytes(bytes(raw))
    with pytest.raises(errors.DataLoss, match="containers/app/checkpoint/pages-1.img"):
        load_and_verify(d, [str(tmp_path)], key=key)
    # and when the checksum is "fixed" in the manifest, the manifest no longer authenticates
    doc = json.loads((d / "manifest.json").read_text())
    import hashlib

    doc["files"]["containers/app/checkpoint/pages-1.img"]["sha256"] = hashlib.sha256(raw).hexdigest()
    (d / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(errors.DataLoss, match="MAC does not match"):
        load_and_verify(d, [str(tmp_path)], key=key)
    # the chunk authentication names the file even past the checksums
    with pytest.raises(errors.DataLoss, match="pages-1.img does not authenticate"):
        crypto.decrypt_members(d, ["containers/app/checkpoint/pages-1.img"], "containers/app", tmp_path, key)


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["timings"].__setitem__("freeze_window", 0.0),
        lambda doc: doc["containers"][0].__setitem__("image", "evil"),
        lambda doc: doc["encryption"].__setitem__("mac", "0" * 64),
        lambda doc: doc["encryption"].__setitem__("mac", ""),
    ],
)
def test_tampered_manifest_is_data_loss(tmp_path: Path, key: crypto.NodeKey, edit: object) -> None:
    d, _ = sample_archive(tmp_path, key)
    doc = json.loads((d / "manifest.json").read_text())
    edit(doc)  # type: ignore[operator]
    (d / "manifest.json").write_text(json.dumps(doc, indent=1))
    with pytest.raises(errors.DataLoss, match="does not authenticate"):
        load_and_verify(d, [str(tmp_path)], key=key)


def test_manifest_reformatted_still_authenticates(tmp_path: Path, key: crypto.NodeKey) -> None:
    d, _ = sample_archive(tmp_path, key)
    doc = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps(doc, sort_keys=True))  # same content, other layout
    load_and_verify(d, [str(tmp_path)], key=key)


def test_stripped_encryption_is_data_loss(tmp_path: Path, key: crypto.NodeKey) -> None:
    """A manifest whose encryption record was removed passes as plain, but its files do not."""
    d, _ = sample_archive(tmp_path, key)
    doc = json.loads((d / "manifest.json").read_text())
    del doc["encryption"]
    (d / "manifest.json").write_text(json.dumps(doc))
    m = load_and_verify(d, [str(tmp_path)], key=key)
    with pytest.raises(errors.DataLoss, match="encrypted but manifest.json records no encryption"):
        read_member(d, d / "containers/app/config.dump", m, key)


def test_unknown_scheme_is_failed_precondition(tmp_path: Path, key: crypto.NodeKey) -> None:
    d, _ = sample_archive(tmp_path, key)
    doc = json.loads((d / "manifest.json").read_text())
    doc["encryption"]["scheme"] = "rot13"
    (d / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(errors.FailedPrecondition, match="rot13"):
        load_and_verify(d, [str(tmp_path)], key=key)


def test_read_manifest_keeps_the_encryption_record(tmp_path: Path, key: crypto.NodeKey) -> None:
    d, _ = sample_archive(tmp_path, key)
    m = read_manifest(d)
    assert m.encryption is not None and m.mac_key is None
    assert (
        json.loads(m.to_json())["encryption"] == json.loads((d / "manifest.json").read_text())["encryption"]
    )


def test_encrypt_tree_refuses_symlinks(tmp_path: Path, key: crypto.NodeKey) -> None:
    d = tmp_path / "t"
    d.mkdir()
    (d / "a").write_bytes(b"x")
    (d / "link").symlink_to("/etc/passwd")
    with pytest.raises(errors.Internal, match="link is not a regular file"):
        crypto.encrypt_tree(d, key)


# ---------------------------------------------------------------------------- decrypted dirs


def test_decrypted_dirs(tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = crypto.new_decrypted_dir(state, tmp_path / "ckpt", "app")
    assert d.parent == crypto.decrypted_root(state)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(d.parent.stat().st_mode) == 0o700
    assert crypto.is_decrypted_dir(d)
    assert crypto.read_marker(d) is not None and "container_id" not in crypto.read_marker(d)  # type: ignore[operator]
    crypto.set_owner(d, "c" * 64)
    [(listed, marker, age)] = crypto.list_decrypted(state)
    assert listed == d and marker is not None and marker["container_id"] == "c" * 64 and age < 60
    crypto.remove_decrypted(d)
    assert crypto.list_decrypted(state) == []
    crypto.set_owner(d, "c" * 64)  # consumed meanwhile: nothing to do, no error
    assert not d.exists()


# ---------------------------------------------------------------------------- the key file


def test_key_file_checks(tmp_path: Path) -> None:
    good = make_key(tmp_path)
    assert config.key_file_problem(str(good)) is None
    assert crypto.load_key(str(good)).raw == good.read_bytes()
    assert good.read_bytes().hex() not in repr(crypto.load_key(str(good)))  # never printed

    loose = make_key(tmp_path, "loose.key")
    loose.chmod(0o644)
    short = make_key(tmp_path, "short.key", os.urandom(16))
    link = tmp_path / "link.key"
    link.symlink_to(good)
    cases = {
        str(loose): "mode 0644, must be 0600",
        str(short): "16 bytes, must hold exactly 32",
        str(link): "symlink",
        str(tmp_path / "missing.key"): "does not exist",
        str(tmp_path): "not a regular file",
    }
    for path, needle in cases.items():
        assert needle in (config.key_file_problem(path) or ""), path
        with pytest.raises(errors.FailedPrecondition) as e:
            crypto.load_key(path)
        assert "checkpoint.encryption_key_file" in e.value.message and path in e.value.message
        assert needle in e.value.message


def test_config_key(tmp_path: Path) -> None:
    good = make_key(tmp_path)
    cfg_file = tmp_path / "podshim.toml"
    cfg_file.write_text(f'[checkpoint]\nencryption_key_file = "{good}"\n')
    assert config.load(str(cfg_file), env={}).encryption_key_file == str(good)
    assert config.load(env={"PODSHIM_CHECKPOINT_ENCRYPTION_KEY_FILE": str(good)}).encryption_key_file == str(
        good
    )
    assert config.load(env={}).encryption_key_file == ""
    good.chmod(0o640)
    with pytest.raises(config.ConfigError) as e:
        config.load(str(cfg_file), env={})
    msg = str(e.value)
    assert "checkpoint.encryption_key_file" in msg and str(good) in msg and "0640" in msg
    assert "\n" not in msg
    # podshim-runc never needs the key: it does not check the file
    assert config.load(str(cfg_file), env={}, check_files=False).encryption_key_file == str(good)
    cfg_file.write_text('[checkpoint]\nencryption_key_file = "relative.key"\n')
    with pytest.raises(config.ConfigError, match="encryption_key_file: must be an absolute path"):
        config.load(str(cfg_file), env={}, check_files=False)
