"""`make demo`: counter pod → CheckpointPod → RestorePod → the counter resumes.

Starts a private containerd + podshim (the test bed), talks to podshim's socket only, and
removes everything at the end.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from api.runtime.v1 import api_pb2 as cri
from testbed import pods
from testbed.bed import TestBed


def say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def main() -> int:
    with TestBed() as bed:
        say(f"containerd at {bed.containerd_socket}, podshim at {bed.podshim_socket}")
        rt, _ = pods.stubs(bed.podshim_socket)
        v = rt.Version(cri.VersionRequest())
        say(f"Version through podshim: {v.runtime_name} {v.runtime_version}")
        log_root = Path(bed.base_dir) / "pod-logs"
        counter = pods.container_config("counter", args=["--mem-mib", "64", "--interval-ms", "100"])
        src = pods.run_pod(rt, "counter-demo", log_root, {"counter": counter})
        say(f"pod {src.id[:13]} running; waiting for the counter to reach 30")
        pods.wait_count(src.log_path("counter"), 30)

        out = Path(bed.checkpoint_root) / "counter-demo"
        out.mkdir(mode=0o700)
        before = pods.counts(src.log_path("counter"))[-1]  # the frozen counter is past it
        start = time.monotonic()
        rt.CheckpointPod(
            cri.CheckpointPodRequest(
                pod_sandbox_id=src.id, container_ids=pods.running_ids(rt, src.id), output_path=str(out)
            ),
            timeout=120,
        )
        saved = pods.counts(src.log_path("counter"))[-1]
        manifest = json.loads((out / "manifest.json").read_text())
        size = sum(f["size"] for f in manifest["files"].values())
        say(
            f"CheckpointPod took {time.monotonic() - start:.2f}s; pod frozen for "
            f"{manifest['timings']['freeze_window'] * 1000:.0f} ms; {size / 2**20:.1f} MiB in {out}"
        )
        pods.wait_count(src.log_path("counter"), saved + 5)
        say(f"the source pod keeps counting: {pods.counts(src.log_path('counter'))[-1]}")

        new_config = pods.pod_config("counter-demo-restored", log_root)
        resp = rt.RestorePod(
            cri.RestorePodRequest(checkpoint_path=str(out), config=new_config, container_configs=[counter]),
            timeout=120,
        )
        say(
            f"RestorePod: new pod {resp.pod_sandbox_id[:13]}, containers CREATED: "
            f"{', '.join(c.name for c in resp.restored_containers)}"
        )
        for c in resp.restored_containers:
            rt.StartContainer(cri.StartContainerRequest(container_id=c.container_id))  # as the kubelet does
        restored_log = Path(new_config.log_directory) / counter.log_path  # the new pod's log
        first = pods.wait_for(lambda: pods.counts(restored_log), what="restored counter output")[0]
        say(f"restored counter resumed at {first} (checkpointed between {before} and {saved}), not at 0")
        pods.wait_count(restored_log, first + 10)
        say(f"restored counter keeps counting: {pods.counts(restored_log)[-1]}")
        for pod_id in (src.id, resp.pod_sandbox_id):
            pods.remove_pod(rt, pod_id)
        say("removed both pods; stopping containerd and podshim")
        if first <= before:  # what it had counted before CheckpointPod began, or from 0
            print("demo FAILED: the counter did not resume from its checkpoint", file=sys.stderr)
            return 1
    say("demo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
