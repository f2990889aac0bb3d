"""A small critest-style runner: registered tests, RPC probes that turn into skips, per-test
clean-up, a PASS/FAIL/SKIP listing and JUnit XML."""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from api.runtime.v1 import api_pb2 as cri
from conformance.cri import POD_UID_LABEL, RUN_LABEL, Runtime, rpc_error_text

# The RPCs under test, and a probe request for each that any runtime implementing the RPC must
# reject without side effects (no pod, no path).
PROBES: dict[str, Callable[[], Any]] = {
    "CheckpointPod": lambda: cri.CheckpointPodRequest(),
    "RestorePod": lambda: cri.RestorePodRequest(),
    "CheckpointContainer": lambda: cri.CheckpointContainerRequest(),
}
# Answers that mean "this runtime has the RPC but cannot checkpoint on this node" (the same the
# Kubernetes node e2e test skips on).
UNSUPPORTED_MESSAGES = (
    "checkpoint/restore support not available",
    "CRIU binary not found",  # also "... or too old"
)


class Skip(Exception):
    """Raised by a test (or the runner) to skip it with a message."""


@dataclass
class TestCase:
    group: str
    name: str
    fn: Callable[[Context], None]
    requires: tuple[str, ...]
    doc: str

    @property
    def id(self) -> str:
        return f"{self.group}.{self.name}"


REGISTRY: list[TestCase] = []


def conformance_test(group: str, *requires: str) -> Callable[[Callable[[Context], None]], Callable]:
    """Register a test function; `requires` names the RPCs it needs (skipped when absent)."""

    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        doc = (fn.__doc__ or "").strip().splitlines()
        REGISTRY.append(
            TestCase(group, fn.__name__.removeprefix("test_"), fn, requires, doc[0] if doc else "")
        )
        return fn

    return register


@dataclass
class Result:
    case: TestCase
    outcome: str  # "passed", "failed", "skipped"
    seconds: float
    message: str = ""
    details: str = ""


@dataclass
class Pod:
    """A pod the suite runs: its id, config, and container configs/ids by name."""

    id: str
    config: cri.PodSandboxConfig
    configs: dict[str, cri.ContainerConfig]
    ids: dict[str, str]
    log_paths: dict[str, str] = field(default_factory=dict)


@dataclass
class Settings:
    checkpoint_root: Path
    rpc_timeout: float
    verbose: bool = False


class Suite:
    """Run-wide state: the runtime, probe results, shared fixtures and what must be removed."""

    def __init__(self, runtime: Runtime, settings: Settings) -> None:
        self.runtime = runtime
        self.settings = settings
        self.available: dict[str, str | None] = {}  # rpc -> None (available) or the skip message
        self.runtime_label = runtime.endpoint
        self.shared: dict[str, Any] = {}
        self._shared_cleanup: list[Callable[[], None]] = []
        self._seq = 0
        # A test's pods are removed in the background while the next test runs (stopping a pod
        # takes seconds); problems are reported at the end of the run.
        self._reaper = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cleanup")
        self._reaping: list[tuple[str, Future[list[str]]]] = []

    def clean_up_later(self, case: TestCase, items: list[Cleanup]) -> None:
        mine = list(items)
        items.clear()
        self._reaping.append((case.id, self._reaper.submit(cleanup, mine)))

    def finish_clean_ups(self) -> list[str]:
        """Wait for the background clean-ups; return their problems."""
        problems = []
        for case_id, fut in self._reaping:
            problems += [f"{case_id}: {p}" for p in fut.result()]
        self._reaping.clear()
        self._reaper.shutdown(wait=True)
        return problems

    def probe(self) -> None:
        """Call each RPC with an empty request: UNIMPLEMENTED (or 'CRIU not available') means skip."""
        for rpc, make in PROBES.items():
            try:
                getattr(self.runtime.rt, rpc)(make(), timeout=30)
                self.available[rpc] = None  # an empty request accepted: odd, but implemented
            except grpc.RpcError as e:
                details = e.details() or ""
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.available[rpc] = (
                        f"{self.runtime_label} does not implement {rpc}: a probe call answered "
                        f"UNIMPLEMENTED ({details})"
                    )
                elif any(m.lower() in details.lower() for m in UNSUPPORTED_MESSAGES):
                    self.available[rpc] = f"{self.runtime_label} cannot checkpoint on this node: {details}"
                elif e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                else:
                    self.available[rpc] = None

    def next_name(self, tag: str) -> str:
        self._seq += 1
        return f"{tag}-{self._seq}"

    def add_shared_cleanup(self, fn: Callable[[], None]) -> None:
        self._shared_cleanup.append(fn)

    def close_shared(self) -> list[str]:
        problems = []
        for fn in reversed(self._shared_cleanup):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report, keep cleaning
                problems.append(f"{type(e).__name__}: {e}")
        self._shared_cleanup.clear()
        self.shared.clear()
        return problems

    def sweep(self) -> list[str]:
        """Remove any sandbox of this run still present (a safety net); return their ids."""
        rt = self.runtime
        left = []
        with contextlib.suppress(grpc.RpcError):
            for sb in rt.sandboxes({RUN_LABEL: rt.run_id}):
                left.append(sb.id)
                with contextlib.suppress(grpc.RpcError):
                    rt.remove_pod(sb.id, self._parent_of(sb))
        return left

    def _parent_of(self, sb: cri.PodSandbox) -> str:
        uid = sb.labels.get(POD_UID_LABEL, "") or sb.metadata.uid
        cg = self.runtime.cgroups
        return cg.parent(uid) if cg is not None and uid else ""


class Context:
    """What a test sees: the runtime plus helpers that record everything for clean-up."""

    def __init__(self, suite: Suite, case: TestCase, owner: list[Cleanup] | None = None) -> None:
        self.suite = suite
        self.case = case
        self.runtime = suite.runtime
        self.rpc_timeout = suite.settings.rpc_timeout
        self._cleanup: list[Cleanup] = owner if owner is not None else []

    # ------------------------------------------------------------------ resources

    def on_cleanup(self, fn: Callable[[], None], pod: bool = False) -> None:
        """Run fn at the end of the test; pod removals (pod=True) run concurrently, before the rest."""
        self._cleanup.append(Cleanup(fn, pod))

    def checkpoint_dir(self, tag: str) -> Path:
        """A fresh, empty, caller-owned directory under the checkpoint root (removed afterwards)."""
        root = self.suite.settings.checkpoint_root
        d = root / f"conformance-{self.runtime.run_id}-{self.suite.next_name(tag)}"
        d.mkdir(mode=0o700)
        self.on_cleanup(lambda: shutil.rmtree(d, ignore_errors=True))
        return d

    def track_pod(self, pod_id: str, config: cri.PodSandboxConfig) -> None:
        parent = config.linux.cgroup_parent
        self.on_cleanup(lambda: self.runtime.remove_pod(pod_id, parent), pod=True)

    def run_pod(self, tag: str, containers: dict[str, list[str] | None] | None = None) -> Pod:
        """Run a pod with the workload in each named container (value: args, None = default)
        and wait until every container printed a few numbers."""
        rt = self.runtime
        config = rt.pod_config(self.suite.next_name(tag))
        pod_id = rt.run_pod(config)
        self.track_pod(pod_id, config)
        pod = Pod(pod_id, config, {}, {})
        for name, args in (containers or {"workload": None}).items():
            cc = rt.container_config(name, config, args)
            cid = rt.create_container(pod_id, config, cc)
            rt.start_container(cid)
            pod.configs[name], pod.ids[name] = cc, cid
            pod.log_paths[name] = self.log_path(cid, config, cc)
        for name in pod.ids:
            rt.wait_count(pod.log_paths[name], 3)
        return pod

    def log_path(self, cid: str, pod: cri.PodSandboxConfig, cc: cri.ContainerConfig) -> str:
        st = self.runtime.container_status(cid)
        return st.log_path or str(Path(pod.log_directory) / cc.log_path)

    def restore_config(self, source: cri.PodSandboxConfig) -> cri.PodSandboxConfig:
        """The PodSandboxConfig of a restored pod: new UID, log directory and cgroup parent."""
        return self.runtime.pod_config(source.metadata.name + "-restored")

    # ------------------------------------------------------------------ the RPCs under test

    def checkpoint_pod(
        self,
        pod: Pod,
        out: Path,
        names: list[str] | None = None,
        options: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> cri.CheckpointPodResponse:
        ids = [pod.ids[n] for n in (names if names is not None else pod.ids)]
        req = cri.CheckpointPodRequest(
            pod_sandbox_id=pod.id, output_path=str(out), container_ids=ids, options=options or {}
        )
        return self.runtime.rt.CheckpointPod(req, timeout=timeout or self.rpc_timeout)

    def restore_pod(
        self,
        path: Path,
        config: cri.PodSandboxConfig,
        container_configs: list[cri.ContainerConfig],
        options: dict[str, str] | None = None,
        runtime_handler: str | None = None,
    ) -> cri.RestorePodResponse:
        """RestorePod; the new sandbox (found by the config's UID) is removed at clean-up, whatever
        the outcome."""
        self.track_pod_by_uid(config)
        req = cri.RestorePodRequest(
            checkpoint_path=str(path),
            config=config,
            runtime_handler=self.runtime.runtime_handler if runtime_handler is None else runtime_handler,
            options=options or {},
            container_configs=container_configs,
        )
        return self.runtime.rt.RestorePod(req, timeout=self.rpc_timeout)

    def track_pod_by_uid(self, config: cri.PodSandboxConfig) -> None:
        """Remove any sandbox carrying this config's UID at clean-up (one a runtime leaked)."""
        uid, parent = config.metadata.uid, config.linux.cgroup_parent

        def remove() -> None:
            for sb in self.runtime.sandboxes({POD_UID_LABEL: uid}):
                self.runtime.remove_pod(sb.id, parent)
            if parent and self.runtime.cgroups is not None:
                self.runtime.cgroups.remove_pod(parent)

        self.on_cleanup(remove, pod=True)

    # ------------------------------------------------------------------ assertions

    def expect_error(
        self, codes: tuple[grpc.StatusCode, ...], fn: Callable[[], Any], what: str
    ) -> grpc.RpcError:
        """Call fn; it must fail with one of `codes`."""
        try:
            fn()
        except grpc.RpcError as e:
            if e.code() not in codes:
                raise AssertionError(
                    f"{what}: expected {' or '.join(c.name for c in codes)}, got {rpc_error_text(e)}"
                ) from None
            return e
        raise AssertionError(f"{what}: expected {' or '.join(c.name for c in codes)}, but the call succeeded")

    def assert_no_sandbox(self, config: cri.PodSandboxConfig, why: str) -> None:
        left = self.runtime.sandboxes({POD_UID_LABEL: config.metadata.uid})
        assert not left, (
            f"{why}: the runtime left sandbox(es) {[s.id[:13] for s in left]} with the new pod's UID"
        )

    def assert_running(self, pod: Pod, names: list[str] | None = None) -> None:
        """The pod is READY and the named containers RUNNING and still making progress (not frozen)."""
        st = self.runtime.pod_status(pod.id)
        assert st.state == cri.SANDBOX_READY, f"pod {pod.id[:13]} is {cri.PodSandboxState.Name(st.state)}"
        last = {}
        for name in names if names is not None else pod.ids:
            cst = self.runtime.container_status(pod.ids[name])
            assert cst.state == cri.CONTAINER_RUNNING, (
                f"container {name} is {cri.ContainerState.Name(cst.state)}, expected CONTAINER_RUNNING"
            )
            last[name] = self.runtime.last_count(pod.log_paths[name]) or 0
        for name, n in last.items():
            self.runtime.wait_count(pod.log_paths[name], n + 2, timeout=15)


# ---------------------------------------------------------------------------- running


def select(cases: list[TestCase], focus: str | None, skip: str | None) -> list[TestCase]:
    out = cases
    if focus:
        out = [c for c in out if re.search(focus, c.id)]
    if skip:
        out = [c for c in out if not re.search(skip, c.id)]
    return out


def run_case(suite: Suite, case: TestCase) -> Result:
    start = time.monotonic()
    missing = [suite.available.get(r) for r in case.requires if suite.available.get(r)]
    if missing:
        return Result(case, "skipped", 0.0, str(missing[0]))
    ctx = Context(suite, case)
    outcome, message, details = "passed", "", ""
    try:
        case.fn(ctx)
    except Skip as e:
        outcome, message = "skipped", str(e)
    except grpc.RpcError as e:
        outcome, message = "failed", f"unexpected CRI error {rpc_error_text(e)}"
        details = traceback.format_exc()
    except Exception as e:  # noqa: BLE001 - a failing test, whatever it raised
        outcome, message = "failed", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        details = traceback.format_exc()
    finally:  # also on KeyboardInterrupt / SIGTERM
        suite.clean_up_later(case, ctx._cleanup)
    return Result(case, outcome, time.monotonic() - start, message, details)


@dataclass
class Cleanup:
    fn: Callable[[], None]
    pod: bool = False


def cleanup(items: list[Cleanup]) -> list[str]:
    """Remove the pods (concurrently), then the rest in reverse order; return the problems."""
    problems: list[str] = []

    def attempt(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report, keep cleaning
            text = rpc_error_text(e) if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
            problems.append(text)

    pods = [c.fn for c in items if c.pod]
    if pods:
        with ThreadPoolExecutor(max_workers=min(8, len(pods))) as pool:
            list(pool.map(attempt, pods))
    for c in reversed(items):
        if not c.pod:
            attempt(c.fn)
    items.clear()
    return problems


LABELS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}


def report_line(r: Result, out: TextIO, verbose: bool) -> None:
    out.write(f"{LABELS[r.outcome]}  {r.case.id}  ({r.seconds:.2f}s)\n")
    if r.message:
        for line in r.message.splitlines():
            out.write(f"      {line}\n")
    if r.outcome == "failed" and verbose and r.details:
        for line in r.details.rstrip().splitlines():
            out.write(f"      | {line}\n")
    out.flush()


CLEAN_UP = TestCase("suite", "clean_up", lambda t: None, (), "remove everything the tests created")


def run(suite: Suite, cases: list[TestCase], out: TextIO = sys.stdout) -> list[Result]:
    """Run the cases; a failed clean-up is reported as one more failing result, suite.clean_up."""
    results = []
    try:
        for case in cases:
            r = run_case(suite, case)
            results.append(r)
            report_line(r, out, suite.settings.verbose)
    finally:
        start = time.monotonic()
        problems = suite.finish_clean_ups() + suite.close_shared()
        left = suite.sweep()
        problems += [f"sandbox {i[:13]} of this run was still there (removed now)" for i in left]
        if problems:
            r = Result(CLEAN_UP, "failed", time.monotonic() - start, "\n".join(problems))
            results.append(r)
            report_line(r, out, suite.settings.verbose)
    return results


def shared_context(suite: Suite, case: TestCase) -> Context:
    """A Context whose resources live until the end of the run (shared fixtures)."""
    holder: list[Cleanup] = []
    suite.add_shared_cleanup(lambda: _raise_first(cleanup(holder)))
    return Context(suite, case, holder)


def _raise_first(problems: list[str]) -> None:
    if problems:
        raise RuntimeError("; ".join(problems))


def summary(results: list[Result], seconds: float) -> str:
    n = {k: sum(1 for r in results if r.outcome == k) for k in LABELS}
    return f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped in {seconds:.1f}s"


def write_junit(path: Path, results: list[Result], seconds: float, properties: dict[str, str]) -> None:
    suite = ET.Element(
        "testsuite",
        name="podshim-conformance",
        tests=str(len(results)),
        failures=str(sum(r.outcome == "failed" for r in results)),
        errors="0",
        skipped=str(sum(r.outcome == "skipped" for r in results)),
        time=f"{seconds:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for k, v in properties.items():
        ET.SubElement(props, "property", name=k, value=v)
    for r in results:
        tc = ET.SubElement(
            suite,
            "testcase",
            classname=f"conformance.{r.case.group}",
            name=r.case.name,
            time=f"{r.seconds:.3f}",
        )
        if r.outcome == "skipped":
            ET.SubElement(tc, "skipped", message=r.message)
        elif r.outcome == "failed":
            el = ET.SubElement(tc, "failure", message=r.message)
            el.text = r.details or r.message
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
