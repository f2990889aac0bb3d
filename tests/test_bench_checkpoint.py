"""Unit tests of bench/checkpoint.py's pure helpers: the extra cells, the ratios of a sample, the
writeback podshim reports in its log. No bed, no timings asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import checkpoint as bc


def test_cells() -> None:
    assert bc._cells("2x4096") == [(2, 4096)]
    assert bc._cells(" 2x4096, 1x512 ,") == [(2, 4096), (1, 512)]
    assert bc._cells("") == []
    with pytest.raises(ValueError):
        bc._cells("8GiB")


def test_sample_ratios() -> None:
    s = bc.Sample("podshim-first", freeze=2.0, total=6.0, wall=6.1, dump=2.0, archive=3.5)
    s.raw, s.raw_cpu, s.raw_flush = [1.0, 1.5], 4.0, 1.3
    cores = bc.os.cpu_count() or 1
    assert s.freeze_floor == max(1.5, 4.0 / cores)
    assert s.total_vs_durable_floor == pytest.approx(6.0 / (2.5 + 1.3 + 0.2))
    assert math.isnan(s.freeze_vs_parallel)  # not measured (no --parallel-floor)
    s.parallel = 1.6
    assert s.freeze_vs_parallel == pytest.approx(1.25)


def test_writeback_from_podshims_log(tmp_path: Path) -> None:
    log = tmp_path / "podshim.log"

    def line(event: str, **kv: Any) -> str:
        return json.dumps({"event": event, **kv}) + "\n"

    log.write_text(line("images written back during the dumps", mib=100))
    at = log.stat().st_size
    assert bc.ahead_mib(log, 0) == (100, at)
    assert bc.ahead_mib(log, at) == (0, at)  # left to the kernel this time: no line
    with log.open("a") as f:
        f.write(line("pod frozen") + line("images written back during the dumps", mib=4090))
    assert bc.ahead_mib(log, at) == (4090, log.stat().st_size)


def test_freeze_window_bounds_from_podshims_log(tmp_path: Path) -> None:
    """The window on CLOCK_MONOTONIC: "pod frozen" minus its cut_seconds to "pod thawed", the
    lines past the offset only."""
    from bench.common import freeze_bounds

    log = tmp_path / "podshim.log"
    log.write_text(
        json.dumps({"event": "pod frozen", "timestamp": "2026-11-28T10:00:00.000000Z", "cut_seconds": 0.5})
        + "\n"
    )
    at = log.stat().st_size
    assert freeze_bounds(log, 0) is None  # not thawed yet
    with log.open("a") as f:
        for event, ts, extra in (
            ("pod frozen", "2026-11-28T10:00:10.250000Z", {"cut_seconds": 0.25}),
            ("container dumped", "2026-11-28T10:00:11.000000Z", {}),
            ("pod thawed", "2026-11-28T10:00:12.000000Z", {"freeze_window": 2.0}),
        ):
            f.write(json.dumps({"event": event, "timestamp": ts, **extra}) + "\n")
    bounds = freeze_bounds(log, at)
    assert bounds is not None
    assert bounds[1] - bounds[0] == pytest.approx(2.0)


def test_cpu_times_of_a_window() -> None:
    """Core-seconds per /proc/stat state between the samples around the window (no samples
    around it: {}); a sample's idle() is idle + iowait."""
    from bench.common import CpuTimes, cpu_line

    ct = CpuTimes()
    tick = ct._tick
    ct.samples = [
        (10.0, [0, 0, 0, 0, 0, 0, 0, 0]),
        (10.5, [tick, 0, tick // 2, 0, 0, 0, 0, 0]),
        (11.0, [2 * tick, 0, tick, tick // 2, tick // 2, 0, 0, tick // 10]),
    ]
    w = ct.window(10.1, 10.9)
    assert w["user"] == 2.0 and w["system"] == 1.0 and w["iowait"] == 0.5 and w["span"] == 1.0
    assert cpu_line(w) == "busy 3.00 idle 0.50 iowait 0.50 steal 0.10 of 4.10 core-s"
    assert ct.window(9.0, 10.9) == {} and cpu_line({}) == "n/a"
    s = bc.Sample("raw-first", freeze=1.0, total=2.0, wall=2.0, dump=1.0, archive=1.0)
    assert s.idle(w) == 1.0 and math.isnan(s.idle({}))
