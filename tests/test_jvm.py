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


def jvm_service(image: str, volume: Path) -> cri.ContainerConfig:
    # the source written where the launcher reads it, then the JVM in the shell's place (pid 1)
    run = 'printf "%s" "$SERVER_JAVA" > /tmp/Server.java && exec java -Xmx256m /tmp/Server.java'
    cc = pods.container_config("app", image=image, command=["sh", "-c", run], env={"SERVER_JAVA": SERVER})
    cc.args[:] = []
    cc.mounts.append(cri.Mount(host_path=str(volume), container_path="/config"))
    return cc


def test_jvm_service_warm_starts_with_its_heap_count_and_config(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    runtime_handler: str,
    archives: list[Path],
    jre_image: str,
) -> None:
    def service(volume: Path) -> cri.ContainerConfig:
        return jvm_service(jre_image, volume)

    warm_start(rt, bed, log_root, pod_cleanup, archives, runtime_handler, "jvm", service, COUNT_RE, 120)
