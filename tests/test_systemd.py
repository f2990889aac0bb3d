"""systemd/: the unit, the containerd drop-in, the podshim config and the kubelet flags parse,
agree with each other and with the console scripts; `systemd-analyze verify` and `containerd
config dump` check them for real when those programs are installed."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from shim import config as configmod
from shim.cli import base
from shim.cli import parser as cli_parser

REPO = Path(__file__).resolve().parents[1]
SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "podshim.service"
DROPIN = SYSTEMD / "containerd-podshim.toml"
CONFIG = SYSTEMD / "config.toml"
KUBELET_ENV = SYSTEMD / "kubelet.env"
KUBELET_DROPIN = SYSTEMD / "kubelet-podshim.conf"
VENV_PODSHIM = REPO / ".venv" / "bin" / "podshim"
CRI = "io.containerd.grpc.v1.cri"

# options that give the service a private mount namespace, a read-only /sys/fs/cgroup or take
# away what CRIU needs: the unit must not use them (see its comments)
BREAKS_CRIU = (
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "ProtectControlGroups",
    "ProtectKernelTunables",
    "RestrictNamespaces",
    "PrivateNetwork",
    "NoNewPrivileges",
    "CapabilityBoundingSet",
    "SystemCallFilter",
    "MemoryDenyWriteExecute",
    "DevicePolicy",
    "ProtectClock",
)


def unit(path: Path) -> configparser.ConfigParser:
    p = configparser.ConfigParser(interpolation=None, strict=True, delimiters=("=",))
    p.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    p.read_string(path.read_text())
    return p


def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


# ---------------------------------------------------------------------------- podshim.service


def test_service_runs_the_console_script() -> None:
    u = unit(UNIT)
    assert set(u.sections()) == {"Unit", "Service", "Install"}
    svc = u["Service"]
    argv = shlex.split(svc["ExecStart"])
    assert argv[0] == "/opt/podshim/bin/podshim"  # the package's (scripts/build-deb.sh)
    assert console_scripts()[os.path.basename(argv[0])] == "shim.cli:main"
    assert argv[1:] == ["serve", "--config", "/etc/podshim/config.toml"]
    args = cli_parser.build_parser().parse_args(argv[1:])  # the flags exist
    assert args.command == "serve" and args.config == "/etc/podshim/config.toml"
    assert svc["Type"] in ("simple", "exec")  # no sd_notify in podshim
    assert svc["Restart"] == "always"
    assert svc["RestartPreventExitStatus"] == "2"  # podshim's bad-configuration exit code
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert "containerd.service" in u["Unit"]["After"].split()
    assert "kubelet.service" in u["Unit"]["Before"].split()


def test_service_hardening_keeps_criu_working() -> None:
    svc = unit(UNIT)["Service"]
    used = [k for k in BREAKS_CRIU if k in svc]
    assert not used, f"these options break CRIU or the cgroup freezer: {used}"
    assert svc["UMask"] == "0077"


def test_service_stop_leaves_runc_and_criu_to_podshim() -> None:
    """KillMode=process: a stop or a crash signals podshim alone (the default control-group also
    SIGTERMs the runc/CRIU of a running checkpoint, whose orphaned CRIU then froze the pod again;
    mixed SIGKILLs them, the lazy-pages daemons and their guards once podshim exited); podshim's
    graceful stop (grace + clean-up) ends before systemd's SIGKILL of podshim."""
    from shim.server.app import STOP_CLEANUP, STOP_GRACE

    svc = unit(UNIT)["Service"]
    assert svc["KillMode"] == "process"
    assert svc.get("KillSignal", "SIGTERM") == "SIGTERM"
    assert STOP_GRACE + STOP_CLEANUP < float(svc["TimeoutStopSec"])


def test_service_directories_match_the_config() -> None:
    svc = unit(UNIT)["Service"]
    cfg = configmod.load(str(CONFIG), env={})
    assert cfg.state_dir == f"/var/lib/{svc['StateDirectory']}"
    assert os.path.dirname(cfg.socket) == f"/run/{svc['RuntimeDirectory']}"


def test_no_socket_unit_without_socket_activation() -> None:
    """podshim binds its own socket; a .socket unit needs LISTEN_FDS support first."""
    supports = any("LISTEN_FDS" in p.read_text() for p in (REPO / "shim").rglob("*.py"))
    sockets = list(SYSTEMD.glob("*.socket"))
    assert bool(sockets) == supports, (sockets, supports)


def _verify(path: Path) -> tuple[int, list[str]]:
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
    )
    ours = [line for line in (res.stdout + res.stderr).splitlines() if path.name in line]
    return res.returncode, ours


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (package systemd)"
)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """The unit as installed, with ExecStart pointing at this checkout's console script (the
    verifier checks that the program exists)."""
    assert VENV_PODSHIM.exists(), "run `make setup` first"
    text = UNIT.read_text().replace("/opt/podshim/bin/podshim", str(VENV_PODSHIM))
    copy = tmp_path / "podshim.service"
    copy.write_text(text)
    code, problems = _verify(copy)
    assert code == 0 and not problems, problems
    # the check sees mistakes (unknown keys are only warnings, with exit code 0)
    broken = tmp_path / "broken" / "podshim.service"
    broken.parent.mkdir()
    broken.write_text(text.replace("RestartSec=", "RestartSecs="))
    _code, problems = _verify(broken)
    assert any("RestartSecs" in p for p in problems), problems


# ---------------------------------------------------------------------------- containerd drop-in


def test_containerd_dropin_installs_podshim_runc() -> None:
    data = tomllib.loads(DROPIN.read_text())
    assert data["version"] == 2
    cri = data["plugins"][CRI]
    assert cri["containerd"]["snapshotter"] == "overlayfs"
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["runtime_type"] == "io.containerd.runc.v2"
    assert "podshim.*" in runc["container_annotations"]
    binary = runc["options"]["BinaryName"]
    assert os.path.basename(binary) == "podshim-runc"
    # podshim-runc is the compiled wrapper (`make -C native install`), which hands restores to
    # the console script podshim-runc-hook next to its real path
    assert "podshim-runc" not in console_scripts()
    assert console_scripts()["podshim-runc-hook"] == "shim.wrapper.main:main"
    native = (REPO / "native" / "Makefile").read_text()
    assert "$(BINDIR)/podshim-runc" in native
    assert '#define HOOK_NAME "podshim-runc-hook"' in (REPO / "native" / "podshim-runc.c").read_text()
    assert runc["options"]["CriuPath"] == configmod.load(str(CONFIG), env={}).runtime.criu


@pytest.mark.skipif(shutil.which("containerd") is None, reason="containerd is not installed")
def test_containerd_reads_the_dropin(tmp_path: Path) -> None:
    """`containerd config dump` (no daemon started) merges the drop-in through `imports`."""
    main = tmp_path / "config.toml"
    main.write_text(
        f'version = 2\nimports = ["{DROPIN}"]\nroot = "{tmp_path}/root"\nstate = "{tmp_path}/state"\n'
    )
    res = subprocess.run(
        ["containerd", "--config", str(main), "config", "dump"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    runc = tomllib.loads(res.stdout)["plugins"][CRI]["containerd"]["runtimes"]["runc"]
    assert runc["options"]["BinaryName"] == "/opt/podshim/bin/podshim-runc"
    assert runc["container_annotations"] == ["podshim.*"]
    assert not (tmp_path / "root").exists()  # nothing was started


# ---------------------------------------------------------------------------- config and kubelet


def test_example_config_loads() -> None:
    cfg = configmod.load(str(CONFIG), env={})
    assert cfg.socket == "/run/podshim/podshim.sock"
    assert base.DEFAULT_ENDPOINT == f"unix://{cfg.socket}"  # the CLI's default endpoint
    assert cfg.upstream_endpoint == "unix:///run/containerd/containerd.sock"
    assert cfg.metrics_address  # documented on, bound to localhost
    assert cfg.metrics_address.startswith("127.0.0.1:")
    assert cfg.runtime.root == "/run/containerd/runc/k8s.io"
    # a stock kubelet's checkpoint API (POST /checkpoint/...) writes into <root-dir>/checkpoints
    assert "/var/lib/kubelet/checkpoints" in cfg.allowed_roots
    assert cfg.allowed_roots == configmod.Config().allowed_roots
    # every CheckpointPod option's node default is written out, as the built-in one
    assert cfg.option_defaults() == configmod.Config().option_defaults()
    assert "ghost_limit_max" in CONFIG.read_text() and "irmap_scan_paths" in CONFIG.read_text()


def test_kubelet_flags_point_at_podshim() -> None:
    env: dict[str, str] = {}
    for line in KUBELET_ENV.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = " ".join(shlex.split(value))
    flags = env["KUBELET_EXTRA_ARGS"].split()
    socket = configmod.load(str(CONFIG), env={}).socket
    assert f"--container-runtime-endpoint=unix://{socket}" in flags
    dropin = unit(KUBELET_DROPIN)["Unit"]
    assert "podshim.service" in dropin["After"].split()
    assert "podshim.service" in dropin["Wants"].split()
