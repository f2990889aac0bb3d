"""A real kubelet (v1.37.2, standalone, static pods) on podshim: the calls a node makes all day,
through podshim, end to end (testbed/kubelet.py). `make test-kubelet` runs this module alone."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from api.runtime.v1 import api_pb2 as cri
from testbed import _sys, pods, resume
from testbed.bed import BUSYBOX_IMAGE, COUNTER_IMAGE
from testbed.kubelet import (
    KUBELET_PATH,
    KUBELET_SYSCTLS,
    NAMESPACE,
    ROOT_IN_NODE,
    Kubelet,
    KubeletBed,
    KubeletError,
    exec_stream,
    pod_manifest,
)
from testbed.kubelet_calls import record as record_calls
from testbed.mntns import host_sysctl, same_namespace
from testbed.tools import go_tool

pytestmark = [pytest.mark.e2e, pytest.mark.kubelet]

HOST_SYSCTLS_BEFORE = {k: host_sysctl(k) for k in KUBELET_SYSCTLS}
HOST_VAR_LIB_KUBELET_BEFORE = Path("/var/lib/kubelet").exists()


@pytest.fixture(scope="module")
def kb() -> Iterator[KubeletBed]:
    with KubeletBed() as b:
        yield b


@pytest.fixture
def kubelet(kb: KubeletBed) -> Kubelet:
    if not kb.kubelet.running:  # a test that stopped it failed half-way
        kb.kubelet.start()
    return kb.kubelet


@pytest.fixture
def static_pods(kubelet: Kubelet) -> Iterator[list[str]]:
    """Append static pod names; their manifests are removed after the test and the pods gone."""
    names: list[str] = []
    yield names
    for n in names:
        kubelet.remove_static_pod(n)
    for n in names:
        kubelet.wait_for(f"pod {n} gone", lambda n=n: kubelet.pod(n) is None, timeout=60)


def counter(name: str = "app", **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": COUNTER_IMAGE, "imagePullPolicy": "Never", **extra}


def busybox(name: str, script: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script],
        **extra,
    }


def log_file(kubelet: Kubelet, pod: str, container: str, restart: int = 0) -> Path:
    uid = (kubelet.pod(pod) or {})["metadata"]["uid"]
    return kubelet.pod_logs / f"{NAMESPACE}_{kubelet.full_name(pod)}_{uid}" / container / f"{restart}.log"


def cri_containers(kb: KubeletBed, pod: str) -> dict[str, cri.Container]:
    """The running containers of a kubelet pod, as podshim lists them."""
    rt = kb.bed.runtime_stub(kb.bed.podshim_socket)
    f = cri.ContainerFilter(label_selector={"io.kubernetes.pod.name": kb.kubelet.full_name(pod)})
    listed = rt.ListContainers(cri.ListContainersRequest(filter=f)).containers
    return {c.metadata.name: c for c in listed if c.state == cri.CONTAINER_RUNNING}


def test_the_host_is_left_alone(kb: KubeletBed, kubelet: Kubelet) -> None:
    """Its sysctls went into the bed's files, its root dir is the bed's, no iptables on its PATH."""
    assert {k: host_sysctl(k) for k in KUBELET_SYSCTLS} == HOST_SYSCTLS_BEFORE
    assert kb.bed.node_mounts is not None
    files = kb.bed.node_mounts.sysctl_files(kb.bed.base_dir)
    assert {k: files[k].read_text().strip() for k in KUBELET_SYSCTLS} == KUBELET_SYSCTLS
    assert kubelet.pid is not None and not same_namespace(kubelet.pid)
    assert Path("/var/lib/kubelet").exists() == HOST_VAR_LIB_KUBELET_BEFORE, "the host's /var/lib/kubelet"
    assert (kubelet.root / "pki").is_dir(), "its serving cert is in the bed's root dir"
    assert shutil.which("iptables", path=KUBELET_PATH) is None
    assert str(kubelet.config()["volumePluginDir"]).startswith(str(kb.bed.base_dir))
    # in the bed's cgroup subtree, whichever hierarchies this host mounts (v1, hybrid or cgroup2)
    assert _sys.cgroup_dirs(f"{kubelet.cgroup_root}/kubepods"), "no kubepods under the bed's cgroup root"


def test_pods_with_one_and_two_containers(kb: KubeletBed, kubelet: Kubelet, static_pods: list[str]) -> None:
    static_pods += ["one", "two"]
    kubelet.add_static_pod(pod_manifest("one", [counter()]))
    kubelet.add_static_pod(pod_manifest("two", [counter(), busybox("side", "echo side up; exec sleep 3600")]))
    kubelet.wait_running("one", ["app"])
    st = kubelet.wait_running("two", ["app", "side"])
    assert all(s["restartCount"] == 0 for s in st.values())
    listed = cri_containers(kb, "two")
    assert sorted(listed) == ["app", "side"]
    for name, status in st.items():
        assert status["containerID"].split("://", 1)[1] == listed[name].id
    pods.wait_count(log_file(kubelet, "one", "app"), 2)
    assert pods.wait_for(lambda: "side up" in log_file(kubelet, "two", "side").read_text(), what="side's log")


def test_init_container_runs_first(kubelet: Kubelet, static_pods: list[str]) -> None:
    static_pods.append("init")
    volume = {"name": "work", "mountPath": "/work"}
    kubelet.add_static_pod(
        pod_manifest(
            "init",
            [busybox("main", "cat /work/ready; exec sleep 3600", volumeMounts=[volume])],
            init_containers=[busybox("prepare", "echo prepared > /work/ready", volumeMounts=[volume])],
            volumes=[{"name": "work", "emptyDir": {}}],
        )
    )
    kubelet.wait_running("init", ["main"])
    init = kubelet.container_statuses("init", init=True)["prepare"]
    assert init["state"]["terminated"]["exitCode"] == 0
    assert pods.wait_for(
        lambda: "prepared" in log_file(kubelet, "init", "main").read_text(), what="main's log"
    )


def test_probes_and_a_liveness_restart(kubelet: Kubelet, static_pods: list[str]) -> None:
    """Exec readiness and liveness probes pass; when the liveness probe starts failing the kubelet
    restarts the container (through podshim: StopContainer, CreateContainer, StartContainer)."""
    static_pods.append("probes")
    probe = {"periodSeconds": 1, "failureThreshold": 2, "timeoutSeconds": 5}
    kubelet.add_static_pod(
        pod_manifest(
            "probes",
            [
                busybox(
                    "app",
                    "touch /tmp/healthy; [ -e /restarted-once ] || { sleep 8; rm /tmp/healthy; }; "
                    "touch /restarted-once; exec sleep 3600",
                    livenessProbe={"exec": {"command": ["cat", "/tmp/healthy"]}, **probe},
                    readinessProbe={"exec": {"command": ["true"]}, **probe},
                )
            ],
        )
    )
    st = kubelet.wait_running("probes", ["app"])
    assert st["app"]["restartCount"] == 0
    restarted = kubelet.wait_for(
        "the liveness restart",
        lambda: (s := kubelet.container_statuses("probes").get("app")) and s["restartCount"] >= 1 and s,
        timeout=60,
    )
    assert "terminated" in restarted["lastState"]
    st = kubelet.wait_running("probes", ["app"])
    assert st["app"]["restartCount"] == 1, "the restarted container (rootfs kept) stays healthy"


def test_logs_and_rotation(kb: KubeletBed, kubelet: Kubelet, static_pods: list[str]) -> None:
    """The kubelet rotates a chatty container's log past containerLogMaxSize (64 KiB here):
    ReopenContainerLog through podshim; /containerLogs serves the current file."""
    static_pods.append("chatty")
    line = "x" * 200
    kubelet.add_static_pod(
        pod_manifest(
            "chatty", [busybox("app", f'i=0; while true; do i=$((i+1)); echo "$i {line}"; usleep 2000; done')]
        )
    )
    kubelet.wait_running("chatty", ["app"])
    current = log_file(kubelet, "chatty", "app")
    rotated = kubelet.wait_for(
        "a rotated log",
        lambda: [p for p in current.parent.iterdir() if p.name.startswith("0.log.")],
        timeout=60,
    )
    assert rotated
    status, body = kubelet.api(
        "GET", f"/containerLogs/{NAMESPACE}/{kubelet.full_name('chatty')}/app", query={"tailLines": 3}
    )
    assert status == 200, body
    last = body.decode().splitlines()
    assert len(last) == 3 and all(x.endswith(line) for x in last)
    assert current.stat().st_size < 4 * 64 * 1024, "the current file was reopened after rotation"


def test_exec_run_and_stream(kubelet: Kubelet, static_pods: list[str]) -> None:
    """/run (ExecSync) and the streaming /exec (Exec: the kubelet proxies the runtime's stream)."""
    static_pods.append("shell")
    kubelet.add_static_pod(pod_manifest("shell", [busybox("app", "exec sleep 3600")]))
    kubelet.wait_running("shell", ["app"])
    status, body = kubelet.api(
        "POST", f"/run/{NAMESPACE}/{kubelet.full_name('shell')}/app", query={"cmd": "expr 6 * 7"}
    )  # the kubelet splits cmd at spaces, no shell
    assert (status, body.decode().strip()) == (200, "42")
    res = exec_stream(kubelet, "shell", "app", ["sh", "-c", "echo out-ok; echo err-ok >&2; exit 3"])
    assert res["stdout"] == "out-ok\n" and res["stderr"] == "err-ok\n", res
    assert (
        res["status"].get("status") == "Failure" and res["status"]["details"]["causes"][0]["message"] == "3"
    ), res
    ok = exec_stream(kubelet, "shell", "app", ["hostname"])
    assert ok["stdout"].strip() == kubelet.full_name("shell") and ok["status"].get("status") == "Success", ok


def test_stats_summary(kubelet: Kubelet, static_pods: list[str]) -> None:
    """/stats/summary: the container's CPU and memory (16 MiB resident), and the pod's (cadvisor,
    after its first housekeeping). No pod network stats here, through podshim or straight at
    containerd alike (the bed's pods' network namespaces live in the node's mount namespace)."""
    static_pods.append("stats")
    kubelet.add_static_pod(pod_manifest("stats", [counter(args=["--mem-mib", "16"])]))
    kubelet.wait_running("stats", ["app"])

    def pod_stats() -> dict[str, Any] | None:
        summary = kubelet.api_json("/stats/summary")
        for p in summary.get("pods") or []:
            if p["podRef"]["name"] == kubelet.full_name("stats"):
                c = {x["name"]: x for x in p.get("containers") or []}.get("app") or {}
                mem = (c.get("memory") or {}).get("workingSetBytes") or 0
                pod_mem = (p.get("memory") or {}).get("workingSetBytes") or 0
                if mem >= 16 << 20 and (c.get("cpu") or {}).get("usageCoreNanoSeconds") and pod_mem >= mem:
                    return p
        return None

    p = kubelet.wait_for("the counter's stats", pod_stats, timeout=90)
    assert p["cpu"]["usageCoreNanoSeconds"] > 0 and p["ephemeral-storage"]["usedBytes"] > 0


def kubelet_samples(kubelet: Kubelet, path: str = "/metrics") -> list[Sample]:
    """The samples of the kubelet's metrics endpoint `path` (/metrics, /metrics/probes)."""
    status, body = kubelet.api("GET", path)
    if status != 200:
        raise KubeletError(f"GET {path}: {status} {body[:300]!r}")
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def pleg_last_seen(kubelet: Kubelet) -> float:
    """When the PLEG's last successful relist began (Unix seconds, whole: never after it began)."""
    (value,) = [s.value for s in kubelet_samples(kubelet) if s.name == "kubelet_pleg_last_seen_seconds"]
    return value


def pod_syncs(kubelet: Kubelet) -> float:
    """Pod syncs the kubelet's pod workers finished (periodic or for a PLEG event), all pods."""
    return sum(
        s.value
        for s in kubelet_samples(kubelet)
        if s.name == "kubelet_pod_worker_duration_seconds_count" and s.labels.get("operation_type") == "sync"
    )


def probes_passed(kubelet: Kubelet, pod: str) -> dict[tuple[str, str], float]:
    """(container, probe type) -> the runs of that probe of `pod` that passed."""
    out: dict[tuple[str, str], float] = {}
    for s in kubelet_samples(kubelet, "/metrics/probes"):
        if (
            s.name == "prober_probe_total"
            and s.labels.get("pod") == kubelet.full_name(pod)
            and s.labels.get("result") == "successful"
        ):
            key = (s.labels["container"], s.labels["probe_type"])
            out[key] = out.get(key, 0.0) + s.value
    return out


def _running_ids(kubelet: Kubelet, pod: str) -> dict[str, tuple[str, int]]:
    return {n: (s["containerID"], s["restartCount"]) for n, s in kubelet.container_statuses(pod).items()}


def test_kubelet_and_podshim_restarts_keep_pods(
    kb: KubeletBed, kubelet: Kubelet, static_pods: list[str]
) -> None:
    """A kubelet restart and a podshim restart with pods running: the same containers keep
    running (no restart, same ids), the counter keeps counting, the kubelet stays healthy."""
    static_pods.append("steady")
    kubelet.add_static_pod(pod_manifest("steady", [counter(), busybox("side", "exec sleep 3600")]))
    kubelet.wait_running("steady", ["app", "side"])
    before = _running_ids(kubelet, "steady")
    log = log_file(kubelet, "steady", "app")

    kubelet.restart()
    kubelet.wait_running("steady", ["app", "side"])
    assert _running_ids(kubelet, "steady") == before
    n = pods.counts(log)[-1]
    pods.wait_count(log, n + 2)

    kb.bed.kill_podshim(signal.SIGTERM)
    kb.bed.start_podshim_again()
    up = time.time()  # the new podshim answers: what the kubelet lists from now on is its answer
    # a PLEG relist begun since then (any difference in what it lists is an event of that relist),
    # then one begun after that one was seen (so that one ended, its events sent to the sync loop),
    # then two syncs of the pod (the only one) after that: the second began after any event's
    # cache update, and its status is what the kubelet reports below
    kubelet.wait_for("a PLEG relist of the new podshim", lambda: pleg_last_seen(kubelet) >= up)
    seen = time.time()
    kubelet.wait_for("the next PLEG relist", lambda: pleg_last_seen(kubelet) >= seen)
    syncs = pod_syncs(kubelet)
    kubelet.wait_for("two syncs of the pod since", lambda: pod_syncs(kubelet) >= syncs + 2, timeout=90)
    kubelet.wait_running("steady", ["app", "side"])
    assert _running_ids(kubelet, "steady") == before
    assert kubelet.api("GET", "/healthz")[0] == 200
    n = pods.counts(log)[-1]
    pods.wait_count(log, n + 2)


def test_checkpoint_api_with_the_stock_config(
    kb: KubeletBed, kubelet: Kubelet, static_pods: list[str]
) -> None:
    """POST /checkpoint/<ns>/<pod>/<ctr>: the kubelet asks for a tar in /var/lib/kubelet/checkpoints;
    podshim's stock config (no allowed_roots in the bed's podshim.toml) writes it."""
    static_pods.append("ckpt")
    kubelet.add_static_pod(pod_manifest("ckpt", [counter()]))
    kubelet.wait_running("ckpt", ["app"])
    log = log_file(kubelet, "ckpt", "app")
    pods.wait_count(log, 1)
    status, body = kubelet.api(
        "POST", f"/checkpoint/{NAMESPACE}/{kubelet.full_name('ckpt')}/app", timeout=120
    )
    assert status == 200, body
    (item,) = json.loads(body)["items"]
    assert item.startswith(str(ROOT_IN_NODE / "checkpoints") + "/")
    tar = kubelet.host_path(item)
    with tarfile.open(tar) as t:
        names = set(t.getnames())
    assert {"spec.dump", "config.dump", "checkpoint/inventory.img"} <= names, sorted(names)[:20]
    n = pods.counts(log)[-1]
    pods.wait_count(log, n + 2)  # the container kept running (the wait raises otherwise)
    assert _running_ids(kubelet, "ckpt")["app"][1] == 0
    tar.unlink()


PROBED = {("app", "Liveness"), ("app", "Readiness"), ("side", "Readiness")}  # the probes of "probed"


def test_checkpoint_pod_while_probes_keep_passing(
    kb: KubeletBed, kubelet: Kubelet, static_pods: list[str]
) -> None:
    """CheckpointPod (as the KEP-5823 kubelet code will call it: empty options, a deadline) of a
    kubelet pod whose exec probes run every second: the pod stays Ready, nothing restarts, and
    the counter goes on."""
    static_pods.append("probed")
    probe = {"exec": {"command": ["cat", "/proc/1/status"]}, "periodSeconds": 1, "failureThreshold": 3}
    kubelet.add_static_pod(
        pod_manifest(
            "probed",
            [
                counter(livenessProbe=probe, readinessProbe=probe),
                busybox("side", "exec sleep 3600", readinessProbe=probe),
            ],
        )
    )
    kubelet.wait_running("probed", ["app", "side"])
    before = _running_ids(kubelet, "probed")
    pod_id = (kubelet.pod("probed") or {})["metadata"]["uid"]
    rt = kb.bed.runtime_stub(kb.bed.podshim_socket)
    sandbox = next(
        p.id
        for p in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items
        if p.metadata.uid == pod_id and p.state == cri.SANDBOX_READY
    )
    out_node = ROOT_IN_NODE / "pod-checkpoints" / "probed-1"
    out = kubelet.host_path(out_node)
    out.mkdir(parents=True, mode=0o700)
    try:
        for _ in range(3):
            shutil.rmtree(out)
            out.mkdir(mode=0o700)
            ids = [c.id for c in cri_containers(kb, "probed").values()]
            rt.CheckpointPod(
                cri.CheckpointPodRequest(
                    pod_sandbox_id=sandbox, output_path=str(out_node), container_ids=ids
                ),
                timeout=120,
            )
            assert (out / "manifest.json").is_file()
            passed = probes_passed(kubelet, "probed")

            def probed_on(passed: dict[tuple[str, str], float] = passed) -> bool:
                st = kubelet.container_statuses("probed")
                assert all(s["ready"] for s in st.values()), st  # Ready all along
                now = probes_passed(kubelet, "probed")
                return all(now.get(k, 0.0) >= passed.get(k, 0.0) + 3 for k in PROBED)

            # the probes run on: each passes 3 more times (its failureThreshold: as many failures
            # would have made the pod unready or restarted it), whatever time that takes
            kubelet.wait_for("every probe passing 3 more times", probed_on, every=0.2)
        assert _running_ids(kubelet, "probed") == before, "no probe failure restarted anything"
        log = log_file(kubelet, "probed", "app")
        n = pods.counts(log)[-1]
        pods.wait_count(log, n + 2)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_what_the_kubelet_sends(kb: KubeletBed, kubelet: Kubelet) -> None:
    """The kubelet through a recording relay in front of podshim (testbed/kubelet_calls.py, the
    source of docs/kubelet-calls.md): the request shapes podshim relies on, and no call failing
    but those that fail straight at containerd too."""
    rec = record_calls(kb)
    creates = {r["config"]["metadata"]["name"]: r["config"] for r in rec.calls["CreateContainer"]}
    app = creates["app"]
    uid = app["labels"]["io.kubernetes.pod.uid"]
    assert app["image"]["image"].startswith("sha256:"), "the kubelet creates containers by image ID"
    assert app["image"]["userSpecifiedImage"] == COUNTER_IMAGE
    mounts = {m["containerPath"]: m["hostPath"] for m in app.get("mounts", [])}
    assert mounts["/etc/hosts"] == f"{ROOT_IN_NODE}/pods/{uid}/etc-hosts"
    assert mounts["/dev/termination-log"].startswith(f"{ROOT_IN_NODE}/pods/{uid}/containers/app/")
    assert app["logPath"] == "app/0.log"
    assert [e["key"] for e in app.get("envs", [])] == ["GREETING"], "no service env vars: standalone"
    (sandbox,) = rec.calls["RunPodSandbox"][:1]
    assert sandbox["config"]["linux"]["cgroupParent"].startswith(kubelet.cgroup_root + "/kubepods/")
    assert sandbox["config"]["metadata"]["uid"] == uid
    (ckpt,) = rec.calls["CheckpointContainer"][:1]
    assert ckpt["location"].startswith(f"{ROOT_IN_NODE}/checkpoints/checkpoint-")
    # NOT_FOUND: statuses of containers being removed; probes' ExecSync may time out (1 s) or meet
    # a container being stopped (UNKNOWN, as straight at containerd)
    failed = {(m, c) for (m, c) in rec.counts if c != "OK" and m != "ExecSync" and c != "NOT_FOUND"}
    expected = {("RuntimeConfig", "UNIMPLEMENTED")}  # containerd 1.6 has no RuntimeConfig
    assert failed <= expected, rec.counts


def cri_client(kb: KubeletBed, *args: str, expect: str | None = "OK") -> dict[str, Any]:
    """The project's Go client (tools/go/cri-client: the released API's stubs and the kubelet's
    CRI client code), run in the node's mount namespace like the kubelet; its JSON answer."""
    assert kb.bed.node_mounts is not None
    argv = kb.bed.node_mounts.command([str(go_tool("cri-client")), *args])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode in (0, 3), f"cri-client {args[0]}: exit {res.returncode}: {res.stderr}"
    out: dict[str, Any] = json.loads(res.stdout)
    if expect is not None:
        assert out["code"] == expect, out
    return out


def test_restore_pod_of_a_kubelet_pod_with_the_released_api(
    kb: KubeletBed, kubelet: Kubelet, static_pods: list[str]
) -> None:
    """RestorePod of the checkpoint of a pod the kubelet made, called as the kubelet's KEP-5823
    code will (docs/design/testbed.md (The released API's Go client)): the new pod's own uid,
    name, log dir, /etc/hosts, termination logs and emptyDir, each image by its ID plus the name
    the spec gives; StartContainer; the counter resumes where it was. The same image by a digest
    reference or by name restores too; another image is a config mismatch (INVALID_ARGUMENT),
    never DATA_LOSS."""
    static_pods.append("warm")
    volume = {"name": "work", "mountPath": "/work"}
    manifest = pod_manifest(
        "warm",
        [
            counter(env=[{"name": "GREETING", "value": "hello"}], volumeMounts=[volume]),
            busybox("side", "date > /work/side; exec sleep 3600", volumeMounts=[volume]),
        ],
        volumes=[{"name": "work", "emptyDir": {}}],
    )
    kubelet.add_static_pod(manifest)
    kubelet.wait_running("warm", ["app", "side"])
    old_uid = (kubelet.pod("warm") or {})["metadata"]["uid"]
    log = log_file(kubelet, "warm", "app")
    pods.wait_count(log, 3)
    manifest_file = kubelet.dir / "warm-manifest.json"
    manifest_file.write_text(json.dumps(manifest))
    out_node = ROOT_IN_NODE / "pod-checkpoints" / f"warm-{uuid.uuid4().hex[:6]}"
    kubelet.host_path(out_node).mkdir(parents=True, mode=0o700)
    endpoint = f"unix://{kb.bed.podshim_socket}"
    ck = cri_client(
        kb, "checkpoint-pod", f"--endpoint={endpoint}", f"--pod-uid={old_uid}", f"--output={out_node}"
    )
    assert len(ck["container_ids"]) == 2
    # the count the restored counter must print first, from the archive's cut and the source's log
    cut = resume.Cut.of_archive(kubelet.host_path(out_node))
    pods.wait_for(lambda: any(x.ts > cut.frozen_at for x in resume.lines(log)), what="a line after the thaw")
    first = resume.possible_firsts(log, cut, "app")

    kubelet.stop()  # it would remove the restored pods (it did not make them) within seconds
    rt = kb.bed.runtime_stub(kb.bed.podshim_socket)
    restored: list[str] = []
    try:

        def restore(uid: str, *extra: str, expect: str | None = "OK") -> dict[str, Any]:
            r = cri_client(
                kb,
                "restore-pod",
                "--endpoint", endpoint,
                "--checkpoint", str(out_node),
                "--manifest", str(manifest_file),
                "--name", f"warm-{uid[:6]}",
                "--uid", uid,
                "--pod-logs-dir", str(kubelet.pod_logs),
                "--cgroup-root", kubelet.cgroup_root,
                *extra,
                expect=expect,
            )  # fmt: skip
            if r.get("pod_sandbox_id"):
                restored.append(r["pod_sandbox_id"])
            return r

        new_uid = uuid.uuid4().hex
        r = restore(new_uid)
        assert r["images"]["app"].startswith("sha256:") and r["started"], r
        new_log = kubelet.pod_logs / f"{NAMESPACE}_warm-{new_uid[:6]}_{new_uid}" / "app" / "0.log"
        resume.assert_exact_resume({"app": new_log}, {"app": first})
        for name, cid in r["containers"].items():
            st = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
            assert st.state == cri.CONTAINER_RUNNING and st.labels["io.kubernetes.pod.uid"] == new_uid
            text = str(st)
            assert old_uid not in text, f"{name} keeps something of the old pod: {text}"
            hosts = [m.host_path for m in st.mounts if m.container_path == "/etc/hosts"]
            assert hosts == [f"{ROOT_IN_NODE}/pods/{new_uid}/etc-hosts"], hosts

        # the same images, by a digest reference (as a pull leaves one) or by name
        with pods.digest_reference(kb.bed, COUNTER_IMAGE), pods.digest_reference(kb.bed, BUSYBOX_IMAGE):
            for how in ("--image-as=digest", "--image-as=name"):
                other = restore(uuid.uuid4().hex, how, "--no-start")
                # each container's image as the request named it: a digest reference, or the name
                want = "@sha256:" if how.endswith("digest") else COUNTER_IMAGE
                assert want in other["images"]["app"] and "sha256:" not in other["images"]["app"][:7], other
                states = [
                    rt.ContainerStatus(cri.ContainerStatusRequest(container_id=c)).status.state
                    for c in other["containers"].values()
                ]
                assert states == [cri.CONTAINER_CREATED] * 2, (how, states)
        busybox_id = (
            kb.bed.image_stub()
            .ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=BUSYBOX_IMAGE)))
            .image.id
        )
        wrong = restore(uuid.uuid4().hex, f"--image=app={busybox_id}", expect=None)
        assert wrong["code"] == "InvalidArgument" and "'app'" in wrong["message"], wrong
    finally:
        for pod_id in restored:
            pods.remove_pod(rt, pod_id)
        shutil.rmtree(kubelet.host_path(out_node), ignore_errors=True)
        kubelet.start()
