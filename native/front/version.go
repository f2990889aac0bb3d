package main

import (
	"context"
	"regexp"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
)

const versionMethod = "/runtime.v1.RuntimeService/Version"

// versionRewrite is how Version names podshim (the daemon's shim/server/runtime.py
// version_answer, which tests/test_front.py holds this to): answered here, from the upstream's
// own answer, so that the kubelet's most frequent owned call never crosses to the daemon.
type versionRewrite struct {
	runtimeName string // [server] runtime_name: "upstream" or "podshim"
	podshim     string // podshim's version
}

// VersionResponse's fields (runtime/v1 api.proto), all strings.
const (
	fieldVersion protowire.Number = iota + 1
	fieldRuntimeName
	fieldRuntimeVersion
	fieldRuntimeAPIVersion
)

var notBuildMetadata = regexp.MustCompile(`[^0-9A-Za-z.-]`)

// answer is the response podshim gives for the upstream's VersionResponse `up`. "upstream": the
// upstream's runtime_name and its runtime_version with podshim as build metadata
// (`1.6.20~ds1+podshim.0.1.0`, after a "." when it has a "+" already); "podshim": runtime_name
// podshim, the upstream in the build metadata of podshim's version (`0.1.0+containerd-1.6.20-ds1`).
func (r versionRewrite) answer(up []byte) ([]byte, error) {
	fields, err := stringFields(up)
	if err != nil {
		return nil, err
	}
	name, version := fields[fieldRuntimeName], fields[fieldRuntimeVersion]
	if r.runtimeName == "podshim" {
		version = r.podshim + "+" + notBuildMetadata.ReplaceAllString(name+"-"+version, "-")
		name = "podshim"
	} else {
		sep := "+"
		if strings.Contains(version, "+") {
			sep = "."
		}
		version = version + sep + "podshim." + r.podshim
	}
	out := []struct {
		n protowire.Number
		v string
	}{
		{fieldVersion, orDefault(fields[fieldVersion], "0.1.0")},
		{fieldRuntimeName, name},
		{fieldRuntimeVersion, version},
		{fieldRuntimeAPIVersion, orDefault(fields[fieldRuntimeAPIVersion], "v1")},
	}
	var b []byte
	for _, f := range out {
		if f.v != "" { // proto3: an empty string is not sent
			b = protowire.AppendTag(b, f.n, protowire.BytesType)
			b = protowire.AppendString(b, f.v)
		}
	}
	return b, nil
}

// stringFields reads a message's length-delimited fields 1-4 (the last of each wins, as protobuf
// merges); any other field is skipped.
func stringFields(b []byte) (map[protowire.Number]string, error) {
	fields := map[protowire.Number]string{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.BytesType && num >= fieldVersion && num <= fieldRuntimeAPIVersion {
			v, m := protowire.ConsumeString(b)
			if m < 0 {
				return nil, protowire.ParseError(m)
			}
			fields[num], b = v, b[m:]
			continue
		}
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return nil, protowire.ParseError(m)
		}
		b = b[m:]
	}
	return fields, nil
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// versionCall passes Version to the upstream as any unary call and rewrites its answer.
func (p *proxy) versionCall(ctx context.Context, ss grpc.ServerStream) error {
	var req, resp frame
	if err := ss.RecvMsg(&req); err != nil {
		return err
	}
	err := p.invoke(ctx, p.upstream, versionMethod, &req, &resp, ss)
	if err != nil {
		return err
	}
	up := resp.data.Materialize()
	resp.data.Free()
	answer, err := p.version.answer(up)
	if err != nil {
		return status.Errorf(codes.Internal, "podshim: the upstream's VersionResponse cannot be read: %v", err)
	}
	return ss.SendMsg(&frame{data: mem.BufferSlice{mem.SliceBuffer(answer)}})
}
