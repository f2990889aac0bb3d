"""Unit tests of the restore grid's pure helpers (bench/restore_grid.py): the slope, the count
before the freeze, the RESULT values and the table. No bed, no timings asserted."""

from __future__ import annotations

import math

import pytest

from bench import restore_grid as rg


def sample(first: float, restore: float = 1.0, count: int = 7) -> rg.Sample:
    return rg.Sample(
        restore_s=restore, call_s=0.5, first_s=first, resident_s=first + 1, count=count, criu_restore_s=0.2
    )


def test_lsq_slope() -> None:
    assert rg.lsq_slope([(0.25, 0.2), (1, 0.2), (4, 0.2)]) == pytest.approx(0.0)
    assert rg.lsq_slope([(0.25, 0.125), (1, 0.5), (4, 2.0)]) == pytest.approx(0.5)
    # least squares, not the end points: (0,0) (1,1) (2,0.5) -> 0.25
    assert rg.lsq_slope([(0, 0), (1, 1), (2, 0.5)]) == pytest.approx(0.25)
    # NaN points are left out; fewer than two distinct sizes give no slope
    assert rg.lsq_slope([(1, 1.0), (2, math.nan), (3, 3.0)]) == pytest.approx(1.0)
    assert math.isnan(rg.lsq_slope([(1, 1.0), (1, 2.0)]))
    assert math.isnan(rg.lsq_slope([]))


def test_count_before_freeze() -> None:
    lines = [
        b"2026-11-23T00:00:00Z stdout F count=10 ts=100.000",
        b"2026-11-23T00:00:00Z stdout F count=11 ts=100.010",
        b"2026-11-23T00:00:00Z stdout F count=12 ts=100.020",  # frozen after this one
        b"2026-11-23T00:00:00Z stdout F count=13 ts=100.900",
        b"2026-11-23T00:00:00Z stdout F count=14 ts=100.910",
        b"",
    ]
    assert rg.count_before_freeze(lines) == 12
    assert rg.count_before_freeze(lines[:1]) == 10
    assert rg.count_before_freeze([b"ready mem_mib=4", b""]) == -1


def grid(lazy: str = "") -> rg.GridResult:
    g = rg.GridResult(cold_start=[10.0, 11.0, 12.0], loads=["1.0 1.0 1.0", "2.0 2.0 2.0"], seconds=60)
    for mem, lazy_first in ((256, 0.2), (1024, 0.22), (4096, 0.28)):
        s = rg.SizeResult(mem, sandbox=[0.2, 0.3, 0.2], check_ref=[0.1], last_count=6, checkpoint_s=1.0)
        s.cell("eager", "warm").samples += [sample(1.0, restore=1.2), sample(1.1, restore=1.4)]
        s.cell("runc", "warm").samples += [sample(0.5, restore=0.8)]
        s.cell("eager", "cold").samples += [sample(3.0)]
        s.cell("runc", "cold").samples += [sample(1.0)]
        if not lazy:
            s.cell("lazy", "warm").samples += [sample(lazy_first), sample(lazy_first + 0.1)]
            s.cell("lazy", "cold").samples += [sample(0.9)]
            s.cell("lazy", "cold").errors.append("DEADLINE_EXCEEDED: slow")
        g.sizes.append(s)
    g.lazy = lazy
    return g


def test_summarize() -> None:
    v = rg.summarize(grid())
    assert list(v) == [
        "lazy_first_output_4g_s",
        "lazy_slope_s_per_gib",
        "eager_overhead_ratio",
        "warm_start_ratio_lazy",
    ]
    assert v["lazy_first_output_4g_s"] == pytest.approx(0.33)  # median of 0.28 and 0.38
    assert v["lazy_slope_s_per_gib"] == pytest.approx(rg.lsq_slope([(0.25, 0.25), (1, 0.27), (4, 0.33)]))
    assert v["eager_overhead_ratio"] == pytest.approx(1.3 / (0.8 + 0.2))
    assert v["warm_start_ratio_lazy"] == pytest.approx(0.27 / 11.0)


def test_summarize_without_lazy_gives_no_lazy_figure() -> None:
    v = rg.summarize(grid(lazy="INVALID_ARGUMENT: unknown restore option(s) lazy-pages"))
    assert math.isnan(v["lazy_first_output_4g_s"])
    assert math.isnan(v["lazy_slope_s_per_gib"])
    assert math.isnan(v["warm_start_ratio_lazy"])
    assert v["eager_overhead_ratio"] == pytest.approx(1.3)


def test_summarize_skipped_size() -> None:
    g = grid()
    g.sizes[2] = rg.SizeResult(4096, skipped="2000 MiB of memory available, 13312 needed")
    v = rg.summarize(g)
    assert math.isnan(v["lazy_first_output_4g_s"])
    assert v["lazy_slope_s_per_gib"] == pytest.approx(rg.lsq_slope([(0.25, 0.25), (1, 0.27)]))


def test_report() -> None:
    text = rg.report(grid())
    lines = text.splitlines()
    row = next(
        line for line in lines if line.startswith("4096 MiB") and " warm " in line and " lazy " in line
    )
    assert row.split()[4:] == ["2", "0.500", "n/a", "1.000", "0.330", "1.330", "0.200", "7", "(6)"]
    assert any(" lazy " in line and "1 (1 failed)" in line for line in lines)
    assert "failed: 256 MiB lazy cold: DEADLINE_EXCEEDED: slow" in text
    assert "median 11.000 s of 3" in text
    no_lazy = rg.report(grid(lazy="INVALID_ARGUMENT: unknown"))
    assert "lazy cells: n/a: INVALID_ARGUMENT: unknown" in no_lazy
    assert sum(1 for line in no_lazy.splitlines() if " lazy " in line and "n/a" in line) == 6


def test_targets_line() -> None:
    line = rg.targets_line({**rg.summarize(grid()), "eager_overhead_ratio": 2.5})
    assert line.startswith("targets: lazy_first_output_4g_s <= 0.3 (0.330), ")
    assert "eager_overhead_ratio <= 1.3 (2.500)" in line
    assert "warm_start_ratio_lazy <= 0.05 (" in line
    assert rg.targets_line({}).endswith("warm_start_ratio_lazy <= 0.05")
