"""The crictl-style `podshim` client: argument handling, rendering and config derivation as unit
tests; checkpointpod → restorepod → ps/pods end to end through the session bed's containerd."""

from __future__ import annotations

import io
import json
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf import json_format

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim import cli, deadlines, rpc_client
from shim.cli import base, output, transport
from shim.cli import parser as cli_parser
from shim.cli.commands import inspectp, restorepod
from testbed import pods, resume
from testbed.bed import TestBed

REPO = Path(__file__).resolve().parents[1]
PODSHIM = REPO / ".venv" / "bin" / "podshim"


def podshim(
    *args: str, endpoint: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run the installed console script with pipes (so: not a terminal)."""
    cmd = [str(PODSHIM)]
    if endpoint:
        cmd += ["-r", endpoint]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)


def assert_clean_error(res: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    for n in needles:
        assert n in res.stderr, res.stderr


# ---------------------------------------------------------------------------- arguments


def test_duration_accepts_seconds_and_units() -> None:
    assert base.duration("30") == 30
    assert base.duration("2.5s") == 2.5
    assert base.duration("2m") == 120
    assert base.duration("500ms") == 0.5
    for bad in ("", "x", "-1", "0", "3d"):
        with pytest.raises(Exception, match="invalid duration"):
            base.duration(bad)


def test_key_value_and_name_file() -> None:
    assert base.key_value("tcp-established=true") == ("tcp-established", "true")
    assert base.key_value("k=") == ("k", "")
    assert base.key_value("k=a=b") == ("k", "a=b")
    assert base.name_file("app=/tmp/c.yaml") == ("app", "/tmp/c.yaml")
    for bad in ("novalue", "=v"):
        with pytest.raises(Exception, match="KEY=VALUE"):
            base.key_value(bad)
    for bad in ("app", "app=", "=f"):
        with pytest.raises(Exception, match="NAME=FILE"):
            base.name_file(bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["checkpointpod", "pod", "/tmp/x", "--option", "no-equals-sign"],
        ["checkpointpod", "pod"],  # PATH missing
        ["restorepod", "/tmp/x", "--container-config", "nofile"],
        ["pods", "-o", "xml"],
        ["--timeout", "soon", "pods"],
        ["nosuchcommand"],
    ],
)
def test_usage_errors_exit_2_without_traceback(argv: list[str]) -> None:
    res = podshim(*argv, endpoint="unix:///nonexistent/podshim.sock")
    assert_clean_error(res, 2)
    assert "usage:" in res.stderr


def test_global_options_before_or_after_the_command() -> None:
    parser = cli_parser.build_parser()
    a = parser.parse_args(["-r", "unix:///a.sock", "--timeout", "5", "-o", "json", "pods"])
    b = parser.parse_args(["pods", "-r", "unix:///a.sock", "--timeout", "5", "-o", "json"])
    for ns in (a, b):
        assert base.endpoint(ns) == "unix:///a.sock"
        assert base.timeout_of(ns) == 5
        assert base.output_of(ns) == "json"
    c = parser.parse_args(["pods"])
    assert base.timeout_of(c) == deadlines.CLI_SHORT_TIMEOUT
    assert base.timeout_of(c, long=True) == deadlines.CLI_LONG_TIMEOUT
    assert base.output_of(c) == "table"


def test_endpoint_from_environment_and_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli_parser.build_parser()
    monkeypatch.delenv(base.ENDPOINT_ENV, raising=False)
    assert base.endpoint(parser.parse_args(["pods"])) == base.DEFAULT_ENDPOINT
    monkeypatch.setenv(base.ENDPOINT_ENV, "unix:///env.sock")
    assert base.endpoint(parser.parse_args(["pods"])) == "unix:///env.sock"
    assert base.endpoint(parser.parse_args(["-r", "/flag.sock", "pods"])) == "/flag.sock"
    assert rpc_client.grpc_target("/flag.sock") == "unix:///flag.sock"
    assert rpc_client.grpc_target("unix:///a.sock") == "unix:///a.sock"
    assert rpc_client.grpc_target("tcp://127.0.0.1:1234") == "127.0.0.1:1234"


def test_unreachable_runtime_is_exit_1_unavailable(tmp_path: Path) -> None:
    res = podshim("pods", endpoint=f"unix://{tmp_path}/none.sock")
    assert_clean_error(res, 1, "podshim pods: UNAVAILABLE", "cannot reach the runtime")
    assert res.stdout == ""


def test_inspect_container_without_an_id_is_usage(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    assert inspectp.inspect_container(argparse.Namespace()) == 2
    assert "no container id" in capsys.readouterr().err


# ---------------------------------------------------------------------------- rendering


def test_table_aligns_columns() -> None:
    text = output.table(["POD ID", "NAME"], [["abc", "x"], ["abcdefgh", "longer-name"]])
    lines = text.splitlines()
    assert lines[0] == "POD ID     NAME"
    assert lines[2] == "abcdefgh   longer-name"
    assert all(line == line.rstrip() for line in lines)


def test_message_dict_keeps_zero_enums() -> None:
    d = output.message_dict(cri.PodSandbox(id="p", state=cri.SANDBOX_READY))
    assert d["state"] == "SANDBOX_READY"
    d = output.message_dict(cri.Container(id="c", state=cri.CONTAINER_CREATED))
    assert d["state"] == "CONTAINER_CREATED"


def test_render_json_yaml_table() -> None:
    data = {"items": [{"id": "a", "n": 1}]}
    for fmt, parse in (("json", json.loads), ("yaml", yaml.safe_load)):
        buf = io.StringIO()
        output.render(data, fmt, lambda _d: "TABLE", out=buf)
        assert parse(buf.getvalue()) == data
    buf = io.StringIO()
    output.render(data, "table", lambda _d: "TABLE", out=buf)
    assert buf.getvalue() == "TABLE\n"


def test_human_duration_and_bytes() -> None:
    assert output.human_duration(0.2) == "Less than a second"
    assert output.human_duration(42) == "42 seconds"
    assert output.human_duration(90) == "About a minute"
    assert output.human_duration(3 * 3600) == "3 hours"
    assert output.ago(0) == "Unknown"
    assert output.human_bytes(512) == "512 B"
    assert output.human_bytes(3 * 2**20) == "3.0 MiB"
    assert output.timestamp(0) == ""
    assert output.timestamp(1_700_000_000_123_000_000) == "2023-11-14T22:13:20.123Z"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class SlowFuture:
    """A grpc future that completes after `delay` seconds."""

    def __init__(self, delay: float, value: Any = "done") -> None:
        self.done_at = time.monotonic() + delay
        self.value = value
        self.cancelled = False

    def result(self, timeout: float | None = None) -> Any:
        left = self.done_at - time.monotonic()
        if timeout is not None and left > timeout:
            time.sleep(timeout)
            raise grpc.FutureTimeoutError()
        time.sleep(max(0.0, left))
        return self.value

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class SlowMethod:
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def future(self, request: Any, timeout: float | None = None) -> SlowFuture:
        return SlowFuture(self.delay)


def test_progress_on_a_terminal_shows_elapsed_and_bytes(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "pages.img").write_bytes(b"x" * 3 * 2**20)
    tty = FakeTTY()
    progress = output.Progress("checkpointpod abc", watch=tmp_path, stream=tty)
    assert transport.long_call(SlowMethod(1.1), cri.CheckpointPodRequest(), 5, progress) == "done"
    frames = [f for f in tty.getvalue().split("\r") if f.strip()]
    assert len(frames) >= 3, frames  # ~4 refreshes a second
    assert frames[-1].startswith("checkpointpod abc: ")
    assert "3.0 MiB written" in frames[-1]
    assert tty.getvalue().endswith("\r")  # the line is cleared at the end


def test_progress_is_silent_when_not_a_terminal(tmp_path: Path) -> None:
    pipe = io.StringIO()
    progress = output.Progress("restorepod x", watch=tmp_path, stream=pipe)
    transport.long_call(SlowMethod(0.6), cri.RestorePodRequest(), 5, progress)
    assert pipe.getvalue() == ""


# ---------------------------------------------------------------------------- config derivation


def fake_archive(root: Path, uid: str = "0609a4ed92945fc9") -> Path:
    """The parts of a podshim checkpoint the client reads (manifest, sandbox status, config.dump)."""
    sandbox_config = {
        "metadata": {"name": "web", "uid": uid, "namespace": "shop", "attempt": 2},
        "hostname": "web",
        "log_directory": f"/var/log/pods/shop_web_{uid}",
        "labels": {"io.kubernetes.pod.name": "web", "io.kubernetes.pod.uid": uid, "app": "web"},
        "linux": {
            "cgroup_parent": f"/kubepods/burstable/pod{uid}",
            "security_context": {"namespace_options": {"pid": 1}},
        },
        "a_field_from_a_newer_cri": True,
    }
    manifest = {
        "format": "podshim.checkpoint.v1",
        "sandbox": {"id": "f" * 64, "metadata": sandbox_config["metadata"], "config": sandbox_config},
        "containers": [
            {"name": "app", "id": "a" * 64, "checkpointed": True, "dir": "containers/app"},
            {"name": "done", "id": "b" * 64, "checkpointed": False, "dir": "containers/done"},
        ],
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.json").write_text(json.dumps(manifest))
    (root / "sandbox").mkdir(exist_ok=True)
    (root / "sandbox" / "status.json").write_text(json.dumps({"runtime_handler": "crun"}))
    for c in ("app", "done"):
        (root / "containers" / c).mkdir(parents=True, exist_ok=True)
        record = {
            "name": c,
            "config": {
                "metadata": {"name": c, "attempt": 1},
                "image": {"image": "localhost/podshim/counter:1"},
                "args": ["--interval-ms", "100"],
                "log_path": f"{c}/1.log",
                "unknown_future_field": 1,
            },
        }
        (root / "containers" / c / "config.dump").write_text(json.dumps(record))
    return root


def test_derive_pod_config_is_a_new_pod(tmp_path: Path) -> None:
    m = restorepod.read_archive_manifest(fake_archive(tmp_path / "a"))
    cfg = restorepod.derive_pod_config(m, uid="11111111-2222-3333-4444-555555555555")
    new = "11111111-2222-3333-4444-555555555555"
    assert cfg.metadata.name == "web-restored"
    assert cfg.metadata.namespace == "shop"
    assert cfg.metadata.uid == new
    assert cfg.metadata.attempt == 0
    assert cfg.log_directory == f"/var/log/pods/shop_web-restored_{new}"
    assert cfg.linux.cgroup_parent == f"/kubepods/burstable/pod{new}"
    assert cfg.labels["io.kubernetes.pod.uid"] == new
    assert cfg.labels["io.kubernetes.pod.name"] == "web-restored"
    assert cfg.labels["app"] == "web"
    assert cfg.hostname == "web"  # the processes may know it
    assert cfg.linux.security_context.namespace_options.pid == cri.CONTAINER
    named = restorepod.derive_pod_config(m, name="other")
    assert named.metadata.name == "other"
    assert named.metadata.uid not in ("", "0609a4ed92945fc9")


def test_derive_pod_config_systemd_cgroup_and_foreign_log_dir(tmp_path: Path) -> None:
    uid = "0a1b-2c3d"
    m = restorepod.read_archive_manifest(fake_archive(tmp_path / "a", uid=uid))
    m["sandbox"]["config"]["linux"]["cgroup_parent"] = "kubepods-burstable-pod0a1b_2c3d.slice"
    m["sandbox"]["config"]["log_directory"] = "/logs/web"
    cfg = restorepod.derive_pod_config(m, uid="9f8e-7d6c")
    assert cfg.linux.cgroup_parent == "kubepods-burstable-pod9f8e_7d6c.slice"
    assert cfg.log_directory == "/logs/web-restored"  # never the original pod's directory


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_restorepod_print_request_derives_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = fake_archive(tmp_path / "cp")
    code, out, err = run_main(
        ["restorepod", str(archive), "--print-request", "--start", "-o", "yaml"], capsys
    )
    assert code == 0, err
    req = yaml.safe_load(out)
    assert req["checkpointPath"] == str(archive)
    assert req["config"]["metadata"]["name"] == "web-restored"
    assert req["runtimeHandler"] == "crun"  # the checkpointed pod's handler
    assert req["options"] == {"start": "true"}
    # only the checkpointed container; unknown fields of the dump are ignored
    assert [c["metadata"]["name"] for c in req["containerConfigs"]] == ["app"]
    assert req["containerConfigs"][0]["args"] == ["--interval-ms", "100"]
    assert req["containerConfigs"][0]["logPath"] == "app/1.log"


def test_restorepod_moves_derived_containers_to_the_new_pod(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kubelet's container config names its pod (labels) and mounts the pod's own files
    (<root-dir>/pods/<uid>/etc-hosts, a termination log): derived for the new pod, they name the
    new pod and mount the new pod's files; nothing of the old uid is left in the request."""
    uid = "0609a4ed-9294-5fc9-aaaa-bbbbccccdddd"
    archive = fake_archive(tmp_path / "cp", uid=uid)
    pod_dir = tmp_path / "kubelet" / "pods" / uid
    (pod_dir / "containers" / "app").mkdir(parents=True)
    (pod_dir / "etc-hosts").write_text("127.0.0.1 localhost\n10.88.0.7 web\n")
    (pod_dir / "containers" / "app" / "5e1f").write_text("the old container's last words")
    dump = archive / "containers" / "app" / "config.dump"
    record = json.loads(dump.read_text())
    record["config"]["labels"] = {
        "io.kubernetes.pod.uid": uid,
        "io.kubernetes.pod.name": "web",
        "io.kubernetes.pod.namespace": "shop",
        "io.kubernetes.container.name": "app",
    }
    record["config"]["annotations"] = {
        "io.kubernetes.container.terminationMessagePath": "/dev/termination-log"
    }
    record["config"]["mounts"] = [
        {"host_path": str(pod_dir / "etc-hosts"), "container_path": "/etc/hosts"},
        {"host_path": str(pod_dir / "containers/app/5e1f"), "container_path": "/dev/termination-log"},
        {"host_path": "/srv/data", "container_path": "/data"},
    ]
    dump.write_text(json.dumps(record))

    code, out, err = run_main(["restorepod", str(archive), "--print-request"], capsys)
    assert code == 0, err
    req = json.loads(out)
    new_uid = req["config"]["metadata"]["uid"]
    assert uid not in out and new_uid != uid
    cc = req["containerConfigs"][0]
    assert cc["labels"]["io.kubernetes.pod.uid"] == new_uid
    assert cc["labels"]["io.kubernetes.pod.name"] == "web-restored"
    new_dir = tmp_path / "kubelet" / "pods" / new_uid
    assert [(m["hostPath"], m["containerPath"]) for m in cc["mounts"]] == [
        (str(new_dir / "etc-hosts"), "/etc/hosts"),
        (str(new_dir / "containers/app/5e1f"), "/dev/termination-log"),
        ("/srv/data", "/data"),  # not the old pod's
    ]
    assert not new_dir.exists()  # --print-request makes nothing

    # what restorepod makes before sending the request: the new pod's own files
    derived = restorepod.build_restore_request(
        cli_parser.build_parser().parse_args(["restorepod", str(archive), "--pod-name", "w2"])
    )[1]
    restorepod.make_pod_files(derived.pod_files)
    made = tmp_path / "kubelet" / "pods" / derived.pod_files[0].new.split("/pods/")[1].split("/")[0]
    assert (made / "etc-hosts").read_text() == (pod_dir / "etc-hosts").read_text()
    assert (made / "containers/app/5e1f").read_text() == ""  # a termination log starts empty


def test_restorepod_given_configs_json_and_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = fake_archive(tmp_path / "cp")
    pod = tmp_path / "pod.json"
    pod.write_text(json.dumps({"metadata": {"name": "mine", "uid": "u1", "namespace": "ns"}}))
    app = tmp_path / "app.yaml"
    app.write_text("image:\n  image: localhost/podshim/counter:1\nargs: [a, b]\n")
    argv = ["restorepod", str(archive), "--print-request", "--config", str(pod)]
    code, out, err = run_main([*argv, "--container-config", f"app={app}", "--runtime-handler", ""], capsys)
    assert code == 0, err
    req = json.loads(out)
    assert req["config"]["metadata"] == {"name": "mine", "uid": "u1", "namespace": "ns", "attempt": 0}
    assert req["runtimeHandler"] == ""
    assert req["containerConfigs"][0]["metadata"]["name"] == "app"  # from NAME=
    assert req["containerConfigs"][0]["args"] == ["a", "b"]


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda d: (d / "pod.json").write_text("{not json"), "not valid JSON/YAML"),
        (lambda d: (d / "pod.json").write_text('{"metadata": {"nmae": "typo"}}'), "nmae"),
        (lambda d: None, "No such file"),
    ],
)
def test_restorepod_bad_config_file_is_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: Any, needle: str
) -> None:
    archive = fake_archive(tmp_path / "cp")
    setup(tmp_path)
    code, _out, err = run_main(
        ["restorepod", str(archive), "--print-request", "--config", str(tmp_path / "pod.json")], capsys
    )
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_restorepod_unknown_container_config_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = fake_archive(tmp_path / "cp")
    app = tmp_path / "x.json"
    app.write_text("{}")
    code, _o, err = run_main(
        ["restorepod", str(archive), "--print-request", "--container-config", f"db={app}"], capsys
    )
    assert code == 2
    assert "no such container in the checkpoint (it has app)" in err


def test_restorepod_without_manifest_is_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _o, err = run_main(["restorepod", str(tmp_path), "--print-request"], capsys)
    assert code == 1
    assert "manifest.json: not found" in err


# ---------------------------------------------------------------------------- end to end


def _json(res: subprocess.CompletedProcess[str]) -> Any:
    assert res.returncode == 0, (res.returncode, res.stderr)
    return json.loads(res.stdout)


@pytest.mark.e2e
def test_checkpointpod_restorepod_ps_pods_end_to_end(
    bed: TestBed, rt: api_pb2_grpc.RuntimeServiceStub, pod_cleanup: list[str], log_root: Path
) -> None:
    ep = f"unix://{bed.podshim_socket}"
    src = pods.run_pod(rt, "cli-counter", log_root)
    pod_cleanup.append(src.id)
    pods.wait_count(src.log_path("counter"), 5)

    out = Path(bed.checkpoint_root) / f"cli-{src.id[:12]}"  # created by the CLI
    before = pods.counts(src.log_path("counter"))[-1]
    res = podshim("checkpointpod", src.id[:12], str(out), endpoint=ep)  # a unique prefix is enough
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # piped: no progress lines
    assert res.stdout.strip() == str(out)
    assert (out / "manifest.json").is_file()
    saved = pods.counts(src.log_path("counter"))[-1]

    res = podshim("restorepod", str(out), "--start", "-o", "json", endpoint=ep)
    assert res.stderr == ""
    restored = _json(res)
    pod_cleanup.append(restored["podSandboxId"])
    assert restored["name"] == "cli-counter-restored"
    assert [c["name"] for c in restored["restoredContainers"]] == ["counter"]
    cid = restored["restoredContainers"][0]["containerId"]

    listed = _json(podshim("ps", "-o", "json", endpoint=ep))["containers"]
    mine = [c for c in listed if c["id"] == cid]
    assert mine and mine[0]["state"] == "CONTAINER_RUNNING"
    assert mine[0]["podSandboxId"] == restored["podSandboxId"]
    in_pod = _json(podshim("ps", "-a", "-p", restored["podSandboxId"][:12], "-o", "json", endpoint=ep))
    assert [c["id"] for c in in_pod["containers"]] == [cid]

    items = _json(podshim("pods", "-o", "json", endpoint=ep))["items"]
    new = [p for p in items if p["id"] == restored["podSandboxId"]]
    assert new and new[0]["metadata"]["name"] == "cli-counter-restored"
    assert new[0]["state"] == "SANDBOX_READY"
    assert new[0]["metadata"]["uid"] != src.config.metadata.uid
    assert yaml.safe_load(podshim("pods", "-o", "yaml", endpoint=ep).stdout)["items"]

    table = podshim("pods", "--name", "^cli-counter", endpoint=ep)
    assert table.returncode == 0
    assert table.stdout.splitlines()[0].split() == [
        "POD", "ID", "CREATED", "STATE", "NAME", "NAMESPACE", "ATTEMPT", "RUNTIME",
    ]  # fmt: skip
    assert restored["podSandboxId"][:13] in table.stdout and "cli-counter-restored" in table.stdout

    # the restored counter resumes from the checkpoint (taken during the call), not from 0: after
    # the count seen before the call, at most one past the last one seen after it
    log_path = Path(rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.log_path)
    first = pods.wait_for(lambda: pods.counts(log_path), what="restored counter output")[0]
    assert before < first <= saved + 1, (before, first, saved)
    pods.wait_count(log_path, first + 3)

    status = _json(podshim("inspectp", restored["podSandboxId"], endpoint=ep))
    assert status["status"]["id"] == restored["podSandboxId"]
    assert status["status"]["state"] == "SANDBOX_READY"
    assert isinstance(status["info"], dict)
    # the container half of `inspect` (the archive inspector falls back to it)
    import argparse

    ns = argparse.Namespace(runtime_endpoint=ep, timeout=None, output="json")
    assert inspectp.inspect_container(ns, cid[:12]) == 0


@pytest.mark.e2e
def test_checkpointpod_errors(bed: TestBed, rt: api_pb2_grpc.RuntimeServiceStub, tmp_path: Path) -> None:
    ep = f"unix://{bed.podshim_socket}"
    out = Path(bed.checkpoint_root) / "cli-unknown-pod"
    res = podshim("checkpointpod", "0123456789abcdef" * 4, str(out), endpoint=ep)
    assert_clean_error(res, 1, "podshim checkpointpod: NOT_FOUND:")
    assert not out.exists()  # the directory the CLI created is removed again

    res = podshim("checkpointpod", "somepod", str(out), "--option", "tcp-established", endpoint=ep)
    assert_clean_error(res, 2, "expected KEY=VALUE")

    # outside podshim's allowed roots: the runtime refuses, the created directory goes away
    outside = tmp_path / "not-allowed"
    # a pod with a running container: the command lists them before the runtime sees the path
    running = cri.ContainerFilter(state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING))
    pods_list = rt.ListContainers(cri.ListContainersRequest(filter=running)).containers
    if pods_list:
        res = podshim("checkpointpod", pods_list[0].pod_sandbox_id, str(outside), endpoint=ep)
        assert_clean_error(res, 1, "INVALID_ARGUMENT")
        assert not outside.exists()

    res = podshim("checkpointpod", "x", str(out), "--option", "no-such-option=1", endpoint=ep)
    assert res.returncode == 1 and "Traceback" not in res.stderr

    res = podshim("inspectp", "does-not-exist", endpoint=ep)
    assert_clean_error(res, 1, "NOT_FOUND")


@pytest.mark.e2e
def test_restorepod_of_a_kubelet_pod_has_only_its_own_identity(
    bed: TestBed,
    rt: api_pb2_grpc.RuntimeServiceStub,
    img: api_pb2_grpc.ImageServiceStub,
    pod_cleanup: list[str],
    log_root: Path,
) -> None:
    """`podshim restorepod PATH` without --config of a pod a kubelet made: the restored
    containers carry nothing of the old pod's uid or per-pod paths (labels, annotations, the
    /etc/hosts and termination-log mounts: ContainerStatus and its verbose info), mount files of
    the new pod, and resume."""
    ep = f"unix://{bed.podshim_socket}"
    kubelet_root = Path(bed.base_dir) / "kubelet"
    config = pods.pod_config("cli-kubelet", log_root)
    cc = pods.kubelet_container_config(img, config, kubelet_root, "counter")
    pod_id = pods.run_pod(rt, "cli-kubelet", log_root, {"counter": cc}, config=config).id
    pod_cleanup.append(pod_id)
    src_log = Path(config.log_directory) / "counter" / "0.log"
    pods.wait_count(src_log, 5)
    old_uid, old_dir = config.metadata.uid, str(pods.kubelet_pod_dir(kubelet_root, config))

    def take() -> Path:
        out = Path(bed.checkpoint_root) / f"cli-kubelet-{pod_id[:12]}-{secrets.token_hex(2)}"
        assert podshim("checkpointpod", pod_id, str(out), endpoint=ep).returncode == 0
        return out

    out, first = resume.checkpoint_exactly(take, {"counter": src_log})
    restored = _json(podshim("restorepod", str(out), "--start", "-o", "json", endpoint=ep))
    pod_cleanup.append(restored["podSandboxId"])
    new_cid = restored["restoredContainers"][0]["containerId"]
    new_uid = restored["uid"]

    st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=new_cid, verbose=True))
    seen = json.dumps({"status": json_format.MessageToDict(st.status), "info": dict(st.info)})
    assert old_uid not in seen, f"the old pod's uid {old_uid} is in the restored container: {seen[:2000]}"
    assert old_dir not in seen, f"the old pod's files ({old_dir}) are in the restored container"
    assert st.status.labels["io.kubernetes.pod.uid"] == new_uid
    assert st.status.labels["io.kubernetes.pod.name"] == "cli-kubelet-restored"
    new_dir = Path(kubelet_root) / "pods" / new_uid
    spec = json.loads(st.info["info"])["runtimeSpec"]
    mounts = {m["destination"]: m["source"] for m in spec["mounts"]}
    assert mounts["/etc/hosts"] == str(new_dir / "etc-hosts"), mounts
    assert mounts[pods.TERMINATION_LOG].startswith(str(new_dir / "containers" / "counter") + "/"), mounts
    assert Path(mounts[pods.TERMINATION_LOG]).read_text() == ""

    resume.assert_exact_resume({"counter": Path(st.status.log_path)}, first)
