"""The live migration's failure paths with the upstream seam's fakes (docs/design/migration.md (Live
migration)): races made deterministic, which the e2e failure matrix (tests/test_migration.py)
meets only now and then."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import errors
from shim.config import Config
from shim.engine import Engine
from shim.migration import credentials, source
from tests.fakes import FakeUpstream


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    roots = tmp_path / "roots"
    roots.mkdir()
    (cert, key) = credentials.issue(tmp_path / "pki", {"node-a": ["127.0.0.1"]})["node-a"]
    return Config(
        state_dir=str(tmp_path / "state"),
        allowed_roots=(str(roots),),
        migration_cert_file=str(cert),
        migration_key_file=str(key),
        migration_ca_file=str(tmp_path / "pki" / "ca.pem"),
    )


async def test_a_cancelled_migration_holds_the_pod_until_its_undo_ended(
    cfg: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller of a migrating CheckpointPod goes away (its deadline) while the source undoes a
    failure (ends the dumps, waits out the destination's lease, thaws): the call ends only with
    the undo, so the pod's operation lock is held meanwhile and a second CheckpointPod of the pod
    is ABORTED instead of starting on a pod still frozen."""
    engine = Engine(cfg, FakeUpstream())  # type: ignore[arg-type]
    out = Path(cfg.allowed_roots[0]) / "out"
    undoing, release = asyncio.Event(), asyncio.Event()

    async def check(_req: Any, carry_volumes: bool = True) -> tuple[Any, ...]:
        assert not carry_volumes  # a migration carries no volumes
        return None, out, SimpleNamespace(name="p"), [], SimpleNamespace(close=lambda: None), None

    async def run(*_args: Any) -> None:
        raise source.MigrationFailed(errors.Unavailable("the link was lost"))

    async def fail(*_args: Any) -> None:
        undoing.set()
        await release.wait()  # the fence: the destination's lease

    monkeypatch.setattr(engine.migration_out.archiver, "_check", check)
    monkeypatch.setattr(engine.migration_out, "_run", run)
    monkeypatch.setattr(engine.migration_out, "_fail", fail)
    req = cri.CheckpointPodRequest(
        pod_sandbox_id="pod1", output_path=str(out), options={source.OPTION: "127.0.0.1:9"}
    )
    first = asyncio.ensure_future(engine.checkpoint_pod(req, 60.0))
    await asyncio.wait_for(undoing.wait(), 5)
    first.cancel()  # the caller's deadline, during the undo
    await asyncio.sleep(0.05)
    assert not first.done()
    with pytest.raises(errors.Aborted, match="in progress on pod pod1"):
        await engine.checkpoint_pod(cri.CheckpointPodRequest(pod_sandbox_id="pod1", output_path=str(out)), 5)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert engine.locks._held == {}
