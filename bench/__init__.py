"""podshim benchmarks: ``python -m bench.proxy``, ``bench.checkpoint``, ``bench.restore``.

Each script starts its own test bed (private containerd + podshim), measures in one run, prints
tables and ends with a ``RESULT ...`` line of its figures. Nothing is asserted on timings.
"""
