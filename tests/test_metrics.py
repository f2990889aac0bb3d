"""podshim's /metrics: the names operators alert on exist, and end to end a podshim started with
`metrics_address` counts proxied calls and checkpoint/restore operations (result, duration,
archive size, freeze window)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from shim import __version__, metrics
from testbed import pods
from testbed.bed import TestBed

REPO = Path(__file__).resolve().parents[1]
PODSHIM = REPO / ".venv" / "bin" / "podshim"

# name -> type, as docs/reference/metrics.md lists them
EXPECTED = {
    "podshim_operations": "counter",
    "podshim_operation_duration_seconds": "histogram",
    "podshim_checkpoint_freeze_window_seconds": "histogram",
    "podshim_checkpoint_archive_bytes": "histogram",
    "podshim_proxy_requests": "counter",
    "podshim_proxy_request_duration_seconds": "histogram",
    "podshim_build_info": "gauge",
}


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> tuple[dict[str, str], Samples]:
    types: dict[str, str] = {}
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------- names


def test_metric_names_follow_the_documented_list() -> None:
    from prometheus_client import REGISTRY, generate_latest

    metrics.operations.labels("checkpoint_pod", "OK")  # make labelled families visible
    types, _ = parse(generate_latest(REGISTRY).decode())
    for name, kind in EXPECTED.items():
        assert types.get(name) == kind, (name, types.get(name))
    assert metrics.operations._labelnames == ("operation", "result")
    assert metrics.proxy_requests._labelnames == ("method", "code")
    assert metrics.proxy_latency._labelnames == ("method",)
    assert metrics.operation_duration._labelnames == ("operation",)
    assert metrics.archive_size._labelnames == ("operation",)


def test_metrics_address_forms() -> None:
    assert metrics.split_address("127.0.0.1:9847") == ("127.0.0.1", 9847)
    assert metrics.split_address(":9847") == ("0.0.0.0", 9847)
    assert metrics.split_address("[::1]:9847") == ("::1", 9847)


# ---------------------------------------------------------------------------- end to end


@pytest.fixture
def metered_podshim(bed: TestBed, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A second podshim in front of the session bed's containerd, with /metrics on a free port.
    Yields (its socket, the metrics port)."""
    port = free_port()
    with bed.extra_podshim(tmp_path, server={"metrics_address": f"127.0.0.1:{port}"}) as (sock, log):
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, f"no /metrics: {log.read_text()[-2000:]}"
                time.sleep(0.1)
        yield str(sock), port


def scrape(port: int) -> tuple[dict[str, str], Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return parse(resp.read().decode())


@pytest.mark.e2e
def test_metrics_move_with_proxied_calls_and_operations(
    bed: TestBed, metered_podshim: tuple[str, int], pod_cleanup: list[str], log_root: Path
) -> None:
    sock, port = metered_podshim
    types, before = scrape(port)
    for name, kind in EXPECTED.items():
        assert types.get(name) == kind, (name, types.get(name))
    # podshim is visible in its metrics, whatever Version calls the runtime (the upstream's name)
    assert value(before, "podshim_build_info", version=__version__) == 1

    channel = grpc.insecure_channel(f"unix://{sock}")
    rt = api_pb2_grpc.RuntimeServiceStub(channel)
    try:
        src = pods.run_pod(rt, "metrics-counter", log_root)
        pod_cleanup.append(src.id)
        pods.wait_count(src.log_path("counter"), 3)
        for _ in range(3):
            rt.ListContainers(cri.ListContainersRequest())
        with pytest.raises(grpc.RpcError) as err:
            rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id="0" * 64))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        out = Path(bed.checkpoint_root) / f"metrics-{src.id[:12]}"
        out.mkdir(mode=0o700)
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=src.id, container_ids=pods.running_ids(rt, src.id), output_path=str(out)
            ),
            timeout=120,
        )
        with pytest.raises(grpc.RpcError) as err:
            rt.CheckpointPod(
                cri.CheckpointPodRequest(pod_sandbox_id="f" * 64, output_path=str(out) + "-x"), timeout=30
            )
        new_cfg = pods.pod_config("metrics-counter-restored", log_root)
        resp = rt.RestorePod(
            cri.RestorePodRequest(
                checkpoint_path=str(out),
                config=new_cfg,
                container_configs=[pods.container_config("counter")],
            ),
            timeout=120,
        )
        pod_cleanup.append(resp.pod_sandbox_id)
    finally:
        channel.close()

    _, after = scrape(port)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # operations by result, durations, archive size, freeze window
    assert moved("podshim_operations_total", operation="checkpoint_pod", result="OK") == 1
    assert moved("podshim_operations_total", operation="checkpoint_pod", result=err.value.code().name) == 1
    assert moved("podshim_operations_total", operation="restore_pod", result="OK") == 1
    assert moved("podshim_operation_duration_seconds_count", operation="checkpoint_pod") == 2
    assert moved("podshim_operation_duration_seconds_count", operation="restore_pod") == 1
    assert moved("podshim_operation_duration_seconds_sum", operation="restore_pod") > 0
    assert moved("podshim_checkpoint_freeze_window_seconds_count") == 1
    assert moved("podshim_checkpoint_freeze_window_seconds_sum") > 0
    assert moved("podshim_checkpoint_archive_bytes_count", operation="checkpoint_pod") == 1
    manifest = json.loads((out / "manifest.json").read_text())
    size = sum(f["size"] for f in manifest["files"].values())
    assert moved("podshim_checkpoint_archive_bytes_sum", operation="checkpoint_pod") == size

    # the proxy's per-method counters (by code) and latency
    for method in ("RunPodSandbox", "CreateContainer", "StartContainer"):
        assert moved("podshim_proxy_requests_total", method=method, code="OK") >= 1, method
        assert moved("podshim_proxy_request_duration_seconds_count", method=method) >= 1, method
    assert moved("podshim_proxy_requests_total", method="ListContainers", code="OK") >= 3
    assert moved("podshim_proxy_requests_total", method="PodSandboxStatus", code="NOT_FOUND") == 1
    inf = value(after, "podshim_proxy_request_duration_seconds_bucket", method="ListContainers", le="+Inf")
    assert inf >= 3
