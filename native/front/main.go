// podshim-front: podshim's public CRI socket, compiled (docs/design/proxy.md (The proxy)).
//
// `podshim serve` starts it. Every CRI call podshim does not own goes to the upstream runtime byte
// for byte (the request and response never decoded; metadata, deadline and cancellation carried
// over; the upstream's status, headers and trailers back unchanged); the methods podshim owns
// (--own, the daemon's routing table) go to the daemon over its private socket, the same way. The
// daemon passes everything on the command line:
//
//	podshim-front --listen SOCK [--listen-fd N] --upstream unix:///… [--daemon DAEMON_SOCK]
//	    --own METHOD,… --unary METHOD,… [--version-name upstream|podshim --podshim-version V]
//	    [--metrics-socket SOCK] [--grace 1] [--orphan-timeout 60s]
//	    [--log-format json|console] [--log-level info]
//
// With --version-name it answers Version itself while its connection to the daemon (which owns
// Version) is up: the upstream's answer with podshim named in it, as the daemon would (version.go),
// so the kubelet's most frequent call podshim changes stays in compiled code. Otherwise Version
// goes to the daemon as any owned call, so that an answer still means podshim is serving.
//
// The daemon binds SOCK itself and passes the listening socket as descriptor N (--listen-fd): it
// keeps it across the fronts it starts, so while a front that died is started again, new
// connections wait in the socket's backlog instead of being refused, and the path never goes
// away. The front keeps N open under that number, for a daemon that adopts it to take a copy
// (pidfd_getfd). Without --listen-fd it binds SOCK itself (bench/proxy's floor, the tests).
//
// It prints one line on stdout: "ready" once it listens, or "error: …" before it exits 1. It
// outlives a daemon that dies: the node's CRI keeps working (the upstream's calls pass, the
// daemon's are UNAVAILABLE) until the next daemon adopts it. It stops on SIGTERM, which the daemon
// sends at its graceful stop, or once its daemon has been unreachable for --orphan-timeout (none
// came back): no new calls, those in flight get --grace seconds, then it exits. It removes SOCK
// (if the path is still the file it was serving) when it bound it itself, and after an orphan
// timeout (no daemon is left to); a daemon that passed the socket removes it at its own stop.
// SIGINT is ignored: a terminal's ^C reaches the daemon too, which still passes calls through
// while it drains.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
)

const maxMessage = 16 << 20 // the kubelet's own CRI limit, as the daemon's

// A fixed flow-control window of a whole message: with one, gRPC does not estimate the link's
// bandwidth, which costs a PING and its ACK with every message received on each connection (and
// so a wake-up of the front and of the upstream per call).
const window = maxMessage

type options struct {
	listen, upstream, daemon, metricsSocket string
	listenFD                                int
	own, unary                              string
	versionName, podshimVersion             string
	grace, deadlineMargin, orphanTimeout    time.Duration
	logFormat, logLevel                     string
}

func parseFlags() options {
	var o options
	flag.StringVar(&o.listen, "listen", "", "the public CRI socket path")
	flag.IntVar(&o.listenFD, "listen-fd", -1,
		"serve this inherited descriptor, a socket listening on --listen, instead of binding --listen")
	flag.StringVar(&o.upstream, "upstream", "", "the upstream CRI endpoint (unix:///…)")
	flag.StringVar(&o.daemon, "daemon", "", "the daemon's private socket path")
	flag.StringVar(&o.metricsSocket, "metrics-socket", "", "serve GET /metrics on this unix socket")
	flag.StringVar(&o.own, "own", "", "full method names the daemon answers, comma-separated")
	flag.StringVar(&o.unary, "unary", "", "full method names known to be unary, comma-separated")
	flag.StringVar(&o.versionName, "version-name", "",
		"answer Version here from the upstream's, naming \"upstream\" or \"podshim\" ([server] runtime_name)")
	flag.StringVar(&o.podshimVersion, "podshim-version", "", "podshim's version, for --version-name")
	flag.DurationVar(&o.orphanTimeout, "orphan-timeout", 0,
		"stop once the daemon's socket has been unreachable this long (0: never)")
	flag.DurationVar(&o.grace, "grace", time.Second, "calls in flight at a stop get this long")
	flag.DurationVar(&o.deadlineMargin, "deadline-margin", 100*time.Millisecond,
		"kept from each caller's deadline when the call is passed on")
	flag.StringVar(&o.logFormat, "log-format", "json", "json or console")
	flag.StringVar(&o.logLevel, "log-level", "info", "debug, info, warning or error")
	flag.Parse()
	return o
}

func main() {
	o := parseFlags()
	log := newLogger(o.logFormat, o.logLevel)
	if err := run(o, log); err != nil {
		fmt.Printf("error: %s\n", err)
		log.Error("podshim-front stopped", "error", err.Error())
		os.Exit(1)
	}
}

func run(o options, log *slog.Logger) error {
	if o.listen == "" || o.upstream == "" || (o.daemon == "" && o.own != "") {
		return fmt.Errorf("--listen, --upstream and --daemon are required")
	}
	if o.versionName != "" && (o.versionName != "upstream" && o.versionName != "podshim" || o.podshimVersion == "") {
		return fmt.Errorf("--version-name is upstream or podshim, with --podshim-version")
	}
	signal.Ignore(syscall.SIGINT)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM)

	metrics := newProxyMetrics()
	upstream, err := dial("upstream", o.upstream, true)
	if err != nil {
		return err
	}
	defer upstream.conn.Close()
	var daemon *target // none: every method goes to the upstream (bench/proxy's floor)
	if o.daemon != "" {
		if daemon, err = dial("daemon", "unix://"+o.daemon, false); err != nil {
			return err
		}
		defer daemon.conn.Close()
	}
	p := &proxy{upstream: upstream, daemon: daemon, own: set(o.own), unary: set(o.unary), metrics: metrics,
		margin: o.deadlineMargin}
	if o.versionName != "" {
		p.version = &versionRewrite{runtimeName: o.versionName, podshim: o.podshimVersion}
	}

	srv := grpc.NewServer(
		grpc.ForceServerCodecV2(rawCodec{}),
		grpc.UnknownServiceHandler(p.handle),
		grpc.MaxRecvMsgSize(maxMessage),
		grpc.MaxSendMsgSize(maxMessage),
		grpc.InitialWindowSize(window),
		grpc.InitialConnWindowSize(window),
	)
	var sock *ownSocket
	if o.listenFD >= 0 {
		sock, err = inheritSocket(o.listenFD, o.listen)
	} else {
		sock, err = listenUnix(o.listen, 0o660)
	}
	if err != nil {
		return fmt.Errorf("server.socket %s: cannot listen: %w", o.listen, err)
	}
	// an inherited socket's path is its daemon's (kept for the next front), unless orphaned below
	removePath := !sock.inherited
	defer func() { sock.close(log, removePath) }()
	if o.metricsSocket != "" {
		ms, err := listenUnix(o.metricsSocket, 0o600)
		if err != nil {
			return fmt.Errorf("metrics socket %s: cannot listen: %w", o.metricsSocket, err)
		}
		defer ms.close(log, true)
		go metrics.serve(ms.l)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(sock.l) }()
	fmt.Println("ready")
	log.Info("front serving", "socket", o.listen, "upstream", o.upstream, "daemon", o.daemon,
		"owned_methods", len(p.own))

	orphaned := make(chan struct{})
	if o.daemon != "" && o.orphanTimeout > 0 {
		go watchDaemon(o.daemon, o.orphanTimeout, orphaned)
	}
	select {
	case sig := <-stop:
		log.Info("front stopping", "signal", sig.String(), "grace", o.grace.Seconds())
	case <-orphaned:
		log.Warn("front stopping: its daemon has been unreachable too long", "daemon", o.daemon,
			"seconds", o.orphanTimeout.Seconds())
		removePath = true
	case err := <-served:
		return fmt.Errorf("serving %s: %w", o.listen, err)
	}
	graceful := make(chan struct{})
	go func() { srv.GracefulStop(); close(graceful) }()
	select {
	case <-graceful:
	case <-time.After(o.grace):
		srv.Stop() // cancels the calls still in flight, streams included
	}
	log.Info("front stopped")
	return nil
}

// watchDaemon closes orphaned once the daemon's socket has refused connections for `timeout`: the
// daemon died and none came back to adopt the front (a stop whose SIGTERM never reached it).
func watchDaemon(path string, timeout time.Duration, orphaned chan<- struct{}) {
	seen := time.Now()
	for range time.Tick(time.Second) {
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			seen = time.Now()
		} else if time.Since(seen) > timeout {
			close(orphaned)
			return
		}
	}
}

func set(list string) map[string]bool {
	out := map[string]bool{}
	for _, m := range strings.Split(list, ",") {
		if m = strings.TrimSpace(m); m != "" {
			out[m] = true
		}
	}
	return out
}

// dial: one channel per target, reconnecting within about a second of it coming back (gRPC's
// default backoff grows to 2 minutes), no retries, 16 MiB messages both ways.
func dial(name, endpoint string, counted bool) (*target, error) {
	conn, err := grpc.NewClient(endpoint,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(
			grpc.ForceCodecV2(rawCodec{}),
			grpc.MaxCallRecvMsgSize(maxMessage),
			grpc.MaxCallSendMsgSize(maxMessage),
		),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 5 * time.Second,
		}),
		grpc.WithDisableRetry(),
		grpc.WithInitialWindowSize(window),
		grpc.WithInitialConnWindowSize(window),
	)
	if err != nil {
		return nil, fmt.Errorf("%s endpoint %s: %w", name, endpoint, err)
	}
	conn.Connect()
	return &target{name: name, endpoint: endpoint, conn: conn, counted: counted}, nil
}

// ownSocket is a listening unix socket and the file it bound, removed at the end only while it is
// still that file: a podshim started after this one's daemon died may have bound the path anew.
type ownSocket struct {
	l         *net.UnixListener
	path      string
	ino       uint64
	inherited bool     // passed by the daemon (--listen-fd), not bound here
	file      *os.File // the inherited descriptor, kept open under its number for pidfd_getfd
}

func listenUnix(path string, mode os.FileMode) (*ownSocket, error) {
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		l.Close()
		return nil, err
	}
	if err := os.Chmod(path, mode); err != nil {
		l.Close()
		return nil, err
	}
	return &ownSocket{l: l, path: path, ino: st.Ino}, nil
}

// inheritSocket: the socket the daemon bound to path and listens on, passed as descriptor fd.
func inheritSocket(fd int, path string) (*ownSocket, error) {
	if on, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || on != 1 {
		return nil, fmt.Errorf("--listen-fd %d is not a listening socket", fd)
	}
	f := os.NewFile(uintptr(fd), "listen-fd")
	fl, err := net.FileListener(f) // a duplicate: f stays open, for a daemon's pidfd_getfd
	if err != nil {
		f.Close()
		return nil, err
	}
	l, ok := fl.(*net.UnixListener)
	if !ok || l.Addr().String() != path {
		fl.Close()
		f.Close()
		return nil, fmt.Errorf("--listen-fd %d listens on %s, not on this path", fd, fl.Addr())
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		l.Close()
		f.Close()
		return nil, err
	}
	return &ownSocket{l: l, path: path, ino: st.Ino, inherited: true, file: f}, nil
}

// close stops listening (the daemon's copy of an inherited socket listens on) and, if removePath,
// removes the path while it is still the file this socket was serving.
func (s *ownSocket) close(log *slog.Logger, removePath bool) {
	s.l.Close()
	if s.file != nil {
		s.file.Close()
	}
	var st unix.Stat_t
	if removePath && unix.Stat(s.path, &st) == nil && st.Ino == s.ino {
		if err := os.Remove(s.path); err != nil {
			log.Warn("cannot remove the socket", "socket", s.path, "error", err.Error())
		}
	}
}

// newLogger writes JSON lines shaped like the daemon's (structlog: event, level, timestamp) to
// stderr, which the daemon's stderr is, or a console line.
func newLogger(format, level string) *slog.Logger {
	lvl := map[string]slog.Level{"debug": slog.LevelDebug, "info": slog.LevelInfo,
		"warning": slog.LevelWarn, "error": slog.LevelError}[level]
	opts := &slog.HandlerOptions{Level: lvl, ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
		if len(groups) > 0 {
			return a
		}
		switch a.Key {
		case slog.MessageKey:
			a.Key = "event"
		case slog.TimeKey:
			a = slog.String("timestamp", a.Value.Time().UTC().Format("2006-01-02T15:04:05.000000Z"))
		case slog.LevelKey:
			a.Value = slog.StringValue(strings.ToLower(strings.Replace(a.Value.String(), "WARN", "warning", 1)))
		}
		return a
	}}
	var h slog.Handler = slog.NewJSONHandler(os.Stderr, opts)
	if format == "console" {
		h = slog.NewTextHandler(os.Stderr, opts)
	}
	return slog.New(h).With("logger", "podshim-front")
}
