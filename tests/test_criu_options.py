"""CheckpointPod's CRIU options without runc/crun flags: ghost-limit and
irmap-scan-paths are parsed strictly, reach CRIU through a config file, and a CRIU log that one of
them would fix makes the failure name it."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shim import deadlines, errors
from shim.criu import options, runtime
from shim.criu.log import option_hint
from shim.criu.netns_lock import NetnsLock
from shim.criu.options import CriuOptions, DumpGate, criu_path_env
from shim.criu.runtime import OciRuntime
from shim.ops.checkpoint_pod import CheckpointOptions


@pytest.mark.parametrize(
    ("value", "want"), [("2097152", 2097152), ("4M", 4 << 20), ("8k", 8 << 10), ("1G", 1 << 30), ("", 0)]
)
def test_ghost_limit_sizes(value: str, want: int) -> None:
    assert CheckpointOptions.parse({"ghost-limit": value}).criu.ghost_limit == want


@pytest.mark.parametrize("value", ["-1", "0", "4X", "M", "1.5M", "2T"])
def test_bad_ghost_limit_is_invalid(value: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="ghost-limit"):
        CheckpointOptions.parse({"ghost-limit": value})


def test_irmap_scan_paths() -> None:
    opts = CheckpointOptions.parse({"irmap-scan-paths": "/data, /etc/app", "ghost-limit": "4M"}).criu
    assert opts.irmap_scan_paths == ("/data", "/etc/app")
    assert opts.config_lines() == ["ghost-limit 4194304", "irmap-scan-path /data", "irmap-scan-path /etc/app"]
    assert CriuOptions().config_lines() == []
    for bad in ("data", "/a/../b", "/a\nforce-irmap"):
        with pytest.raises(errors.InvalidArgument, match="irmap-scan-paths"):
            CheckpointOptions.parse({"irmap-scan-paths": bad})


def test_failure_names_the_option_that_would_help(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.1) Error (criu/files-reg.c:1047): Can't dump ghost file /tmp/big of 2097152 size, "
        "increase limit\n"
    )
    assert "ghost-limit=2097152" in option_hint(log)
    log.write_text("(00.1) Error (criu/fsnotify.c:284): fsnotify: \tCan't dump that handle\n")
    assert "irmap-scan-paths=" in option_hint(log)
    log.write_text("(00.1) Error (criu/cr-dump.c:2111): Dumping FAILED.\n")
    assert option_hint(log) == ""
    assert option_hint(tmp_path / "missing.log") == ""


def test_dump_skips_criu_network_lock() -> None:
    """Each container's CRIU would lock the pod's shared netns with iptables-restore before its
    dump and unlock it after, inside the freeze window (docs/design/checkpoint-pod.md (The freeze
    window)): the dump's config file turns that off; with tcp-established CheckpointPod takes the
    same lock once for the pod (NetnsLock)."""
    assert CriuOptions().dump_config_lines() == ["network-lock skip"]
    opts = CheckpointOptions.parse({"ghost-limit": "4M"}).criu
    assert opts.dump_config_lines() == ["ghost-limit 4194304", "network-lock skip"]
    tcp = CheckpointOptions.parse({"tcp-established": "true"}).criu
    assert tcp.dump_config_lines() == ["network-lock skip"]


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("iptables-restore"), reason="needs root and iptables"
)
def test_netns_lock_once_for_the_pod() -> None:
    """NetnsLock puts CRIU's own lock (the CRIU chain dropping all but CRIU's marked packets) on a
    network namespace and takes it off again; unlocking what was never locked does nothing."""
    name = f"podshim-test-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    netns = f"/var/run/netns/{name}"

    def rules() -> str:
        return subprocess.run(
            ["nsenter", f"--net={netns}", "iptables", "-S"], capture_output=True, text=True, check=True
        ).stdout

    try:
        lock = NetnsLock(netns)
        lock.unlock()  # nothing locked: nothing to do
        lock.lock()
        assert "-A INPUT -j CRIU" in rules() and "-A CRIU -j DROP" in rules()
        assert "iptables-restore" in lock.locked
        lock.unlock()
        assert "CRIU" not in rules() and lock.locked == []
        with pytest.raises(errors.Internal, match="network namespace /nonexistent"):
            NetnsLock("/nonexistent").lock()
        # recovery: a lock a crash left behind is found and removed; none left, nothing done
        NetnsLock(netns).lock()
        assert NetnsLock.unlock_leftover(netns) is True
        assert "CRIU" not in rules()
        assert NetnsLock.unlock_leftover(netns) is False
        assert NetnsLock.unlock_leftover("/nonexistent") is False
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_a_failed_dump_on_a_full_filesystem_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU's log lies on the images' filesystem: when that is full, the line saying so may never
    have been written, so the error names it from the filesystem itself."""

    class Fs:
        f_frsize = 4096
        f_bavail = 0
        f_files = 1000
        f_favail = 500

    monkeypatch.setattr(runtime.os, "statvfs", lambda _p: Fs())
    assert runtime._full_fs(tmp_path)
    Fs.f_bavail = 1 << 20  # 4 GiB free
    assert not runtime._full_fs(tmp_path)
    Fs.f_favail = 3  # out of inodes
    assert runtime._full_fs(tmp_path)
    Fs.f_files = Fs.f_favail = 0  # a filesystem that counts no inodes (btrfs)
    assert not runtime._full_fs(tmp_path)
    monkeypatch.undo()
    assert not runtime._full_fs(tmp_path / "gone")


def test_the_configured_criu_goes_first_on_the_runtimes_path() -> None:
    """runc >= 1.2 ignores --criu and crun's libcriu runs `criu` from PATH; containerd 2.x passes no
    CriuPath: podshim puts its CRIU's directory first on the PATH of every runtime it runs."""
    assert criu_path_env("/opt/podshim/sbin/criu", "/usr/sbin:/usr/bin") == {
        "PATH": "/opt/podshim/sbin:/usr/sbin:/usr/bin"
    }
    assert criu_path_env("criu", "/usr/bin") == {}  # on PATH already: nothing to name
    assert criu_path_env("/opt/x/criu-4.2", "/usr/bin") == {}  # not reachable as `criu`


def test_runc_gets_no_criu_flag_when_path_names_the_criu() -> None:
    """runc >= 1.2 ignores --criu with a warning on stderr (which kills it by SIGPIPE once podshim
    is gone mid-dump): podshim passes it only for a CRIU PATH cannot name."""
    assert "--criu" not in OciRuntime("/usr/sbin/runc", "/r", "/opt/podshim/sbin/criu").global_args()
    assert OciRuntime("/usr/sbin/runc", "/r", "/x/criu-4.2").global_args()[-2:] == ["--criu", "/x/criu-4.2"]
    assert "--criu" not in OciRuntime("/usr/local/bin/crun", "/r", "/x/criu-4.2").global_args()


def test_the_upstreams_criu_flag_leaves_the_restore() -> None:
    from shim.wrapper.restore import _without_flag

    argv = ["--root", "/r", "--criu", "/usr/sbin/criu", "--log", "l", "--criu=/x"]
    assert _without_flag(argv, "--criu") == ["--root", "/r", "--log", "l"]


def _run_gate_script(gate: DumpGate, action: str = "pre-dump") -> subprocess.Popen[bytes]:
    """The gate's script as CRIU runs an action script (`sh -c <path>`, the action in the env)."""
    env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": action}
    return subprocess.Popen(["sh", "-c", str(gate.script)], env=env)


def _wait_ready(gate: DumpGate) -> None:
    deadline = time.monotonic() + 10
    while not gate.ready():
        assert time.monotonic() < deadline, "the gate's script never reached the gate"
        time.sleep(0.01)


def test_dump_gate_holds_criu_until_opened() -> None:
    """A dump started before the cut waits in CRIU's pre-dump action script (docs/design/checkpoint-pod.md
    (The freeze window)): it says it is there, goes on (exit 0) only once the gate opens, and
    the gate's line names the script in the dump's CRIU config file."""
    gate = DumpGate()
    try:
        assert gate.config_line() == f"action-script {gate.script}"
        other = _run_gate_script(gate, "post-dump")  # every other action passes at once
        assert other.wait(10) == 0
        p = _run_gate_script(gate)
        _wait_ready(gate)
        time.sleep(0.2)
        assert p.poll() is None, "the dump went past the gate before it opened"
        assert not gate.passed.is_set()
        gate.open()
        assert p.wait(10) == 0
        assert gate.passed.is_set()
    finally:
        gate.close()
    assert not gate.dir.exists()


def test_dump_gate_passes_a_go_split_by_the_scripts_read_timeout() -> None:
    """The script reads the FIFO with a timeout (GATE_LOOK, to see that podshim lives); a timeout
    between the bytes of "go" consumed the "g", the next read got "o", and the dump failed at the
    gate: once in a whole-suite run, under load (test_subdirectory_planted_after_the_emptiness_check
    got INTERNAL "Pre dump script failed")."""
    gate = DumpGate()
    try:
        p = _run_gate_script(gate)
        _wait_ready(gate)
        assert gate.fd is not None
        os.write(gate.fd, b"g")
        time.sleep(3 * deadlines.GATE_LOOK)  # the script's read times out after the "g"
        assert p.poll() is None
        os.write(gate.fd, b"o\n")
        assert p.wait(10) == 0
    finally:
        gate.close()


def test_a_dumps_files_for_runc_and_criu_go_to_the_scratch_dir(tmp_path: Path) -> None:
    """The gate and the CRIU config file live in podshim's scratch dir (Config.scratch_dir,
    emptied at start), not in the shared temp dir, where a killed podshim's would stay."""
    scratch = tmp_path / "state" / "scratch"
    gate = DumpGate(str(scratch))
    try:
        assert gate.dir.parent == scratch
    finally:
        gate.close()
    opts = CriuOptions(tcp_established=True)
    with options.criu_config(opts, "criu", (), str(scratch)) as env:
        assert Path(env["CRIU_CONFIG_FILE"]).parent == scratch
    assert list(scratch.iterdir()) == []


def test_a_gated_dumps_criu_config_file_is_removed_with_its_gate(tmp_path: Path) -> None:
    """A gated dump's CRIU config file lives in the gate's directory and outlasts the dump: it is
    removed with the gate, after the checkpoint, not as each dump ends (where the file system
    discards freed blocks, the unlink waits for the disk's queue and held the event loop, and so
    the thaw, for 0.05-0.25 s per dump: docs/design/checkpoint-pod.md (The freeze window))."""
    scratch = tmp_path / "scratch"
    gate = DumpGate(str(scratch))
    try:
        opts = CriuOptions(tcp_established=True)
        with options.criu_config(opts, "criu", (gate.config_line(),), str(scratch), gate) as env:
            conf = Path(env["CRIU_CONFIG_FILE"])
            assert conf.parent == gate.dir
            assert conf.stat().st_mode & 0o777 == 0o600
            assert gate.config_line() in conf.read_text().splitlines()
        assert conf.exists()  # the dump has ended: still there
    finally:
        gate.close()
    assert not conf.exists() and not gate.dir.exists()
    assert list(scratch.iterdir()) == []


def test_dump_gate_closed_fails_the_dump_at_the_gate() -> None:
    """Closed without opening (a failure before the cut, podshim gone): CRIU's pre-dump script
    fails, so the dump ends before it seizes anything; a CRIU that comes later finds no gate."""
    gate = DumpGate()
    p = _run_gate_script(gate)
    _wait_ready(gate)
    gate.close()
    assert p.wait(10) != 0
    assert gate.passed.is_set()
    late = _run_gate_script(gate)
    assert late.wait(10) != 0


def test_dump_gate_of_a_killed_podshim_gives_up(tmp_path: Path) -> None:
    """podshim killed (SIGKILL) with a dump at its gate: the orphan CRIU's script notices within
    GATE_LOOK that podshim's process is gone, fails (nothing seized) and removes the gate's
    directory, so the restarted podshim's recovery, which waits for such leftovers, goes on."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom shim.criu.options import DumpGate\n"
            "print(DumpGate(sys.argv[1]).dir, flush=True)\ntime.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert owner.stdout is not None
        gate_dir = Path(owner.stdout.readline().decode().strip())
        env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": "pre-dump"}
        p = subprocess.Popen(["sh", "-c", str(gate_dir / "pre-dump")], env=env)
        deadline = time.monotonic() + 10
        while not (gate_dir / "ready").exists():
            assert time.monotonic() < deadline, "the gate's script never reached the gate"
            time.sleep(0.01)
        time.sleep(0.3)
        assert p.poll() is None, "the gate gave up while podshim was there"
    finally:
        owner.kill()
        owner.wait()
    start = time.monotonic()
    assert p.wait(10) != 0
    assert time.monotonic() - start < 1 + deadlines.GATE_LOOK
    assert not gate_dir.exists()
