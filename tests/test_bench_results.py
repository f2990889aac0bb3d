"""Unit tests of the benchmarks' results writer (bench/common.py): the file's schema, NaN as null,
tables kept as rows, targets beside the RESULT values, a run overwriting its file. No bed."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench import common


def a_run() -> common.Run:
    run = common.Run()
    run.load_start = [0.5, 0.4, 0.3]
    run.argv = ["--repeat", "1"]
    return run


def test_results_doc_has_the_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    run = a_run()
    monkeypatch.setattr(common, "RUN", run)
    common.table(
        ["pod", "freeze", "freeze floor"], [["1 x 64 MiB", 0.12, math.nan], ["2 x 64 MiB", 0.2, 0.1]]
    )
    run.result.update(freeze_vs_floor=1.2, total_vs_durable_floor=math.nan, other=3.0)
    now = datetime(2026, 1, 5, 10, 0, 0, tzinfo=UTC)
    doc = common.results_doc(
        "checkpoint",
        run,
        now=now,
        machine={"cpus": 2, "kernel": "6.1", "mem_total_mib": 1024, "cgroup": "v1"},
        code={"commit": "abc", "dirty": True},
        load_end=[1.5, 1.0, 0.5],
    )
    assert doc["bench"] == "checkpoint" and doc["schema"] == common.SCHEMA
    assert doc["date"] == "2026-01-05T10:00:00Z"
    assert doc["commit"] == "abc" and doc["dirty"] is True
    assert doc["load"] == {"start": [0.5, 0.4, 0.3], "end": [1.5, 1.0, 0.5]}
    assert doc["argv"] == ["--repeat", "1"]
    assert doc["tables"] == [
        {
            "headers": ["pod", "freeze", "freeze floor"],
            "rows": [
                {"pod": "1 x 64 MiB", "freeze": 0.12, "freeze floor": None},
                {"pod": "2 x 64 MiB", "freeze": 0.2, "freeze floor": 0.1},
            ],
        }
    ]
    assert doc["result"] == {"freeze_vs_floor": 1.2, "total_vs_durable_floor": None, "other": 3.0}
    assert doc["targets"]["freeze_vs_floor"] == {"op": "<=", "value": 1.3}
    assert doc["figures"][0] == {"figure": "freeze_vs_floor", "value": 1.2, "op": "<=", "target": 1.3}
    assert doc["figures"][2] == {"figure": "other", "value": 3.0}  # no target: none invented
    json.dumps(doc, allow_nan=False)  # strict JSON: no NaN literals


def test_write_results_overwrites_the_bench_file(tmp_path: Path) -> None:
    run = a_run()
    run.result["p99_during_checkpoint_ms"] = 30.0
    path = common.write_results("load", run, tmp_path)
    assert path == tmp_path / "load.json"
    doc = json.loads(path.read_text())
    assert doc["result"] == {"p99_during_checkpoint_ms": 30.0}
    assert doc["machine"]["cpus"] >= 1 and doc["machine"]["cgroup"] in ("v1", "v2")
    assert len(doc["load"]["end"]) == 3
    run.result["p99_during_checkpoint_ms"] = 60.0
    common.write_results("load", run, tmp_path)
    assert json.loads(path.read_text())["result"] == {"p99_during_checkpoint_ms": 60.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["load.json"]  # no temporary left


def test_record_keeps_series_json_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    run = a_run()
    monkeypatch.setattr(common, "RUN", run)
    common.record("latency_ms", [{"q": 99, "ms": math.inf, "target": "floor"}])
    assert run.series == {"latency_ms": [{"q": 99, "ms": None, "target": "floor"}]}


def test_result_line_writes_nothing_outside_a_bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(common, "RUN", a_run())
    assert common.running_bench() is None  # pytest is __main__
    assert common.result_line(a=1.0, b=math.nan) == "RESULT a=1.000 b=n/a"
    assert list(tmp_path.iterdir()) == []


def test_targets_match_the_benches_own() -> None:
    """The results' targets are the ones the benches print beside their figures."""
    from bench import checkpoint, load, restore, restore_grid

    t = common.TARGETS
    assert t["checkpoint"]["freeze_vs_floor"] == ("<=", checkpoint.FREEZE_TARGET)
    assert t["checkpoint"]["total_vs_durable_floor"] == ("<=", checkpoint.TOTAL_TARGET)
    assert t["load"]["p99_during_checkpoint_ms"] == ("<=", load.TARGET_P99_MS)
    assert t["restore"]["warm_start_ratio"] == ("<=", restore.WARM_TARGET)
    for k, v in restore_grid.TARGETS.items():
        assert t["restore"][k] == ("<=", v)
