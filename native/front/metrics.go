package main

import (
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc/codes"
)

// The same families, labels and buckets as the daemon's (shim/metrics.py), which adds these
// samples to its own at each scrape of its /metrics.
var latencyBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

type proxyMetrics struct {
	registry *prometheus.Registry
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
}

func newProxyMetrics() *proxyMetrics {
	m := &proxyMetrics{
		registry: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "podshim_proxy_requests_total",
			Help: "CRI calls passed to the upstream runtime",
		}, []string{"method", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "podshim_proxy_request_duration_seconds",
			Help:    "Latency of CRI calls passed to the upstream runtime",
			Buckets: latencyBuckets,
		}, []string{"method"}),
	}
	m.registry.MustRegister(m.requests, m.latency)
	return m
}

// shortName: "/runtime.v1.RuntimeService/ListContainers" -> "ListContainers", as the daemon labels.
func shortName(method string) string {
	return method[strings.LastIndexByte(method, '/')+1:]
}

// codeName: the gRPC code as the daemon's labels spell it (grpc.StatusCode names: NOT_FOUND).
func codeName(c codes.Code) string {
	if name, ok := codeNames[c]; ok {
		return name
	}
	return c.String()
}

var codeNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
	codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
	codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
	codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
	codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED", codes.Internal: "INTERNAL",
	codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS", codes.Unauthenticated: "UNAUTHENTICATED",
}

// observe: a unary call passed to the upstream (its code and latency).
func (m *proxyMetrics) observe(method string, code codes.Code, took time.Duration) {
	name := shortName(method)
	m.requests.WithLabelValues(name, codeName(code)).Inc()
	m.latency.WithLabelValues(name).Observe(took.Seconds())
}

// count: a streamed call passed to the upstream, once it ended (streams are not timed).
func (m *proxyMetrics) count(method string, code codes.Code) {
	m.requests.WithLabelValues(shortName(method), codeName(code)).Inc()
}

// serve answers GET /metrics on the unix socket the daemon reads it from.
func (m *proxyMetrics) serve(l net.Listener) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	_ = srv.Serve(l)
}
