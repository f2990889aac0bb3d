"""The cluster fixture: one real control plane with a registered node on podshim for the session
(testbed/cluster.py). `make test-cluster` runs tests/cluster alone; `make test` includes it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.cluster import ClusterBed
from testbed.tools import CONTROL_PLANE, missing


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster: runs a Kubernetes control plane and a registered kubelet (make test-cluster)"
    )


def pytest_itemcollected(item: pytest.Item) -> None:
    # every test here runs a control plane and a node: root-only, never in `make test-fast`
    item.add_marker(pytest.mark.e2e)
    item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterBed]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and node 1 Ready, one for the
    whole session (tests delete what they create)."""
    absent = missing([*CONTROL_PLANE, "kubelet"])
    if absent:
        pytest.skip(f"not built: {', '.join(absent)} (run the set-up: scripts/gotools.sh {' '.join(absent)})")
    with ClusterBed() as cb:
        yield cb
