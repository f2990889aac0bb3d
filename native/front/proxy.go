package main

import (
	"context"
	"errors"
	"io"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// The CRI services; any other service is UNIMPLEMENTED, as the daemon's own server answers it.
var criServices = []string{"/runtime.v1.RuntimeService/", "/runtime.v1.ImageService/"}

// frame is one gRPC message, never decoded: the request bytes go on as they came.
type frame struct{ data mem.BufferSlice }

// rawCodec hands the message bytes through. Unmarshal keeps a reference to the received buffers
// and Marshal gives that reference to the transport, which frees it once sent: no copy. Its name
// is "proto" because the client side sends it as the content-subtype (application/grpc+proto).
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	f := v.(*frame)
	data := f.data
	f.data = nil
	return data, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	data.Ref()
	v.(*frame).data = data
	return nil
}

func (rawCodec) Name() string { return "proto" }

// target is one of the two places a call goes: the upstream runtime or podshim's daemon.
type target struct {
	name     string // "upstream" or "daemon", for the messages
	endpoint string
	conn     *grpc.ClientConn
	counted  bool // its calls are podshim_proxy_* (the daemon counts the calls it passes on itself)
}

// connected: t's connection is up. The daemon's is only while a daemon serves, after its
// recovery (it listens only then).
func (t *target) connected() bool {
	return t.conn.GetState() == connectivity.Ready
}

type proxy struct {
	upstream *target
	daemon   *target
	own      map[string]bool // full method names podshim's daemon answers
	unary    map[string]bool // CRI methods known to be unary (the rest: any shape, pumped)
	metrics  *proxyMetrics
	margin   time.Duration   // kept from the caller's deadline (forwardedContext)
	version  *versionRewrite // nil: Version is passed on as any call (to the daemon when owned)
}

// handle serves every method: registered as the server's unknown-service handler, with no
// service registered, so every call arrives here as a stream of raw frames.
func (p *proxy) handle(_ any, ss grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(ss)
	if !ok || !isCRI(method) {
		return status.Errorf(codes.Unimplemented, "unknown method %s", method)
	}
	t := p.upstream
	if p.own[method] {
		t = p.daemon
	}
	ctx, cancel := forwardedContext(ss.Context(), p.margin)
	defer cancel()
	// owned by the daemon: answered here only while a daemon serves, else the daemon's to answer
	if method == versionMethod && p.version != nil && (t == p.upstream || t.connected()) {
		return p.versionCall(ctx, ss)
	}
	if p.unary[method] {
		return p.unaryCall(ctx, t, method, ss)
	}
	return p.streamCall(ctx, t, method, ss)
}

func isCRI(method string) bool {
	for _, s := range criServices {
		if strings.HasPrefix(method, s) {
			return true
		}
	}
	return false
}

// forwardedContext carries the caller's cancellation (the incoming context's), its deadline less
// margin, and its metadata, less what belongs to the hop. The margin lets the target's
// DEADLINE_EXCEEDED reach the caller as a status before this server's own deadline timer resets
// the stream, which a client whose timer runs late would report as CANCELLED.
func forwardedContext(in context.Context, margin time.Duration) (context.Context, context.CancelFunc) {
	md, _ := metadata.FromIncomingContext(in)
	out := metadata.MD{}
	for k, v := range md {
		if strings.HasPrefix(k, ":") || strings.HasPrefix(k, "grpc-") || k == "user-agent" || k == "content-type" {
			continue
		}
		out[k] = v
	}
	ctx := metadata.NewOutgoingContext(in, out)
	if deadline, ok := in.Deadline(); ok {
		return context.WithDeadline(ctx, deadline.Add(-margin))
	}
	return context.WithCancel(ctx)
}

func (p *proxy) unaryCall(ctx context.Context, t *target, method string, ss grpc.ServerStream) error {
	var req, resp frame
	if err := ss.RecvMsg(&req); err != nil {
		return err
	}
	if err := p.invoke(ctx, t, method, &req, &resp, ss); err != nil {
		return err
	}
	return ss.SendMsg(&resp)
}

// invoke makes one unary call on t, counted when t's calls are, its header and trailer set on the
// caller's stream; the error is the caller's status (callError).
func (p *proxy) invoke(ctx context.Context, t *target, method string, req, resp *frame, ss grpc.ServerStream) error {
	start := time.Now()
	var header, trailer metadata.MD
	err := t.conn.Invoke(ctx, method, req, resp, grpc.Header(&header), grpc.Trailer(&trailer))
	if t.counted {
		p.metrics.observe(method, status.Code(err), time.Since(start))
	}
	if len(header) > 0 {
		_ = ss.SetHeader(header)
	}
	if len(trailer) > 0 {
		ss.SetTrailer(trailer)
	}
	if err != nil {
		return t.callError(err)
	}
	return nil
}

// streamCall pumps frames both ways until the target ends the call: server-streaming CRI methods
// and any method podshim's proto does not know, whatever its shape. The caller going away
// cancels the target's stream (the context).
func (p *proxy) streamCall(ctx context.Context, t *target, method string, ss grpc.ServerStream) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	code := codes.OK
	if t.counted {
		defer func() { p.metrics.count(method, code) }()
	}
	desc := &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}
	cs, err := t.conn.NewStream(ctx, desc, method)
	if err != nil {
		code = status.Code(err)
		return t.callError(err)
	}
	go func() { // the caller's messages, then its half-close
		for {
			var f frame
			if err := ss.RecvMsg(&f); err != nil {
				if errors.Is(err, io.EOF) {
					_ = cs.CloseSend()
				} else {
					cancel()
				}
				return
			}
			if err := cs.SendMsg(&f); err != nil {
				return // the target ended the call: RecvMsg below returns its status
			}
		}
	}()
	if header, err := cs.Header(); err == nil && len(header) > 0 {
		_ = ss.SendHeader(header)
	}
	for {
		var f frame
		err := cs.RecvMsg(&f)
		if err != nil {
			ss.SetTrailer(cs.Trailer())
			if errors.Is(err, io.EOF) {
				return nil
			}
			code = status.Code(err)
			return t.callError(err)
		}
		if err := ss.SendMsg(&f); err != nil {
			code = codes.Canceled
			return err
		}
	}
}

// How gRPC's client words a failure of its own transport (the target is not there): the message
// starts with one of these. A status the target itself returned is its own words, passed on
// unchanged, whatever they quote (the daemon's UNAVAILABLE names its upstream's transport error).
var transportPrefixes = []string{
	"connection error", "last connection error", "error while dialing", "transport is closing",
	"error reading from server", "connection closed", "the connection is draining", "name resolver error",
}

// callError is the status the caller gets: the target's own, unchanged; a transport failure
// names the target (docs/design/proxy.md (The proxy)).
func (t *target) callError(err error) error {
	st := status.Convert(err)
	if st.Code() != codes.Unavailable || !isTransportFailure(st.Message()) {
		return st.Err()
	}
	if t.name == "daemon" {
		return status.Errorf(codes.Unavailable,
			"podshim: its daemon at %s is unavailable (%s); podshim is starting or stopping", t.endpoint, st.Message())
	}
	return status.Errorf(codes.Unavailable,
		"podshim: upstream runtime at %s is unavailable (%s); check that it is running — podshim reconnects by itself when it is back",
		t.endpoint, st.Message())
}

func isTransportFailure(message string) bool {
	text := strings.ToLower(message)
	for _, p := range transportPrefixes {
		if strings.HasPrefix(text, p) {
			return true
		}
	}
	return false
}
