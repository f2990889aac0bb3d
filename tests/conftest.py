"""Shared fixtures: one private containerd + podshim test bed for the end-to-end tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2_grpc
from testbed import pods
from testbed.bed import TestBed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="end-to-end tests need root (containerd, runc, CRIU)")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def bed() -> Iterator[TestBed]:
    """containerd + podshim, shared by the session (tests clean up their own pods)."""
    with TestBed() as b:
        yield b


@pytest.fixture(scope="session")
def rt(bed: TestBed) -> api_pb2_grpc.RuntimeServiceStub:
    """RuntimeService through podshim's socket."""
    return pods.stubs(bed.podshim_socket)[0]


@pytest.fixture(scope="session")
def img(bed: TestBed) -> api_pb2_grpc.ImageServiceStub:
    return pods.stubs(bed.podshim_socket)[1]


@pytest.fixture(scope="session")
def direct_rt(bed: TestBed) -> api_pb2_grpc.RuntimeServiceStub:
    """RuntimeService on containerd itself, to compare with."""
    return pods.stubs(bed.containerd_socket)[0]


@pytest.fixture
def pod_cleanup(rt: api_pb2_grpc.RuntimeServiceStub) -> Iterator[list[str]]:
    """Append pod ids to this list; they are removed after the test, pass or fail."""
    ids: list[str] = []
    yield ids
    for pod_id in ids:
        try:
            pods.remove_pod(rt, pod_id)
        except Exception:  # noqa: BLE001 - best effort; the bed's stop removes the rest
            pass


@pytest.fixture
def log_root(bed: TestBed) -> Path:
    root = Path(bed.base_dir) / "pod-logs"
    root.mkdir(exist_ok=True)
    return root
