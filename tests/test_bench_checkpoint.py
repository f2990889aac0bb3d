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
