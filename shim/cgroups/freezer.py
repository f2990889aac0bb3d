"""cgroup freezer (v1 and v2), cgroup path resolution, and the pod-wide "freeze in one cut".

The cut (docs/design/checkpoint-pod.md (CheckpointPod) step 5): freeze the pod's parent cgroup, which stops
every process of the pod at once; freeze each container's own cgroup; thaw the parent. Each
container then stays frozen by its own cgroup, and CRIU never runs under a frozen ancestor (it would
hang: its thaw of the container cgroup has no effect there).

Every cgroup argument is an OCI `linux.cgroupsPath` in either driver's form (cgroupfs
"/kubepods/besteffort/pod<uid>/<id>", systemd "slice:prefix:name" or a bare "<name>.slice"),
resolved the way runc does to a path relative to the hierarchy.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shim.deadlines import FREEZE_TIMEOUT
from shim.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ShimError,
)


class FreezerTimeout(Internal):
    """A cgroup did not reach a freezer state in time: a kernel/runtime failure (INTERNAL), not
    the caller's deadline (the caller's deadline is DEADLINE_EXCEEDED, raised elsewhere)."""


MOUNTINFO = Path("/proc/self/mountinfo")
UNIFIED_MOUNTPOINT = "/sys/fs/cgroup"  # where runc looks for a cgroup2-only host

POLL_INTERVAL = 0.005  # steady-state poll; the first polls are faster (most freezes are sub-ms)
_FIRST_POLLS = (0.0, 0.0002, 0.0005, 0.001, 0.002)


class CgroupMode(enum.StrEnum):
    V1 = "v1"  # legacy/hybrid: the freezer controller has its own hierarchy
    V2 = "v2"  # unified: cgroup.freeze in every non-root cgroup


class FreezerState(enum.StrEnum):
    THAWED = "THAWED"
    FREEZING = "FREEZING"
    FROZEN = "FROZEN"  # by itself or by a frozen ancestor


@dataclass(frozen=True)
class Hierarchy:
    """Where the freezer lives: `root` is the v1 freezer mount or the v2 unified mount."""

    mode: CgroupMode
    root: Path


# ---------------------------------------------------------------------------- detection


@dataclass(frozen=True)
class MountInfo:
    mountpoint: str
    root: str  # the subtree of the file system shown at the mount point
    fstype: str
    super_options: tuple[str, ...]


def _unescape(field_: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def parse_mountinfo(text: str) -> list[MountInfo]:
    """Parse /proc/<pid>/mountinfo (proc(5)); malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        mounts.append(
            MountInfo(
                mountpoint=_unescape(lf[4]),
                root=_unescape(lf[3]),
                fstype=rf[0],
                super_options=tuple(rf[2].split(",")),
            )
        )
    return mounts


def detect_hierarchy(mountinfo: Path = MOUNTINFO, unified_mountpoint: str = UNIFIED_MOUNTPOINT) -> Hierarchy:
    """V2 when the mount on `unified_mountpoint` is cgroup2 (as runc decides); else V1 at the
    mount point of the hierarchy carrying the freezer controller (the one under
    `unified_mountpoint`, else the first mounted). FailedPrecondition if neither."""
    try:
        mounts = parse_mountinfo(Path(mountinfo).read_text())
    except OSError as e:
        raise Internal(f"cannot read {mountinfo} to find the cgroup freezer: {e}") from e
    # the last mount on a mount point is the visible one
    top = [m for m in mounts if m.mountpoint == unified_mountpoint]
    if top and top[-1].fstype == "cgroup2":
        return Hierarchy(CgroupMode.V2, Path(unified_mountpoint))
    freezers = [m for m in mounts if m.fstype == "cgroup" and "freezer" in m.super_options]
    if freezers:
        # Other mounts of the same hierarchy come and go (CRIU mounts a transient
        # ".criu.cgyard.*" copy during a restore): prefer the system one under the unified
        # mount point's directory, else the first mounted.
        system = [m for m in freezers if m.mountpoint.startswith(unified_mountpoint.rstrip("/") + "/")]
        return Hierarchy(CgroupMode.V1, Path((system or freezers)[0].mountpoint))
    raise FailedPrecondition(
        f"no cgroup freezer on this host: {unified_mountpoint} is not cgroup2 and no cgroup v1 "
        f"hierarchy has the freezer controller (see {mountinfo}); mount one to checkpoint pods"
    )


# ---------------------------------------------------------------------------- path resolution

_SLICE = ".slice"


def expand_slice(slice_: str) -> str:
    """runc's systemd ExpandSlice: "a-b-c.slice" -> "/a.slice/a-b.slice/a-b-c.slice"."""
    if not slice_.endswith(_SLICE) or len(slice_) <= len(_SLICE) or "/" in slice_:
        raise InvalidArgument(f"invalid systemd slice name {slice_!r}: expected <name>.slice")
    name = slice_[: -len(_SLICE)]
    if name == "-":
        return "/"
    path, prefix = "", ""
    for comp in name.split("-"):
        if comp == "":  # "a--b.slice" and "-a.slice" are not valid unit names
            raise InvalidArgument(f"invalid systemd slice name {slice_!r}: empty component")
        path += f"/{prefix}{comp}{_SLICE}"
        prefix += f"{comp}-"
    return path


def resolve_cgroups_path(cgroups_path: str) -> str:
    """An OCI linux.cgroupsPath -> the absolute path inside the hierarchy ("/a/b").

    cgroupfs: "/kubepods/besteffort/pod<uid>/<id>" as is (normalised).
    systemd: "slice:prefix:name" -> expand_slice(slice) + "/prefix-name.scope" (runc: a
    name ending in ".slice" is used as is; an empty slice means system.slice); a bare
    "<name>.slice" (a pod's cgroup parent) -> expand_slice(name).
    """
    p = cgroups_path
    if not isinstance(p, str) or not p:
        raise InvalidArgument("empty cgroups path: the container's OCI spec has no linux.cgroupsPath")
    if "\x00" in p:
        raise InvalidArgument(f"cgroups path {p!r} contains a NUL byte")
    if p.startswith("/"):
        parts = [c for c in p.split("/") if c not in ("", ".")]
        if ".." in parts:
            raise InvalidArgument(f"cgroups path {p!r} has a '..' component")
        return "/" + "/".join(parts)
    if ":" in p:
        fields_ = p.split(":")
        if len(fields_) != 3:
            raise InvalidArgument(f"systemd cgroups path {p!r} is not of the form slice:prefix:name")
        slice_, prefix, name = fields_
        if not name or "/" in name or "/" in prefix or name in (".", ".."):
            raise InvalidArgument(f"systemd cgroups path {p!r} has an invalid unit name")
        base = expand_slice(slice_ or "system.slice")
        unit = name if name.endswith(_SLICE) else (f"{prefix}-{name}.scope" if prefix else f"{name}.scope")
        return base.rstrip("/") + "/" + unit
    if p.endswith(_SLICE):
        return expand_slice(p)
    raise InvalidArgument(
        f"cgroups path {p!r} is neither absolute (cgroupfs driver) nor slice:prefix:name (systemd driver)"
    )


# ---------------------------------------------------------------------------- freezer


class Freezer:
    """Freeze, thaw and inspect cgroups of one hierarchy; confirmation by bounded polling."""

    def __init__(self, hierarchy: Hierarchy | None = None, poll_interval: float = POLL_INTERVAL) -> None:
        self.hierarchy = hierarchy or detect_hierarchy()
        self.poll_interval = poll_interval

    @property
    def mode(self) -> CgroupMode:
        return self.hierarchy.mode

    def path(self, cgroup: str) -> Path:
        """The directory of `cgroup` (any cgroupsPath form) in this hierarchy."""
        rel = resolve_cgroups_path(cgroup)
        if rel == "/":
            raise InvalidArgument("refusing to use the root cgroup: it holds every process of the host")
        return self.hierarchy.root / rel.lstrip("/")

    def exists(self, cgroup: str) -> bool:
        return self.path(cgroup).is_dir()

    # -- raw file access with errors that name the cgroup

    def _read(self, cgroup: str, name: str) -> str:
        p = self.path(cgroup) / name
        try:
            with open(p) as f:
                return f.read()
        except FileNotFoundError as e:
            raise self._missing(cgroup, p) from e
        except OSError as e:
            raise Internal(f"cannot read {p} (cgroup {cgroup}): {e}") from e

    def _write(self, cgroup: str, name: str, value: str) -> None:
        p = self.path(cgroup) / name
        try:
            with open(p, "w") as f:
                f.write(value)
        except FileNotFoundError as e:
            raise self._missing(cgroup, p) from e
        except OSError as e:
            raise Internal(f"cannot write {value!r} to {p} (cgroup {cgroup}): {e}") from e

    def _missing(self, cgroup: str, p: Path) -> ShimError:
        if not p.parent.is_dir():
            return NotFound(
                f"cgroup {cgroup} does not exist ({p.parent}): the container may have exited; "
                "check that it is still running"
            )
        return NotFound(
            f"cgroup {cgroup} has no {p.name} ({p}): is {self.hierarchy.root} a freezer hierarchy?"
        )

    # -- state

    def state(self, cgroup: str) -> FreezerState:
        """THAWED, FREEZING or FROZEN; FROZEN also when an ancestor is frozen."""
        if self.mode is CgroupMode.V1:
            raw = self._read(cgroup, "freezer.state").strip()
            try:
                return FreezerState(raw)
            except ValueError:
                raise Internal(f"cgroup {cgroup}: unexpected freezer.state {raw!r}") from None
        if self._v2_events_frozen(cgroup):
            return FreezerState.FROZEN
        return FreezerState.FREEZING if self.self_frozen(cgroup) else FreezerState.THAWED

    def self_frozen(self, cgroup: str) -> bool:
        """Whether `cgroup` itself is asked to be frozen (not merely under a frozen ancestor)."""
        if self.mode is CgroupMode.V1:
            return self._read(cgroup, "freezer.self_freezing").strip() == "1"
        return self._read(cgroup, "cgroup.freeze").strip() == "1"

    def _v2_events_frozen(self, cgroup: str) -> bool:
        for line in self._read(cgroup, "cgroup.events").splitlines():
            key, _, value = line.partition(" ")
            if key == "frozen":
                return value.strip() == "1"
        raise Internal(f"cgroup {cgroup}: cgroup.events has no 'frozen' key (kernel without the v2 freezer?)")

    def _ancestor_frozen(self, cgroup: str) -> bool:
        try:
            if self.mode is CgroupMode.V1:
                return self._read(cgroup, "freezer.parent_freezing").strip() == "1"
            parent = os.path.dirname(resolve_cgroups_path(cgroup))
            return parent != "/" and self._v2_events_frozen(parent)
        except ShimError:
            return False

    def procs(self, cgroup: str) -> list[int]:
        """PIDs of the processes directly in `cgroup`."""
        return [int(x) for x in self._read(cgroup, "cgroup.procs").split()]

    # -- freeze / thaw

    def _wait(self, cgroup: str, want: FreezerState, timeout: float, nudge: str | None) -> float:
        """Poll until state(cgroup) == want; returns the seconds taken. Raises FreezerTimeout."""
        start = time.monotonic()
        deadline = start + max(timeout, 0.0)
        i = 0
        while True:
            s = self.state(cgroup)
            if s is want:
                return time.monotonic() - start
            now = time.monotonic()
            if now >= deadline:
                raise FreezerTimeout(f"cgroup {cgroup} is {s}, not {want}, after {timeout:.3g}s")
            if nudge is not None and s is FreezerState.FREEZING and i % 10 == 9:
                # v1 can stay FREEZING while tasks are forking; re-asking helps (as runc does)
                self._write(cgroup, "freezer.state", nudge)
            delay = _FIRST_POLLS[i] if i < len(_FIRST_POLLS) else self.poll_interval
            i += 1
            if delay:
                time.sleep(min(delay, max(deadline - now, 0.0)))

    def wait_state(self, cgroup: str, want: FreezerState, timeout: float = FREEZE_TIMEOUT) -> float:
        """Poll until `cgroup` is in state `want`; seconds taken, or FreezerTimeout naming it."""
        return self._wait(cgroup, want, timeout, nudge=None)

    def freeze(self, cgroup: str, timeout: float = FREEZE_TIMEOUT) -> float:
        """Freeze `cgroup` and confirm FROZEN; returns seconds taken.

        On timeout the cgroup is thawed back (never left FREEZING) and FreezerTimeout names it.
        """
        v1 = self.mode is CgroupMode.V1
        self._write(cgroup, "freezer.state" if v1 else "cgroup.freeze", "FROZEN" if v1 else "1")
        try:
            return self._wait(cgroup, FreezerState.FROZEN, timeout, nudge="FROZEN" if v1 else None)
        except FreezerTimeout as e:
            with contextlib.suppress(ShimError):
                self._write(cgroup, "freezer.state" if v1 else "cgroup.freeze", "THAWED" if v1 else "0")
            raise FreezerTimeout(
                f"could not freeze cgroup {cgroup} within {timeout:.3g}s ({e.message}); it was thawed "
                "back. A process may be in uninterruptible sleep (D state, e.g. on a hung mount): "
                "check the container's processes and retry"
            ) from e

    def thaw(self, cgroup: str, timeout: float = FREEZE_TIMEOUT, missing_ok: bool = False) -> float:
        """Thaw `cgroup` and confirm THAWED; returns seconds taken (0.0 if missing and missing_ok)."""
        v1 = self.mode is CgroupMode.V1
        try:
            self._write(cgroup, "freezer.state" if v1 else "cgroup.freeze", "THAWED" if v1 else "0")
        except NotFound:
            if missing_ok:
                return 0.0
            raise
        try:
            return self._wait(cgroup, FreezerState.THAWED, timeout, nudge=None)
        except NotFound:
            if missing_ok:  # its last process exited while thawing
                return 0.0
            raise
        except FreezerTimeout as e:
            why = (
                "an ancestor cgroup is frozen: thaw the ancestor"
                if self._ancestor_frozen(cgroup)
                else "check the kernel log"
            )
            raise FreezerTimeout(f"could not thaw cgroup {cgroup} within {timeout:.3g}s: {why}") from e

    def frozen_among(self, cgroups: Sequence[str]) -> list[str]:
        """The cgroups of `cgroups` that exist and are FROZEN or FREEZING (missing ones skipped)."""
        out = []
        for cg in cgroups:
            try:
                if self.state(cg) is not FreezerState.THAWED or self.self_frozen(cg):
                    out.append(cg)
            except NotFound:
                continue
        return out


@functools.cache
def default_freezer() -> Freezer:
    """The host's freezer, detected once from /proc/self/mountinfo."""
    return Freezer()


# ---------------------------------------------------------------------------- the cut


@dataclass
class CutTimings:
    """Seconds (monotonic) of each step of a cut, and when it took effect."""

    parent_freeze: float = 0.0
    containers_freeze: dict[str, float] = field(default_factory=dict)
    parent_thaw: float = 0.0
    thaw: dict[str, float] = field(default_factory=dict)
    started_monotonic: float | None = None  # the parent freeze was asked for
    started_wall: float | None = None  # the same instant, wall clock (time.time())
    cut_monotonic: float | None = None  # the instant every process of the pod was frozen
    cut_wall: float | None = None  # the same instant, wall clock (time.time())
    cut_done_monotonic: float | None = None  # containers frozen by their own cgroups, parent thawed
    thaw_wall: float | None = None  # wall clock before the first thaw write: frozen until then
    thawed_monotonic: float | None = None  # the last container thawed: the window ends

    def wall_clock(self) -> dict[str, float]:
        """The cut's instants on the wall clock, for the manifest's timings: a workload's own
        timestamps place each of its log lines before the freeze, inside it or after it."""
        named = {
            "freeze_asked_at": self.started_wall,
            "frozen_at": self.cut_wall,
            "thaw_asked_at": self.thaw_wall,
        }
        return {k: v for k, v in named.items() if v is not None}


class PodCut:
    """Freeze a pod in one cut; `thaw_all` (always run: context exit, finally) undoes it.

    `parent`: the pod cgroup; `containers`: the selected containers' cgroups, each under
    `parent`. A container whose cgroup was already frozen by itself before the cut (paused by
    someone else) is left as it was found. Not thread-safe: one owner drives a cut.

    `parent=None`: a cut of the containers' own cgroups only, one after the other (what
    CheckpointContainer freezes: one container, whose own freeze is already one cut; the rest of
    its pod is never touched). Everything else (the pre-existing pause left alone, thaw on any
    failure, the window's timings) is the same.
    """

    def __init__(
        self,
        parent: str | None,
        containers: Sequence[str],
        timeout: float = FREEZE_TIMEOUT,
        freezer: Freezer | None = None,
        thaw_timeout: float | None = None,
    ) -> None:
        self.freezer = freezer or default_freezer()
        self.parent = parent
        self.containers = list(containers)
        self.timeout = timeout
        self.thaw_timeout = thaw_timeout if thaw_timeout is not None else max(timeout, FREEZE_TIMEOUT)
        self.timings = CutTimings()
        self.frozen: list[str] = []  # containers this cut froze, in order
        self.preexisting: list[str] = []  # containers already self-frozen: not ours to thaw
        self._parent_frozen = False
        self._started = False
        if len(set(map(resolve_cgroups_path, self.containers))) != len(self.containers):
            raise InvalidArgument(f"pod cut of {self.name}: a container cgroup is listed twice")
        if parent is None:
            return
        parent_rel = resolve_cgroups_path(parent)
        for c in self.containers:
            rel = resolve_cgroups_path(c)
            if not rel.startswith(parent_rel.rstrip("/") + "/"):
                # the parent freeze is only atomic for the pod when it contains every container
                raise InvalidArgument(f"container cgroup {c} is not under the pod cgroup {parent}")

    @property
    def name(self) -> str:
        """What messages call the cut: the pod cgroup, or the one container's cgroup."""
        return self.parent if self.parent is not None else ", ".join(self.containers)

    # -- timings the orchestration reports

    @property
    def cut_seconds(self) -> float:
        """From the start of the parent freeze until the cut is in place (parent thawed)."""
        t = self.timings
        if t.cut_done_monotonic is None or t.started_monotonic is None:
            return 0.0
        return t.cut_done_monotonic - t.started_monotonic

    @property
    def window_seconds(self) -> float:
        """How long the pod's processes stayed frozen: from the cut to the last thaw (or now)."""
        t = self.timings
        if t.cut_monotonic is None:
            return 0.0
        end = t.thawed_monotonic if t.thawed_monotonic is not None else time.monotonic()
        return end - t.cut_monotonic

    # -- the cut

    def freeze(self) -> PodCut:
        """Make the cut within `timeout` in all. On any failure everything frozen is thawed
        before the error propagates."""
        if self._started:
            raise FailedPrecondition(f"pod cut of {self.name} was already made; make a new PodCut")
        self._started = True
        f = self.freezer
        deadline = time.monotonic() + self.timeout
        if self.parent is None:
            return self._freeze_containers(deadline)
        if f.state(self.parent) is not FreezerState.THAWED:
            raise FailedPrecondition(
                f"pod cgroup {self.parent} is already frozen (paused by someone else): CRIU cannot dump "
                "under a frozen cgroup; thaw the pod and retry"
            )
        try:
            for c in self.containers:
                if f.self_frozen(c):
                    self.preexisting.append(c)
            self._parent_frozen = True  # before the write: a half-done freeze is still undone
            self.timings.started_wall = time.time()
            self.timings.started_monotonic = time.monotonic()
            self.timings.parent_freeze = f.freeze(self.parent, self._left(deadline))
            self.timings.cut_monotonic = time.monotonic()
            self.timings.cut_wall = time.time()
            for c in self.containers:
                if c in self.preexisting:
                    continue
                self.frozen.append(c)
                self.timings.containers_freeze[c] = f.freeze(c, self._left(deadline))
            self.timings.parent_thaw = f.thaw(self.parent, self._left(deadline))
            self._parent_frozen = False
            for c in self.containers:
                # each container must now hold itself frozen (normally true at the first read);
                # a deadline already past is the cut's timeout, not a container that thawed
                left = self._left(deadline)
                try:
                    f.wait_state(c, FreezerState.FROZEN, left)
                except FreezerTimeout as e:
                    raise Internal(
                        f"container cgroup {c} did not stay frozen when the pod cgroup was thawed: "
                        f"{e.message}"
                    ) from e
            self.timings.cut_done_monotonic = time.monotonic()
        except BaseException:
            self.thaw_all()  # raises its own error only if thawing fails; the cause is kept
            raise
        return self

    def _freeze_containers(self, deadline: float) -> PodCut:
        """The cut without a parent: each container's own cgroup, confirmed FROZEN; the cut is in
        place when the last one is."""
        f = self.freezer
        try:
            for c in self.containers:
                if f.self_frozen(c):
                    self.preexisting.append(c)
            self.timings.started_wall = time.time()
            self.timings.started_monotonic = time.monotonic()
            for c in self.containers:
                if c in self.preexisting:
                    continue
                self.frozen.append(c)  # before the write: a half-done freeze is still undone
                self.timings.containers_freeze[c] = f.freeze(c, self._left(deadline))
            self.timings.cut_monotonic = self.timings.cut_done_monotonic = time.monotonic()
            self.timings.cut_wall = time.time()
        except BaseException:
            self.thaw_all()
            raise
        return self

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise FreezerTimeout(
                f"freezing pod cgroup {self.name} and its {len(self.containers)} containers took longer "
                f"than {self.timeout:.3g}s; the pod was thawed, retry"
                if self.parent is not None
                else f"freezing cgroup {self.name} took longer than {self.timeout:.3g}s; it was thawed, retry"
            )
        return left

    def thaw_all(self) -> None:
        """Thaw the parent (if still frozen) and every container this cut froze. Idempotent.

        Tries all of them even when some fail, then raises Internal naming the failures: a
        pod must never be left frozen silently.
        """
        f = self.freezer
        failures: list[str] = []
        if self.timings.thaw_wall is None and (self._parent_frozen or self.frozen):
            self.timings.thaw_wall = time.time()
        if self._parent_frozen:
            assert self.parent is not None  # only a cut with a pod cgroup freezes a parent
            try:
                self.timings.parent_thaw = f.thaw(self.parent, self.thaw_timeout, missing_ok=True)
                self._parent_frozen = False
            except ShimError as e:
                failures.append(e.message)
        still: list[str] = []
        for c in self.frozen:
            try:
                self.timings.thaw[c] = f.thaw(c, self.thaw_timeout, missing_ok=True)
            except ShimError as e:
                failures.append(e.message)
                still.append(c)
        self.frozen = still
        if self.timings.cut_monotonic is not None and not still and self.timings.thawed_monotonic is None:
            self.timings.thawed_monotonic = time.monotonic()
        if failures:
            raise Internal(
                f"{'pod cgroup' if self.parent is not None else 'cgroup'} {self.name}: could not thaw "
                f"everything: {'; '.join(failures)}. "
                f"Thaw by hand ({f.hierarchy.root}) before anything else"
            )

    def __enter__(self) -> PodCut:
        return self.freeze()

    def __exit__(self, *exc: object) -> None:
        self.thaw_all()


# ---------------------------------------------------------------------------- helpers


def thaw_paths(
    cgroups: Sequence[str], timeout: float = FREEZE_TIMEOUT, freezer: Freezer | None = None
) -> list[str]:
    """Recovery: thaw every existing, frozen cgroup of `cgroups` (missing ones skipped).

    Returns those it thawed. Tries all, then raises Internal naming any it could not thaw.
    """
    f = freezer or default_freezer()
    thawed: list[str] = []
    failures: list[str] = []
    depth: dict[str, int] = {}
    for cg in cgroups:
        try:
            depth[cg] = resolve_cgroups_path(cg).count("/")
        except ShimError as e:  # one bad path in a journal must not stop the others' thaw
            failures.append(e.message)
    # ancestors first: a child cannot thaw under a frozen parent
    for cg in sorted(depth, key=lambda c: depth[c]):
        try:
            if f.state(cg) is FreezerState.THAWED and not f.self_frozen(cg):
                continue
            f.thaw(cg, timeout, missing_ok=True)
            thawed.append(cg)
        except NotFound:
            continue
        except ShimError as e:
            failures.append(e.message)
    if failures:
        raise Internal(f"could not thaw: {'; '.join(failures)}; thaw by hand ({f.hierarchy.root})")
    return thawed


def cgroup_procs(cgroup: str, freezer: Freezer | None = None) -> list[int]:
    """PIDs of the processes directly in `cgroup` (freezer hierarchy view)."""
    return (freezer or default_freezer()).procs(cgroup)
