"""Shared fixtures: one private containerd + podshim test bed for the end-to-end tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2_grpc
from testbed import pods
from testbed.bed import TestBed
from testbed.versions import containerd_version_from_env

# The end-to-end core: `make test` runs the whole suite on the default upstream (containerd 1.6)
# and then `pytest -m core` on containerd 2.2 and on 2.4 with runc 1.3 and CRIU 4.2, `make
# test-matrix` on the other combinations (PODSHIM_TEST_CONTAINERD/RUNC/CRIU, testbed/bed.py): the
# demo flow, the proxy, CheckpointPod, RestorePod, container checkpoint and restore, crash recovery
# (tests/faults), the node's wiring, node setup and doctor.
CORE_MODULES = (
    "test_demo.py",
    "test_proxy.py",
    "test_checkpoint_pod.py",
    "test_restore_pod.py",
    "test_checkpoint_container.py",
    "test_upstreams.py",
    "test_wiring.py",
    "test_node_setup.py",
    "test_doctor.py",
    "test_distribution.py",
    "test_nonroot.py",
    "test_pod_volumes.py",
    "faults/",
)
# The tests of podshim's CRIU patches (scripts/patches/criu): also run on another CRIU than the
# default (`make test-core CRIU=4.2`)
CRIU_MODULES = ("test_restore_identity.py", "test_nonroot.py")
# One test of each feature whose path differs on the newest runtimes a node runs (containerd 2.4,
# runc 1.3, CRIU 4.2): also in `make test`'s pass on those, the rest of their modules in `make
# test-matrix`
NEWEST = (
    "test_lazy_restore.py::test_lazy_restore_plain_pattern_intact[256]",  # CRIU 4.2's lazy-pages
    "test_migration.py::test_migrates_a_counter_with_its_memory[256]",
    "test_encryption_e2e.py::test_restore_resumes_and_leaves_no_plaintext",  # runc 1.3 and --criu
    "test_chains.py::test_container_checkpoint_links[runc]",  # 2.4 dropped its own tar restore
    "test_dump_given_up.py::test_the_deadline_while_a_large_container_is_cured[runc]",
    "hostile/test_rootfs_diff.py::test_restore_with_hostile_diff[write-under-an-image-file]",
)
TESTS_DIR = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "core: the end-to-end core, also run on other runtimes (tests/conftest.py, make test-core)"
    )
    config.addinivalue_line("markers", "kubelet: runs a real kubelet (testbed/kubelet.py; make test-kubelet)")
    config.addinivalue_line("markers", "conformance: critest, checkpoint suite, crictl (make conformance)")
    config.addinivalue_line(
        "markers", "package: the package installed in a fresh Debian root (tests/test_package.py)"
    )
    config.addinivalue_line("markers", "criu: the tests of podshim's CRIU patches (tests/conftest.py)")
    config.addinivalue_line(
        "markers", "newest: also run on containerd 2.4, runc 1.3 and CRIU 4.2 (tests/conftest.py NEWEST)"
    )


def pytest_itemcollected(item: pytest.Item) -> None:
    rel = Path(str(item.path)).resolve().relative_to(TESTS_DIR).as_posix()
    if any(rel == m or (m.endswith("/") and rel.startswith(m)) for m in CORE_MODULES):
        item.add_marker(pytest.mark.core)
    if rel in CRIU_MODULES:
        item.add_marker(pytest.mark.criu)
    if f"{rel}::{item.name}" in NEWEST:
        item.add_marker(pytest.mark.newest)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="end-to-end tests need root (containerd, runc, CRIU)")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip)


# the compiled wrapper (native/podshim-runc.c) the set-up installs next to its Python hook
# .venv/bin/podshim-runc-hook: the BinaryName of both runtime handlers of the bed
PODSHIM_RUNC = Path(__file__).resolve().parents[1] / ".venv/bin/podshim-runc"
CRUN = Path("/usr/local/bin/crun")  # built with CRIU by the set-up


def crun_usable() -> bool:
    if not CRUN.exists():
        return False
    out = subprocess.run([str(CRUN), "--version"], capture_output=True, text=True).stdout
    return "+CRIU" in out


@pytest.fixture(scope="session")
def bed() -> Iterator[TestBed]:
    """containerd + podshim, shared by the session (tests clean up their own pods). Runtime
    handlers: runc (default) and, when the set-up built it, crun — both behind podshim-runc. On
    containerd 2.2 its own restore of a checkpoint tar is on (off by default there), so that a
    test can restore podshim's tar in containerd itself; podshim handles such a create itself."""
    own_restore = containerd_version_from_env() == "2.2"
    crun = PODSHIM_RUNC if crun_usable() else None
    with TestBed(crun_binary=crun, crun_runtime=CRUN, restore_via_create=own_restore) as b:
        yield b


@pytest.fixture
def upstream_first_container_checkpoint(bed: TestBed) -> Iterator[None]:
    """For a test of `container_checkpoint = "fallback"` (the default is podshim's own checkpoint,
    "always"): the bed's podshim restarted with it until the test ends (a FailpointPodshim or a
    restart in between inherits it through bed.extra_env). containerd 1.6 and 1.7 then answer
    UNIMPLEMENTED and podshim checkpoints; containerd 2.x checkpoints the container itself."""
    key = "PODSHIM_CHECKPOINT_CONTAINER_CHECKPOINT"
    bed.extra_env[key] = "fallback"
    bed.kill_podshim(signal.SIGTERM)
    bed.start_podshim_again()
    try:
        yield
    finally:
        del bed.extra_env[key]
        bed.kill_podshim(signal.SIGTERM)
        bed.start_podshim_again()


@pytest.fixture(params=["runc", "crun"])
def runtime_handler(request: pytest.FixtureRequest, bed: TestBed) -> str:
    """The CRI runtime handler to run a test's pods with: every e2e checkpoint/restore test that
    takes this fixture runs once with runc and once with crun."""
    if request.param == "crun" and bed.crun_binary is None:
        require_crun()
    return "" if request.param == "runc" else request.param


@pytest.fixture
def crun_handler(bed: TestBed) -> str:
    """The "crun" runtime handler, for a test that needs crun in particular."""
    if bed.crun_binary is None:
        require_crun()
    return "crun"


def require_crun() -> None:
    """crun with CRIU is part of the set-up: its absence fails the crun variants, so a
    broken crun build cannot pass unnoticed. PODSHIM_TESTS_WITHOUT_CRUN=1 skips them instead."""
    why = "crun with CRIU is not installed (scripts/setup.sh builds it)"
    if os.environ.get("PODSHIM_TESTS_WITHOUT_CRUN") == "1":
        pytest.skip(why)
    pytest.fail(f"{why}; set PODSHIM_TESTS_WITHOUT_CRUN=1 to skip the crun variants")


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
def archives() -> Iterator[list[Path]]:
    """Append checkpoint dirs (or symlinks to them) here; they are removed after the test (the
    archives are large)."""
    dirs: list[Path] = []
    yield dirs
    for d in dirs:
        if d.is_symlink():
            d.unlink()
        else:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def log_root(bed: TestBed) -> Path:
    root = Path(bed.base_dir) / "pod-logs"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(autouse=True, scope="session")
def cli_warm_helpers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The `podshim` commands the tests run start their warm helpers (shim/cli/warm.py) in a
    directory of the session's, whose helpers the session stops at its end (by their pid files)."""
    from shim.cli import warm

    where = tmp_path_factory.mktemp("cli-warm", numbered=False)
    os.environ[warm.DIR_ENV] = str(where)
    yield where
    warm.stop_helpers(str(where))
