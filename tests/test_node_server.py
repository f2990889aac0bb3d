"""A Node.js 18 server (Debian's own packages, images/debian.py) warm-started from a pod
checkpoint, end to end, with runc and crun: a first container renders the app's config into an
emptyDir and exits, as an init container does; the server builds a 64 MiB heap, counts every
100 ms, and answers HTTP with its count, a digest of its heap computed on the spot and the config
it re-reads from the emptyDir on every request. CheckpointPod (STOPPED: the source is killed at
the cut) and RestorePod: the same process (its start time), the same heap (the digest), the
count resumed at exactly the next number, and the rendered config read again after the restore.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import pods
from testbed.bed import BUSYBOX_IMAGE, TestBed
from tests.test_pod_volumes import empty_dir

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 180
COUNT_RE = re.compile(rb"node (\d+) ")
SERVER = r"""
const crypto = require('crypto'), fs = require('fs'), http = require('http');
const heap = [];
for (let i = 0; i < 1 << 20; i++) heap.push(crypto.createHash('md5').update(String(i)).digest('hex') + i);
const started = Date.now();
let count = 0;
setInterval(() => { console.log(`node ${count++} ${Date.now() / 1000}`); }, 100);
http.createServer((req, res) => {
  const h = crypto.createHash('sha256');
  for (const s of heap) h.update(s);
  const config = JSON.parse(fs.readFileSync('/config/app.json', 'utf8'));
  res.end(JSON.stringify({count, started, pid: process.pid, digest: h.digest('hex'), config}));
}).listen(8080, '127.0.0.1', () => console.log('listening'));
"""


@pytest.fixture(scope="module")
def node_image(bed: TestBed) -> str:
    return bed.import_debian_image("node")


def server(image: str, volume: Path) -> cri.ContainerConfig:
    cc = pods.container_config("app", image=image, command=["node", "-e", SERVER], args=[])
    cc.mounts.append(cri.Mount(host_path=str(volume), container_path="/config"))
    return cc


def ask(rt: Stub, cid: str) -> dict[str, Any]:
    r = rt.ExecSync(
        cri.ExecSyncRequest(container_id=cid, cmd=["wget", "-qO-", "http://127.0.0.1:8080/"], timeout=60),
        timeout=90,
    )
    assert r.exit_code == 0, r.stderr.decode(errors="replace")
    return dict(json.loads(r.stdout))


def counts(log: Path) -> list[int]:
    return [int(n) for n in COUNT_RE.findall(log.read_bytes())] if log.exists() else []


def test_node_server_warm_starts_with_its_heap_count_and_config(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    runtime_handler: str,
    archives: list[Path],
    node_image: str,
) -> None:
    tag = f"node-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    src_config = pods.pod_config(tag, log_root)
    src_dir = empty_dir(bed, src_config.metadata.uid, "config")
    rendered = {"greeting": f"hello from {tag}", "replicas": 3}
    render = pods.container_config(
        "render",
        image=BUSYBOX_IMAGE,
        command=["sh", "-c", f"echo '{json.dumps(rendered)}' > /config/app.json"],
    )
    render.args[:] = []
    render.mounts.append(cri.Mount(host_path=str(src_dir), container_path="/config"))
    src = pods.run_pod(
        rt,
        tag,
        log_root,
        {"render": render, "app": server(node_image, src_dir)},
        runtime_handler=runtime_handler,
        config=src_config,
    )
    pod_cleanup.append(src.id)
    log = src.log_path("app")
    pods.wait_for(lambda: log.exists() and b"listening" in log.read_bytes(), timeout=90, what="node")
    before = ask(rt, src.containers["app"])
    assert before["config"] == rendered

    out = Path(bed.checkpoint_root) / tag
    out.mkdir(mode=0o700)
    archives.append(out)
    req = pods.checkpoint_request(rt, src.id, out, container_ids=[src.containers["app"]])
    req.post_checkpoint_state = cri.POST_CHECKPOINT_STATE_STOPPED  # the source's log ends at the cut
    rt.CheckpointPod(req, timeout=RPC_TIMEOUT)
    last = counts(log)[-1]
    pods.remove_pod(rt, src.id)

    config = pods.pod_config(f"{tag}-new", log_root)
    new_dir = empty_dir(bed, config.metadata.uid, "config")
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(out),
            config=config,
            container_configs=[server(node_image, new_dir)],
            runtime_handler=runtime_handler,
        ),
        timeout=RPC_TIMEOUT,
    )
    pod_cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    new_log = Path(config.log_directory) / "app" / "0.log"
    pods.wait_for(lambda: len(counts(new_log)) >= 3, what="the restored server to count")
    after = ask(rt, cid)
    assert (after["started"], after["pid"], after["digest"]) == (
        before["started"],
        before["pid"],
        before["digest"],
    )
    assert after["config"] == rendered  # re-read from the restored emptyDir
    restored = counts(new_log)
    assert restored[:3] == [last + 1, last + 2, last + 3], (last, restored[:5])
    assert b"listening" not in new_log.read_bytes(), "the server started again: not restored"
