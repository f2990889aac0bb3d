"""The restore broker's protocol edges (shim/ops/restore_broker.py, docs/design/runtime-wrapper.md
(The runtime wrapper)), with a Python client in podshim-runc's place. The restores themselves,
through the real podshim-runc, containerd, runc/crun and CRIU, are in
tests/test_restore_broker_e2e.py."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim import contract
from shim.config import Config
from shim.ops import restore_broker as broker
from shim.wrapper import page_check, restore


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[broker.RestoreBroker, Path]]:
    # a state dir whose socket path does not fit in sun_path: named through a descriptor
    state = tmp_path / ("s" * 90) / "state"
    state.mkdir(parents=True, mode=0o700)
    b = broker.RestoreBroker(
        Config(state_dir=str(state), allowed_roots=(str(tmp_path),)), broker.PageChecks()
    )
    b.start()
    try:
        yield b, tmp_path
    finally:
        b.stop()


def _connect(b: broker.RestoreBroker) -> socket.socket:
    fd = os.open(b.state_dir, os.O_PATH | os.O_DIRECTORY)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(f"/proc/self/fd/{fd}/{contract.BROKER_SOCKET}")
    finally:
        os.close(fd)
    conn.settimeout(10)
    return conn


def _ask(conn: socket.socket, *fields: str) -> list[str]:
    conn.send(broker._packet(*fields))
    return broker._fields(conn.recv(broker.MAX_PACKET))


def _bundle(tmp_path: Path, annotations: dict[str, str]) -> Path:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps({"annotations": annotations, "root": {"path": "rootfs"}}))
    return bundle


def _argv(tmp_path: Path, bundle: Path) -> list[str]:
    root = tmp_path / "runtime-root"
    root.mkdir(exist_ok=True)
    return [
        "--root",
        str(root),
        "--log",
        str(tmp_path / "log.json"),
        "create",
        "--bundle",
        str(bundle),
        "cid",
    ]


def test_the_socket_is_private_and_removed_at_stop(served: tuple[broker.RestoreBroker, Path]) -> None:
    b, _ = served
    assert len(str(b.path)) > 108
    fd = os.open(b.state_dir, os.O_PATH | os.O_DIRECTORY)
    try:
        mode = os.stat(contract.BROKER_SOCKET, dir_fd=fd).st_mode & 0o777
    finally:
        os.close(fd)
    assert mode == 0o600
    b.stop()
    assert not b.path.exists()


def test_a_container_that_is_no_restore_goes_to_the_hook(served: tuple[broker.RestoreBroker, Path]) -> None:
    b, tmp_path = served
    bundle = _bundle(tmp_path, {})
    with _connect(b) as conn:
        assert _ask(conn, "prepare", "/", "/usr/sbin/runc", "", *_argv(tmp_path, bundle)) == ["hook"]
    with _connect(b) as conn:  # not a create, or not the protocol: the hook judges
        assert _ask(conn, "prepare", "/", "/usr/sbin/runc", "", "state", "cid") == ["hook"]
    with _connect(b) as conn:
        assert _ask(conn, "hello") == ["hook"]


def test_an_archive_outside_the_allowed_roots_fails_the_create(
    served: tuple[broker.RestoreBroker, Path],
) -> None:
    b, tmp_path = served
    bundle = _bundle(tmp_path, {contract.RESTORE_ANNOTATION: "/etc"})
    with _connect(b) as conn:
        reply = _ask(conn, "prepare", "/", "/usr/sbin/runc", "", *_argv(tmp_path, bundle))
    assert reply[0] == "fail" and "restore of cid" in reply[1], reply


def _archive(tmp_path: Path, pages: bytes) -> tuple[Path, dict[str, str]]:
    ckpt = tmp_path / "ckpt" / "c1"
    (ckpt / "checkpoint").mkdir(parents=True)
    (ckpt / "checkpoint" / "pages-1.img").write_bytes(pages)
    return ckpt, {"checkpoint/pages-1.img": hashlib.sha256(pages).hexdigest()}


def _started_eager_restore(
    b: broker.RestoreBroker, tmp_path: Path, ckpt: Path, digests: dict[str, str]
) -> tuple[page_check.PageImages, Path]:
    """RestorePod's part: the page check started, and the bundle of an eager restore of `ckpt`."""
    b.checks.start(ckpt, digests)
    annotations = {
        contract.RESTORE_ANNOTATION: str(ckpt),
        contract.PAGE_DIGESTS_ANNOTATION: contract.page_digests_record(digests),
    }
    return b.checks._checks[b.checks._key(ckpt, digests)][0], _bundle(tmp_path, annotations)


def test_exec_started_exited_then_the_verdict(
    served: tuple[broker.RestoreBroker, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole exchange: podshim answers the runtime's restore argv with CRIU_CONFIG_FILE, takes the
    page check RestorePod started, and a failed restore's verdict is `fail` naming the exit code."""
    b, tmp_path = served
    ckpt, digests = _archive(tmp_path, b"\1" * 4096)
    started, bundle = _started_eager_restore(b, tmp_path, ckpt, digests)
    taken: list[page_check.PageImages] = []
    real_settle = restore.Prepared.settle

    def settle(self: restore.Prepared, returncode: int, hit: object = None) -> None:
        taken.append(self.pages)  # type: ignore[arg-type]
        real_settle(self, returncode, hit)  # type: ignore[arg-type]

    monkeypatch.setattr(restore.Prepared, "settle", settle)
    with _connect(b) as conn:
        reply = _ask(conn, "prepare", "/", "/usr/sbin/runc", "", *_argv(tmp_path, bundle))
        assert reply[0] == "exec", reply
        sep = reply.index("", 1)
        env, argv = reply[1:sep], reply[sep + 1 :]
        assert env == [f"CRIU_CONFIG_FILE={bundle / contract.WORK_DIR / 'criu.conf'}"]
        assert argv[0] == "/usr/sbin/runc" and "restore" in argv and "--detach" in argv
        assert "leave-stopped" in (bundle / contract.WORK_DIR / "criu.conf").read_text()
        child = subprocess.Popen(["sleep", "30"], start_new_session=True)
        conn.send(broker._packet("started", str(child.pid)))
        child.kill()
        child.wait()
        reply = _ask(conn, "exited", "1")
    assert reply[0] == "fail" and "failed (exit 1)" in reply[1], reply
    assert taken == [started]  # RestorePod's check, not a new one
    assert not b.checks._checks


def test_an_eof_after_started_undoes_the_restore(
    served: tuple[broker.RestoreBroker, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """podshim-runc killed (the upstream's deadline) while the runtime's restore runs: podshim kills
    its process group, as the hook's watchdog did."""
    b, tmp_path = served
    ckpt, _ = _archive(tmp_path, b"\2" * 4096)
    bundle = _bundle(tmp_path, {contract.RESTORE_ANNOTATION: str(ckpt)})
    undone: list[int | None] = []
    real_undo = restore.undo
    monkeypatch.setattr(
        restore, "undo", lambda p, pgid, held=None: (undone.append(pgid), real_undo(p, pgid, held))
    )
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    with _connect(b) as conn:
        assert _ask(conn, "prepare", "/", "/usr/sbin/runc", "", *_argv(tmp_path, bundle))[0] == "exec"
        conn.send(broker._packet("started", str(child.pid)))
    deadline = time.monotonic() + 10
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() == -9
    assert undone == [child.pid]


def test_a_client_failpoint_kill_kills_podshim_runc(served: tuple[broker.RestoreBroker, Path]) -> None:
    """`runc-wrapper.before-restore=kill` in podshim-runc's PODSHIM_FAILPOINTS kills podshim-runc
    itself (its SO_PEERCRED pid), before anything ran."""
    b, tmp_path = served
    ckpt, _ = _archive(tmp_path, b"\3" * 4096)
    bundle = _bundle(tmp_path, {contract.RESTORE_ANNOTATION: str(ckpt)})
    script = (
        "import socket,sys,os\n"
        "fd=os.open(sys.argv[1],os.O_PATH)\n"
        "c=socket.socket(socket.AF_UNIX,socket.SOCK_SEQPACKET);c.connect(f'/proc/self/fd/{fd}/restore.sock')\n"
        "c.send(sys.stdin.buffer.read())\n"
        "print(c.recv(65536))\n"
    )
    packet = broker._packet(
        "prepare", "/", "/usr/sbin/runc", "runc-wrapper.before-restore=kill", *_argv(tmp_path, bundle)
    )
    proc = subprocess.run(
        ["python3", "-c", script, b.state_dir], input=packet, capture_output=True, timeout=30
    )
    assert proc.returncode == -9, proc


def test_an_early_page_check_yields_the_cpu_until_a_restore_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RestorePod's check hashes at nice 10 (per thread) beside the new pod's start-up; the broker's
    prepare takes it and puts its threads back to podshim's priority (PageImages.boost)."""
    import threading

    from shim.archive import fsutil

    ckpt, digests = _archive(tmp_path, b"\4" * 4096)
    release = threading.Event()
    real_hash = fsutil.hash_file

    def held_hash(path: Path, chunk: int, stop: threading.Event) -> tuple[int, str]:
        release.wait(10)
        return real_hash(path, chunk, stop)

    monkeypatch.setattr(fsutil, "hash_file", held_hash)
    checks = broker.PageChecks()
    checks.start(ckpt, digests)
    pages = checks.take(ckpt, digests)
    assert pages is not None and checks.take(ckpt, digests) is None
    deadline = time.monotonic() + 5
    while not pages._tids and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [os.getpriority(os.PRIO_PROCESS, t) for t in pages._tids] == [broker.EARLY_NICE]
    pages.boost()
    assert [os.getpriority(os.PRIO_PROCESS, t) for t in pages._tids] == [0]
    release.set()
    assert pages.wait() == ""


def test_a_client_that_hangs_up_stops_the_preparation(
    served: tuple[broker.RestoreBroker, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """podshim-runc killed (its deadline) while podshim applies the rootfs diff: podshim stops at
    the next member instead of working on for nobody, and stops the page check it took."""
    import io
    import tarfile

    from shim.archive import layout, rootfs_diff

    b, tmp_path = served
    ckpt, digests = _archive(tmp_path, b"\5" * 4096)
    with tarfile.open(layout.ContainerLayout(root=ckpt, rel="").rootfs_diff_tar, "w") as tar:
        for i in range(200):
            ti = tarfile.TarInfo(f"f{i}")
            ti.size = 1
            tar.addfile(ti, io.BytesIO(b"x"))
    applied: list[str] = []
    real_apply = rootfs_diff._apply_member

    def slow_apply(tar: tarfile.TarFile, ti: tarfile.TarInfo, *args: object) -> None:
        applied.append(ti.name)
        time.sleep(0.02)
        real_apply(tar, ti, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(rootfs_diff, "_apply_member", slow_apply)
    pages, bundle = _started_eager_restore(b, tmp_path, ckpt, digests)
    with _connect(b) as conn:
        conn.send(broker._packet("prepare", "/", "/usr/sbin/runc", "", *_argv(tmp_path, bundle)))
        deadline = time.monotonic() + 10
        while len(applied) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    time.sleep(0.5)
    stopped_at = len(applied)
    time.sleep(0.5)
    assert 5 <= stopped_at == len(applied) < 100, (stopped_at, len(applied))
    assert pages.stop.is_set()
