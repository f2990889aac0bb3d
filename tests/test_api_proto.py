"""Wire contract of api/runtime/v1/api.proto and freshness of its generated stubs.

The stubs are committed; test (a) regenerates them and fails on any drift.
The descriptor checks pin the field numbers of the KEP-5823 messages and a
sample of long-standing upstream CRI fields, so a typo in the proto fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor

from api.runtime.v1 import api_pb2, api_pb2_grpc
from testbed.tools import GO_CACHE

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO = "api/runtime/v1/api.proto"
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")
PROTOC_ARGS = ["-I", ".", "--python_out={out}", "--pyi_out={out}", "--grpc_python_out={out}", PROTO]

FILE = api_pb2.DESCRIPTOR
RUNTIME: ServiceDescriptor = FILE.services_by_name["RuntimeService"]
IMAGE: ServiceDescriptor = FILE.services_by_name["ImageService"]

T = FieldDescriptor  # short alias for the TYPE_* constants


def _msg(name: str) -> Descriptor:
    return FILE.message_types_by_name[name]


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _numbers(name: str) -> dict[str, int]:
    return {f.name: f.number for f in _msg(name).fields}


def _assert_field(
    message: str,
    field: str,
    number: int,
    ftype: int,
    *,
    repeated: bool = False,
    type_name: str | None = None,
) -> None:
    f = _msg(message).fields_by_name[field]
    assert f.number == number, f"{message}.{field}: number {f.number} != {number}"
    assert f.type == ftype, f"{message}.{field}: type {f.type} != {ftype}"
    assert f.is_repeated == repeated, f"{message}.{field}: repeated is {f.is_repeated}"
    if type_name is not None:
        target = f.message_type or f.enum_type
        assert target is not None and target.full_name == type_name, f"{message}.{field}: {target}"


# (a) generated stubs match the proto -------------------------------------------------


def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    args = [a.format(out=tmp_path) for a in PROTOC_ARGS]
    proc = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for name in GENERATED:
        fresh = (tmp_path / "api/runtime/v1" / name).read_bytes()
        committed = (REPO_ROOT / "api/runtime/v1" / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run scripts/gen_proto.sh and commit the result"


def test_gen_script_uses_the_same_command() -> None:
    script = (REPO_ROOT / "scripts/gen_proto.sh").read_text()
    expected = "-m grpc_tools.protoc " + " ".join(a.format(out=".") for a in PROTOC_ARGS)
    assert expected in script
    assert "set -euo pipefail" in script
    assert "${PYTHON:-.venv/bin/python}" in script


# (b) file-level identity -------------------------------------------------------------


def test_package_and_go_package() -> None:
    assert FILE.package == "runtime.v1"
    assert FILE.GetOptions().go_package == "k8s.io/cri-api/pkg/apis/runtime/v1"
    assert RUNTIME.full_name == "runtime.v1.RuntimeService"
    assert IMAGE.full_name == "runtime.v1.ImageService"


# (b) KEP-5823 / KEP-2008 messages ----------------------------------------------------


def test_checkpoint_pod_request() -> None:
    m = "CheckpointPodRequest"
    assert _numbers(m) == {
        "pod_sandbox_id": 1,
        "output_path": 2,
        "container_ids": 3,
        "options": 4,
        "post_checkpoint_state": 5,
    }
    _assert_field(m, "pod_sandbox_id", 1, T.TYPE_STRING)
    _assert_field(m, "output_path", 2, T.TYPE_STRING)
    _assert_field(m, "container_ids", 3, T.TYPE_STRING, repeated=True)
    options = _msg(m).fields_by_name["options"]
    assert _is_map(options)
    assert options.message_type.fields_by_name["key"].type == T.TYPE_STRING
    assert options.message_type.fields_by_name["value"].type == T.TYPE_STRING
    _assert_field(m, "post_checkpoint_state", 5, T.TYPE_ENUM, type_name="runtime.v1.PostCheckpointState")
    assert _numbers("CheckpointPodResponse") == {}


def test_post_checkpoint_state_enum() -> None:
    enum = FILE.enum_types_by_name["PostCheckpointState"]
    assert {v.name: v.number for v in enum.values} == {
        "POST_CHECKPOINT_STATE_RUNNING": 0,
        "POST_CHECKPOINT_STATE_STOPPED": 1,
    }


def test_restore_pod_messages() -> None:
    m = "RestorePodRequest"
    assert _numbers(m) == {
        "checkpoint_path": 1,
        "config": 2,
        "runtime_handler": 3,
        "options": 4,
        "container_configs": 5,
    }
    _assert_field(m, "checkpoint_path", 1, T.TYPE_STRING)
    _assert_field(m, "config", 2, T.TYPE_MESSAGE, type_name="runtime.v1.PodSandboxConfig")
    _assert_field(m, "runtime_handler", 3, T.TYPE_STRING)
    assert _is_map(_msg(m).fields_by_name["options"])
    _assert_field(
        m, "container_configs", 5, T.TYPE_MESSAGE, repeated=True, type_name="runtime.v1.ContainerConfig"
    )

    assert _numbers("RestoredContainer") == {"name": 1, "container_id": 2}
    _assert_field("RestoredContainer", "name", 1, T.TYPE_STRING)
    _assert_field("RestoredContainer", "container_id", 2, T.TYPE_STRING)

    assert _numbers("RestorePodResponse") == {"pod_sandbox_id": 1, "restored_containers": 2}
    _assert_field("RestorePodResponse", "pod_sandbox_id", 1, T.TYPE_STRING)
    _assert_field(
        "RestorePodResponse",
        "restored_containers",
        2,
        T.TYPE_MESSAGE,
        repeated=True,
        type_name="runtime.v1.RestoredContainer",
    )


def test_checkpoint_container_request() -> None:
    assert _numbers("CheckpointContainerRequest") == {"container_id": 1, "location": 2, "timeout": 3}
    _assert_field("CheckpointContainerRequest", "container_id", 1, T.TYPE_STRING)
    _assert_field("CheckpointContainerRequest", "location", 2, T.TYPE_STRING)
    _assert_field("CheckpointContainerRequest", "timeout", 3, T.TYPE_INT64)
    assert _numbers("CheckpointContainerResponse") == {}


def test_new_messages_encode_with_expected_tags() -> None:
    # Raw bytes: (field_number << 3) | wire_type.
    req = api_pb2.CheckpointPodRequest(
        pod_sandbox_id="p",
        output_path="o",
        container_ids=["c"],
        post_checkpoint_state=api_pb2.POST_CHECKPOINT_STATE_STOPPED,
    )
    assert req.SerializeToString() == b"\x0a\x01p\x12\x01o\x1a\x01c\x28\x01"
    assert api_pb2.RestorePodRequest(checkpoint_path="x", runtime_handler="h").SerializeToString() == (
        b"\x0a\x01x\x1a\x01h"
    )
    resp = api_pb2.RestorePodResponse(
        pod_sandbox_id="s", restored_containers=[api_pb2.RestoredContainer(name="n", container_id="i")]
    )
    assert resp.SerializeToString() == b"\x0a\x01s\x12\x06\x0a\x01n\x12\x01i"


# (b) services ------------------------------------------------------------------------

RUNTIME_RPCS = [
    "Version",
    "RunPodSandbox",
    "StopPodSandbox",
    "RemovePodSandbox",
    "PodSandboxStatus",
    "ListPodSandbox",
    "StreamPodSandboxes",
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "RemoveContainer",
    "ListContainers",
    "StreamContainers",
    "ContainerStatus",
    "UpdateContainerResources",
    "ReopenContainerLog",
    "ExecSync",
    "Exec",
    "Attach",
    "PortForward",
    "ContainerStats",
    "ListContainerStats",
    "StreamContainerStats",
    "PodSandboxStats",
    "ListPodSandboxStats",
    "StreamPodSandboxStats",
    "UpdateRuntimeConfig",
    "Status",
    "CheckpointContainer",
    "CheckpointPod",
    "RestorePod",
    "GetContainerEvents",
    "ListMetricDescriptors",
    "ListPodSandboxMetrics",
    "StreamPodSandboxMetrics",
    "RuntimeConfig",
    "UpdatePodSandboxResources",
]
RUNTIME_SERVER_STREAMING = {
    "StreamPodSandboxes",
    "StreamContainers",
    "StreamContainerStats",
    "StreamPodSandboxStats",
    "GetContainerEvents",
    "StreamPodSandboxMetrics",
}
IMAGE_RPCS = ["ListImages", "StreamImages", "ImageStatus", "PullImage", "RemoveImage", "ImageFsInfo"]
IMAGE_SERVER_STREAMING = {"StreamImages"}


@pytest.mark.parametrize(
    ("service", "rpcs", "streaming"),
    [(RUNTIME, RUNTIME_RPCS, RUNTIME_SERVER_STREAMING), (IMAGE, IMAGE_RPCS, IMAGE_SERVER_STREAMING)],
    ids=["RuntimeService", "ImageService"],
)
def test_service_rpcs_and_streaming(service: ServiceDescriptor, rpcs: list[str], streaming: set[str]) -> None:
    assert [m.name for m in service.methods] == rpcs
    for method in service.methods:
        assert not method.client_streaming, method.name
        assert method.server_streaming == (method.name in streaming), method.name


def test_checkpoint_rpcs_types_and_order() -> None:
    names = [m.name for m in RUNTIME.methods]
    i = names.index("CheckpointContainer")
    assert names[i + 1 : i + 3] == ["CheckpointPod", "RestorePod"]
    cp = RUNTIME.methods_by_name["CheckpointPod"]
    assert (cp.input_type.name, cp.output_type.name) == ("CheckpointPodRequest", "CheckpointPodResponse")
    rp = RUNTIME.methods_by_name["RestorePod"]
    assert (rp.input_type.name, rp.output_type.name) == ("RestorePodRequest", "RestorePodResponse")
    ev = RUNTIME.methods_by_name["GetContainerEvents"]
    assert ev.server_streaming and ev.input_type.name == "GetEventsRequest"
    assert ev.output_type.name == "ContainerEventResponse"


def test_grpc_stubs_expose_new_rpcs() -> None:
    assert hasattr(api_pb2_grpc.RuntimeServiceServicer, "CheckpointPod")
    assert hasattr(api_pb2_grpc.RuntimeServiceServicer, "RestorePod")
    assert hasattr(api_pb2_grpc.RuntimeServiceServicer, "CheckpointContainer")
    assert callable(api_pb2_grpc.add_RuntimeServiceServicer_to_server)
    assert callable(api_pb2_grpc.add_ImageServiceServicer_to_server)


# (b) spot checks of long-standing upstream fields ------------------------------------


def test_pod_sandbox_config_numbers() -> None:
    assert _numbers("PodSandboxConfig") == {
        "metadata": 1,
        "hostname": 2,
        "log_directory": 3,
        "dns_config": 4,
        "port_mappings": 5,
        "labels": 6,
        "annotations": 7,
        "linux": 8,
        "windows": 9,
    }
    assert _numbers("PodSandboxMetadata") == {"name": 1, "uid": 2, "namespace": 3, "attempt": 4}
    _assert_field("PodSandboxMetadata", "attempt", 4, T.TYPE_UINT32)
    assert _numbers("LinuxPodSandboxConfig") == {
        "cgroup_parent": 1,
        "security_context": 2,
        "sysctls": 3,
        "overhead": 4,
        "resources": 5,
    }
    assert _numbers("RunPodSandboxRequest") == {"config": 1, "runtime_handler": 2}


def test_container_config_numbers() -> None:
    assert _numbers("ContainerConfig") == {
        "metadata": 1,
        "image": 2,
        "command": 3,
        "args": 4,
        "working_dir": 5,
        "envs": 6,
        "mounts": 7,
        "devices": 8,
        "labels": 9,
        "annotations": 10,
        "log_path": 11,
        "stdin": 12,
        "stdin_once": 13,
        "tty": 14,
        "linux": 15,
        "windows": 16,
        "CDI_devices": 17,
        "stop_signal": 18,
    }
    _assert_field(
        "ContainerConfig", "envs", 6, T.TYPE_MESSAGE, repeated=True, type_name="runtime.v1.KeyValue"
    )
    _assert_field("ContainerConfig", "stop_signal", 18, T.TYPE_ENUM, type_name="runtime.v1.Signal")
    assert _numbers("CreateContainerRequest") == {"pod_sandbox_id": 1, "config": 2, "sandbox_config": 3}


def test_linux_container_resources_numbers() -> None:
    assert _numbers("LinuxContainerResources") == {
        "cpu_period": 1,
        "cpu_quota": 2,
        "cpu_shares": 3,
        "memory_limit_in_bytes": 4,
        "oom_score_adj": 5,
        "cpuset_cpus": 6,
        "cpuset_mems": 7,
        "hugepage_limits": 8,
        "unified": 9,
        "memory_swap_limit_in_bytes": 10,
    }
    _assert_field("LinuxContainerResources", "cpu_quota", 2, T.TYPE_INT64)
    _assert_field("LinuxContainerResources", "cpuset_cpus", 6, T.TYPE_STRING)
    assert _is_map(_msg("LinuxContainerResources").fields_by_name["unified"])


def test_security_context_out_of_order_numbers() -> None:
    sandbox = _numbers("LinuxSandboxSecurityContext")
    assert sandbox["run_as_group"] == 8
    assert sandbox["supplemental_groups_policy"] == 11
    assert sandbox["seccomp"] == 9 and sandbox["apparmor"] == 10
    assert sandbox["seccomp_profile_path"] == 7
    ctr = _numbers("LinuxContainerSecurityContext")
    assert ctr["run_as_group"] == 12
    assert ctr["run_as_username"] == 6
    assert ctr["no_new_privs"] == 11
    assert ctr["supplemental_groups_policy"] == 17
    assert ctr["seccomp"] == 15 and ctr["apparmor"] == 16
    assert ctr["apparmor_profile"] == 9 and ctr["seccomp_profile_path"] == 10


def test_misc_upstream_numbers() -> None:
    assert _numbers("ImageSpec") == {
        "image": 1,
        "annotations": 2,
        "user_specified_image": 18,
        "runtime_handler": 19,
        "image_ref": 20,
    }
    mount = _numbers("Mount")
    assert mount["uidMappings"] == 6 and mount["gidMappings"] == 7
    assert mount["recursive_read_only"] == 8 and mount["image"] == 9 and mount["image_sub_path"] == 10
    status = _numbers("ContainerStatus")
    assert status["mounts"] == 14 and status["image_id"] == 17
    assert status["user"] == 18 and status["stop_signal"] == 19
    assert _numbers("PodSandboxStatusResponse") == {
        "status": 1,
        "info": 2,
        "containers_statuses": 3,
        "timestamp": 4,
    }
    assert "audit_request_id" not in _numbers("ExecRequest") and "audit_request_id" not in _numbers(
        "AttachRequest"
    )
    _assert_field("KeyValue", "value", 2, T.TYPE_BYTES)  # bytes in the released API
    _assert_field("Mount", "mount_options", 11, T.TYPE_STRING, repeated=True)
    _assert_field("RuntimeFeatures", "mount_options", 3, T.TYPE_BOOL)
    assert _numbers("Namespace") == {"options": 2}
    assert _numbers("PsiData") == {"Total": 1, "Avg10": 2, "Avg60": 3, "Avg300": 4}
    _assert_field("ExecSyncResponse", "stdout", 1, T.TYPE_BYTES)
    _assert_field("PortForwardRequest", "port", 2, T.TYPE_INT32, repeated=True)


def test_upstream_enums() -> None:
    def values(name: str) -> dict[str, int]:
        return {v.name: v.number for v in FILE.enum_types_by_name[name].values}

    assert values("ContainerState") == {
        "CONTAINER_CREATED": 0,
        "CONTAINER_RUNNING": 1,
        "CONTAINER_EXITED": 2,
        "CONTAINER_UNKNOWN": 3,
    }
    assert values("PodSandboxState") == {"SANDBOX_READY": 0, "SANDBOX_NOTREADY": 1}
    assert values("NamespaceMode") == {"POD": 0, "CONTAINER": 1, "NODE": 2, "TARGET": 3}
    assert values("CgroupDriver") == {"SYSTEMD": 0, "CGROUPFS": 1}
    signal = values("Signal")
    assert len(signal) == 66
    assert signal["SIGNAL_RUNTIME_DEFAULT"] == 0 and signal["SIGNAL_SIGKILL"] == 13
    assert signal["SIGNAL_SIGTERM"] == 23 and signal["SIGNAL_SIGRTMIN"] == 35
    assert signal["SIGNAL_SIGRTMAXMINUS1"] == 64 and signal["SIGNAL_SIGRTMAX"] == 65


# (c) the whole schema against the released API ----------------------------------------

# the released proto the set-up fetched with the Go modules (k8s.io/cri-api v0.37.2, required by
# tools/go/cri-client and the kubelet's module): docs/design/testbed.md (The released API's Go
# client)
RELEASED = GO_CACHE / "mod/k8s.io/cri-api@v0.37.2/pkg/apis/runtime/v1/api.proto"
EXTENSIONS = {  # podshim's own, on field numbers the released API leaves free
    "CheckpointPodRequest.post_checkpoint_state",
    "PostCheckpointState.POST_CHECKPOINT_STATE_RUNNING",
    "PostCheckpointState.POST_CHECKPOINT_STATE_STOPPED",
}


def _schema(fds_bytes: bytes) -> dict[str, object]:
    """Every field (number, type, label, type name), enum value and RPC of a descriptor set."""
    fds = descriptor_pb2.FileDescriptorSet.FromString(fds_bytes)
    (f,) = [x for x in fds.file if x.package == "runtime.v1"]
    out: dict[str, object] = {}

    def message(m: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        for fld in m.field:
            out[f"{prefix}{m.name}.{fld.name}"] = (fld.number, fld.type, fld.label, fld.type_name)
        for n in m.nested_type:
            message(n, f"{prefix}{m.name}.")
        for e in m.enum_type:
            for v in e.value:
                out[f"{prefix}{m.name}.{e.name}.{v.name}"] = v.number

    for m in f.message_type:
        message(m, "")
    for e in f.enum_type:
        for v in e.value:
            out[f"{e.name}.{v.name}"] = v.number
    for svc in f.service:
        for meth in svc.method:
            out[f"{svc.name}/{meth.name}"] = (meth.input_type, meth.output_type, meth.server_streaming)
    return out


def test_schema_is_the_released_apis(tmp_path: Path) -> None:
    """Field for field, value for value, RPC for RPC what k8s.io/cri-api v0.37.2 defines, plus
    the extensions above on numbers it leaves free (the released stubs' wire format is podshim's)."""
    assert RELEASED.is_file(), f"{RELEASED} is missing: run the set-up (scripts/gotools.sh)"
    src = tmp_path / "released" / "api.proto"
    src.parent.mkdir()
    # its gogo-era imports and options, if any, do not change the schema
    text = "\n".join(
        line for line in RELEASED.read_text().splitlines() if not line.startswith(("import ", "option "))
    )
    src.write_text(text)
    sets = {}
    for name, args in (
        ("released", ["-I", str(src.parent), str(src)]),
        ("podshim", ["-I", str(REPO_ROOT), str(REPO_ROOT / PROTO)]),
    ):
        out = tmp_path / f"{name}.pb"
        proc = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", *args, f"--descriptor_set_out={out}"],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        sets[name] = _schema(out.read_bytes())
    released, ours = sets["released"], sets["podshim"]
    differ = sorted(k for k in released.keys() | ours.keys() if released.get(k) != ours.get(k))
    assert set(differ) == EXTENSIONS, {k: (released.get(k), ours.get(k)) for k in differ}
