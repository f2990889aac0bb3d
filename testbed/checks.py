"""Small checks the end-to-end tests share: errors, verbose status, freezer state, journal."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc

FREEZER = Path("/sys/fs/cgroup/freezer")  # this machine: cgroup v1


def expect_error(code: grpc.StatusCode, call: Callable[[], Any], *words: str) -> str:
    """Run `call`, expect an RpcError with `code` whose message contains every word."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, (err.value.code(), err.value.details())
    details = err.value.details() or ""
    for w in words:
        assert w in details, f"{w!r} not in error message {details!r}"
    return details


def verbose_info(rt: api_pb2_grpc.RuntimeServiceStub, container_id: str) -> dict[str, Any]:
    resp = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=container_id, verbose=True))
    return json.loads(resp.info["info"])


def container_cgroup(rt: api_pb2_grpc.RuntimeServiceStub, container_id: str) -> str:
    return str(verbose_info(rt, container_id)["runtimeSpec"]["linux"]["cgroupsPath"])


def freezer_state(cgroup: str) -> str:
    return (FREEZER / cgroup.lstrip("/") / "freezer.state").read_text().strip()


def journal_files(state_dir: str | os.PathLike[str]) -> list[str]:
    """podshim's open operations (journal records) in `state_dir`."""
    ops = Path(state_dir) / "ops"
    return sorted(n for n in os.listdir(ops) if n.endswith(".json")) if ops.is_dir() else []
