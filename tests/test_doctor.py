"""`podshim doctor` (shim/node/doctor.py, docs/design/install.md (Installing a node)): it passes on
the session's bed (wired right, podshim serving, a kubelet pointed at it) and fails on that node
broken one way at a time, naming the check that broke and only that one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tomli_w

from shim.config import Config
from shim.node import doctor
from testbed import _sys
from testbed.bed import VENV_BIN, TestBed
from testbed.versions import real_runc

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "scripts" / "patches" / "criu"


def run_doctor(config: Path, *kubelets: subprocess.Popen[bytes]) -> tuple[int, list[str]]:
    pids = [a for k in kubelets for a in ("--kubelet-pid", str(k.pid))] or ["--kubelet-pid", "0"]
    res = subprocess.run(
        [str(VENV_BIN / "podshim"), "doctor", "--config", str(config), *pids],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert not res.stderr.strip(), res.stderr
    return res.returncode, res.stdout.splitlines()


def failed(lines: list[str]) -> list[str]:
    return [line.split(":", 1)[0].removeprefix("FAIL ") for line in lines if line.startswith("FAIL ")]


@contextlib.contextmanager
def fake_kubelet(endpoint: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose command line is a kubelet's (what the doctor reads of a kubelet)."""
    k = subprocess.Popen(
        ["kubelet", "-c", "import time; time.sleep(600)", f"--container-runtime-endpoint={endpoint}"],
        executable=sys.executable,
        start_new_session=True,
    )
    try:
        yield k
    finally:
        k.kill()
        k.wait()


@pytest.fixture
def kubelet_ok(bed: TestBed) -> Iterator[subprocess.Popen[bytes]]:
    with fake_kubelet(f"unix://{bed.podshim_socket}") as k:
        yield k


def config_with(bed: TestBed, tmp_path: Path, **sections: dict[str, object]) -> Path:
    """The bed's podshim config with `sections` merged in, as a file of its own."""
    cfg = tomllib.loads(bed.podshim_config.read_text())
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = tmp_path / "podshim.toml"
    path.write_text(tomli_w.dumps(cfg))
    return path


@pytest.mark.e2e
def test_doctor_passes_on_a_good_node(bed: TestBed, kubelet_ok: subprocess.Popen[bytes]) -> None:
    rc, lines = run_doctor(bed.podshim_config, kubelet_ok)
    assert rc == 0 and not failed(lines), "\n".join(lines)
    for check in ("criu check", "criu patches", "criu dump/restore", "wiring runc", "podshim", "state dir"):
        assert any(line.startswith(f"ok   {check}:") for line in lines), (check, lines)
    assert f"ok   kubelet {kubelet_ok.pid}: uses unix://{bed.podshim_socket}" in "\n".join(lines)


Break = Callable[[TestBed, Path], Path]  # breaks the node, returns the podshim config to check


def state_dir_open(bed: TestBed, tmp: Path) -> Path:
    os.chmod(bed.podshim_state_dir, 0o777)
    return bed.podshim_config


def allowed_root_open(bed: TestBed, tmp: Path) -> Path:
    """Anyone may write where podshim reads archives and writes checkpoints."""
    root = tmp / "open-root"
    root.mkdir()
    root.chmod(0o777)
    return config_with(bed, tmp, checkpoint={"allowed_roots": [str(root)]})


def criu_without_patches(bed: TestBed, tmp: Path) -> Path:
    """The bed's CRIU with the strings podshim's patches add overwritten: it still dumps and
    restores, but it is not the CRIU that carries the fixes."""
    data = bed.criu.read_bytes()
    for marker in filter(None, doctor.CRIU_PATCH_MARKERS.values()):
        assert marker in data
        data = data.replace(marker, b"x" * len(marker))
    criu = tmp / "unpatched" / "criu"
    criu.parent.mkdir()
    criu.write_bytes(data)
    criu.chmod(0o755)
    return config_with(bed, tmp, runtime={"criu": str(criu)})


def runtime_missing(bed: TestBed, tmp: Path) -> Path:
    return config_with(bed, tmp, runtime={"binary": str(tmp / "no-runc")})


def podshim_not_serving(bed: TestBed, tmp: Path) -> Path:
    bed.kill_podshim(signal.SIGTERM)  # started again after the check
    return bed.podshim_config


def checkpoint_disk_full(bed: TestBed, tmp: Path) -> Path:
    root = tmp / "small"
    root.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(root)], check=True)
    return config_with(bed, tmp, checkpoint={"allowed_roots": [str(root)]})


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("breaks", "expected"),
    [
        (state_dir_open, ["state dir"]),
        (allowed_root_open, ["allowed root"]),
        (criu_without_patches, ["criu patches"]),
        (runtime_missing, ["runtime runc"]),
        (podshim_not_serving, ["podshim"]),
        (checkpoint_disk_full, ["free space"]),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_doctor_fails_on_a_node_broken_one_way(
    bed: TestBed, kubelet_ok: subprocess.Popen[bytes], tmp_path: Path, breaks: Break, expected: list[str]
) -> None:
    os.chmod(tmp_path, 0o700)
    try:
        config = breaks(bed, tmp_path)
        rc, lines = run_doctor(config, kubelet_ok)
    finally:
        os.chmod(bed.podshim_state_dir, 0o700)
        _sys.unmount_all_under(tmp_path)
        if not bed.podshim_running:
            bed.start_podshim_again()
    if breaks is criu_without_patches and not bed.containerd_at_least("2.0") and bed.runc_version == "1.1":
        # and containerd 1.x's CriuPath names another CRIU (the bed sets it for runc < 1.2 only,
        # as `podshim node setup` does: runc >= 1.2 ignores it)
        expected = [*expected, "wiring runc"]
    assert rc == 1, "\n".join(lines)
    assert [f.split(" /")[0] for f in failed(lines)] == expected, "\n".join(lines)


@pytest.mark.e2e
def test_doctor_fails_on_a_kubelet_pointed_elsewhere(bed: TestBed) -> None:
    with fake_kubelet(f"unix://{bed.containerd_socket}") as k:
        rc, lines = run_doctor(bed.podshim_config, k)
    assert rc == 1 and failed(lines) == [f"kubelet {k.pid}"], "\n".join(lines)
    assert any("set --container-runtime-endpoint=unix://" in line for line in lines), lines


@pytest.mark.e2e
def test_doctor_fails_on_containerd_wired_wrong(tmp_path: Path) -> None:
    """A node whose runc handler runs the plain runc: restores would start containers from
    scratch. The doctor says so, and how to fix it."""
    with TestBed(runc_binary=real_runc()) as b, fake_kubelet(f"unix://{b.podshim_socket}") as k:
        rc, lines = run_doctor(b.podshim_config, k)
    assert rc == 1 and failed(lines) == ["wiring runc"], "\n".join(lines)
    assert any("BinaryName" in line and "podshim node setup" in line for line in lines), lines


# ---------------------------------------------------------------------------- units


def test_every_shared_criu_patch_has_a_marker_in_it() -> None:
    """The doctor tells a CRIU with podshim's patches by a string each shared patch adds: a new
    patch needs its entry in doctor.CRIU_PATCH_MARKERS (a log message it adds)."""
    shared = sorted(p.name for p in PATCHES.glob("*.patch"))
    assert sorted(doctor.CRIU_PATCH_MARKERS) == shared
    for name, marker in doctor.CRIU_PATCH_MARKERS.items():
        if marker is None:  # adds no string of its own: not checked
            continue
        added = "\n".join(x for x in (PATCHES / name).read_text().splitlines() if x.startswith("+"))
        assert marker.decode() in added, name


@pytest.mark.parametrize("criu", ["/usr/local/sbin/criu", "/var/cache/podshim/criu/4.2/sbin/criu"])
def test_the_set_ups_criu_builds_carry_the_markers(criu: str) -> None:
    if not Path(criu).exists():
        pytest.skip(f"{criu} not built (scripts/setup.sh)")
    assert doctor.check_criu_patches(criu)[0].status is doctor.Status.OK


def test_a_criu_not_named_criu_is_refused(tmp_path: Path) -> None:
    """runc >= 1.2, crun and containerd 2.x run the `criu` on PATH: podshim can only put a file
    named criu first there."""
    for name, status in (("criu-4.2", doctor.Status.FAIL), ("criu", doctor.Status.OK)):
        fake = tmp_path / name
        fake.write_text("#!/bin/sh\necho Version: 4.2.1\n")
        fake.chmod(0o755)
        r = doctor.check_criu_binary(str(fake))[0]
        assert r.status is status and ("named `criu`" in r.detail) == (status is doctor.Status.FAIL), r


def test_cgroup_layout_is_read_from_the_mounts() -> None:
    results = doctor.check_cgroups(Config())
    assert results[0].status is doctor.Status.OK, results


def test_a_cgroup2_node_is_reported_as_v2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This host is hybrid: the unified layout's line is reached only with its mount faked."""
    monkeypatch.setattr(doctor, "_fstype", lambda path: "cgroup2")
    (result,) = doctor.check_cgroups(Config(), tmp_path)
    assert result.status is doctor.Status.OK and result.detail.startswith("v2"), result
