"""shim/distribution without a registry: the layer tars, the pulled manifest's shape,
credentials and transport rules. End to end: tests/test_distribution.py."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import socket
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.archive import manifest as mf
from shim.archive import writeback
from shim.distribution import artifact, registry_auth
from shim.distribution.pull import WRITE_SIZE, _finish_file, _TarStream, _write
from shim.errors import DataLoss, InvalidArgument


def stream(data: bytes, chunk: int = 7000) -> _TarStream:
    class Src:
        def __init__(self) -> None:
            self.pos = 0

        def read(self, n: int) -> bytes:
            out = data[self.pos : self.pos + min(n, chunk)]
            self.pos += len(out)
            return out

    return _TarStream(Src())


def members(data: bytes) -> dict[str, bytes]:
    t = stream(data)
    out = {}
    for ti in t:
        out[ti.name] = b"".join(bytes(x) for x in t.data(ti.size)) if ti.isreg() else b"<dir>"
    return out


def test_push_tars_read_back_with_long_names() -> None:
    long = "containers/" + "c" * 200 + "/checkpoint/" + "p" * 120 + ".img"
    body = b"x" * 70000
    data = (
        artifact.tar_header("containers/app", 0, True)
        + artifact.tar_header(long, len(body), False)
        + body
        + artifact.tar_padding(len(body))
        + artifact.TAR_END
    )
    assert members(data) == {"containers/app": b"<dir>", long: body}
    with tarfile.open(fileobj=io.BytesIO(data)) as t:  # and any tar reader reads them the same
        assert t.getnames() == ["containers/app", long]


def test_gnu_long_names_and_skipped_directory_data() -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as t:
        ti = tarfile.TarInfo("sandbox/" + "n" * 150)
        ti.size = 3
        t.addfile(ti, io.BytesIO(b"abc"))
    assert members(out.getvalue()) == {"sandbox/" + "n" * 150: b"abc"}


@pytest.mark.parametrize("cut", [100, 512 + 10, 1024 + 5])
def test_truncated_or_corrupt_tar_is_a_tar_error(cut: int) -> None:
    data = (
        artifact.tar_header("sandbox/a", 600, False)
        + b"y" * 600
        + artifact.tar_padding(600)
        + artifact.TAR_END
    )
    with pytest.raises(tarfile.TarError):
        members(data[:cut])
    bad = bytearray(data)
    bad[0] ^= 0xFF  # header checksum no longer matches
    with pytest.raises(tarfile.TarError):
        members(bytes(bad))


def manifest_with(files: dict[str, int]) -> mf.Manifest:
    return mf.Manifest(
        sandbox=mf.SandboxInfo(id="s", metadata={"name": "web"}, config={}),
        containers=[mf.ContainerEntry("app", "c", "img", "CONTAINER_RUNNING", 0, True, "containers/app")],
        files={k: mf.FileEntry(v, "0" * 64) for k, v in files.items()},
    )


def test_units_group_files_by_layer_and_refuse_other_layouts() -> None:
    m = manifest_with({"sandbox/config.json": 5, "containers/app/checkpoint/pages-1.img": 4096})
    units = artifact.units_of(m)
    assert [(u.title, u.container, u.size) for u in units] == [
        ("sandbox", "", 5),
        ("containers/app", "app", 4096),
    ]
    assert units[1].dirs() == ["containers/app", "containers/app/checkpoint"]
    assert units[1].tar_cap() >= 4096 + 3 * 512
    with pytest.raises(InvalidArgument, match="outside sandbox/"):
        artifact.units_of(manifest_with({"elsewhere/x": 1}))


def test_large_files_travel_as_raw_layers_and_their_directories_stay_in_the_tar() -> None:
    big = artifact.RAW_FILE_MIN
    m = manifest_with(
        {
            "sandbox/config.json": 5,
            "containers/app/checkpoint/pages-1.img": 3 * big,
            "containers/app/checkpoint/pages-2.img": big,
            "containers/app/checkpoint/core-1.img": big - 1,
        }
    )
    units = artifact.units_of(m)
    raw = artifact.raw_files(units)
    assert raw == {"containers/app/checkpoint/pages-1.img", "containers/app/checkpoint/pages-2.img"}
    artifact.split_raw(units, raw)
    app = units[1]
    assert list(app.files) == ["containers/app/checkpoint/core-1.img"]
    assert list(app.raw) == ["containers/app/checkpoint/pages-1.img", "containers/app/checkpoint/pages-2.img"]
    assert app.dirs() == ["containers/app", "containers/app/checkpoint"]  # made by the tar
    assert app.size == 5 * big - 1
    assert app.tar_cap() < 2 * big  # the raw files are not the tar's
    many = manifest_with({f"containers/app/f{i:03}": big + i for i in range(300)})
    kept = artifact.raw_files(artifact.units_of(many))
    assert len(kept) == artifact.MAX_LAYERS - 2 and "containers/app/f299" in kept  # the largest


def oci(**over: object) -> dict:
    doc = artifact.oci_manifest(
        artifact.descriptor(artifact.CONFIG_MEDIA_TYPE, "sha256:" + "a" * 64, 10),
        [
            artifact.descriptor(
                artifact.LAYER_MEDIA_TYPE, "sha256:" + "b" * 64, 10, {artifact.TITLE: "sandbox"}
            )
        ],
        {},
    )
    doc.update(over)
    return doc


def test_pulled_manifest_shape_is_checked() -> None:
    assert artifact.parse_oci_manifest(oci()).layers[0].title == "sandbox"
    for bad in (
        oci(schemaVersion=1),
        oci(
            config={
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": "sha256:" + "a" * 64,
                "size": 1,
            }
        ),
        oci(layers=[]),
        oci(layers=[{"mediaType": artifact.LAYER_MEDIA_TYPE, "digest": "md5:x", "size": 1}]),
        oci(layers=[{"mediaType": "text/plain", "digest": "sha256:" + "b" * 64, "size": 1}]),
    ):
        with pytest.raises(DataLoss):
            artifact.parse_oci_manifest(bad)
    file_layer = artifact.descriptor(
        artifact.FILE_MEDIA_TYPE, "sha256:" + "c" * 64, 10, {artifact.TITLE: "containers/a/pages-1.img"}
    )
    parsed = artifact.parse_oci_manifest(oci(layers=oci()["layers"] + [file_layer])).layers
    assert [(x.title, x.is_file) for x in parsed] == [("sandbox", False), ("containers/a/pages-1.img", True)]
    for title in ("../x", "containers/a/b", "/sandbox", "other"):
        layer = artifact.descriptor(
            artifact.LAYER_MEDIA_TYPE, "sha256:" + "b" * 64, 1, {artifact.TITLE: title}
        )
        with pytest.raises(InvalidArgument):
            artifact.parse_oci_manifest(oci(layers=[layer]))


def test_credentials_from_env_then_docker_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"auths": {"127.0.0.1:5000": {"auth": base64.b64encode(b"u:p@ss").decode()}}}))
    got = registry_auth.credentials_for("127.0.0.1:5000", str(cfg), env={})
    assert (got.username, got.password) == ("u", "p@ss") and "p@ss" not in repr(got)
    got = registry_auth.credentials_for("127.0.0.1:5000", str(cfg), env={"PODSHIM_REGISTRY_AUTH": "e:pw"})
    assert (got.username, got.source) == ("e", "$PODSHIM_REGISTRY_AUTH")
    docker_dir = tmp_path / "docker"
    docker_dir.mkdir()
    (docker_dir / "config.json").write_text(cfg.read_text())
    assert (
        registry_auth.credentials_for("127.0.0.1:5000", env={"DOCKER_CONFIG": str(docker_dir)}).username
        == "u"
    )
    assert not registry_auth.credentials_for("127.0.0.1:6000", str(cfg), env={})
    with pytest.raises(InvalidArgument) as err:
        registry_auth.credentials_for("h:1", env={"PODSHIM_REGISTRY_AUTH": "no-colon-secret"})
    assert "no-colon-secret" not in err.value.message


def test_plain_http_only_for_loopback_unless_insecure() -> None:
    for host in ("127.0.0.1:5000", "localhost:5000", "[::1]:5000", "127.1.2.3"):
        assert registry_auth.scheme_for(host, False) == "http", host
    assert registry_auth.scheme_for("10.0.0.1:5000", False) == "https"
    assert registry_auth.scheme_for("10.0.0.1:5000", True) == "http"
    with pytest.raises(InvalidArgument, match="names no registry host"):
        registry_auth.parse_reference("library/busybox:1")


def test_transfer_progress_on_a_terminal_only() -> None:
    from shim.cli.commands.distribution import TransferProgress

    class TTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = TTY(), io.StringIO()
    for stream in (tty, pipe):
        p = TransferProgress("push web", stream)
        p(512 << 20, 1 << 30)
        p(1 << 30, 1 << 30)
        p.clear()
    assert "push web: " in tty.getvalue() and "(100%)" in tty.getvalue() and "/s" in tty.getvalue()
    assert pipe.getvalue() == ""


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os
    import sys

    return subprocess.run(
        [sys.executable, "-c", "import sys; from shim.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def nothing_listens() -> Iterator[str]:
    """host:port of a loopback port bound but not listening while the test runs: a connection is
    refused there on any machine (a fixed port may be some service's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_cli_refusals_are_one_line_with_the_code(tmp_path: Path, nothing_listens: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    config = tmp_path / "podshim.toml"
    config.write_text(f'[checkpoint]\nallowed_roots = ["{root}"]\n')
    outside = tmp_path / "outside"
    res = run_cli("pull", f"{nothing_listens}/pods/x:v1", str(outside), "--podshim-config", str(config))
    assert res.returncode == 1 and "podshim pull: INVALID_ARGUMENT:" in res.stderr, res.stderr
    assert "outside the allowed checkpoint roots" in res.stderr and "Traceback" not in res.stderr
    assert not outside.exists()  # the directory the command created is gone again
    empty = root / "empty"
    empty.mkdir()
    res = run_cli("push", str(empty), f"{nothing_listens}/pods/x:v1")
    assert res.returncode == 1 and "podshim push: NOT_FOUND:" in res.stderr, res.stderr
    res = run_cli("push", str(empty), "pods/x:v1")
    assert res.returncode == 1 and "INVALID_ARGUMENT" in res.stderr and "names no registry host" in res.stderr
    res = run_cli("pull", f"{nothing_listens}/pods/x:v1", str(root / "new"), "--podshim-config", str(config))
    assert res.returncode == 1 and "podshim pull: UNAVAILABLE:" in res.stderr, res.stderr  # nothing listens
    assert not (root / "new").exists()


def test_a_second_pull_into_the_same_target_is_aborted(tmp_path: Path) -> None:
    import fcntl
    import os

    from shim.distribution import pull
    from shim.errors import Aborted

    root = tmp_path / "root"
    target = root / "t"
    target.mkdir(parents=True)
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a pull in progress holds it
        with pytest.raises(Aborted, match="another pull"):
            pull.pull("127.0.0.1:9/pods/x:v1", target, allowed_roots=[str(root)])
    finally:
        os.close(fd)


def test_a_pulled_file_is_hashed_written_and_its_writeback_started_as_it_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(writeback, "start_writeback", lambda fd, off, n: started.append((off, n)) or True)
    mib = 1 << 20
    data = os.urandom(2 * mib + 1234)
    fd = os.open(tmp_path / "pages-1.img", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    sha, ahead = hashlib.sha256(), writeback.Ahead(fd, step=mib)
    for i in range(0, len(data), 300_000):  # the chunks as they come off the stream
        _write(fd, sha, ahead, data[i : i + 300_000])
    assert started == [(0, mib), (mib, mib)]  # each MiB once it was written, not at the fsync
    _finish_file(fd, sha, "ref", "pages-1.img", hashlib.sha256(data).hexdigest())  # fsyncs, closes
    assert (tmp_path / "pages-1.img").read_bytes() == data
    fd = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    sha = hashlib.sha256()
    _write(fd, sha, writeback.Ahead(fd), b"tampered")
    with pytest.raises(DataLoss, match="sha256"):
        _finish_file(fd, sha, "ref", "other", hashlib.sha256(b"original").hexdigest())


def test_pulled_file_writes_end_on_write_size_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No write covers an aligned 2 MiB of the file (a 2 MiB page-cache folio: docs/design/versions.md
    (This machine)), whatever the chunks the tar hands out; the bytes and the hash are whole."""
    writes: list[tuple[int, int]] = []
    real_write = os.write

    def recording_write(fd: int, data: memoryview) -> int:
        writes.append((os.lseek(fd, 0, os.SEEK_CUR), len(data)))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", recording_write)
    data = os.urandom(3 * WRITE_SIZE + 777)
    fd = os.open(tmp_path / "pages-1.img", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    sha = hashlib.sha256()
    ahead = writeback.Ahead(fd)
    pos = 0
    for size in (1000, 2 * WRITE_SIZE, WRITE_SIZE - 1000, 777):  # a header's offset, then chunks
        _write(fd, sha, ahead, memoryview(data)[pos : pos + size])
        pos += size
    _finish_file(fd, sha, "ref", "pages-1.img", hashlib.sha256(data).hexdigest())
    assert (tmp_path / "pages-1.img").read_bytes() == data
    assert sum(n for _, n in writes) == len(data)
    assert all(off // WRITE_SIZE == (off + n - 1) // WRITE_SIZE for off, n in writes), writes
