"""KEP-5823's cluster API served by podshim, end to end: a real API server, scheduler,
controller manager, a kubelet registered as a node, podshim and containerd (docs/cluster.md).
PodCheckpoint objects are created with kubectl as a user would; restored Pods are made by the
stock kubelet's own calls, and the counter resumes at exactly the count the cut says."""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from shim.config import Config
from shim.kube import api
from shim.kube import doctor as kube_doctor
from testbed import resume
from testbed.bed import BUSYBOX_IMAGE, COUNTER_IMAGE, REPO
from testbed.cluster import ClusterBed, pod_manifest

pytestmark = pytest.mark.cluster

NS = "default"


@pytest.fixture(scope="module", autouse=True)
def deployed(cluster: ClusterBed) -> None:
    """podshim's API objects, installed as a cluster admin does (kubectl apply -k deploy/)."""
    cluster.kubectl("apply", "-k", str(REPO / "deploy"))
    cluster.wait_for(
        "the PodCheckpoint API served",
        lambda: cluster.kubectl("get", f"{api.PLURAL}.{api.GROUP}", check=False).returncode == 0,
    )


def counter(name: str = "app", **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": COUNTER_IMAGE, "imagePullPolicy": "Never", **extra}


def checkpoint_object(name: str, pod: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": NS},
        "spec": {"sourcePodName": pod, **spec},
    }


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


def get_checkpoint(cb: ClusterBed, name: str) -> dict[str, Any] | None:
    res = cb.kubectl("get", f"{api.PLURAL}.{api.GROUP}", name, "-n", NS, "-o", "json", check=False)
    return json.loads(res.stdout) if res.returncode == 0 else None


def wait_checkpoint(cb: ClusterBed, name: str, timeout: float = 180.0) -> dict[str, Any]:
    """The object once it is terminal (Ready=True, or False with a terminal reason)."""

    def done() -> dict[str, Any] | None:
        obj = get_checkpoint(cb, name)
        return obj if obj is not None and api.is_terminal(obj) else None

    return cb.wait_for(f"PodCheckpoint {name} terminal", done, timeout=timeout)  # type: ignore[no-any-return]


def reason(obj: dict[str, Any]) -> str:
    return str((api.ready_condition(obj) or {}).get("reason"))


def log_of(cb: ClusterBed, pod: str, container: str) -> Path:
    uid = (cb.pod(pod) or {})["metadata"]["uid"]
    return cb.kubelet.pod_logs / f"{NS}_{pod}_{uid}" / container / "0.log"


def events_of(cb: ClusterBed, name: str) -> list[str]:
    doc = cb.kubectl_json("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}")
    return [str(e.get("reason")) for e in doc.get("items") or []]


def event_time(e: dict[str, Any]) -> float:
    """When the event last happened (RFC 3339, whole seconds)."""
    stamp = e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp") or ""
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def host_archive(cb: ClusterBed, obj: dict[str, Any]) -> Path:
    path = api.archive_path(obj)
    assert path, f"no checkpointLocation: {obj.get('status')}"
    return cb.kubelet.host_path(path)


def restore_pod(cb: ClusterBed, ck: dict[str, Any], name: str, **overrides: Any) -> dict[str, Any]:
    """The Pod `kubectl podshim restore` makes: the checkpoint's template, the annotation, the
    checkpoint's node."""
    template = ck["status"]["checkpointedPodTemplate"]
    md = dict(template.get("metadata") or {})
    md["name"], md["namespace"] = name, NS
    md["annotations"] = {**(md.get("annotations") or {}), api.RESTORE_FROM_ANNOTATION: ck["metadata"]["name"]}
    spec = {**template["spec"], "nodeName": ck["status"]["nodeName"], **overrides}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": md, "spec": spec}
    cb.apply(pod)
    return pod


def running_counter(cb: ClusterBed, name: str, containers: list[dict[str, Any]], **spec: Any) -> None:
    cb.apply(pod_manifest(name, containers, **spec))
    cb.wait_pod_running(name)
    for c in containers:
        if c["image"] == COUNTER_IMAGE and "command" not in c:  # the counter itself
            log = log_of(cb, name, c["name"])
            cb.wait_for(f"{name}/{c['name']} counting", lambda log=log: len(resume.lines(log)) >= 3)


def take(cb: ClusterBed, pod: str, containers: list[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """A completed PodCheckpoint of `pod` whose cut its logs place exactly, and the first count
    each restored container must print."""
    logs = {c: log_of(cb, pod, c) for c in containers}
    for _ in range(resume.CUT_ATTEMPTS):
        name = unique(pod)
        cb.apply(checkpoint_object(name, pod))
        ck = wait_checkpoint(cb, name)
        assert reason(ck) == api.COMPLETED, ck.get("status")
        try:
            return ck, resume.firsts_after_cut(host_archive(cb, ck), logs)
        except resume.AmbiguousCut:
            cb.kubectl("delete", f"{api.PLURAL}.{api.GROUP}", name, "-n", NS)
    raise AssertionError(f"no unambiguous cut in {resume.CUT_ATTEMPTS} checkpoints")


def wait_restored(cb: ClusterBed, name: str, first: dict[str, int]) -> None:
    cb.wait_pod_running(name)
    logs = {c: log_of(cb, name, c) for c in first}
    resume.assert_exact_resume(logs, first)
    statuses = (cb.pod(name) or {})["status"]["containerStatuses"]
    assert all(s["restartCount"] == 0 for s in statuses), statuses


def test_checkpoint_completes_with_status_events_and_archive(cluster: ClusterBed) -> None:
    """The happy path: the object is claimed by the pod's node, completes with the location,
    the sanitised template and the containers, and the events say so; the archive is there."""
    pod = unique("web")
    running_counter(cluster, pod, [counter()])
    source = cluster.pod(pod) or {}
    ck, _ = take(cluster, pod, ["app"])
    st = ck["status"]
    assert st["nodeName"] == cluster.node_name
    assert st["sourcePodUID"] == source["metadata"]["uid"]
    assert st["checkpointLocation"]["type"] == api.LOCATION_NODE_LOCAL
    rel = st["checkpointLocation"]["nodeLocal"]["path"]
    assert rel.startswith(f"checkpoint-{pod}_{NS}-") and "/" not in rel
    assert (host_archive(cluster, ck) / "manifest.json").is_file()
    assert st["checkpointedContainers"] == [{"name": "app", "image": COUNTER_IMAGE}]
    template = st["checkpointedPodTemplate"]
    assert "nodeName" not in template["spec"], template["spec"]
    assert not {"uid", "resourceVersion", "managedFields"} & set(template.get("metadata") or {})
    assert st.get("completionTime")
    cluster.wait_for(
        "the checkpoint's events",
        lambda: {api.EVENT_STARTED, api.EVENT_SUCCEEDED} <= set(events_of(cluster, ck["metadata"]["name"])),
    )
    assert (cluster.pod(pod) or {})["status"]["containerStatuses"][0]["restartCount"] == 0


def test_restore_resumes_the_counter_exactly(cluster: ClusterBed) -> None:
    """A Pod that names the checkpoint is restored by the kubelet's own calls: Running, the
    counter resumes at the next count, nothing restarted; deleting the object removes its
    archive."""
    pod = unique("count")
    running_counter(cluster, pod, [counter()])
    ck, first = take(cluster, pod, ["app"])
    archive = host_archive(cluster, ck)
    new = unique("restored")
    restore_pod(cluster, ck, new)
    wait_restored(cluster, new, first)
    assert api.RESTORE_FROM_ANNOTATION in (cluster.pod(new) or {})["metadata"]["annotations"]
    cluster.delete_pod(new)
    cluster.kubectl("delete", f"{api.PLURAL}.{api.GROUP}", ck["metadata"]["name"], "-n", NS, "--wait=true")
    assert not archive.exists(), f"{archive} outlived its PodCheckpoint"


def test_restore_of_two_containers_and_an_init_container(cluster: ClusterBed) -> None:
    """Two counters and an init container: the init container (it ran in the source pod)
    completes at once with exit code 0, both counters resume exactly."""
    pod = unique("multi")
    init = {
        "name": "prepare",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", "echo prepared"],
    }
    running_counter(cluster, pod, [counter("a"), counter("b")], initContainers=[init])
    ck, first = take(cluster, pod, ["a", "b"])
    assert ck["status"]["checkpointedInitContainers"] == [{"name": "prepare", "image": BUSYBOX_IMAGE}]
    new = unique("multi-restored")
    restore_pod(cluster, ck, new)
    wait_restored(cluster, new, first)
    init_status = (cluster.pod(new) or {})["status"]["initContainerStatuses"][0]
    assert init_status["state"]["terminated"]["exitCode"] == 0, init_status


def test_restore_keeps_the_empty_dirs_and_dev_shm(cluster: ClusterBed) -> None:
    """An init container renders a config into an emptyDir (and a memory-backed one), a second
    container takes numbers from a POSIX shared memory file of the pod's /dev/shm: the restored
    Pod's emptyDirs hold what the init container wrote (it does not run again), the counter
    resumes exactly, and the shared memory sequence goes on from where it was, in the restored
    process (no start-up line)."""
    pod = unique("vols")
    init = {
        "name": "render",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": [
            "sh",
            "-c",
            "echo rendered-config > /config/msg && mkdir /scratch/d && echo m > /scratch/d/f",
        ],
        "volumeMounts": [
            {"name": "config", "mountPath": "/config"},
            {"name": "scratch", "mountPath": "/scratch"},
        ],
    }
    app = counter("app", volumeMounts=[{"name": "config", "mountPath": "/config"}])
    shm = counter("shm", command=["/sharer"], args=["shmcount", "podshim-seg"])
    volumes = [{"name": "config", "emptyDir": {}}, {"name": "scratch", "emptyDir": {"medium": "Memory"}}]
    running_counter(cluster, pod, [app, shm], initContainers=[init], volumes=volumes)
    shm_log = log_of(cluster, pod, "shm")
    cluster.wait_for("shm taking numbers", lambda: shm_log.read_bytes().count(b"shm ") >= 3)
    ck, first = take(cluster, pod, ["app"])
    archive = host_archive(cluster, ck)
    record = json.loads((archive / "sandbox" / "volumes.json").read_text())
    # "scratch" only the init container mounts: it does not run again, so nothing reads it
    assert [e["name"] for e in record["empty_dirs"]] == ["config"], record
    assert record["dev_shm"] is not None, record
    new = unique("vols-restored")
    restore_pod(cluster, ck, new)
    wait_restored(cluster, new, first)
    out = cluster.kubectl("exec", new, "-n", NS, "-c", "app", "--", "cat", "/config/msg").stdout
    assert out.strip() == "rendered-config", out
    new_shm = log_of(cluster, new, "shm")
    cluster.wait_for("restored shm taking numbers", lambda: new_shm.read_bytes().count(b"shm ") >= 3)
    restored = [int(n) for n in re.findall(rb" shm (\d+) ", new_shm.read_bytes())]
    assert b"ready" not in new_shm.read_bytes(), "the shm container started afresh"
    assert restored[0] >= 3 and restored == list(range(restored[0], restored[0] + len(restored))), restored


def test_a_pinned_uid_of_another_instance_is_source_pod_replaced(cluster: ClusterBed) -> None:
    pod = unique("pinned")
    running_counter(cluster, pod, [counter()])
    name = unique("pinned-ck")
    cluster.apply(checkpoint_object(name, pod, sourcePodUID=str(uuid.uuid4())))
    ck = wait_checkpoint(cluster, name)
    assert reason(ck) == api.SOURCE_POD_REPLACED, ck["status"]
    assert ck["status"]["sourcePodUID"] == (cluster.pod(pod) or {})["metadata"]["uid"]
    assert "checkpointLocation" not in ck["status"]


def test_two_objects_for_one_pod_both_complete(cluster: ClusterBed) -> None:
    pod = unique("twice")
    running_counter(cluster, pod, [counter()])
    names = [unique("twice-a"), unique("twice-b")]
    for n in names:
        cluster.apply(checkpoint_object(n, pod))
    done = [wait_checkpoint(cluster, n) for n in names]
    assert [reason(d) for d in done] == [api.COMPLETED, api.COMPLETED], [d["status"] for d in done]
    paths = {api.archive_path(d) for d in done}
    assert len(paths) == 2, paths
    # one at a time: each archive's freeze ended before the other's began
    cuts = sorted((resume.Cut.of_archive(host_archive(cluster, d)) for d in done), key=lambda c: c.frozen_at)
    assert cuts[0].thaw_asked_at <= cuts[1].frozen_at, cuts


def test_a_restore_waits_for_its_checkpoint_then_succeeds(cluster: ClusterBed) -> None:
    """A Pod naming a checkpoint that does not exist yet stays Pending with CheckpointNotReady
    (never Failed), and restores once the checkpoint is Ready."""
    pod = unique("later")
    running_counter(cluster, pod, [counter()])
    ck, first = take(cluster, pod, ["app"])
    # the same template, naming an object yet to come
    pending_name = unique("later-ck")
    early = dict(ck)
    early["metadata"] = {**ck["metadata"], "name": pending_name}
    new = unique("later-restored")
    restore_pod(cluster, early, new)
    cluster.wait_for(
        "CheckpointNotReady on the Pod", lambda: api.NOT_READY in events_of(cluster, new), timeout=120
    )
    assert (cluster.pod(new) or {})["status"]["phase"] == "Pending"
    # now the object exists and completes: the kubelet's next attempt restores
    cluster.apply(checkpoint_object(pending_name, pod))
    done = wait_checkpoint(cluster, pending_name)
    assert reason(done) == api.COMPLETED
    later_first = resume.firsts_after_cut(host_archive(cluster, done), {"app": log_of(cluster, pod, "app")})
    wait_restored(cluster, new, later_first)
    assert first["app"] < later_first["app"]


def test_a_spec_that_differs_from_the_template_is_refused_until_it_matches(cluster: ClusterBed) -> None:
    """A Pod whose spec differs from the checkpointed template stays Pending with PodSpecMismatch;
    once the Pod is changed to match (a container's image is the one field a Pod may change), the
    kubelet's next attempt restores it."""
    pod = unique("spec")
    running_counter(cluster, pod, [counter()])
    ck, first = take(cluster, pod, ["app"])
    new = unique("spec-restored")
    containers = [dict(c) for c in ck["status"]["checkpointedPodTemplate"]["spec"]["containers"]]
    containers[0]["image"] = BUSYBOX_IMAGE
    restore_pod(cluster, ck, new, containers=containers)
    cluster.wait_for(
        "PodSpecMismatch on the Pod", lambda: api.SPEC_MISMATCH in events_of(cluster, new), timeout=120
    )
    pod_now = cluster.pod(new) or {}
    assert pod_now["status"]["phase"] == "Pending", pod_now["status"]
    fix = [{"op": "replace", "path": "/spec/containers/0/image", "value": COUNTER_IMAGE}]
    cluster.kubectl("patch", "pod", new, "-n", NS, "--type=json", "-p", json.dumps(fix))
    wait_restored(cluster, new, first)


def test_a_missing_archive_is_checkpoint_data_missing_until_it_is_back(cluster: ClusterBed) -> None:
    pod = unique("gone")
    running_counter(cluster, pod, [counter()])
    ck, first = take(cluster, pod, ["app"])
    archive = host_archive(cluster, ck)
    (archive / "manifest.json").rename(archive / "manifest.json.away")
    new = unique("gone-restored")
    restore_pod(cluster, ck, new)
    cluster.wait_for(
        "CheckpointDataMissing", lambda: api.DATA_MISSING in events_of(cluster, new), timeout=120
    )
    assert (cluster.pod(new) or {})["status"]["phase"] == "Pending"
    (archive / "manifest.json.away").rename(archive / "manifest.json")
    wait_restored(cluster, new, first)


def set_crd_categories(cb: ClusterBed, categories: list[str]) -> None:
    doc = {"spec": {"names": {"categories": categories}}}
    cb.kubectl("patch", "crd", api.CRD_NAME, "--type=merge", "-p", json.dumps(doc))


def test_podshim_stands_aside_when_the_cluster_serves_its_own_podcheckpoint(cluster: ClusterBed) -> None:
    """While discovery shows PodCheckpoint without podshim's category (as the built-in type shows),
    podshim acts on no object and restores no Pod that names one by its annotation (the kubelet
    does both), and `podshim doctor` says so; with the category back, both go ahead."""
    pod = unique("aside")
    running_counter(cluster, pod, [counter()])
    ck, first = take(cluster, pod, ["app"])
    log = cluster.bed.podshim_log
    start = log.stat().st_size
    name, new = unique("aside-ck"), unique("aside-restored")

    def logged(*words: str) -> bool:
        with open(log, errors="replace") as f:
            f.seek(start)
            return any(all(w in line for w in words) for line in f)

    set_crd_categories(cluster, [])
    try:
        cluster.wait_for("podshim stands aside", lambda: logged("stands aside"), timeout=60)
        cluster.apply(checkpoint_object(name, pod))
        cluster.wait_for(
            "the object left to the kubelet",
            lambda: logged("left to the kubelet", f"{NS}/{name}"),
            timeout=60,
        )
        assert not (get_checkpoint(cluster, name) or {}).get("status"), get_checkpoint(cluster, name)
        restore_pod(cluster, ck, new)
        cluster.wait_for(
            "PodCheckpointBuiltIn on the Pod",
            lambda: api.BUILT_IN_API in events_of(cluster, new),
            timeout=120,
        )
        assert (cluster.pod(new) or {})["status"]["phase"] == "Pending"
        node = Config(
            kubernetes_kubeconfig=str(cluster.kubeconfig["node"]), kubernetes_node_name=cluster.node_name
        )
        served = kube_doctor.check_cluster(node)[-1]
        assert served[0] == "ok" and "stands aside" in served[2], served
    finally:
        set_crd_categories(cluster, [api.CRD_CATEGORY])
    assert reason(wait_checkpoint(cluster, name)) == api.COMPLETED
    wait_restored(cluster, new, first)


class failpoints:
    """The node's podshim restarted with PODSHIM_FAILPOINTS armed, and restarted without them on
    the way out (SIGTERM: a graceful stop; a `kill` failpoint ends it itself)."""

    def __init__(self, cb: ClusterBed, spec: str) -> None:
        self.bed, self.spec = cb.bed, spec

    def restart(self, spec: str | None) -> None:
        if spec:
            self.bed.extra_env["PODSHIM_FAILPOINTS"] = spec
        else:
            self.bed.extra_env.pop("PODSHIM_FAILPOINTS", None)
        if self.bed.podshim_running:
            self.bed.kill_podshim(signal.SIGTERM)
        self.bed.start_podshim_again()

    def __enter__(self) -> failpoints:
        self.restart(self.spec)
        return self

    def __exit__(self, *exc: object) -> None:
        self.restart(None)


def test_an_exec_liveness_probe_survives_a_long_freeze(cluster: ClusterBed) -> None:
    """A liveness probe every second with a 1 s timeout and one failure allowed, through a
    checkpoint whose freeze a failpoint holds for 6 s: its ExecSyncs wait for the thaw and then
    pass. Without the wait, runc refuses an exec into the frozen container: the probe errors, an
    Unhealthy event every second of the freeze."""
    probe = {
        "exec": {"command": ["sh", "-c", "grep -Eq '^State:[[:space:]]+[RS]' /proc/1/status"]},
        "periodSeconds": 1,
        "timeoutSeconds": 1,
        "failureThreshold": 1,
    }
    pod = unique("probed")
    running_counter(cluster, pod, [counter(livenessProbe=probe)])
    with failpoints(cluster, "checkpoint.before-thaw=sleep:6"):
        since = int(time.time()) + 1  # the probes of the restarted podshim, at whole seconds
        name = unique("probed-ck")
        cluster.apply(checkpoint_object(name, pod))
        ck = wait_checkpoint(cluster, name)
        assert reason(ck) == api.COMPLETED, ck["status"]
        cut = resume.Cut.of_archive(host_archive(cluster, ck))
        assert cut.window >= 6.0, cut  # the freeze the probe lived through
        log = log_of(cluster, pod, "app")
        cluster.wait_for(
            "counts after the thaw", lambda: sum(x.ts > cut.thaw_asked_at for x in resume.lines(log)) >= 5
        )
        until = int(time.time())  # before the failpoints' podshim stops (its socket goes with it)
    events = cluster.kubectl_json("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={pod}")
    unhealthy = [
        e.get("message")
        for e in events["items"]
        if e.get("reason") == "Unhealthy" and since <= event_time(e) < until
    ]
    assert not unhealthy, unhealthy
    statuses = (cluster.pod(pod) or {})["status"]["containerStatuses"]
    assert statuses[0]["restartCount"] == 0, statuses


def test_podshim_killed_mid_checkpoint_ends_the_object_failed(cluster: ClusterBed) -> None:
    """podshim dies with the pod frozen: the next podshim thaws the pod, removes the partial
    archive and marks the object CheckpointFailed (never stuck in CheckpointInProgress); a new
    object then completes."""
    pod = unique("crash")
    running_counter(cluster, pod, [counter()])
    log = log_of(cluster, pod, "app")
    fp = failpoints(cluster, "checkpoint.after-freeze=kill")
    fp.restart(fp.spec)
    name = unique("crash-ck")
    try:
        cluster.apply(checkpoint_object(name, pod))
        cluster.wait_for(
            "podshim killed by its failpoint", lambda: not cluster.bed.podshim_running, timeout=120
        )
    finally:
        fp.restart(None)
    ck = wait_checkpoint(cluster, name)
    assert reason(ck) == api.FAILED and "restarted" in ck["status"]["conditions"][0]["message"], ck["status"]
    assert "checkpointLocation" not in ck["status"]
    leftovers = [p.name for p in cluster.kubelet.host_path(api.CHECKPOINT_ROOT).glob(f"checkpoint-{pod}_*")]
    assert not leftovers, leftovers
    before = len(resume.lines(log))
    cluster.wait_for("the pod counting again", lambda: len(resume.lines(log)) >= before + 3)
    again, _ = take(cluster, pod, ["app"])
    assert reason(again) == api.COMPLETED


def test_the_api_server_restarted_mid_checkpoint_loses_no_object(cluster: ClusterBed) -> None:
    """The API server goes away while a checkpoint runs (a failpoint holds its freeze for 4 s):
    podshim writes the result once it is back; the object completes with one archive, never
    stuck in CheckpointInProgress, and the pod counts on."""
    pod = unique("apidown")
    running_counter(cluster, pod, [counter()])
    with failpoints(cluster, "checkpoint.before-thaw=sleep:4"):
        name = unique("apidown-ck")
        cluster.apply(checkpoint_object(name, pod))
        cluster.wait_for(
            "CheckpointInProgress", lambda: reason(get_checkpoint(cluster, name) or {}) == api.IN_PROGRESS
        )
        cluster.restart_apiserver()
        ck = wait_checkpoint(cluster, name)
    assert reason(ck) == api.COMPLETED, ck["status"]
    archives = [p.name for p in cluster.kubelet.host_path(api.CHECKPOINT_ROOT).glob(f"checkpoint-{pod}_*")]
    assert archives == [ck["status"]["checkpointLocation"]["nodeLocal"]["path"]], archives
    log = log_of(cluster, pod, "app")
    before = len(resume.lines(log))
    cluster.wait_for("the pod counting on", lambda: len(resume.lines(log)) >= before + 3)


def test_a_restore_on_another_node_is_wrong_node_and_the_right_node_restores(cluster: ClusterBed) -> None:
    """A second node (its own containerd, podshim and kubelet) is asked to restore a checkpoint
    taken on node 1: CheckpointWrongNode, Pending; the same Pod on node 1 restores exactly."""
    pod = unique("where")
    running_counter(cluster, pod, [counter()])
    ck, first = take(cluster, pod, ["app"])
    node2 = cluster.add_node()
    try:
        wrong = unique("where-wrong")
        restore_pod(cluster, ck, wrong, nodeName=node2.name)
        cluster.wait_for(
            "CheckpointWrongNode on the Pod", lambda: api.WRONG_NODE in events_of(cluster, wrong), timeout=120
        )
        assert (cluster.pod(wrong) or {})["status"]["phase"] == "Pending"
        cluster.delete_pod(wrong)
    finally:
        cluster.remove_node(node2)
    right = unique("where-right")
    restore_pod(cluster, ck, right)
    wait_restored(cluster, right, first)


def test_twenty_pods_checkpointed_through_twenty_objects_at_once(cluster: ClusterBed) -> None:
    """20 pods, one PodCheckpoint each, all created at once: each completes with its own
    archive, and every pod counts on afterwards."""
    names = [unique(f"many{i}") for i in range(20)]
    small = counter(args=["--mem-mib", "4", "--interval-ms", "100"])
    for n in names:
        cluster.apply(pod_manifest(n, [small]))
    for n in names:
        cluster.wait_pod_running(n, timeout=300)
    objects = {n: unique(f"{n}-ck") for n in names}
    docs = [checkpoint_object(ck, pod) for pod, ck in objects.items()]
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))
    done = {pod: wait_checkpoint(cluster, ck, timeout=600) for pod, ck in objects.items()}
    failed = {pod: d["status"] for pod, d in done.items() if reason(d) != api.COMPLETED}
    assert not failed, failed
    for pod, d in done.items():
        assert (host_archive(cluster, d) / "manifest.json").is_file(), pod
        cut = resume.Cut.of_archive(host_archive(cluster, d))
        log = log_of(cluster, pod, "app")
        cluster.wait_for(
            f"{pod} counting after its cut", lambda log=log, cut=cut: resume._after(log, cut.thaw_asked_at)
        )
    for n in names:
        cluster.kubectl("delete", "pod", n, "--wait=false")


def test_doctor_sees_the_api_server_the_api_and_each_node_right(cluster: ClusterBed) -> None:
    """`podshim doctor`'s cluster checks with the node's credentials pass; with a user's who has
    no rights they name what is missing and what to install."""
    node = Config(
        kubernetes_kubeconfig=str(cluster.kubeconfig["node"]), kubernetes_node_name=cluster.node_name
    )
    results = kube_doctor.check_cluster(node)
    assert [r[0] for r in results] == ["ok", "ok", "ok"], results
    nobody = Config(kubernetes_kubeconfig=str(cluster.user_kubeconfig(unique("nobody"))))
    results = kube_doctor.check_cluster(nobody)
    assert results[0][0] == "ok", results  # the API server answers anyone it authenticates
    assert results[1][0] == "fail" and "may not get podcheckpoints" in results[1][2], results
    assert "kubectl apply -k" in results[1][2], results
    off = Config(kubernetes_kubeconfig="")
    assert [r[0] for r in kube_doctor.check_cluster(off)] == ["warn"]
