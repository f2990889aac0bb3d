"""`make demo`, the cluster half: the same counter as a pod of a real cluster (testbed/cluster.py),
checkpointed and restored with `kubectl podshim` (docs/cluster.md).

Starts etcd, the API server, the scheduler, the controller manager and a kubelet registered as a
node whose runtime is podshim; installs deploy/ with kubectl; removes everything at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shim.kube import api
from testbed import pods
from testbed.bed import COUNTER_IMAGE, REPO, VENV_BIN
from testbed.cluster import ClusterBed, pod_manifest


def say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def plugin(cb: ClusterBed, *args: str) -> str:
    """`kubectl podshim ARGS` as a user runs it: kubectl finds kubectl-podshim on PATH."""
    kubectl = Path(cb.kubectl("version", "--client", "-o", "json").args[0])
    env = {
        "PATH": f"{VENV_BIN}:{kubectl.parent}:/usr/bin:/bin",
        "HOME": str(cb.home),
        "KUBECONFIG": str(cb.kubeconfig["admin"]),
    }
    argv = [str(kubectl), "podshim", *args]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0:
        raise SystemExit(
            f"kubectl podshim {' '.join(args)} failed: {res.stderr.strip() or res.stdout.strip()}"
        )
    return res.stdout.strip()


def log_of(cb: ClusterBed, pod: dict[str, Any], container: str) -> Path:
    md = pod["metadata"]
    return cb.kubelet.pod_logs / f"{md['namespace']}_{md['name']}_{md['uid']}" / container / "0.log"


def main() -> int:
    with ClusterBed() as cb:
        say(f"cluster up: node {cb.node_name} Ready; KUBECONFIG={cb.kubeconfig['admin']}")
        cb.kubectl("apply", "-k", str(REPO / "deploy"))
        say("kubectl apply -k deploy/: the PodCheckpoint CRD, its roles and admission policies")
        counter = {
            "name": "counter",
            "image": COUNTER_IMAGE,
            "imagePullPolicy": "Never",
            "args": ["--mem-mib", "64", "--interval-ms", "100"],
        }
        cb.apply(pod_manifest("counter", [counter]))
        src = cb.wait_pod_running("counter")
        src_log = log_of(cb, src, "counter")
        pods.wait_count(src_log, 30)
        say(f"pod counter Running on {src['spec']['nodeName']}; its counter reached 30")

        start = time.monotonic()
        out = plugin(cb, "checkpoint", "counter", "--name", "counter-ck", "--wait")
        ck = cb.kubectl_json("get", f"{api.PLURAL}.{api.GROUP}", "counter-ck")
        saved = pods.counts(src_log)[-1]
        say(f"kubectl podshim checkpoint counter --wait: {out} ({time.monotonic() - start:.2f}s)")
        say(f"PodCheckpoint counter-ck: {json.dumps((api.ready_condition(ck) or {}).get('reason'))}, "
            f"{ck['status']['checkpointLocation']['nodeLocal']['path']}")  # fmt: skip

        out = plugin(cb, "restore", "counter-ck", "--name", "counter-restored", "--wait")
        say(f"kubectl podshim restore counter-ck: {out}")
        new = cb.pod("counter-restored") or {}
        restored_log = log_of(cb, new, "counter")
        first = pods.wait_for(lambda: pods.counts(restored_log), what="restored counter output")[0]
        say(f"restored counter resumed at {first} (the source had printed {saved} when it was checkpointed)")
        pods.wait_count(restored_log, first + 10)
        say(f"restored counter keeps counting: {pods.counts(restored_log)[-1]}; restarts: "
            f"{new['status']['containerStatuses'][0]['restartCount']}")  # fmt: skip
        say(plugin(cb, "list"))
        if first <= 1 or first > saved + 1:
            print(
                "cluster demo FAILED: the restored counter did not resume from its checkpoint",
                file=sys.stderr,
            )
            return 1
        for p in ("counter", "counter-restored"):
            cb.delete_pod(p)
        say("stopping the cluster")
    say("cluster demo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
