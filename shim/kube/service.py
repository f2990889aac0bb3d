"""The cluster API's pieces together, started beside the CRI server when `[kubernetes]`
names the node's credentials (docs/cluster.md)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from shim import logs
from shim.config import Config
from shim.kube import client
from shim.kube.controller import CheckpointController, PodGuards
from shim.kube.restore import RestoreGate
from shim.upstream import Upstream

log = logs.get("shim.kube")


class ClusterApi:
    def __init__(self, config: Config, engine: Any, upstream: Upstream) -> None:
        self.kube = client.Kube(config)
        guards = PodGuards()  # one checkpoint or restore per pod, whichever asked first
        self.controller = CheckpointController(self.kube, self.kube.node, engine, upstream, config.state_dir)
        self.controller.guards = guards
        self.restores = RestoreGate(self.kube, engine, upstream, guards)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.controller.run())
        log.info("serving the cluster API", node=self.kube.node)

    async def stop_watching(self) -> None:
        """No new object is taken (a graceful stop: the checkpoints in flight go on)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def stop(self) -> None:
        await self.stop_watching()
        await self.controller.cancel()
        await self.kube.close()


def from_config(config: Config, engine: Any, upstream: Upstream) -> ClusterApi | None:
    """The cluster API, or None (logged) when `[kubernetes] kubeconfig` names no file."""
    if not client.enabled(config):
        log.info(
            "no cluster API: [kubernetes] kubeconfig names no file", kubeconfig=config.kubernetes_kubeconfig
        )
        return None
    return ClusterApi(config, engine, upstream)
