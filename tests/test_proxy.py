"""The CRI proxy end to end: every standard call through podshim's socket against a real
containerd behaves as it does against containerd directly."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim import __version__
from testbed import pods
from testbed.bed import TestBed

pytestmark = pytest.mark.e2e


def test_version_names_the_upstream_and_podshim(
    rt: api_pb2_grpc.RuntimeServiceStub,
    direct_rt: api_pb2_grpc.RuntimeServiceStub,
    bed: TestBed,
    tmp_path: Path,
) -> None:
    """The node still looks like a containerd node: runtime_name is the upstream's (the kubelet
    shows containerd://<id>), podshim is in runtime_version's build metadata; `[server]
    runtime_name = "podshim"` gives the name podshim again, the upstream in its version."""
    ours = rt.Version(cri.VersionRequest())
    theirs = direct_rt.Version(cri.VersionRequest())
    assert ours.runtime_name == theirs.runtime_name == "containerd"
    assert ours.runtime_api_version == theirs.runtime_api_version == "v1"
    sep = "." if "+" in theirs.runtime_version else "+"  # one "+" only (semver build metadata)
    assert ours.runtime_version == f"{theirs.runtime_version}{sep}podshim.{__version__}", ours.runtime_version
    with bed.extra_podshim(tmp_path, server={"runtime_name": "podshim"}) as (socket, _log):
        named = pods.stubs(socket)[0].Version(cri.VersionRequest(), timeout=10)
    upstream = re.sub(r"[^0-9A-Za-z.-]", "-", theirs.runtime_version)  # "1.6.20~ds1", "2.1.9+unknown"
    assert named.runtime_name == "podshim", named
    assert named.runtime_version == f"{__version__}+containerd-{upstream}", named.runtime_version


def test_pod_sandbox_lifecycle(
    rt: api_pb2_grpc.RuntimeServiceStub, log_root: Path, pod_cleanup: list[str]
) -> None:
    pod = pods.run_pod(rt, "lifecycle", log_root, containers={})
    pod_cleanup.append(pod.id)
    status = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id)).status
    assert status.state == cri.SANDBOX_READY
    assert status.metadata.name == "lifecycle"
    assert status.network.ip, "CNI gave the pod an address"
    listed = rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(id=pod.id))).items
    assert [p.id for p in listed] == [pod.id]
    by_label = rt.ListPodSandbox(
        cri.ListPodSandboxRequest(
            filter=cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.name": "lifecycle"})
        )
    ).items
    assert pod.id in [p.id for p in by_label]
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod.id))
    status = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id)).status
    assert status.state == cri.SANDBOX_NOTREADY
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
    with pytest.raises(grpc.RpcError) as err:
        rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_container_lifecycle_exec_and_logs(
    rt: api_pb2_grpc.RuntimeServiceStub, log_root: Path, pod_cleanup: list[str]
) -> None:
    pod = pods.run_pod(rt, "ctr-life", log_root, containers={"counter": pods.container_config("counter")})
    pod_cleanup.append(pod.id)
    cid = pod.containers["counter"]
    status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    assert status.state == cri.CONTAINER_RUNNING
    assert status.image.image == pods.COUNTER_IMAGE
    # Logs: the counter prints through the CRI log of the pod.
    pods.wait_count(pod.log_path("counter"), 3)
    # Filters: by pod, by state, by label.
    f = cri.ContainerFilter(pod_sandbox_id=pod.id, state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING))
    assert [c.id for c in rt.ListContainers(cri.ListContainersRequest(filter=f)).containers] == [cid]
    f = cri.ContainerFilter(label_selector={"io.kubernetes.container.name": "counter"}, pod_sandbox_id=pod.id)
    assert [c.id for c in rt.ListContainers(cri.ListContainersRequest(filter=f)).containers] == [cid]
    # ExecSync: stdout, stderr and exit code come back unchanged.
    r = rt.ExecSync(
        cri.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)
    )
    assert (r.stdout, r.stderr, r.exit_code) == (b"out\n", b"err\n", 3)
    stats = rt.ContainerStats(cri.ContainerStatsRequest(container_id=cid)).stats
    assert stats.attributes.id == cid
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=5))
    status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
    assert status.state == cri.CONTAINER_EXITED
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    with pytest.raises(grpc.RpcError) as err:
        rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_stop_of_gone_ids_is_idempotent(
    rt: api_pb2_grpc.RuntimeServiceStub, direct_rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed
) -> None:
    """containerd 1.6 answers NOT_FOUND; the CRI says Stop* are idempotent: podshim answers OK."""
    gone = [
        lambda s: s.StopContainer(cri.StopContainerRequest(container_id="gone-container")),
        lambda s: s.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id="gone-pod")),
    ]
    for call in gone:
        if bed.containerd_at_least("1.7"):
            call(direct_rt)  # 1.7 and 2.x answer OK themselves: podshim's correction is a no-op
        else:
            with pytest.raises(grpc.RpcError) as err:
                call(direct_rt)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND  # the deviation podshim corrects
        call(rt)


def test_upstream_errors_keep_code_and_message(
    rt: api_pb2_grpc.RuntimeServiceStub, direct_rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed
) -> None:
    calls = [
        lambda s: s.ContainerStatus(cri.ContainerStatusRequest(container_id="no-such-container")),
        lambda s: s.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id="no-such-pod")),
        lambda s: s.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id="no-such-pod")),
    ]
    runtime_config = lambda s: s.RuntimeConfig(cri.RuntimeConfigRequest())  # noqa: E731
    if bed.containerd_at_least("2.0"):  # 2.x implements RuntimeConfig: passed through unchanged
        assert runtime_config(rt) == runtime_config(direct_rt)
    else:
        calls.append(runtime_config)  # 1.6 and 1.7 answer UNIMPLEMENTED
    metric_descriptors = lambda s: s.ListMetricDescriptors(cri.ListMetricDescriptorsRequest())  # noqa: E731
    if bed.containerd_at_least("2.2"):  # 2.2 implements it: passed through unchanged (in any order)

        def descriptors(s: api_pb2_grpc.RuntimeServiceStub) -> list[bytes]:
            return sorted(d.SerializeToString() for d in metric_descriptors(s).descriptors)

        assert descriptors(rt) == descriptors(direct_rt) and descriptors(rt)
    else:
        calls.append(metric_descriptors)  # 1.6 to 2.1 answer UNIMPLEMENTED
    for call in calls:
        with pytest.raises(grpc.RpcError) as direct:
            call(direct_rt)
        with pytest.raises(grpc.RpcError) as proxied:
            call(rt)
        assert proxied.value.code() == direct.value.code()
        assert proxied.value.details() == direct.value.details()


def test_deadline_is_forwarded(
    rt: api_pb2_grpc.RuntimeServiceStub, log_root: Path, pod_cleanup: list[str]
) -> None:
    pod = pods.run_pod(rt, "deadline", log_root, containers={"counter": pods.container_config("counter")})
    pod_cleanup.append(pod.id)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        rt.ExecSync(
            cri.ExecSyncRequest(container_id=pod.containers["counter"], cmd=["sleep", "30"]), timeout=1.0
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 5


def test_images(img: api_pb2_grpc.ImageServiceStub, bed: TestBed) -> None:
    names = {t for i in img.ListImages(cri.ListImagesRequest()).images for t in i.repo_tags}
    assert {pods.PAUSE_IMAGE, pods.BUSYBOX_IMAGE, pods.COUNTER_IMAGE} <= names
    st = img.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=pods.BUSYBOX_IMAGE))).image
    assert pods.BUSYBOX_IMAGE in st.repo_tags and st.size > 0
    missing = img.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image="localhost/podshim/absent:1")))
    assert not missing.HasField("image")
    fs = img.ImageFsInfo(cri.ImageFsInfoRequest())
    assert fs.image_filesystems
    # Remove an image through podshim, then put it back.
    img.RemoveImage(cri.RemoveImageRequest(image=cri.ImageSpec(image=pods.BUSYBOX_IMAGE)))
    names = {t for i in img.ListImages(cri.ListImagesRequest()).images for t in i.repo_tags}
    assert pods.BUSYBOX_IMAGE not in names
    bed.import_image(bed.image_cache / "busybox.tar")

    def listed() -> bool:
        return any(pods.BUSYBOX_IMAGE in i.repo_tags for i in img.ListImages(cri.ListImagesRequest()).images)

    # containerd 2.x updates the CRI image list from containerd's events, after `ctr import`
    # returned (1.6 and 1.7 at once): wait for it, as the bed does for its own imports
    pods.wait_for(listed, timeout=30, what="the imported image listed by CRI")


def test_container_events_stream(
    rt: api_pb2_grpc.RuntimeServiceStub,
    direct_rt: api_pb2_grpc.RuntimeServiceStub,
    log_root: Path,
    pod_cleanup: list[str],
) -> None:
    """Server-streaming passthrough: events flow when the upstream has them; when it does not
    (containerd 1.6), the stream ends with exactly the upstream's status."""
    direct = direct_rt.GetContainerEvents(cri.GetEventsRequest(), timeout=2)
    try:
        next(iter(direct))
        upstream_code = None
    except grpc.RpcError as e:
        upstream_code = e.code(), e.details()
    # containerd 1.7 hands each event to ONE of its subscribers (a shared channel, which also keeps
    # the events of earlier tests until someone reads them; 2.x copies them to each): a probe
    # that got one of those must not stay subscribed and take the events this test waits for
    direct.cancel()
    if upstream_code is not None and upstream_code[0] != grpc.StatusCode.DEADLINE_EXCEEDED:
        proxied = rt.GetContainerEvents(cri.GetEventsRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            next(iter(proxied))
        assert (err.value.code(), err.value.details()) == upstream_code
        return
    events: list[cri.ContainerEventResponse] = []
    stream = rt.GetContainerEvents(cri.GetEventsRequest())

    def read() -> None:
        try:
            for ev in stream:
                events.append(ev)
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)
    pod = pods.run_pod(rt, "events", log_root, containers={"counter": pods.container_config("counter")})
    pod_cleanup.append(pod.id)
    cid = pod.containers["counter"]
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=2))
    pods.wait_for(
        lambda: (
            {cri.CONTAINER_CREATED_EVENT, cri.CONTAINER_STARTED_EVENT, cri.CONTAINER_STOPPED_EVENT}
            <= {e.container_event_type for e in events if e.container_id == cid}
        ),
        timeout=15,
        what="created/started/stopped events",
    )
    stream.cancel()
    reader.join(5)


def test_exec_url_from_upstream_works(
    rt: api_pb2_grpc.RuntimeServiceStub, log_root: Path, pod_cleanup: list[str]
) -> None:
    pod = pods.run_pod(rt, "exec-url", log_root, containers={"counter": pods.container_config("counter")})
    pod_cleanup.append(pod.id)
    url = rt.Exec(cri.ExecRequest(container_id=pod.containers["counter"], cmd=["true"], stdout=True)).url
    parsed = urlparse(url)
    assert parsed.scheme == "http" and parsed.port
    with socket.create_connection((parsed.hostname, parsed.port), timeout=5):
        pass  # containerd's streaming server answers on the URL podshim returned


def test_unknown_pod_checkpoint_rpc_is_typed(rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed) -> None:
    with pytest.raises(grpc.RpcError) as err:
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id="no-such-pod", output_path=str(bed.checkpoint_root / "x")
            ),
            timeout=10,
        )
    assert err.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED)


def test_bad_config_is_one_line_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[server]\nsockt = "/tmp/x.sock"\n')
    podshim = Path(__file__).resolve().parents[1] / ".venv/bin/podshim"
    r = subprocess.run(
        [str(podshim), "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "server.sockt" in lines[0], r.stderr
    cfg.write_text('[log]\nformat = "xml"\n')
    r = subprocess.run(
        [str(podshim), "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2 and "log.format" in r.stderr


def test_upstream_down_is_unavailable_and_recovers(
    rt: api_pb2_grpc.RuntimeServiceStub, bed: TestBed, log_root: Path, pod_cleanup: list[str]
) -> None:
    """containerd stops: podshim answers UNAVAILABLE naming the upstream (and stays up); containerd
    comes back: podshim serves again by itself, and running pods were not disturbed."""
    pod = pods.run_pod(
        rt, "upstream-restart", log_root, containers={"counter": pods.container_config("counter")}
    )
    pod_cleanup.append(pod.id)
    bed.stop_containerd()
    try:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "upstream runtime" in err.value.details() and str(bed.containerd_socket) in err.value.details()
        assert time.monotonic() - start < 5, "fails fast, no hang"
        assert bed.podshim_running
    finally:
        bed.start_containerd()
    pods.wait_for(
        lambda: _answers(rt, pod.id), timeout=10, what="podshim serving again after containerd came back"
    )
    before = pods.counts(pod.log_path("counter"))[-1]
    assert pods.wait_count(pod.log_path("counter"), before + 3) > before  # the container kept running


def _answers(rt: api_pb2_grpc.RuntimeServiceStub, pod_id: str) -> bool:
    try:
        st = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id), timeout=2)
    except grpc.RpcError:
        return False
    return st.status.state == cri.SANDBOX_READY
