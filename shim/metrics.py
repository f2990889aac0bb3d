"""Prometheus metrics (names follow KEP-5823's list), served over HTTP when configured."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from shim import __version__

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_OP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_SIZE_BUCKETS = tuple(float(2**i) for i in range(20, 38, 2))  # 1 MiB .. 64 GiB

# The calls the daemon passes to the upstream itself; podshim-front's are added at each scrape
# (ProxyCalls below), so these two are not registered on their own.
proxy_requests = Counter(
    "podshim_proxy_requests_total",
    "CRI calls passed to the upstream runtime",
    ["method", "code"],
    registry=None,
)
proxy_latency = Histogram(
    "podshim_proxy_request_duration_seconds",
    "Latency of CRI calls passed to the upstream runtime",
    ["method"],
    buckets=_LATENCY_BUCKETS,
    registry=None,
)


class ProxyCalls(Collector):
    """podshim_proxy_*: the daemon's own samples plus podshim-front's (native/front/metrics.go:
    the same names, labels and buckets), read from the front when /metrics is scraped and added
    sample by sample (docs/design/proxy.md (The proxy))."""

    def __init__(self) -> None:
        self.front: Callable[[], str] | None = None

    def describe(self) -> Iterator[Metric]:
        yield from proxy_requests.describe()
        yield from proxy_latency.describe()

    def collect(self) -> Iterator[Metric]:
        theirs: dict[str, Metric] = {}
        if self.front is not None:
            for fam in text_string_to_metric_families(self.front()):
                theirs[fam.name] = fam
        for own in (*proxy_requests.collect(), *proxy_latency.collect()):
            yield _added(own, theirs.get(own.name))


def _added(own: Metric, theirs: Metric | None) -> Metric:
    def key(s: Sample) -> tuple[str, frozenset[tuple[str, str]]]:
        labels = dict(s.labels)
        if "le" in labels:  # Go writes 1, Python 1.0
            labels["le"] = floatToGoString(float(labels["le"]))
        return s.name, frozenset(labels.items())

    values = {key(s): s for s in own.samples}
    for s in theirs.samples if theirs is not None else ():
        k = key(s)
        mine = values.get(k)
        total = s.value + (mine.value if mine else 0.0)
        values[k] = Sample(k[0], dict(k[1]), total, None, None)
    out = Metric(own.name, own.documentation, own.type, own.unit)
    out.samples = list(values.values())
    return out


proxy_calls = ProxyCalls()
REGISTRY.register(proxy_calls)


def read_front(source: Callable[[], str]) -> None:
    """Add podshim-front's proxy samples (its exposition, read by `source`) to every scrape."""
    proxy_calls.front = source


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

# The values each label takes, for docs/reference/metrics.md (shim/docgen.py).
LABEL_DOCS: dict[str, str] = {
    "operation": (
        "`checkpoint_pod`, `restore_pod`, `checkpoint_container`, `restore_container` (CreateContainer "
        "from a container checkpoint tar); podshim_checkpoint_tasks_resumed_total: `checkpoint_pod`, "
        "`checkpoint_container`"
    ),
    "result": (
        "`OK`, the gRPC code name, `CANCELLED` when the caller went away first; for an operation a "
        "crashed podshim left: `RECOVERED`, or `RECOVERY_FAILED` for each failed attempt (it is retried "
        "in the background, 0.5 s doubling to 30 s, while podshim runs)"
    ),
    "method": "the CRI method name",
    "code": "the gRPC code name of the upstream's answer",
    "reason": (
        "podshim_lazy_restore_failures_total: `killed` (the lazy-pages daemon died of a signal), `exit` "
        "(it failed), `podshim-restart` (podshim restarted while it served), `checksum` (a page image "
        "differed from the manifest or could not be read); podshim_migration_killed_total: `link`, "
        "`lease`, `abort`, `deadline`"
    ),
    "role": "`source`, `destination`",
    "version": "podshim's version",
    "handler": "the upstream's runtime handler (checked at start-up and at each restore)",
}


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT, :PORT (all addresses) or [IPv6]:PORT -> (host, port)."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return host or "0.0.0.0", int(port)


def serve(address: str) -> None:
    """Start the /metrics endpoint on HOST:PORT (a daemon thread)."""
    host, port = split_address(address)
    start_http_server(port, addr=host)
