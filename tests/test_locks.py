"""OperationLocks (shim/engine.py): one operation per pod or path; restores of one archive share
its path (N replicas from one checkpoint at once), a checkpoint into it excludes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim import errors
from shim.engine import OperationLocks


def test_restores_share_a_path_and_exclude_a_checkpoint(tmp_path: Path) -> None:
    locks = OperationLocks()
    path = f"path {tmp_path}"
    a = locks.acquire("restore_pod", ["pod default/a"], [path])
    b = locks.acquire("restore_pod", ["pod default/b"], [f"path {tmp_path}/."])  # an alias, shared
    with pytest.raises(errors.Aborted, match=r"another operation \(restore_pod\) is in progress"):
        locks.acquire("checkpoint_pod", ["pod p2", path])
    with pytest.raises(errors.Aborted):
        locks.acquire("restore_pod", ["pod default/a"], [path])  # the same pod stays exclusive
    locks.release(a)
    with pytest.raises(errors.Aborted):
        locks.acquire("checkpoint_pod", ["pod p3", path])  # b still reads it
    locks.release(b)
    c = locks.acquire("checkpoint_pod", ["pod p3", path])
    with pytest.raises(errors.Aborted, match=r"\(checkpoint_pod\)"):
        locks.acquire("restore_pod", ["pod default/c"], [path])
    locks.release(c)
    locks.release(locks.acquire("restore_pod", ["pod default/c"], [path]))
    assert not locks._held and not locks._shared
