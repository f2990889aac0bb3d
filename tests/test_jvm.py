"""A JVM service (OpenJDK 17 from Debian's own packages, images/debian.py) warm-started from a pod
checkpoint, end to end, with runc and crun: a first container renders the app's config into an
emptyDir and exits, as an init container does; the service is compiled at start (the JDK's
single-file source launcher), builds a heap of a million strings, counts every 100 ms and answers
HTTP (the JDK's own server) with its count, a digest of its heap computed on the spot and the
config it re-reads from the emptyDir on every request. CheckpointPod (STOPPED: the source is
killed at the cut) and RestorePod: the same JVM (its start time and pid), the same heap (the
digest), the count resumed at exactly the next number, the config read again after the restore,
and neither the compile nor the heap built again.
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

pytestmark = pytest.mark.e2e

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 180
COUNT_RE = re.compile(rb"jvm (\d+) ")
SERVER = r"""
import com.sun.net.httpserver.HttpServer;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;
import java.util.concurrent.atomic.AtomicLong;

public class Server {
    public static void main(String[] args) throws Exception {
        List<String> heap = new ArrayList<>();
        MessageDigest md5 = MessageDigest.getInstance("MD5");
        for (int i = 0; i < 1 << 20; i++) {
            heap.add(HexFormat.of().formatHex(md5.digest(Integer.toString(i).getBytes())) + i);
        }
        long started = System.currentTimeMillis();
        AtomicLong count = new AtomicLong();
        Thread ticker = new Thread(() -> {
            while (true) {
                long now = System.currentTimeMillis();
                System.out.println("jvm " + count.getAndIncrement() + " " + now / 1000.0);
                try { Thread.sleep(100); } catch (InterruptedException e) { return; }
            }
        });
        ticker.setDaemon(true);
        HttpServer server = HttpServer.create(new InetSocketAddress("127.0.0.1", 8080), 0);
        server.createContext("/", ex -> {
            try {
                MessageDigest h = MessageDigest.getInstance("SHA-256");
                for (String s : heap) h.update(s.getBytes(StandardCharsets.UTF_8));
                String config = Files.readString(Path.of("/config/app.json")).strip();
                String body = "{\"count\":" + count.get() + ",\"started\":" + started
                    + ",\"pid\":" + ProcessHandle.current().pid()
                    + ",\"digest\":\"" + HexFormat.of().formatHex(h.digest())
                    + "\",\"config\":" + config + "}";
                byte[] out = body.getBytes(StandardCharsets.UTF_8);
                ex.sendResponseHeaders(200, out.length);
                ex.getResponseBody().write(out);
            } catch (Exception e) {
                ex.sendResponseHeaders(500, -1);
            } finally {
                ex.close();
            }
        });
        server.start();
        ticker.start();
        System.out.println("listening");
    }
}
"""


@pytest.fixture(scope="module")
def jre_image(bed: TestBed) -> str:
    return bed.import_debian_image("jre")


def service(image: str, volume: Path) -> cri.ContainerConfig:
    # the source written where the launcher reads it, then the JVM in the shell's place (pid 1)
    run = 'printf "%s" "$SERVER_JAVA" > /tmp/Server.java && exec java -Xmx256m /tmp/Server.java'
    cc = pods.container_config("app", image=image, command=["sh", "-c", run], env={"SERVER_JAVA": SERVER})
    cc.args[:] = []
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


def test_jvm_service_warm_starts_with_its_heap_count_and_config(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    runtime_handler: str,
    archives: list[Path],
    jre_image: str,
) -> None:
    kubelet = Path(bed.base_dir) / "kubelet"
    tag = f"jvm-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
    src_config = pods.pod_config(tag, log_root)
    src_dir = pods.empty_dir(kubelet, src_config.metadata.uid, "config")
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
        {"render": render, "app": service(jre_image, src_dir)},
        runtime_handler=runtime_handler,
        config=src_config,
    )
    pod_cleanup.append(src.id)
    log = src.log_path("app")
    pods.wait_for(lambda: log.exists() and b"listening" in log.read_bytes(), timeout=120, what="the JVM")
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
    new_dir = pods.empty_dir(kubelet, config.metadata.uid, "config")
    resp = rt.RestorePod(
        cri.RestorePodRequest(
            checkpoint_path=str(out),
            config=config,
            container_configs=[service(jre_image, new_dir)],
            runtime_handler=runtime_handler,
        ),
        timeout=RPC_TIMEOUT,
    )
    pod_cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    new_log = Path(config.log_directory) / "app" / "0.log"
    pods.wait_for(lambda: len(counts(new_log)) >= 3, what="the restored JVM to count")
    after = ask(rt, cid)
    assert (after["started"], after["pid"], after["digest"]) == (
        before["started"],
        before["pid"],
        before["digest"],
    )
    assert after["config"] == rendered  # re-read from the restored emptyDir
    restored = counts(new_log)
    assert restored[:3] == [last + 1, last + 2, last + 3], (last, restored[:5])
    assert b"listening" not in new_log.read_bytes(), "the JVM started again: not restored"
