#!/usr/bin/env bash
# The Go programs the tests drive, built from pinned Go modules (scripts/setup.sh step 3c; alone:
# `bash scripts/gotools.sh [NAME...]`). Idempotent: a program is rebuilt only when its module
# files (tools/go/<dir>/go.mod, go.sum, its own *.go) or this script's recipe for it changed.
#
# Each tools/go/<dir>/ is a small Go module of the project's whose go.mod requires the released
# module (or, for cri-client, holds the project's own Go CRI client, main.go) and whose go.sum
# pins every dependency's hash: the build runs with -mod=readonly, so it
# downloads only what go.sum names, from the Go module proxy, into the cache below, and fails
# rather than resolve anything new. k8s.io/kubernetes points its ~30 staging modules at local
# paths; tools/go/kubelet/go.mod replaces each with the same-numbered v0.x release.
#
# The control plane of the cluster test bed (testbed/cluster.py): tools/go/controlplane/ is the
# kubelet's module with the API server, controller manager, scheduler and kubectl as its tools
# (the same replaces); tools/go/etcd/ is a main of the project's own calling etcdmain (server/v3's
# go.mod has replaces, so `go install` of it is refused), built without cgo.
#
# Output: $PODSHIM_GO_CACHE/bin/<name>/<binary> (default /var/cache/podshim/go), with a stamp
# next to it. testbed/tools.py finds them there.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GO_CACHE=${PODSHIM_GO_CACHE:-/var/cache/podshim/go}
export GOMODCACHE=$GO_CACHE/mod GOCACHE=$GO_CACHE/build GOTOOLCHAIN=local GOFLAGS=-mod=readonly
export GOPATH=$GO_CACHE/path CGO_ENABLED=1

# name | module dir | how: build or test (a `go test -c` binary) | package | binary | tags | ldflags
# [| env: VAR=VALUE ... for this build only]
TOOLS=(
  "kubelet|kubelet|build|k8s.io/kubernetes/cmd/kubelet|kubelet||-X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean"
  "crictl|cri-tools|build|sigs.k8s.io/cri-tools/cmd/crictl|crictl||-X sigs.k8s.io/cri-tools/pkg/version.Version=1.37.0"
  "critest|cri-tools|test|sigs.k8s.io/cri-tools/cmd/critest|critest||-X sigs.k8s.io/cri-tools/pkg/version.Version=1.37.0"
  "ginkgo|cri-tools|build|github.com/onsi/ginkgo/v2/ginkgo|ginkgo||"
  "runc-1.3|runc-1.3|build|github.com/opencontainers/runc|runc|seccomp|-X main.version=1.3.7"
  "containerd-2.2|containerd-2.2|build|github.com/containerd/containerd/v2/cmd/containerd|containerd|no_btrfs|-X github.com/containerd/containerd/v2/version.Version=2.2.9"
  "containerd-2.2|containerd-2.2|build|github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2|containerd-shim-runc-v2||-X github.com/containerd/containerd/v2/version.Version=2.2.9"
  "containerd-2.2|containerd-2.2|build|github.com/containerd/containerd/v2/cmd/ctr|ctr||-X github.com/containerd/containerd/v2/version.Version=2.2.9"
  "containerd-2.4|containerd-2.4|build|github.com/containerd/containerd/v2/cmd/containerd|containerd|no_btrfs|-X github.com/containerd/containerd/v2/version.Version=2.4.2"
  "containerd-2.4|containerd-2.4|build|github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2|containerd-shim-runc-v2||-X github.com/containerd/containerd/v2/version.Version=2.4.2"
  "containerd-2.4|containerd-2.4|build|github.com/containerd/containerd/v2/cmd/ctr|ctr||-X github.com/containerd/containerd/v2/version.Version=2.4.2"
  "cri-client|cri-client|build|podshim.local/tools/cri-client|cri-client||"
  "kube-apiserver|controlplane|build|k8s.io/kubernetes/cmd/kube-apiserver|kube-apiserver||-X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean"
  "kube-controller-manager|controlplane|build|k8s.io/kubernetes/cmd/kube-controller-manager|kube-controller-manager||-X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean"
  "kube-scheduler|controlplane|build|k8s.io/kubernetes/cmd/kube-scheduler|kube-scheduler||-X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean"
  "kubectl|controlplane|build|k8s.io/kubernetes/cmd/kubectl|kubectl||-X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37 -X k8s.io/component-base/version.gitTreeState=clean"
  "etcd|etcd|build|podshim.local/tools/etcd|etcd|||CGO_ENABLED=0"
)

info() { printf '    %s\n' "$*"; }

command -v go >/dev/null || { echo "ERROR: go is not installed (the set-up needs Go >= 1.26)" >&2; exit 1; }

want=("$@")
wanted() {
  [ ${#want[@]} -eq 0 ] && return 0
  local w; for w in "${want[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1
}

mkdir -p "$GO_CACHE/bin" "$GO_CACHE/logs"
for entry in "${TOOLS[@]}"; do
  IFS='|' read -r name dir how pkg binary tags ldflags build_env <<<"$entry"
  wanted "$name" || continue
  src=$REPO_ROOT/tools/go/$dir
  out=$GO_CACHE/bin/$name/$binary
  stamp=$out.stamp
  # the module's own Go source (cri-client's main.go; not the tools.go that only pins imports)
  own=$(find "$src" -maxdepth 1 -name '*.go' ! -name tools.go | sort)
  # shellcheck disable=SC2086
  key=$( { cat "$src/go.mod" "$src/go.sum" $own; echo "$entry"; go env GOVERSION; } | sha256sum | cut -c1-16)
  if [ -x "$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
    continue
  fi
  mkdir -p "$(dirname "$out")"
  log=$GO_CACHE/logs/$name-$binary.log
  info "go $how $pkg -> $out (log: $log)"
  t0=$(date +%s)
  args=(-trimpath -o "$out.tmp" -ldflags "-s -w $ldflags")
  [ -n "$tags" ] && args+=(-tags "$tags")
  # shellcheck disable=SC2206 # build_env is a list of VAR=VALUE words
  envs=($build_env)
  if [ "$how" = test ]; then
    cmd=(env "${envs[@]}" go test -c "${args[@]}" "$pkg")
  else
    cmd=(env "${envs[@]}" go build "${args[@]}" "$pkg")
  fi
  if ! (cd "$src" && "${cmd[@]}") >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "ERROR: building $name ($binary) failed (log: $log)" >&2
    exit 1
  fi
  mv -f "$out.tmp" "$out"
  echo "$key" >"$stamp"
  info "$name/$binary built in $(( $(date +%s) - t0 ))s"
done
