"""A Node.js 18 server (Debian's own packages, images/debian.py) warm-started from a pod
checkpoint, end to end, with runc and crun: a first container renders the app's config into an
emptyDir and exits, as an init container does; the server builds a 64 MiB heap, counts every
100 ms, and answers HTTP with its count, a digest of its heap computed on the spot and the config
it re-reads from the emptyDir on every request. CheckpointPod (STOPPED: the source is killed at
the cut) and RestorePod: the same process (its start time), the same heap (the digest), the
count resumed at exactly the next number, and the rendered config read again after the restore.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import pods
from testbed.bed import TestBed
from tests.warm_start import warm_start

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
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


def test_node_server_warm_starts_with_its_heap_count_and_config(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    runtime_handler: str,
    archives: list[Path],
    node_image: str,
) -> None:
    def service(volume: Path) -> cri.ContainerConfig:
        return server(node_image, volume)

    warm_start(rt, bed, log_root, pod_cleanup, archives, runtime_handler, "node", service, COUNT_RE, 90)
