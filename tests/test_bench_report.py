"""The performance page's renderer (bench/report.py) on a fixture result set
(tests/fixtures/bench_results/): its tables, the target verdicts, the loaded-run mark, the line of
a bench without results, the plots, and the same page and PNGs from the same input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench import report

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bench_results"


def render(tmp_path: Path, sub: str = "a") -> tuple[str, Path]:
    out = tmp_path / sub / "docs" / "performance.md"
    out.parent.mkdir(parents=True)
    img = out.parent / "img" / "performance"
    return report.render(FIXTURES, out, img), img


def section(page: str, title: str) -> str:
    start = page.index(f"## {title}")
    end = page.find("\n## ", start + 1)
    return page[start : end if end > 0 else len(page)]


def test_tables_and_verdicts(tmp_path: Path) -> None:
    page, _ = render(tmp_path)
    ck = section(page, "Checkpoint")
    assert "| `freeze_vs_floor` | 1.200 | <= 1.300 | met |" in ck
    assert "| `total_vs_durable_floor` | 1.250 | <= 1.100 | **missed** |" in ck
    assert "commit 0123456789ab" in ck and "`python -m bench.checkpoint --repeat 1`" in ck
    assert "Loaded run" not in ck
    rs = section(page, "Restore")
    assert "| `eager_overhead_ratio` | 1.400 | <= 1.300 | **missed** |" in rs
    assert "| `warm_start_ratio_lazy` | n/a | <= 0.050 | n/a |" in rs
    mg = section(page, "Live migration")
    assert "| `total_vs_wire_floor` | 2.000 | <= 1.300 | **missed** |" in mg
    assert "`python -m bench.migrate --sizes 64 256 --skip-registry`" in mg
    # a run under load says so, and so does each of its verdicts
    px = section(page, "Proxy")
    assert "**Loaded run**" in px
    assert "| `p99_added_ms` | 2.500 | <= 2.000 | **missed** (loaded run) |" in px
    assert "| `throughput_ratio_16` | 0.800 | >= 0.700 | met (loaded run) |" in px


def test_the_peers_section_has_its_table_of_operations(tmp_path: Path) -> None:
    pe = section(page := render(tmp_path)[0], "Peers")
    assert "`python -m bench.peers --sizes 4,1024 --repeat 3`" in pe
    # figures without targets: a value, no verdict
    assert "| `pause_vs_best_peer` | 0.750 |  |  |" in pe
    assert "| `cli_startup_s` | 0.410 |  |  |" in pe
    assert "| size | operation | n | pause s | checkpoint s | restore s | archive MiB |" in pe
    assert "|---|---:|---:|---:|---:|---:|---:|" in pe
    assert "| 4 MiB | podshim CheckpointPod + RestorePod | 3 | 0.050 | 0.420 | 0.310 | 4.600 |" in pe
    assert "| 1024 MiB | podshim RestorePod lazy | 3 | n/a | n/a | 0.300 | n/a |" in pe
    assert "| 1024 MiB | containerd CheckpointContainer + CreateContainer | 3 | 1.200 |" in pe
    assert "](img/performance/peers-pause.png)" in pe
    assert "client no-op" not in page  # one table per bench on the page: the operations


def test_benches_without_results_say_how_to_get_them(tmp_path: Path) -> None:
    page, _ = render(tmp_path)
    assert "No results yet: `make bench-load` writes `bench/results/load.json`" in section(page, "Load")
    assert "`make bench-front-kill`" in section(page, "Front kill")
    assert "<!-- bench:" not in page  # every marker replaced


def test_plots_are_written_and_linked(tmp_path: Path) -> None:
    page, img = render(tmp_path)
    names = [
        "checkpoint-freeze.png",
        "migrate-downtime.png",
        "peers-pause.png",
        "proxy-latency.png",
        "restore-lazy-eager.png",
    ]
    assert sorted(p.name for p in img.iterdir()) == names
    for n in names:
        assert (img / n).read_bytes().startswith(b"\x89PNG")
        assert f"](img/performance/{n})" in page


def test_same_input_same_output(tmp_path: Path) -> None:
    page_a, img_a = render(tmp_path, "a")
    page_b, img_b = render(tmp_path, "b")
    assert page_a == page_b
    for p in img_a.iterdir():
        assert p.read_bytes() == (img_b / p.name).read_bytes(), p.name


def test_a_results_dir_without_plots_data(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(FIXTURES / "checkpoint.json", results / "checkpoint.json")
    text = (results / "checkpoint.json").read_text().replace('"freeze floor"', '"other"')
    (results / "checkpoint.json").write_text(text)
    out = tmp_path / "performance.md"
    page = report.render(results, out, tmp_path / "img")
    assert "| `freeze_vs_floor` | 1.200 |" in page
    assert not (tmp_path / "img").exists()  # no data for the plot: no plot, no broken link
    assert "checkpoint-freeze.png" not in page


def test_the_page_is_rendered_from_the_committed_results(tmp_path: Path) -> None:
    """docs/performance.md is what `make bench-report` makes of bench/results/ (run it after a bench)."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "docs" / "performance.md"
    out.parent.mkdir()
    page = report.render(root / "bench" / "results", out, out.parent / "img" / "performance")
    assert page == (root / "docs" / "performance.md").read_text(), "stale: run make bench-report"


def test_a_broken_results_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "proxy.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"proxy.json: not a results file"):
        report.render(tmp_path, tmp_path / "performance.md", tmp_path / "img")


def test_loaded_by_the_start_or_the_end() -> None:
    def doc(start: float, end: float) -> dict[str, object]:
        return {"machine": {"cpus": 2}, "load": {"start": [start, 0, 0], "end": [end, 0, 0]}}

    assert not report.is_loaded(doc(0.9, 2.9))  # the bench's own work alone at the end
    assert report.is_loaded(doc(1.1, 0.2))
    assert report.is_loaded(doc(0.2, 3.5))
