"""Prometheus metrics (names follow KEP-5823's list), served over HTTP when configured."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from shim import __version__

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_OP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_SIZE_BUCKETS = tuple(float(2**i) for i in range(20, 38, 2))  # 1 MiB .. 64 GiB

proxy_requests = Counter(
    "podshim_proxy_requests_total", "CRI calls passed to the upstream runtime", ["method", "code"]
)
proxy_latency = Histogram(
    "podshim_proxy_request_duration_seconds",
    "Latency of CRI calls passed to the upstream runtime",
    ["method"],
    buckets=_LATENCY_BUCKETS,
)
operations = Counter(
    "podshim_operations_total",
    "Checkpoint/restore operations by kind and result (gRPC code name)",
    ["operation", "result"],
)
operation_duration = Histogram(
    "podshim_operation_duration_seconds",
    "Duration of checkpoint/restore operations",
    ["operation"],
    buckets=_OP_BUCKETS,
)
freeze_window = Histogram(
    "podshim_checkpoint_freeze_window_seconds",
    "Time the pod's containers were frozen during CheckpointPod/CheckpointContainer",
    buckets=_OP_BUCKETS,
)
tasks_resumed = Counter(
    "podshim_checkpoint_tasks_resumed_total",
    "Tasks of a checkpointed container found stopped after the thaw that were not before the freeze, "
    "resumed with SIGCONT (operation: checkpoint_pod, checkpoint_container)",
    ["operation"],
)
archive_size = Histogram(
    "podshim_checkpoint_archive_bytes",
    "Size of the written checkpoint",
    ["operation"],
    buckets=_SIZE_BUCKETS,
)
lazy_restore_failures = Counter(
    "podshim_lazy_restore_failures_total",
    "Lazily restored containers killed because their lazy-pages daemon ended before delivering every "
    "page, or whose page images failed their checksum (reason: killed, exit, podshim-restart, checksum)",
    ["reason"],
)
# podshim is visible here even where Version reports the upstream's runtime_name
build_info = Gauge("podshim_build_info", "podshim's version (always 1)", ["version"])
build_info.labels(__version__).set(1)
migrations = Counter(
    "podshim_migrations_total",
    "Live migrations by role (source, destination) and result (OK or the gRPC code name)",
    ["role", "result"],
)
migration_refused_peers = Counter(
    "podshim_migration_refused_peers_total",
    "Connections to the migration listener refused: no certificate of the CA, or not the expected source",
)
migration_kills = Counter(
    "podshim_migration_killed_total",
    "Containers a destination killed after they ran because the source or the link was lost (reason: "
    "link, lease, abort, deadline)",
    ["reason"],
)
wiring_ok = Gauge(
    "podshim_wiring_ok",
    "Whether the upstream runtime handler runs podshim-runc and passes podshim.* annotations "
    "(1 yes, 0 no: restores on it are refused, -1 cannot verify)",
    ["handler"],
)


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT, :PORT (all addresses) or [IPv6]:PORT -> (host, port)."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return host or "0.0.0.0", int(port)


def serve(address: str) -> None:
    """Start the /metrics endpoint on HOST:PORT (a daemon thread)."""
    host, port = split_address(address)
    start_http_server(port, addr=host)
