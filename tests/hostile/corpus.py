"""The shared pieces of the hostile corpus: the canary outside the allowed roots, the context a
case builds its request from, and the table row type."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import pods
from testbed.bed import TestBed

Rt = api_pb2_grpc.RuntimeServiceStub
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
DATA_LOSS = grpc.StatusCode.DATA_LOSS
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
COUNTER_ARGS = ["--mem-mib", "8", "--interval-ms", "100"]


@dataclass
class Canary:
    """A directory outside the allowed roots, on a tmpfs mounted `strictatime`: any read of its
    files moves their atime, any write their mtime/ctime, any new entry shows in the listing."""

    dir: Path
    secret: Path
    sub: Path

    def fingerprint(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for dirpath, dirnames, filenames in os.walk(self.dir):
            for n in dirnames + filenames:
                p = Path(dirpath, n)
                st = p.lstat()
                times = (st.st_mtime_ns, st.st_ctime_ns)
                if not stat.S_ISDIR(st.st_mode):  # listing a directory ourselves moves its atime
                    times += (st.st_atime_ns,)
                out[str(p.relative_to(self.dir))] = (st.st_mode, st.st_size, *times)
        return out


@dataclass
class Ctx:
    """What a case builds its request from. Paths it creates go into `made` (removed after)."""

    rt: Rt
    bed: TestBed
    victim: pods.Pod  # a running counter pod
    other: pods.Pod  # another one
    archive: Path  # a good CheckpointPod archive of `victim`
    canary: Canary
    made: list[Path] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)  # the empty dirs `fresh` made

    @property
    def root(self) -> Path:
        return Path(self.bed.checkpoint_root)

    def fresh(self, tag: str = "out") -> Path:
        """A new empty directory inside the allowed root."""
        d = self.root / f"hostile-{tag}-{secrets.token_hex(3)}"
        d.mkdir(mode=0o700)
        self.made.append(d)
        self.outputs.append(d)
        return d

    def name(self, tag: str) -> Path:
        """A fresh name inside the allowed root (nothing created)."""
        p = self.root / f"hostile-{tag}-{secrets.token_hex(3)}"
        self.made.append(p)
        return p

    def copy(self, tag: str = "copy") -> Path:
        """A copy of the good archive (hard links: change files only through `rewrite`)."""
        d = self.name(tag)
        shutil.copytree(self.archive, d, copy_function=os.link)
        return d

    def checkpoint(self, output_path: str, **fields: Any) -> Callable[[], Any]:
        if "pod_sandbox_id" not in fields:  # the victim, its running counter listed as a kubelet lists it
            fields["pod_sandbox_id"] = self.victim.id
            fields.setdefault("container_ids", [self.victim.containers["counter"]])
        req = cri.CheckpointPodRequest(output_path=output_path, **fields)
        return lambda: self.rt.CheckpointPod(req, timeout=60)

    def restore(
        self,
        path: Path | str | None = None,
        containers: list[cri.ContainerConfig] | None = None,
        with_config: bool = True,
        **fields: Any,
    ) -> Callable[[], Any]:
        req = cri.RestorePodRequest(
            checkpoint_path=str(self.archive if path is None else path),
            container_configs=[counter()] if containers is None else containers,
            **fields,
        )
        if with_config:
            req.config.CopyFrom(pods.pod_config(f"hostile-{secrets.token_hex(3)}", self.bed.pod_logs_dir))
        return lambda: self.rt.RestorePod(req, timeout=60)


def counter(name: str = "counter", **changes: Any) -> cri.ContainerConfig:
    """The container config a kubelet sends to restore the victim's counter, with `changes`."""
    cc = pods.container_config(name, args=list(COUNTER_ARGS))
    for k, v in changes.items():
        if k == "args":
            del cc.args[:]
            cc.args.extend(v)
        elif k == "command":
            cc.command.extend(v)
        elif k == "env":
            cc.envs.extend(cri.KeyValue(key=a, value=b.encode()) for a, b in v.items())
        elif k == "working_dir":
            cc.working_dir = v
        elif k == "image":
            cc.image.image = v
        elif k == "run_as_user":
            cc.linux.security_context.run_as_user.value = v
        else:
            raise KeyError(k)
    return cc


@dataclass(frozen=True)
class Case:
    """One row: `build(ctx)` returns the call to make, which must fail with `code` and a
    message containing every needle."""

    id: str
    build: Callable[[Ctx], Callable[[], Any]]
    code: grpc.StatusCode
    needles: tuple[str, ...] = ()


# ---------------------------------------------------------------------------- archive surgery


def rewrite(path: Path, data: bytes) -> None:
    """Replace a file of an archive copy without touching the (hard-linked) original."""
    path.unlink()
    path.write_bytes(data)
    os.chmod(path, 0o600)


def edit_manifest(root: Path, fn: Callable[[dict[str, Any]], object]) -> Path:
    m = json.loads((root / "manifest.json").read_text())
    fn(m)
    rewrite(root / "manifest.json", json.dumps(m, indent=1).encode())
    return root


def rehash(root: Path, rel: str) -> Path:
    """Make the manifest agree with the (modified) file `rel`: the checksum is no signature."""
    data = (root / rel).read_bytes()
    entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return edit_manifest(root, lambda m: m["files"].__setitem__(rel, entry))


def first_pages(root: Path) -> str:
    return next(
        str(p.relative_to(root)) for p in sorted(root.glob("containers/counter/checkpoint/pages-*.img"))
    )
