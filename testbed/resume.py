"""The exact resume of a counter pod: from an archive's cut and the source's own log, the one count
each restored container must print first, and the check that it did.

The counter prints `count=<n> ts=<wall clock>` and the runtime's CRI logger stamps each line with
the instant it read it (never before it was written). The manifest records the cut on the wall
clock: `frozen_at` (every process of the pod frozen) and `thaw_asked_at` (before the first thaw).
So a line the logger read before `thaw_asked_at` was written before the freeze, and a line whose
own `ts` is after `frozen_at` was written after the thaw. The last count written before the freeze
plus one is what the source printed first after the thaw and what every restore must print first.
The one case these two facts cannot settle (the process frozen between reading its clock and
writing the line, or the logger slower than the whole freeze) is reported as `AmbiguousCut`, and
the caller takes another checkpoint: nothing here depends on how fast the machine is.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import tarfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from shim.archive import container_tar, manifest
from testbed import pods

# containerd's CRI logger: "<RFC 3339 nano> <stream> <F|P> <text>", one line each
CRI_COUNTER_LINE = re.compile(rb"^(\S+) (?:stdout|stderr) [FP] count=(\d+) ts=(\d+\.\d+)$", re.M)
TS_RESOLUTION = 0.001  # the counter prints its wall clock truncated to milliseconds
CRI_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


@dataclass(frozen=True)
class Line:
    count: int
    ts: float  # the counter's own clock when it made the line (truncated to TS_RESOLUTION)
    logged_at: float  # when the runtime's logger read it: never before the line was written


def cri_time(stamp: str) -> float:
    """Unix seconds of a CRI log timestamp (RFC 3339 with nanoseconds)."""
    m = CRI_TIME.match(stamp)
    if m is None:
        raise ValueError(f"not a CRI log timestamp: {stamp!r}")
    whole, frac, zone = m.groups()
    base = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def lines(log_path: Path) -> list[Line]:
    """Every counter line of a CRI log file, in order."""
    try:
        raw = log_path.read_bytes()
    except FileNotFoundError:
        return []
    return [Line(int(c), float(t), cri_time(s.decode())) for s, c, t in CRI_COUNTER_LINE.findall(raw)]


@dataclass(frozen=True)
class Cut:
    """A checkpoint's freeze on the wall clock, as its manifest records it."""

    frozen_at: float
    thaw_asked_at: float
    window: float  # the manifest's freeze_window: from the cut to the last thaw

    @classmethod
    def of_timings(cls, t: Mapping[str, float], where: Path | str) -> Cut:
        missing = [k for k in ("frozen_at", "thaw_asked_at", "freeze_window") if k not in t]
        assert not missing, f"the manifest of {where} has no {', '.join(missing)} in its timings: {t}"
        cut = cls(t["frozen_at"], t["thaw_asked_at"], t["freeze_window"])
        assert cut.frozen_at <= cut.thaw_asked_at, f"the cut thawed before it froze: {t}"
        return cut

    @classmethod
    def of_archive(cls, path: Path | str) -> Cut:
        """The cut of a pod checkpoint directory (manifest.json) or of podshim's container
        checkpoint tar (its podshim-manifest.json member)."""
        if Path(path).is_dir():
            return cls.of_timings(manifest.read_manifest(Path(path)).timings, path)
        with tarfile.open(path) as tar:
            member = tar.extractfile(container_tar.MANIFEST_FILE)
            assert member is not None, f"{path} has no {container_tar.MANIFEST_FILE}: not podshim's"
            return cls.of_timings(json.loads(member.read())["timings"], path)


class AmbiguousCut(Exception):
    """The source's log cannot tell which of two counts the dumped process had printed."""


def possible_firsts(log_path: Path, cut: Cut, name: str) -> tuple[int, ...]:
    """The count the checkpointed process prints first after `cut`, from its source's log (which
    must already hold a line made after the thaw): one count, or the two the log cannot choose
    between. Asserts the container never ran while the manifest says it was frozen, and that the
    freeze it saw was at least the recorded one."""
    log = lines(log_path)
    before = [x for x in log if x.logged_at < cut.thaw_asked_at]
    after = [x for x in log if x.ts > cut.frozen_at]
    assert before, f"no line of {name} was logged before the freeze: {log_path}"
    assert after, f"no line of {name} after the thaw yet: {log_path}"
    ran = [x for x in before if x.ts > cut.frozen_at] + [
        x for x in after if x.ts + TS_RESOLUTION < cut.thaw_asked_at
    ]
    assert not ran, (
        f"{name} made lines while the manifest says it was frozen "
        f"({cut.frozen_at:.3f}..{cut.thaw_asked_at:.3f}): {ran[:3]}"
    )
    last, first = before[-1], after[0]
    assert first.count in (last.count + 1, last.count + 2), (
        f"{name}'s log skips counts around the cut: {last} then {first}"
    )
    gap = first.ts - last.ts
    assert cut.thaw_asked_at - cut.frozen_at <= gap + TS_RESOLUTION, (
        f"{name} saw a pause of {gap:.3f}s, shorter than the recorded freeze "
        f"({cut.thaw_asked_at - cut.frozen_at:.3f}s)"
    )
    return tuple(range(last.count + 1, first.count + 1))


def first_after_cut(log_path: Path, cut: Cut, name: str) -> int:
    """`possible_firsts` when the log tells one count; AmbiguousCut otherwise."""
    firsts = possible_firsts(log_path, cut, name)
    if len(firsts) > 1:
        raise AmbiguousCut(f"{name}: count {firsts[0]} may have been written before or after the cut")
    return firsts[0]


def _counts_past(log_path: Path, follow: int) -> list[int] | None:
    """The log's counts once there are more than `follow`."""
    c = pods.counts(log_path)
    return c if len(c) > follow else None


def _after(log_path: Path, instant: float) -> bool:
    return any(x.ts > instant for x in lines(log_path))


def assert_exact_resume(
    logs: Mapping[str, Path], first: Mapping[str, int | tuple[int, ...]], follow: int = 3
) -> dict[str, int]:
    """Every restored container of `logs` (name -> its new log) printed exactly `first[name]`
    first (or one of them, for a cut the source's log cannot place: possible_firsts), then
    `follow` more counts with none repeated or skipped, and never started afresh. Returns the
    first counts."""
    out = {}
    for name, log_path in logs.items():
        expected = first[name]
        allowed = expected if isinstance(expected, tuple) else (expected,)
        got = pods.wait_for(
            functools.partial(_counts_past, log_path, follow),
            what=f"{follow + 1} counts of the restored {name} in {log_path}",
        )
        want = list(range(got[0], got[0] + follow + 1))
        assert got[0] in allowed and got[: follow + 1] == want, (
            f"{name} resumed at {got[: follow + 1]}, not from {' or '.join(map(str, allowed))}: "
            f"the checkpointed process printed {allowed[0] - 1} last"
        )
        text = log_path.read_text(errors="replace")
        assert "ready mem_mib" not in text, f"the restored {name} ran its start-up again: {text[:300]}"
        out[name] = got[0]
    return out


def firsts_after_cut(
    archive: Path | str, source_logs: Mapping[str, Path], timeout: float = 20.0
) -> dict[str, int]:
    """`first_after_cut` of every container of a checkpointed pod (name -> its source's log),
    once each source has logged a line after the thaw."""
    cut = Cut.of_archive(archive)
    out = {}
    for name, log_path in source_logs.items():
        pods.wait_for(
            functools.partial(_after, log_path, cut.frozen_at),
            timeout=timeout,
            what=f"{name}'s first line after the thaw",
        )
        out[name] = first_after_cut(log_path, cut, name)
    return out


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


CUT_ATTEMPTS = 5  # checkpoints taken until one's cut is unambiguous (nearly every one is)


def checkpoint_exactly(
    take: Callable[[], Path], source_logs: Mapping[str, Path], discard: Callable[[Path], None] | None = None
) -> tuple[Path, dict[str, int]]:
    """`take()` a checkpoint of a running counter pod (its archive's path) until its cut is
    unambiguous; returns the archive and the count each container must print first when restored.
    An ambiguous archive is removed (`discard`, default: the directory)."""
    for attempt in range(CUT_ATTEMPTS):
        path = take()
        try:
            return path, firsts_after_cut(path, source_logs)
        except AmbiguousCut as e:
            print(f"\ncheckpoint {attempt + 1} ({path}): {e}; taking another")
            (discard or _remove)(path)
    raise AssertionError(f"{CUT_ATTEMPTS} checkpoints in a row had an ambiguous cut")
