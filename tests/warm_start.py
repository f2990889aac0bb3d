"""The warm start of a real service, shared by tests/test_node_server.py and tests/test_jvm.py: a
first container renders the app's config into an emptyDir and exits, as an init container does;
the service (built by `service(image, volume)`) counts every 100 ms, printing lines `count_re`
matches, and answers HTTP on 127.0.0.1:8080 with JSON holding its count, start time, pid, a digest
of its heap computed on request and the config it re-reads from the emptyDir. CheckpointPod
(STOPPED: the source is killed at the cut, so its log ends there) and RestorePod: the same process
(start time, pid), the same heap (the digest), the count resumed at exactly the next number, the
config read again from the restored emptyDir, and no second start-up ("listening")."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from api.runtime.v1 import api_pb2_grpc
from testbed import pods
from testbed.bed import BUSYBOX_IMAGE, TestBed

Stub = api_pb2_grpc.RuntimeServiceStub
RPC_TIMEOUT = 180


def ask(rt: Stub, cid: str) -> dict[str, Any]:
    r = rt.ExecSync(
        cri.ExecSyncRequest(container_id=cid, cmd=["wget", "-qO-", "http://127.0.0.1:8080/"], timeout=60),
        timeout=90,
    )
    assert r.exit_code == 0, r.stderr.decode(errors="replace")
    return dict(json.loads(r.stdout))


def warm_start(
    rt: Stub,
    bed: TestBed,
    log_root: Path,
    pod_cleanup: list[str],
    archives: list[Path],
    runtime_handler: str,
    name: str,
    service: Callable[[Path], cri.ContainerConfig],
    count_re: re.Pattern[bytes],
    start_timeout: float,
) -> None:
    def counts(log: Path) -> list[int]:
        return [int(n) for n in count_re.findall(log.read_bytes())] if log.exists() else []

    kubelet = Path(bed.base_dir) / "kubelet"
    tag = f"{name}-{runtime_handler or 'runc'}-{secrets.token_hex(2)}"
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
        {"render": render, "app": service(src_dir)},
        runtime_handler=runtime_handler,
        config=src_config,
    )
    pod_cleanup.append(src.id)
    log = src.log_path("app")
    pods.wait_for(lambda: log.exists() and b"listening" in log.read_bytes(), timeout=start_timeout, what=name)
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
            container_configs=[service(new_dir)],
            runtime_handler=runtime_handler,
        ),
        timeout=RPC_TIMEOUT,
    )
    pod_cleanup.append(resp.pod_sandbox_id)
    cid = resp.restored_containers[0].container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    new_log = Path(config.log_directory) / "app" / "0.log"
    pods.wait_for(lambda: len(counts(new_log)) >= 3, what=f"the restored {name} to count")
    after = ask(rt, cid)
    assert (after["started"], after["pid"], after["digest"]) == (
        before["started"],
        before["pid"],
        before["digest"],
    )
    assert after["config"] == rendered  # re-read from the restored emptyDir
    restored = counts(new_log)
    assert restored[:3] == [last + 1, last + 2, last + 3], (last, restored[:5])
    assert b"listening" not in new_log.read_bytes(), f"the {name} service started again: not restored"
