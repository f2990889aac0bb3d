"""`podshim node setup` (shim/node/setup.py, docs/design/install.md (Installing a node)): on the
containerd the suite runs against (PODSHIM_TEST_CONTAINERD), a bed wired like a node without
podshim (the plain runc as BinaryName, podshim's annotations not passed) is wired by it, containerd
restarted, and a pod checkpointed there restores; a second run changes nothing; --undo puts the
config back as it was. Unit tests of the config edits below."""

from __future__ import annotations

import secrets
import signal
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim.node import containerd as ctdmod
from shim.node import kubelet, setup
from testbed import pods
from testbed.bed import VENV_BIN, TestBed
from testbed.versions import real_runc

PODSHIM = str(VENV_BIN / "podshim")


def podshim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PODSHIM, *args], capture_output=True, text=True, timeout=120)


def containerd_binary(b: TestBed) -> str:
    return str(b.containerd_bin_dir / "containerd") if b.containerd_bin_dir else "containerd"


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def plain_bed() -> Iterator[TestBed]:
    """A node before podshim: runc as the handler's BinaryName, other annotations passed."""
    with TestBed(runc_binary=real_runc(), container_annotations=["io.kubernetes.cri.*"]) as b:
        yield b


def setup_args(b: TestBed, *extra: str) -> list[str]:
    return [
        "node",
        "setup",
        "--containerd",
        containerd_binary(b),
        "--config",
        str(b.containerd_config),
        "--drop-in",
        str(b.base_dir / "conf.d" / "podshim.toml"),
        "--podshim-config",
        str(b.podshim_config),
        "--podshim-runc",
        str(VENV_BIN / "podshim-runc"),
        *extra,
    ]


def doctor(b: TestBed) -> subprocess.CompletedProcess[str]:
    return podshim("doctor", "--config", str(b.podshim_config), "--kubelet-pid", "0")


@pytest.mark.e2e
def test_node_setup_wires_containerd_and_a_restore_restores(plain_bed: TestBed) -> None:
    b = plain_bed
    drop_in = b.base_dir / "conf.d" / "podshim.toml"
    original = b.containerd_config.read_text()
    before = doctor(b)
    assert before.returncode == 1 and "FAIL wiring runc: " in before.stdout, before.stdout

    dry = podshim(*setup_args(b, "--dry-run"))
    assert dry.returncode == 0, dry.stderr
    assert "BinaryName" in dry.stdout and "dry run: nothing was written" in dry.stdout, dry.stdout
    assert not drop_in.exists() and b.containerd_config.read_text() == original

    res = podshim(*setup_args(b))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"wrote {drop_in}" in res.stdout and f"backed up {b.containerd_config}" in res.stdout, res.stdout
    written = tomllib.loads(drop_in.read_text())
    major = int(b.containerd_version.split(".")[0])
    assert written["version"] == (2 if major == 1 else 4 if b.containerd_at_least("2.4") else 3)
    b.stop_containerd()
    b.start_containerd()
    # and podshim (re)started after it, as on a node: its wiring check holds a Status for 5 s
    b.kill_podshim(signal.SIGTERM)
    b.start_podshim_again()

    after = doctor(b)
    assert "ok   wiring runc: runs " in after.stdout, after.stdout
    assert "FAIL" not in after.stdout and after.returncode == 0, after.stdout
    restore_resumes(b)

    again = podshim(*setup_args(b))
    assert again.returncode == 0 and "nothing to change" in again.stdout, again.stdout
    assert len(list(b.containerd_config.parent.glob("containerd.toml.podshim-backup-*"))) == 1

    undo = podshim(*setup_args(b, "--undo"))
    assert undo.returncode == 0, undo.stdout + undo.stderr
    assert not drop_in.exists() and b.containerd_config.read_text() == original, undo.stdout


def restore_resumes(b: TestBed) -> None:
    rt = pods.stubs(b.podshim_socket)[0]
    log_root = b.pod_logs_dir
    cc = pods.container_config("counter", args=["--mem-mib", "4", "--interval-ms", "50"])
    src = pods.run_pod(rt, f"setup-{secrets.token_hex(2)}", log_root, {"counter": cc})
    out = b.checkpoint_root / f"setup-{secrets.token_hex(3)}"
    out.mkdir(mode=0o700)
    pods.wait_count(src.log_path("counter"), 10)
    rt.CheckpointPod(
        cri.CheckpointPodRequest(
            pod_sandbox_id=src.id, container_ids=pods.running_ids(rt, src.id), output_path=str(out)
        ),
        timeout=120,
    )
    saved = pods.counts(src.log_path("counter"))[-1]
    pods.remove_pod(rt, src.id)
    config = pods.pod_config(f"setup-restored-{secrets.token_hex(2)}", log_root)
    resp = rt.RestorePod(
        cri.RestorePodRequest(checkpoint_path=str(out), config=config, container_configs=[cc]), timeout=120
    )
    try:
        for c in resp.restored_containers:
            rt.StartContainer(cri.StartContainerRequest(container_id=c.container_id), timeout=60)
        log = Path(config.log_directory) / cc.log_path
        pods.wait_count(log, saved + 3)
        assert pods.counts(log)[0] > 5, "the restored counter started from 0: not restored"
    finally:
        pods.remove_pod(rt, resp.pod_sandbox_id)


# ---------------------------------------------------------------------------- units


CTD1 = ctdmod.Containerd("containerd", "1.6.20", 2)
CTD2 = ctdmod.Containerd("containerd", "2.2.9", 3)


def test_import_is_added_and_undone_exactly(tmp_path: Path) -> None:
    cases = {
        "no imports": 'version = 2\n# a comment\n\n[plugins."x"]\n  a = 1\n',
        "an imports line": 'version = 2\nimports = ["/etc/other/*.toml"]\n[plugins."x"]\n  a = 1\n',
        "no table": "version = 3\n",
    }
    for what, text in cases.items():
        path = tmp_path / "config.toml"
        path.write_text(text)
        main = ctdmod.MainConfig.read(path)
        new, why = setup.add_import(main, "/etc/containerd/conf.d/*.toml", 2)
        assert new is not None, (what, why)
        path.write_text(new)
        assert ctdmod.MainConfig.read(path).covers(Path("/etc/containerd/conf.d/podshim.toml")), what
        assert setup.remove_import(new) == text, what
    created, _ = setup.add_import(ctdmod.MainConfig(tmp_path / "none", None, {}), "/d/*.toml", 3)
    assert created is not None and tomllib.loads(created) == {"version": 3, "imports": ["/d/*.toml"]}
    assert setup.remove_import(created) is None  # a file node setup created goes again


def test_multi_line_imports_are_not_edited(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('version = 2\nimports = [\n  "/a/*.toml",\n]\n')
    new, why = setup.add_import(ctdmod.MainConfig.read(path), "/etc/containerd/conf.d/*.toml", 2)
    assert new is None and "several lines" in why


def test_drop_in_of_containerd_1_carries_the_whole_cri_section() -> None:
    base = {
        "sandbox_image": "pause:9",
        "containerd": {"runtimes": {"runc": {"options": {"SystemdCgroup": True}}}},
    }
    now = {"plugins": {ctdmod.CRI_V2: base}}
    config, problems = setup.drop_in_config(
        CTD1, now, base, ["runc"], "/opt/podshim/bin/podshim-runc", {"runc": "/c/criu"}, True
    )
    assert not problems
    cri_ = config["plugins"][ctdmod.CRI_V2]
    assert config["version"] == 2 and cri_["sandbox_image"] == "pause:9" and cri_["restrict_oom_score_adj"]
    runc = cri_["containerd"]["runtimes"]["runc"]
    assert runc["options"] == {
        "SystemdCgroup": True,
        "BinaryName": "/opt/podshim/bin/podshim-runc",
        "CriuPath": "/c/criu",
    }
    assert runc["container_annotations"] == ["podshim.*"] and runc["runtime_type"] == "io.containerd.runc.v2"
    assert base["containerd"]["runtimes"]["runc"]["options"] == {"SystemdCgroup": True}  # not modified


def test_drop_in_of_containerd_2_holds_podshims_keys_only() -> None:
    table = {"runtime_type": "io.containerd.runc.v2", "container_annotations": ["io.kubernetes.*"]}
    now = {"plugins": {ctdmod.CRI_RUNTIME: {"containerd": {"runtimes": {"runc": table}}}}}
    config, problems = setup.drop_in_config(CTD2, now, {}, ["runc"], "/p/podshim-runc", {}, False)
    assert not problems and config["version"] == 3
    assert config["plugins"] == {
        ctdmod.CRI_RUNTIME: {
            "containerd": {
                "runtimes": {
                    "runc": {
                        "runtime_type": "io.containerd.runc.v2",
                        "container_annotations": ["io.kubernetes.*", "podshim.*"],  # a list is replaced
                        "options": {"BinaryName": "/p/podshim-runc"},  # no CriuPath in 2.x
                    }
                }
            }
        }
    }
    wide = {
        "plugins": {
            ctdmod.CRI_RUNTIME: {"containerd": {"runtimes": {"runc": {"container_annotations": ["*"]}}}}
        }
    }
    config, _ = setup.drop_in_config(CTD2, wide, {}, ["runc"], "/p/podshim-runc", {}, False)
    assert config["plugins"][ctdmod.CRI_RUNTIME]["containerd"]["runtimes"]["runc"][
        "container_annotations"
    ] == ["*"]


def test_a_handler_that_runs_no_oci_runtime_is_refused() -> None:
    now = {
        "plugins": {
            ctdmod.CRI_RUNTIME: {
                "containerd": {"runtimes": {"kata": {"runtime_type": "io.containerd.kata.v2"}}}
            }
        }
    }
    _, problems = setup.drop_in_config(CTD2, now, {}, ["kata"], "/p/podshim-runc", {}, False)
    assert problems and "kata" in problems[0]


def test_capability_is_read_from_cap_eff() -> None:
    assert setup.has_capability(24, "CapEff:\t000001ffffffffff\n")
    assert not setup.has_capability(24, "CapEff:\t000001fffeffffff\n")


def test_the_kubelets_endpoint_from_flag_config_or_default(tmp_path: Path) -> None:
    (tmp_path / "kc.yaml").write_text(
        "kind: KubeletConfiguration\ncontainerRuntimeEndpoint: unix:///run/p.sock\n"
    )
    flag = kubelet.from_argv(
        1, ["kubelet", "--container-runtime-endpoint=unix:///a.sock", "--root-dir", "/k"]
    )
    assert (flag.endpoint, flag.root_dir) == ("unix:///a.sock", "/k")
    by_file = kubelet.from_argv(1, ["kubelet", "--config", "kc.yaml"], "/", str(tmp_path))
    assert by_file.endpoint == "unix:///run/p.sock" and by_file.root_dir == kubelet.DEFAULT_ROOT_DIR
    assert kubelet.from_argv(1, ["kubelet"]).endpoint == kubelet.DEFAULT_ENDPOINT
