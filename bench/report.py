"""Renders docs/performance.md from bench/results/*.json and bench/report_template.md, with its
plots under docs/img/performance/ (`make bench-report`). The same results give the same page and
the same PNGs."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import LOADED_END_PER_CPU, LOADED_PER_CPU, SCHEMA

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = Path(__file__).resolve().parent / "report_template.md"
MARKER = re.compile(r"^<!-- bench: (\w+) -->$", re.MULTILINE)


# ---------------------------------------------------------------------------- reading


def load_results(results_dir: Path) -> dict[str, dict[str, Any]]:
    """Each bench's latest results, by bench name."""
    out = {}
    for p in sorted(results_dir.glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"bench.report: {p}: not a results file: {e}") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise SystemExit(f"bench.report: {p}: not a results file of schema {SCHEMA}")
        out[str(doc.get("bench") or p.stem)] = doc
    return out


def is_loaded(doc: dict[str, Any]) -> bool:
    """Whether other work may have shared the machine: the 1-minute load above LOADED_PER_CPU per
    core at the start, or above LOADED_END_PER_CPU at the end (a higher bar: it holds the bench's
    own work too)."""
    cpus = int(doc.get("machine", {}).get("cpus") or 1)
    load = doc.get("load", {})
    start, end = (load.get("start") or [0.0])[0], (load.get("end") or [0.0])[0]
    return float(start) > LOADED_PER_CPU * cpus or float(end) > LOADED_END_PER_CPU * cpus


def verdict(value: float | None, op: str | None, target: float | None) -> str:
    if op is None or target is None:
        return ""
    if value is None or math.isnan(value):
        return "n/a"
    ok = value <= target if op == "<=" else value >= target
    return "met" if ok else "**missed**"


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def mib_of(cell: Any) -> float | None:
    """The memory a table's size cell names: "256 MiB" -> 256, "4 x 1024 MiB" -> 4096."""
    m = re.match(r"\s*(?:(\d+)\s*x\s*)?(\d+(?:\.\d+)?)\s*(MiB|GiB)", str(cell))
    if not m:
        return None
    mib = float(m.group(2)) * (1024 if m.group(3) == "GiB" else 1)
    return mib * int(m.group(1) or 1)


def find_table(doc: dict[str, Any], header: str) -> list[dict[str, Any]]:
    """The rows of the last table the run printed with a column `header`."""
    for t in reversed(doc.get("tables", [])):
        if header in t.get("headers", []):
            return list(t.get("rows", []))
    return []


# ---------------------------------------------------------------------------- plots


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) else math.nan


def _figure() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "podshim", "font.size": 9})
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    return plt, fig, ax


def _save(plt: Any, fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def _lines(
    ax: Any,
    points: dict[str, list[tuple[float, float]]],
    floors: set[str],
    group: Callable[[str], str] | None = None,
) -> bool:
    """One line per label, floors dashed; labels of one `group` share a colour."""
    colours: dict[str, str] = {}
    xs: set[float] = set()
    for label in sorted(points, key=lambda k: (k in floors, k)):
        pts = sorted(p for p in points[label] if not math.isnan(p[0]) and not math.isnan(p[1]))
        if not pts:
            continue
        key = group(label) if group else label
        colour = colours.setdefault(key, f"C{len(colours) % 10}")
        style = "--" if label in floors else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=colour, label=label)
        xs.update(p[0] for p in pts)
    return bool(xs)


def _plot(
    path: Path,
    points: dict[str, list[tuple[float, float]]],
    floors: set[str],
    labels: tuple[str, str, str],
    group: Callable[[str], str] | None = None,
    memory_axis: bool = True,
) -> bool:
    """`points` drawn into the PNG `path` (floors dashed, `labels`: x, y and title); False, and no
    file, when nothing was measured."""
    plt, fig, ax = _figure()
    if not _lines(ax, points, floors, group):
        plt.close(fig)
        return False
    if memory_axis:
        _mib_axis(ax, points)
    _save(plt, fig, ax, path, *labels)
    return True


def _mib_axis(ax: Any, points: dict[str, list[tuple[float, float]]]) -> None:
    """A log2 memory axis ticked at the sizes measured, in plain MiB."""
    xs = sorted({p[0] for pts in points.values() for p in pts if not math.isnan(p[0])})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()


def plot_checkpoint(doc: dict[str, Any], path: Path) -> bool:
    rows = find_table(doc, "freeze floor")
    points: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        mib, n = mib_of(r.get("pod")), re.match(r"\s*(\d+)\s*x", str(r.get("pod")))
        if mib is None:
            continue
        k = f"{n.group(1) if n else 1} container(s)"
        points.setdefault(f"freeze, {k}", []).append((mib, _num(r.get("freeze"))))
        points.setdefault(f"floor, {k}", []).append((mib, _num(r.get("freeze floor"))))
    floors = {k for k in points if k.startswith("floor")}
    labels = ("pod memory, MiB", "seconds", "Freeze window against pod memory")
    return _plot(path, points, floors, labels, lambda k: k.split(", ", 1)[-1])


def plot_restore(doc: dict[str, Any], path: Path) -> bool:
    rows = find_table(doc, "first output")
    caches = {str(r.get("cache")) for r in rows}
    cache = "warm" if "warm" in caches else None
    points: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        mib, mode = mib_of(r.get("size")), str(r.get("mode"))
        if mib is None or (cache and r.get("cache") != cache):
            continue
        points.setdefault(f"{mode}", []).append((mib, _num(r.get("first output"))))
    floors = {k for k in points if k.startswith("runc")}
    title = "Restore to first output: lazy versus eager" + (f" ({cache} cache)" if cache else "")
    return _plot(path, points, floors, ("pod memory, MiB", "seconds", title))


def plot_migrate(doc: dict[str, Any], path: Path) -> bool:
    rows = find_table(doc, "downtime s")
    cols = ["downtime s", "total s", "wire floor s", "TLS floor s", "memory floor s"]
    points: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        mib = mib_of(r.get("size"))
        if mib is not None:
            for c in cols:
                points.setdefault(c.removesuffix(" s"), []).append((mib, _num(r.get(c))))
    labels = ("pod memory, MiB", "seconds", "Live migration: downtime and total")
    return _plot(path, points, {"wire floor", "TLS floor", "memory floor"}, labels)


def plot_proxy(doc: dict[str, Any], path: Path) -> bool:
    rows = [r for r in doc.get("series", {}).get("latency_ms", []) if r.get("method") == "ListPodSandbox"]
    names = {"floor": "floor (bare grpc passthrough)", "gofloor": "gofloor (bare front)"}
    points: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        t = str(r.get("target"))
        points.setdefault(names.get(t, t), []).append((_num(r.get("q")), _num(r.get("ms"))))
    labels = ("percentile", "ms per call", "ListPodSandbox latency distribution")
    return _plot(path, points, set(names.values()), labels, memory_axis=False)


PEERS_KEY = "pause s"  # the column that names bench/peers.py's table of operations


def plot_peers(doc: dict[str, Any], path: Path) -> bool:
    points: dict[str, list[tuple[float, float]]] = {}
    for r in find_table(doc, PEERS_KEY):
        mib = mib_of(r.get("size"))
        if mib is not None:
            points.setdefault(str(r.get("operation")), []).append((mib, _num(r.get(PEERS_KEY))))
    labels = ("workload memory, MiB", "seconds", "The workload's pause at a checkpoint, per operation")
    return _plot(path, points, set(), labels)


PLOTS: dict[str, tuple[str, Callable[[dict[str, Any], Path], bool]]] = {
    "checkpoint": ("checkpoint-freeze.png", plot_checkpoint),
    "restore": ("restore-lazy-eager.png", plot_restore),
    "migrate": ("migrate-downtime.png", plot_migrate),
    "proxy": ("proxy-latency.png", plot_proxy),
    "peers": ("peers-pause.png", plot_peers),
}


# ---------------------------------------------------------------------------- tables


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """Rows of one results table (header -> value) as a Markdown table, the first column left-aligned."""
    if not rows:
        return []
    headers = list(rows[0])
    out = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    out += ["| " + " | ".join(_fmt(r.get(h)) for h in headers) + " |" for r in rows]
    return out


# a bench's table shown on the page beside its figures: the column that names it
TABLES: dict[str, str] = {"peers": PEERS_KEY}


# ---------------------------------------------------------------------------- the page


def section(bench: str, doc: dict[str, Any] | None, img_dir: Path, img_rel: str) -> str:
    """The generated part of one bench's section."""
    if doc is None:
        how = f"make bench-{bench.replace('_', '-')}"
        return f"No results yet: `{how}` writes `bench/results/{bench}.json`, then `make bench-report`."
    m = doc.get("machine", {})
    load = doc.get("load", {})
    loaded = is_loaded(doc)
    start, end = load.get("start") or [0.0], load.get("end") or [0.0]
    args = shlex.join(doc.get("argv") or [])
    commit = str(doc.get("commit") or "unknown")[:12] + (
        " (with uncommitted changes)" if doc.get("dirty") else ""
    )
    out = [
        f"Run {doc.get('date')}, commit {commit}, `python -m bench.{bench}{' ' + args if args else ''}`; "
        f"{m.get('cpus')} cores, {m.get('mem_total_mib')} MiB, kernel {m.get('kernel')}, cgroup "
        f"{m.get('cgroup')}; load {start[0]:.2f} at the start, {end[0]:.2f} at the end.",
    ]
    if loaded:
        out += [
            "",
            "**Loaded run**: other work may have shared the machine (a load above "
            f"{LOADED_PER_CPU:g} per core at the start or {LOADED_END_PER_CPU:g} at the end), so the "
            "verdicts below are indicative, not claims.",
        ]
    out += ["", "| figure | value | target | verdict |", "|---|---:|---|---|"]
    targets = doc.get("targets", {})
    for k, v in doc.get("result", {}).items():
        t = targets.get(k)
        v_ = verdict(v, t["op"], t["value"]) if t else ""
        if loaded and v_ in ("met", "**missed**"):
            v_ += " (loaded run)"
        out.append(f"| `{k}` | {_fmt(v)} | {t['op'] + ' ' + _fmt(t['value']) if t else ''} | {v_} |")
    if bench in TABLES:
        rows = markdown_table(find_table(doc, TABLES[bench]))
        if rows:
            out += ["", *rows]
    if bench in PLOTS:
        name, fn = PLOTS[bench]
        if fn(doc, img_dir / name):
            out += ["", f"![{bench}]({img_rel}/{name})"]
        else:  # no data for it: no plot left from an earlier run
            (img_dir / name).unlink(missing_ok=True)
    return "\n".join(out)


def render(results_dir: Path, out: Path, img_dir: Path, template: Path = TEMPLATE) -> str:
    """Write the page `out` (and its plots in `img_dir`); returns the page."""
    results = load_results(results_dir)
    text = template.read_text()
    img_rel = Path(os.path.relpath(img_dir.resolve(), out.resolve().parent)).as_posix()

    def one(m: re.Match[str]) -> str:
        return section(m.group(1), results.get(m.group(1)), img_dir, img_rel)

    page = MARKER.sub(one, text)
    out.write_text(page)
    return page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "performance.md")
    p.add_argument("--img", type=Path, default=REPO / "docs" / "img" / "performance")
    p.add_argument("--template", type=Path, default=TEMPLATE)
    args = p.parse_args(argv)
    render(args.results, args.out, args.img, args.template)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
