"""bench/freeze_ab: one cell of bench/checkpoint.py, podshim configurations side by side.

For one pod (``--cell NxMiB``, default 4x1024), each repeat dumps it with plain runc one container
after the other (the floor, as bench/checkpoint.py) and checkpoints it once through each variant:
a podshim of the bed with ``[checkpoint]`` overrides (``--variant label:key=value,...``; the
label alone: the bed's own podshim). The arms' order rotates between repeats, each after a sync,
so every variant meets the others' conditions as often (after one raw arm that is not
counted, bench.checkpoint.prime). Per repeat and as medians: the freeze
window, the CPU seconds of its dumps (manifest timings.dump_cpu) against the raw dumps', and
freeze / floor and total / durable floor as bench/checkpoint.py computes them.

    python -m bench.freeze_ab --cell 4x1024 --repeat 6 --variant auto: --variant never:writeback_ahead=never

A key ``section.name`` sets another section than ``[checkpoint]``, e.g. ``runtime.criu=/x/criu``
(a CRIU built elsewhere; the raw floor keeps the set-up's). ``--code label:DIR`` adds an arm whose
podshim imports its code (``shim``, ``api``) from DIR, e.g. a ``git archive <commit> shim api``
unpacked there: the same bed and config, another commit's code.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from api.runtime.v1 import api_pb2_grpc
from bench.checkpoint import Sample, _cells, ahead_mib, prime, raw_dumps
from bench.common import (
    bench_bed,
    checkpoint_pod,
    counter_config,
    finish,
    machine_summary,
    median,
    remove_pod,
    remove_tree,
    runtime_stub,
    say,
    start_counter_pod,
    sync_disk,
    table,
)


def _variant(text: str) -> tuple[str, dict[str, Any]]:
    """`never:writeback_ahead=never,x=2` -> ("never", {"writeback_ahead": "never", "x": 2})."""
    label, _, rest = text.partition(":")
    values: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        values[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return label, values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.freeze_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", default="4x1024", help="containers x MiB each (default 4x1024)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="label:key=value,... ([checkpoint]; section.key=value for another section)",
    )
    p.add_argument("--code", action="append", default=[], help="label:DIR, a podshim of the code in DIR")
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--timeout", type=float, default=900.0)
    return p.parse_args(argv)


def podshim_arm(
    rt: api_pb2_grpc.RuntimeServiceStub, log: Path, pod_id: str, out: Path, timeout: float
) -> dict[str, Any]:
    sync_disk()
    log_at = log.stat().st_size
    wall, m = checkpoint_pod(rt, pod_id, out, timeout)
    remove_tree(out)
    return {"wall": wall, "t": m["timings"], "ahead": ahead_mib(log, log_at)[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    (n, mem) = _cells(args.cell)[0]
    variants = [_variant(v) for v in args.variant] or ([] if args.code else [("default", {})])
    codes = dict(c.partition(":")[::2] for c in args.code)
    variants += [(label, {}) for label in codes]
    print(f"bench/freeze_ab: {n} x {mem} MiB, variants {[v[0] for v in variants]}", flush=True)
    print(machine_summary(), flush=True)
    samples: dict[str, list[Sample]] = {label: [] for label, _ in variants}
    cpus: dict[str, list[float]] = {label: [] for label, _ in variants}
    with bench_bed() as bed, contextlib.ExitStack() as stack:
        arms: dict[str, tuple[api_pb2_grpc.RuntimeServiceStub, Path]] = {}
        for label, values in variants:
            if not values and label not in codes:
                arms[label] = (runtime_stub(bed.podshim_socket), Path(bed.podshim_log))
                continue
            work = Path(bed.base_dir) / f"ab-{label}"
            work.mkdir()
            env = {"PYTHONPATH": str(Path(codes[label]).resolve())} if label in codes else None
            sections: dict[str, dict[str, Any]] = {"checkpoint": {}}
            for key, value in values.items():  # "runtime.criu=/x/criu": another section than [checkpoint]
                section, _, name = key.rpartition(".")
                sections.setdefault(section or "checkpoint", {})[name] = value
            sock, log = stack.enter_context(bed.extra_podshim(work, failpoints="", env=env, **sections))
            arms[label] = (runtime_stub(sock), log)
        rt = runtime_stub(bed.podshim_socket)
        pod = start_counter_pod(rt, bed, "ab", {f"c{i}": counter_config(f"c{i}", mem) for i in range(n)})
        time.sleep(1.0)
        try:
            prime(bed, pod)
            names = ["raw", *arms]
            for r in range(args.repeat):
                order = names[r % len(names) :] + names[: r % len(names)]
                got: dict[str, Any] = {}
                for name in order:
                    tag = f"{name}-{r}-{secrets.token_hex(2)}"
                    if name == "raw":
                        base = Path(bed.checkpoint_root) / f"raw-{tag}"
                        sync_disk()
                        got["raw"] = raw_dumps(bed, list(pod.containers.values()), base)
                        remove_tree(base)
                    else:
                        stub, log = arms[name]
                        got[name] = podshim_arm(
                            stub, log, pod.id, Path(bed.checkpoint_root) / tag, args.timeout
                        )
                sync_disk()
                raw, raw_cpu, raw_flush = got["raw"]
                raws = " + ".join(f"{x:.2f}" for x in raw)
                line = [f"rep {r + 1} ({' '.join(order)}): raw {raws} s cpu {raw_cpu:.2f}"]
                for label in arms:
                    t = got[label]["t"]
                    s = Sample(
                        order=" ".join(order),
                        freeze=t["freeze_window"],
                        total=t["total"],
                        wall=got[label]["wall"],
                        dump=t.get("dump", float("nan")),
                        archive=t.get("archive", float("nan")),
                        raw=raw,
                        raw_cpu=raw_cpu,
                        raw_flush=raw_flush,
                        ahead_mib=got[label]["ahead"],
                    )
                    samples[label].append(s)
                    cpus[label].append(t.get("dump_cpu", float("nan")))
                    line.append(
                        f"{label}: freeze {s.freeze:.2f} cpu {cpus[label][-1]:.2f} ahead {s.ahead_mib} "
                        f"total {s.total:.2f} -> {s.freeze_vs_floor:.2f} {s.total_vs_durable_floor:.2f}"
                    )
                say("; ".join(line))
        finally:
            remove_pod(rt, pod.id)
    rows = []
    for label, ss in samples.items():
        rows.append(
            [
                label,
                len(ss),
                median([s.freeze for s in ss]),
                median(cpus[label]),
                median([s.total for s in ss]),
                median([max(s.raw) for s in ss]),
                median([s.raw_cpu for s in ss]),
                median([s.freeze_floor for s in ss]),
                median([s.freeze_vs_floor for s in ss]),
                max(s.freeze_vs_floor for s in ss),
                median([s.total_vs_durable_floor for s in ss]),
            ]
        )
    print()
    print(
        table(
            [
                "variant",
                "n",
                "freeze",
                "dump cpu",
                "total",
                "raw slowest",
                "raw cpu",
                "floor",
                "freeze/floor",
                "worst",
                "total/durable",
            ],
            rows,
        )
    )
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
