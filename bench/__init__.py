"""podshim benchmarks: ``python -m bench.proxy``, ``bench.checkpoint``, ``bench.restore``.

Each script starts its own test bed (private containerd + podshim), measures in one run, prints
tables and ends with the ``RESULT ...`` line of its issue. Nothing is asserted on timings.
"""
