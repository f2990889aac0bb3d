"""bench/cluster: what the cluster API path costs over the CRI calls it makes (docs/cluster.md).

    python -m bench.cluster [--rounds 3] [--mem-mib 256] [--init-seconds 10]

A real cluster (testbed/cluster.py) runs a counter pod that, like a slow service, works for
--init-seconds before its first count (a restore skips that). Each round, in the same run:

* api checkpoint: a PodCheckpoint created (kubectl's request) until the object reads Ready=True;
  beside it, the CheckpointPod podshim ran for it (its own "checkpoint_pod done" log line, the
  same operation) and a CheckpointPod of the same pod called straight on the node's socket;
* api restore: a Pod naming the checkpoint created until the restored container's first count
  in its log; beside it, RestorePod + StartContainer of the same archive straight on the node's
  socket until the first count, and a cold start: the same Pod without the annotation until its
  first count.

Ends with ``RESULT api_checkpoint_overhead_s=… api_restore_overhead_s=… restore_vs_cold=…
kubelet_pod_start_s=…``: the medians of (api − CRI) for each path, of api restore / api cold
start, and the floor of the restore's overhead measured beside it: the same cold start through the
kubelet less straight on the node's socket (the kubelet's own pod start: its sync, the volumes).
Target: each overhead ≤ 0.3 s over the CRI-level time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from lightkube import Client, KubeConfig
from lightkube.resources.core_v1 import Pod

from api.runtime.v1 import api_pb2 as cri
from bench.common import COUNT_RE, CriLog, machine_summary, median, result_line, say, table
from shim.archive import layout
from shim.kube import api
from shim.ops.restore_checks import archived_config
from testbed import pods
from testbed.bed import COUNTER_IMAGE, REPO
from testbed.cluster import ClusterBed, pod_manifest

HEADERS = ["", "api ck", "its CheckpointPod", "CRI ck", "api restore", "CRI restore", "api cold", "CRI cold"]
POLL = 0.02  # the API's answer is read this often (a watch's latency is the API server's own)


def counter(mem_mib: int, init_seconds: int) -> dict[str, Any]:
    args = ["--mem-mib", str(mem_mib), "--interval-ms", "100"]
    if init_seconds:  # a service that initialises before it serves: what a restore skips
        args += ["--init-seconds", str(init_seconds)]
    return {"name": "app", "image": COUNTER_IMAGE, "imagePullPolicy": "Never", "args": args}


def pod_from(doc: dict[str, Any]) -> Pod:
    return Pod.from_dict(doc)  # type: ignore[return-value]


def log_of(cb: ClusterBed, pod: dict[str, Any]) -> Path:
    md = pod["metadata"]
    return cb.kubelet.pod_logs / f"{md['namespace']}_{md['name']}_{md['uid']}" / "app" / "0.log"


def first_count(cb: ClusterBed, client: Client, name: str, started: float, timeout: float = 300) -> float:
    """Seconds from `started` until pod `name`'s first count line."""
    end = time.perf_counter() + timeout
    while True:
        pod = client.get(Pod, name, namespace="default").to_dict()
        if pod["metadata"].get("uid") and (pod.get("status") or {}).get("containerStatuses"):
            seen, _ = CriLog(log_of(cb, pod)).wait(COUNT_RE, max(1.0, end - time.perf_counter()), POLL)
            return seen - started
        if time.perf_counter() > end:
            raise TimeoutError(f"pod {name} did not start within {timeout}s")
        time.sleep(POLL)


def wait_ready(client: Client, name: str, timeout: float = 600) -> dict[str, Any]:
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        obj = dict(client.get(api.PodCheckpoint, name, namespace="default").to_dict())
        if api.is_terminal(obj):
            if not api.is_ready(obj):
                raise RuntimeError(f"PodCheckpoint {name}: {api.ready_condition(obj)}")
            return obj
        time.sleep(POLL)
    raise TimeoutError(f"PodCheckpoint {name} not Ready within {timeout}s")


def direct_checkpoint(cb: ClusterBed, rt: Any, pod_uid: str, tag: str) -> float:
    """CheckpointPod of the pod with this UID straight on the node's socket: wall seconds."""
    sandboxes = rt.ListPodSandbox(
        cri.ListPodSandboxRequest(
            filter=cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.uid": pod_uid})
        )
    ).items
    sid = next(s.id for s in sandboxes if s.state == cri.SANDBOX_READY)
    node_path = f"{api.CHECKPOINT_ROOT}/bench-{tag}"
    host = cb.kubelet.host_path(node_path)
    host.mkdir(mode=0o700, parents=True)
    req = pods.checkpoint_request(rt, sid, Path(node_path))
    t0 = time.perf_counter()
    rt.CheckpointPod(req, timeout=900)
    wall = time.perf_counter() - t0
    shutil.rmtree(host, ignore_errors=True)
    return wall


def direct_restore_and_cold(cb: ClusterBed, rt: Any, archive: str, tag: str) -> tuple[float, float]:
    """Straight on the node's socket, until the first count (wall seconds): RestorePod +
    StartContainer of the archive with the checkpoint's own container config (its mounts are the
    source pod's, which still runs), and a cold RunPodSandbox + CreateContainer + StartContainer
    of the same container (the floor: the API path's cold start less this is the kubelet's own pod
    start, which no runtime can take off). The kubelet is stopped meanwhile: it removes within
    seconds any pod it did not make."""
    host = cb.kubelet.host_path(archive)
    record = json.loads(layout.ArchiveLayout(host).container("app").config_dump.read_text())
    cc = archived_config(record)
    cb.kubelet.stop()
    try:
        restore = _restore(rt, archive, pods.pod_config(f"cri-{tag}", Path(cb.bed.pod_logs_dir)), cc)
        config = pods.pod_config(f"cri-cold-{tag}", Path(cb.bed.pod_logs_dir))
        t0 = time.perf_counter()
        pod = pods.run_pod(rt, config.metadata.name, Path(cb.bed.pod_logs_dir), {"app": cc}, config=config)
        seen, _ = CriLog(Path(config.log_directory) / cc.log_path).wait(COUNT_RE, 300, POLL)
        pods.remove_pod(rt, pod.id)
        return restore, seen - t0
    finally:
        cb.kubelet.start()
        cb.wait_node_ready(cb.node_name)


def _restore(rt: Any, archive: str, config: cri.PodSandboxConfig, cc: cri.ContainerConfig) -> float:
    t0 = time.perf_counter()
    resp = rt.RestorePod(
        cri.RestorePodRequest(checkpoint_path=archive, config=config, container_configs=[cc]), timeout=300
    )
    for c in resp.restored_containers:
        rt.StartContainer(cri.StartContainerRequest(container_id=c.container_id))
    seen, _ = CriLog(Path(config.log_directory) / cc.log_path).wait(COUNT_RE, 300, POLL)
    pods.remove_pod(rt, resp.pod_sandbox_id)
    return seen - t0


def logged_checkpoint_seconds(log: Path, since: int) -> float:
    """The seconds of the last "checkpoint_pod done" podshim logged after byte `since`."""
    found = float("nan")
    for line in log.read_bytes()[since:].splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("event") == "checkpoint_pod done":
                found = float(doc["seconds"])
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem-mib", type=int, default=256)
    ap.add_argument("--init-seconds", type=int, default=10, help="the service's start-up work (default 10)")
    args = ap.parse_args()
    say(machine_summary())
    rows: list[list[Any]] = []
    with ClusterBed() as cb:
        cb.kubectl("apply", "-k", str(REPO / "deploy"))
        client = Client(KubeConfig.from_file(cb.kubeconfig["admin"]), field_manager="bench")
        cb.apply(pod_manifest("source", [counter(args.mem_mib, args.init_seconds)]))
        src = cb.wait_pod_running("source")
        CriLog(log_of(cb, src)).wait(COUNT_RE, 300)
        node_rt = cb.bed.runtime_stub(cb.bed.podshim_socket)
        for r in range(args.rounds + 1):  # round 0 warms up
            tag = uuid.uuid4().hex[:5]
            since = cb.bed.podshim_log.stat().st_size
            body: dict[str, Any] = {
                "apiVersion": f"{api.GROUP}/{api.VERSION}",
                "kind": api.KIND,
                "metadata": {"name": f"ck-{tag}", "namespace": "default"},
                "spec": {"sourcePodName": "source"},
            }
            t0 = time.perf_counter()
            client.create(api.PodCheckpoint.from_dict(body))
            ck = wait_ready(client, f"ck-{tag}")
            api_ck = time.perf_counter() - t0
            logged = logged_checkpoint_seconds(cb.bed.podshim_log, since)
            # the same pod, CheckpointPod straight on the node's socket
            cri_ck = direct_checkpoint(cb, node_rt, src["metadata"]["uid"], tag)
            # restore through the API, through RestorePod on the node's socket, and a cold start
            template = ck["status"]["checkpointedPodTemplate"]
            md = {**(template.get("metadata") or {}), "name": f"restored-{tag}", "namespace": "default"}
            md["annotations"] = {**(md.get("annotations") or {}), api.RESTORE_FROM_ANNOTATION: f"ck-{tag}"}
            spec = {**template["spec"], "nodeName": cb.node_name}
            t0 = time.perf_counter()
            client.create(pod_from({"apiVersion": "v1", "kind": "Pod", "metadata": md, "spec": spec}))
            api_restore = first_count(cb, client, f"restored-{tag}", t0)
            cri_restore, cri_cold = direct_restore_and_cold(cb, node_rt, api.archive_path(ck), tag)
            cold_md = {"name": f"cold-{tag}", "namespace": "default", "labels": md.get("labels") or {}}
            t0 = time.perf_counter()
            client.create(pod_from({"apiVersion": "v1", "kind": "Pod", "metadata": cold_md, "spec": spec}))
            cold = first_count(cb, client, f"cold-{tag}", t0)
            for p in (f"restored-{tag}", f"cold-{tag}"):
                cb.delete_pod(p)
            client.delete(api.PodCheckpoint, f"ck-{tag}", namespace="default")
            row: list[Any] = [f"round {r}" + (" (warm-up)" if r == 0 else "")]
            row += [api_ck, logged, cri_ck, api_restore, cri_restore, cold, cri_cold]
            say(table(HEADERS, [row]))
            if r:
                rows.append(row)
    print(table(HEADERS, rows))
    print(
        result_line(
            api_checkpoint_overhead_s=median([row[1] - row[2] for row in rows]),
            api_restore_overhead_s=median([row[4] - row[5] for row in rows]),
            restore_vs_cold=median([row[4] / row[6] for row in rows]),
            # the floor beside the restore's overhead: the kubelet's own pod start (API cold - CRI cold)
            kubelet_pod_start_s=median([row[6] - row[7] for row in rows]),
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
