"""The CRI container config a checkpoint records in `config.dump` (`config`): the upstream's own
JSON of it, from its verbose container status, kept as it is. containerd 1.6, 1.7 and 2.1 write
environment values there as text; the released CRI API types them `bytes`, whose protobuf JSON
is base64, so they are read here, as text (docs/design/testbed.md (The released API's Go
client))."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from api.runtime.v1 import api_pb2 as cri


def container_config(config: dict[str, Any]) -> cri.ContainerConfig:
    """A recorded config as a ContainerConfig (fields this API does not know are ignored)."""
    data = dict(config)
    envs = data.pop("envs", None) or []
    cc = json_format.ParseDict(data, cri.ContainerConfig(), ignore_unknown_fields=True)
    for e in envs:
        if isinstance(e, dict):
            cc.envs.add(key=str(e.get("key") or ""), value=str(e.get("value") or "").encode())
    return cc
