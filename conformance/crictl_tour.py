"""A tour of crictl v1.37 (built by the set-up) through a CRI endpoint: what an operator types on a
node. Each step is one crictl command whose output is checked; the pod is removed at the end,
pass or fail.

    steps = tour(endpoint, workdir, cgroup_parent=..., checkpoint_root=...)
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.bed import BUSYBOX_IMAGE, COUNTER_IMAGE
from testbed.tools import go_tool


@dataclass
class Step:
    name: str
    ok: bool
    detail: str


class _Tour:
    def __init__(self, endpoint: str, workdir: Path, timeout: float) -> None:
        self.endpoint = endpoint
        self.workdir = workdir
        self.timeout = timeout
        self.steps: list[Step] = []

    def crictl(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [
            str(go_tool("crictl")),
            "--runtime-endpoint",
            self.endpoint,
            "--image-endpoint",
            self.endpoint,
        ]
        argv += ["--timeout", "120s", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, cwd=self.workdir)

    def step(self, name: str, args: list[str], check: Callable[[str], Any] = lambda out: True) -> str:
        """Run one crictl command; it passes when it exits 0 and `check(stdout)` is true."""
        res = self.crictl(*args)
        out = res.stdout.strip()
        ok = res.returncode == 0
        detail = (res.stderr.strip() or out)[-300:]
        if ok:
            try:
                ok = bool(check(out))
                detail = detail if ok else f"unexpected output: {out[-300:]}"
            except (ValueError, KeyError, IndexError, TypeError) as e:
                ok, detail = False, f"{type(e).__name__}: {e}; output: {out[-300:]}"
        self.steps.append(Step(name, ok, "" if ok else detail))
        return out


def tour(
    endpoint: str,
    workdir: Path,
    *,
    cgroup_parent: str = "",
    checkpoint_root: Path | None = None,
    timeout: float = 180,
) -> list[Step]:
    workdir.mkdir(parents=True, exist_ok=True)
    t = _Tour(endpoint, workdir, timeout)
    uid = uuid.uuid4().hex
    logs = workdir / f"pod-logs-{uid[:8]}"
    logs.mkdir()
    pod_json = workdir / "pod.json"
    linux: dict[str, Any] = {"cgroup_parent": f"{cgroup_parent}/pod{uid}"} if cgroup_parent else {}
    pod_json.write_text(
        json.dumps(
            {
                "metadata": {"name": f"crictl-tour-{uid[:8]}", "namespace": "crictl-tour", "uid": uid},
                "log_directory": str(logs),
                "linux": linux,
            }
        )
    )
    ctr_json = workdir / "counter.json"
    ctr_json.write_text(
        json.dumps(
            {
                "metadata": {"name": "counter"},
                "image": {"image": COUNTER_IMAGE},
                "args": ["--interval-ms", "200"],
                "log_path": "counter.log",
            }
        )
    )
    shell_json = workdir / "shell.json"
    shell_json.write_text(
        json.dumps(
            {
                "metadata": {"name": "shell"},
                "image": {"image": BUSYBOX_IMAGE},
                "command": ["sh", "-c", "echo shell up; exec sleep 3600"],
                "log_path": "shell.log",
            }
        )
    )
    pod = ""
    try:
        t.step("version", ["version"], lambda out: "RuntimeApiVersion:" in out and "v1" in out)
        t.step("info", ["info"], lambda out: json.loads(out)["status"]["conditions"])
        t.step("images", ["images", "-q"], lambda out: len(out.splitlines()) >= 2)
        pod = t.step("runp", ["runp", str(pod_json)], lambda out: len(out) == 64)
        if len(pod) != 64:
            return t.steps
        t.step("pods", ["pods", "-q", "--id", pod], lambda out: out == pod)
        t.step(
            "inspectp", ["inspectp", pod], lambda out: json.loads(out)["status"]["state"] == "SANDBOX_READY"
        )
        counter = t.step("create counter", ["create", "--no-pull", pod, str(ctr_json), str(pod_json)])
        shell = t.step("create shell", ["create", "--no-pull", pod, str(shell_json), str(pod_json)])
        t.step("start", ["start", counter, shell])
        t.step(
            "ps", ["ps", "-q", "--pod", pod], lambda out: sorted(out.splitlines()) == sorted([counter, shell])
        )
        t.step(
            "inspect",
            ["inspect", counter],
            lambda out: json.loads(out)["status"]["state"] == "CONTAINER_RUNNING",
        )
        t.step(
            "exec -s",
            ["exec", "-s", shell, "sh", "-c", "echo exec-sync $((6*7))"],
            lambda o: o == "exec-sync 42",
        )
        t.step(
            "exec (streaming)",
            ["exec", shell, "sh", "-c", "echo exec-stream ok"],
            lambda o: o == "exec-stream ok",
        )
        t.step("logs", ["logs", shell], lambda out: "shell up" in out)
        t.step("stats", ["stats", "-o", "json", "--id", counter], lambda out: json.loads(out)["stats"])
        t.step("statsp", ["statsp", "-o", "json", "--id", pod], lambda out: json.loads(out)["stats"])
        if checkpoint_root is not None:
            tar = checkpoint_root / f"crictl-tour-{uid[:8]}.tar"
            try:
                t.step(
                    "checkpoint --export",
                    ["checkpoint", f"--export={tar}", counter],
                    lambda out: tar.is_file() and tar.stat().st_size > 0,
                )
            finally:
                tar.unlink(missing_ok=True)
            t.step("counter survives the checkpoint", ["inspect", counter], _running)
        t.step("stop", ["stop", "--timeout", "2", counter, shell])
        t.step("rm", ["rm", counter, shell])
        t.step("stopp", ["stopp", pod])
        t.step("rmp", ["rmp", pod])
        pod = ""
    finally:
        if pod:
            t.crictl("rmp", "--force", pod)
    return t.steps


def _running(out: str) -> bool:
    return bool(json.loads(out)["status"]["state"] == "CONTAINER_RUNNING")
