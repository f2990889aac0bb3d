"""podshim checks its own wiring: the upstream's runtime handler must run podshim-runc and pass
`podshim.*` annotations, read from containerd's verbose Status at start-up and before every
restore (FAILED_PRECONDITION otherwise); after StartContainer of a restored container,
podshim-runc's marker must be there (docs/design/runtime-wrapper.md (Wiring check))."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from api.runtime.v1 import api_pb2 as cri
from shim import errors, logs, metrics
from shim.config import Config
from shim.contract import (
    PAGE_DIGESTS_ANNOTATION,
    RESTORE_ANNOTATION,
    RESTORE_OPTIONS_ANNOTATION,
    RESTORED_MARKER,
)
from shim.deadlines import WIRING_CACHE_SECONDS, WIRING_RETRY_SECONDS, WIRING_STATUS_TIMEOUT
from shim.errors import is_not_found

log = logs.get("shim.checks.wiring")

WRAPPER_PREFIX = "podshim-runc"  # podshim-runc, or a variant of it (its file name starts so)
# PAGE_DIGESTS_ANNOTATION too: dropped on the way, an eager restore would run on memory nobody checked
PASSED_ANNOTATIONS = (RESTORE_ANNOTATION, RESTORE_OPTIONS_ANNOTATION, PAGE_DIGESTS_ANNOTATION)
# containerd shims that run an OCI runtime binary (their `BinaryName` option)
RUNC_SHIMS = ("io.containerd.runc.v2", "io.containerd.runc.v1", "io.containerd.runtime.v1.linux")
RESTORED_DIR = "restored"  # <state_dir>/restored/<container id>: created for a restore, not started
CRI_NAMESPACE = "k8s.io"  # containerd's CRI namespace: the runc shim's root is <Root>/<namespace>


class RuntimeCalls(Protocol):
    """The upstream calls the wiring check and the restore's confirmation make, raising podshim's
    typed errors (shim/upstream's client satisfies it: this module knows neither it nor gRPC)."""

    timeout: float  # each call's default limit (`[upstream] timeout_seconds`)

    async def version(self, *, doing: str = ..., timeout: float | None = None) -> cri.VersionResponse: ...

    async def status(
        self, verbose: bool = False, *, doing: str = ..., timeout: float | None = None
    ) -> cri.StatusResponse: ...

    async def container_status(
        self, container_id: str, verbose: bool = False, *, doing: str = ..., timeout: float | None = None
    ) -> cri.ContainerStatusResponse: ...

    async def stop_container(
        self, container_id: str, grace: int = 0, *, doing: str = ..., timeout: float | None = None
    ) -> None: ...

    async def remove_container(
        self, container_id: str, *, doing: str = ..., timeout: float | None = None
    ) -> None: ...


class Verdict(enum.Enum):
    OK = 1
    WRONG = 0
    UNKNOWN = -1  # the upstream does not say (another runtime, an unknown shape): cannot verify


@dataclass(frozen=True)
class Wiring:
    handler: str  # the upstream's runtime handler ("" resolved to its default)
    verdict: Verdict
    problem: str = ""  # WRONG: what is wrong and the config key to set; UNKNOWN: why not verified
    binary: str = ""  # the handler's BinaryName as reported


# ---------------------------------------------------------------------------- pure checks


def go_match(pattern: str, name: str) -> bool:
    """Go's filepath.Match on Linux, which containerd uses for `container_annotations`: `*` and
    `?` never match a `/`; `[...]` classes with `^` negation and ranges; `\\` escapes. A
    malformed pattern matches nothing (containerd ignores its error)."""
    regex = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            regex.append("[^/]*")
        elif c == "?":
            regex.append("[^/]")
        elif c == "\\":
            if i + 1 >= len(pattern):
                return False
            i += 1
            regex.append(re.escape(pattern[i]))
        elif c == "[":
            end = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] == "^" else i + 1)
            if end < 0:
                return False
            body = pattern[i + 1 : end]
            negate = body.startswith("^")
            body = body[1:] if negate else body
            if not body:
                return False
            cls = "".join("\\" + ch if ch in "\\]^[" else ch for ch in body)
            regex.append(f"[^/{cls}]" if negate else f"[{cls}]")
            i = end
        else:
            regex.append(re.escape(c))
        i += 1
    try:
        return re.fullmatch("".join(regex), name) is not None
    except re.error:
        return False


def executes_podshim_runc(binary: str) -> bool:
    """Whether a BinaryName runs podshim-runc: its file name, or that of the file it resolves to
    (a symlink, a name on PATH), starts with `podshim-runc`. What it really ran is proven after
    StartContainer by the restore marker."""
    if not binary:
        return False
    names = {os.path.basename(binary)}
    path = binary if "/" in binary else shutil.which(binary)
    if path:
        names.add(os.path.basename(os.path.realpath(path)))
    return any(n.startswith(WRAPPER_PREFIX) for n in names)


def config_section(handler: str, major: int) -> str:
    """The TOML table of a runtime handler in containerd's config, as the operator writes it."""
    if major >= 2:
        return f'plugins."io.containerd.cri.v1.runtime".containerd.runtimes.{handler}'
    if major == 1:
        return f'plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{handler}'
    return (
        f'plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{handler} (containerd 2.x: '
        f'plugins."io.containerd.cri.v1.runtime".containerd.runtimes.{handler})'
    )


def judge(info: Mapping[str, str], handler: str, major: int = 0) -> Wiring:
    """The wiring of `handler` ("" = the upstream's default) from a verbose Status `info`."""
    shown = handler or "(default)"
    try:
        cfg = json.loads(info.get("config") or "")
    except ValueError:
        cfg = None
    ctd = cfg.get("containerd") if isinstance(cfg, dict) else None
    runtimes = ctd.get("runtimes") if isinstance(ctd, dict) else None
    if not isinstance(ctd, dict) or not isinstance(runtimes, dict):
        return Wiring(
            shown,
            Verdict.UNKNOWN,
            "the upstream's verbose Status reports no containerd CRI config (containerd.runtimes): "
            "podshim cannot verify that the handler runs podshim-runc and passes podshim.* annotations",
        )
    name = handler or str(ctd.get("defaultRuntimeName") or "")
    if not name:
        return Wiring(shown, Verdict.UNKNOWN, "the upstream reports no default runtime handler")
    rt = runtimes.get(name)
    if not isinstance(rt, dict):
        return Wiring(
            name,
            Verdict.WRONG,
            f"runtime handler {name!r} is not configured in the upstream (it has: "
            f"{', '.join(sorted(runtimes)) or 'none'}): add [{config_section(name, major)}] with "
            'runtime_type = "io.containerd.runc.v2", BinaryName = podshim-runc and '
            'container_annotations = ["podshim.*"], and restart containerd',
        )
    section = config_section(name, major)
    rtype = str(rt.get("runtimeType") or "")
    opts = rt.get("options")
    if rtype and rtype not in RUNC_SHIMS:
        return Wiring(
            name,
            Verdict.WRONG,
            f"runtime handler {name!r} has runtime_type {rtype!r}, which runs no OCI runtime binary "
            f'podshim-runc could wrap: set [{section}] runtime_type = "io.containerd.runc.v2" with '
            "BinaryName = podshim-runc, or restore with another runtime_handler",
        )
    if opts is not None and not isinstance(opts, dict):
        return Wiring(name, Verdict.UNKNOWN, f"runtime handler {name!r}: its options have an unknown shape")
    binary = str((opts or {}).get("BinaryName") or "")
    annotations = rt.get("ContainerAnnotations") or []
    if not isinstance(annotations, list):
        return Wiring(name, Verdict.UNKNOWN, f"runtime handler {name!r}: unknown ContainerAnnotations shape")
    problems = []
    if not executes_podshim_runc(binary):
        problems.append(
            f"it runs {binary or 'runc (no BinaryName)'}, not podshim-runc, so a restore would start "
            f"the containers from scratch: set [{section}.options] BinaryName = "
            '"/usr/local/bin/podshim-runc"'
        )
    blocked = [a for a in PASSED_ANNOTATIONS if not any(go_match(str(p), a) for p in annotations)]
    if blocked:
        problems.append(
            f"it does not pass podshim's annotations to the OCI runtime (container_annotations = "
            f"{json.dumps([str(p) for p in annotations])} lets through none of {', '.join(blocked)}): "
            f'set [{section}] container_annotations = ["podshim.*"]'
        )
    if problems:
        return Wiring(
            name,
            Verdict.WRONG,
            f"runtime handler {name!r} is not wired for podshim: {'; '.join(problems)}; then restart "
            "containerd",
            binary,
        )
    return Wiring(name, Verdict.OK, "", binary)


def major_version(version: str) -> int:
    """The major of an upstream's runtime_version ("1.6.20~ds1", "v2.1.9"); 0 if none."""
    found = re.search(r"(\d+)\.\d+", version)
    return int(found.group(1)) if found else 0


# ---------------------------------------------------------------------------- the checker


class WiringChecker:
    """Asks the upstream (one verbose Status, cached WIRING_CACHE_SECONDS) how its handlers are wired."""

    def __init__(self, upstream: RuntimeCalls, cache_seconds: float = WIRING_CACHE_SECONDS) -> None:
        self.upstream = upstream
        self.cache_seconds = cache_seconds
        self._info: Mapping[str, str] | None = None
        self._at = 0.0
        self._major = 0
        self._lock = asyncio.Lock()
        self._reported: dict[str, Verdict] = {}

    async def _status(self) -> Mapping[str, str]:
        async with self._lock:
            now = time.monotonic()
            if self._info is not None and now - self._at < self.cache_seconds:
                return self._info
            timeout = min(self.upstream.timeout, WIRING_STATUS_TIMEOUT)
            if not self._major:
                with contextlib.suppress(errors.ShimError):
                    v = await self.upstream.version(timeout=timeout)
                    self._major = major_version(v.runtime_version)
            resp = await self.upstream.status(
                verbose=True, doing="checking the runtime handler's wiring", timeout=timeout
            )
            self._info, self._at = dict(resp.info), time.monotonic()
            return self._info

    async def status_info(self) -> Mapping[str, str] | None:
        """The upstream's verbose Status info (cached like every check), None when it does not
        answer: RestorePod's check of a runtime handler the upstream lacks reads the same answer
        as the wiring check right after it, not a Status call of its own."""
        try:
            return await self._status()
        except errors.ShimError:
            return None

    async def check(self, handler: str) -> Wiring:
        """The wiring of `handler`; the gauge follows it. An upstream that does not answer
        Status (other than being unreachable: that raises UNAVAILABLE) cannot be verified."""
        try:
            info = await self._status()
        except errors.ShimError as e:
            if e.transport or e.upstream_code is None:
                raise
            w = Wiring(
                handler or "(default)",
                Verdict.UNKNOWN,
                f"the upstream's verbose Status failed ({e.upstream_code}: {e.upstream_details})",
            )
        else:
            w = judge(info, handler, self._major)
        metrics.wiring_ok.labels(w.handler).set(w.verdict.value)
        return w

    async def require(self, handler: str, doing: str) -> Wiring:
        """Refuse a restore on a handler that is wired wrong (FAILED_PRECONDITION naming the
        handler and the key); one that cannot be verified is logged and let through (the marker
        check after StartContainer still applies). Returns the verdict: RestorePod defers the page
        images' checksums to podshim-runc only on a handler known to pass its annotations."""
        w = await self.check(handler)
        if w.verdict is Verdict.WRONG:
            self._report(w)
            raise errors.FailedPrecondition(f"{doing}: {w.problem}")
        if w.verdict is Verdict.UNKNOWN:
            self._report(w)
        return w

    def _report(self, w: Wiring) -> None:
        """Log a handler's wiring once per change (not on every restore)."""
        if self._reported.get(w.handler) is w.verdict:
            return
        self._reported[w.handler] = w.verdict
        if w.verdict is Verdict.OK:
            log.info("runtime handler wired for podshim", handler=w.handler, binary=w.binary)
        elif w.verdict is Verdict.WRONG:
            log.warning(
                "runtime handler wired wrong: restores on it are refused",
                handler=w.handler,
                problem=w.problem,
            )
        else:
            log.warning("cannot verify the runtime handler's wiring", handler=w.handler, reason=w.problem)

    async def at_startup(self, handlers: list[str]) -> None:
        """Check every handler podshim restores with, once the upstream answers; log and set the
        gauge for each. Runs in the background: podshim serves meanwhile."""
        while True:
            try:
                for h in handlers:
                    self._report(await self.check(h))
                return
            except errors.Unavailable as e:
                log.info("wiring check waits for the upstream", error=e.message)
                await asyncio.sleep(WIRING_RETRY_SECONDS)
            except Exception:  # noqa: BLE001 - never kills podshim; each restore checks again
                log.exception("wiring check at start-up failed; each restore checks again")
                return


# ---------------------------------------------------------------------------- restored containers


class RestoredContainers:
    """Ids of containers podshim created for a restore that were not started yet: in memory for
    StartContainer's lookup (no upstream call), and one file each under `<state_dir>/restored/`
    so that a restarted podshim still checks them."""

    def __init__(self, state_dir: str) -> None:
        self.dir = Path(state_dir) / RESTORED_DIR
        self.ids: set[str] = set()

    def load(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ids = {e.name for e in os.scandir(self.dir) if e.is_file(follow_symlinks=False)}

    def add(self, container_id: str) -> None:
        from shim.archive import fsutil

        fsutil.make_private_dir(self.dir)
        fsutil.write_private_file(self.dir / container_id, b"")
        self.ids.add(container_id)

    def discard(self, container_id: str) -> None:
        self.ids.discard(container_id)
        with contextlib.suppress(OSError):
            (self.dir / container_id).unlink()

    def lookup(self, requested: str) -> str | None:
        """The recorded id `requested` names (the full id, or a unique prefix as the upstream
        accepts), else None."""
        if not requested or not self.ids:
            return None
        if requested in self.ids:
            return requested
        hits = [i for i in self.ids if i.startswith(requested)]
        return hits[0] if len(hits) == 1 else None


async def _runtime_root(upstream: RuntimeCalls, container_id: str) -> tuple[str, int]:
    """The container's OCI runtime root as the upstream reports it ('' if it does not), and its
    state."""
    resp = await upstream.container_status(
        container_id, verbose=True, doing=f"checking the restore of container {container_id}"
    )
    try:
        info = json.loads(resp.info.get("info") or "{}")
        root = str((info.get("runtimeOptions") or {}).get("root") or "")
    except (ValueError, AttributeError):
        root = ""
    return (os.path.join(root, CRI_NAMESPACE) if root else ""), resp.status.state


def marker_verdict(roots: list[str], container_id: str) -> bool | None:
    """True: a runtime state dir of the container holds the restore marker; False: its state dir
    exists without it (podshim-runc writes the marker there before `create` returns, so the
    process was not restored); None: no state dir (the task was already deleted: cannot tell)."""
    seen = False
    for root in dict.fromkeys(r for r in roots if r):
        d = Path(root) / container_id
        if (d / RESTORED_MARKER).exists():
            return True
        seen = seen or d.is_dir()
    return False if seen else None


async def confirm_restored(upstream: RuntimeCalls, config: Config, container_id: str, name: str = "") -> None:
    """After a successful StartContainer of a container created for a restore: the restore must
    have run. If not, the container is stopped and removed, and FailedPrecondition says so."""
    configured = [rt.root for rt in (config.runtime, *config.runtimes.values())]
    if marker_verdict(configured, container_id):
        return  # the marker under a root podshim knows proves it: no upstream call on the start's path
    root, state = await _runtime_root(upstream, container_id)
    roots = [root, *configured]
    verdict = marker_verdict(roots, container_id)
    if verdict:
        return
    if verdict is None:
        # Exited and deleted already (or a root podshim does not know): the wiring check made
        # before creating it stands.
        log.warning(
            "cannot confirm the restore: the container's runtime state is gone",
            container=container_id,
            state=cri.ContainerState.Name(state),
        )
        return
    what = f"container {name!r} ({container_id[:13]})" if name else f"container {container_id[:13]}"
    log.error("restored container was not restored; removing it", container=container_id)
    for call in (upstream.stop_container, upstream.remove_container):
        try:
            await call(container_id)
        except errors.ShimError as e:
            if not is_not_found(e):
                log.error(
                    "removing the unrestored container failed",
                    container=container_id,
                    error=e.upstream_details,
                )
    raise errors.FailedPrecondition(
        f"{what} started, but its process was not restored from the checkpoint: it ran from the start "
        f"(podshim-runc left no {RESTORED_MARKER} marker in its runtime state dir). The upstream's runtime "
        "handler does not run podshim-runc's restore (check its BinaryName and container_annotations); "
        "the container was stopped and removed"
    )
