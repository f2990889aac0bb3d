"""podshim benchmarks: ``python -m bench.proxy``, ``bench.checkpoint``, ``bench.restore``.

Each script starts its own test bed (private containerd + podshim), measures in one run, prints
tables and ends with a ``RESULT ...`` line of its figures, which it also writes as data to
``bench/results/<name>.json`` (``bench.common.write_results``); ``python -m bench.report`` renders
docs/performance.md from those files. Nothing is asserted on timings.
"""
