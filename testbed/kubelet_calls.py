"""What the kubelet sends podshim, call by call: a kubelet of a KubeletBed is pointed at a
recording relay (testbed/cri_recorder.py) in front of podshim while it runs one pod through what
a node does (init container, two containers, exec probes, /run, /exec, logs, stats, the
checkpoint API, removal); then pointed back at podshim.

    python -m testbed.kubelet_calls [--json OUT.json] > calls.md

prints the Markdown table of docs/kubelet-calls.md (each CRI method: how often, with which
codes, and its first request as protobuf JSON). tests/test_kubelet.py runs the same scenario and
checks the shapes podshim relies on.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from api.runtime.v1 import api_pb2 as cri
from testbed.bed import BUSYBOX_IMAGE, COUNTER_IMAGE
from testbed.cri_recorder import CriRecorder
from testbed.kubelet import NAMESPACE, KubeletBed, exec_stream, pod_manifest

POD = "calls"


def scenario_pod() -> dict[str, Any]:
    probe = {"exec": {"command": ["cat", "/proc/1/status"]}, "periodSeconds": 1}
    volume = {"name": "work", "mountPath": "/work"}
    return pod_manifest(
        POD,
        [
            {
                "name": "app",
                "image": COUNTER_IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "livenessProbe": probe,
                "readinessProbe": probe,
                "env": [{"name": "GREETING", "value": "hello"}],
                "resources": {"limits": {"memory": "64Mi", "cpu": "250m"}},
            },
            {
                "name": "side",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "cat /work/ready; exec sleep 3600"],
                "volumeMounts": [volume],
            },
        ],
        init_containers=[
            {
                "name": "prepare",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "echo ready > /work/ready"],
                "volumeMounts": [volume],
            }
        ],
        volumes=[{"name": "work", "emptyDir": {}}],
    )


def sandboxes(kb: KubeletBed) -> list[str]:
    """The runtime's sandboxes of the scenario's pod."""
    rt = kb.bed.runtime_stub(kb.bed.podshim_socket)
    f = cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.name": kb.kubelet.full_name(POD)})
    return [p.id for p in rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=f)).items]


def record(kb: KubeletBed) -> CriRecorder:
    """Run the scenario through a recorder; the kubelet is pointed back at podshim afterwards."""
    kubelet = kb.kubelet
    relay = kb.bed.base_dir / "kubelet-recorder.sock"
    recorder = CriRecorder(relay, kb.bed.podshim_socket)
    with recorder:
        kubelet.stop()
        kubelet.endpoint = relay
        try:
            kubelet.start()
            kubelet.add_static_pod(scenario_pod())
            kubelet.wait_running(POD, ["app", "side"])
            full = kubelet.full_name(POD)
            kubelet.api("POST", f"/run/{NAMESPACE}/{full}/app", query={"cmd": "true"})
            exec_stream(kubelet, POD, "side", ["true"])
            kubelet.api("GET", f"/containerLogs/{NAMESPACE}/{full}/app", query={"tailLines": 1})
            kubelet.api_json("/stats/summary")
            kubelet.api("POST", f"/checkpoint/{NAMESPACE}/{full}/app", timeout=120)
            kubelet.remove_static_pod(POD)
            kubelet.wait_for(f"pod {POD} gone", lambda: kubelet.pod(POD) is None, timeout=60)
            kubelet.wait_for(f"pod {POD} removed from the runtime", lambda: not sandboxes(kb), timeout=60)
        finally:
            kubelet.remove_static_pod(POD)
            kubelet.stop()
            kubelet.endpoint = kb.bed.podshim_socket
            kubelet.start()
    return recorder


# How podshim serves each method (shim/server/runtime.py): docs/kubelet-calls.md's "podshim" column.
SERVED = {
    "Version": "answered by podshim: the upstream's name, podshim in runtime_version",
    "RunPodSandbox": "decoded and checked (names), forwarded as bytes",
    "CreateContainer": "decoded and checked (reserved annotations, names); forwarded as bytes, "
    "or podshim's restore when the image is a checkpoint tar's path",
    "StartContainer": "forwarded as bytes (a restored container's restore is confirmed after)",
    "StopContainer": "forwarded as bytes; NOT_FOUND answered OK",
    "StopPodSandbox": "forwarded as bytes; NOT_FOUND answered OK",
    "CheckpointContainer": "forwarded first; podshim's own on UNIMPLEMENTED",
    "CheckpointPod": "podshim's own",
    "RestorePod": "podshim's own",
}
FORWARDED = "forwarded as bytes"


def shown(method: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The request the doc shows: the first, or for CreateContainer the app's (env, limits, probes)."""
    if method == "CreateContainer":
        for r in requests:
            if r.get("config", {}).get("metadata", {}).get("name") == "app":
                return r
    return requests[0]


def markdown(rec: CriRecorder) -> str:
    codes: dict[str, dict[str, int]] = {}
    for (method, code), n in sorted(rec.counts.items()):
        codes.setdefault(method, {})[code] = n
    out = ["| method | calls in the scenario (code: n) | podshim |", "|---|---|---|"]
    for method in sorted(codes):
        counted = ", ".join(f"{c}: {n}" for c, n in codes[method].items())
        out.append(f"| `{method}` | {counted} | {SERVED.get(method, FORWARDED)} |")
    out.append("")
    for method in sorted(codes):
        first = shown(method, rec.calls.get(method) or [{}])
        out += [f"### {method}", "", "```json", json.dumps(first, indent=1, sort_keys=True), "```", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.kubelet_calls", description=__doc__)
    parser.add_argument("--json", help="also write every recorded request (first 3 per method) here")
    args = parser.parse_args(argv)
    with KubeletBed() as kb:
        rec = record(kb)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"calls": rec.calls, "counts": {f"{m} {c}": n for (m, c), n in rec.counts.items()}},
                f,
                indent=1,
            )
    sys.stdout.write(markdown(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
