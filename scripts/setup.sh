#!/usr/bin/env bash
# podshim set-up: idempotent, for a fresh Debian 12 machine and for one already set up.
#
#   bash scripts/setup.sh            (from anywhere; `make setup` calls it)
#
# What it does, each step skipped quickly when already done:
#   1. apt: a deb-src entry for Debian's newer release (trixie), mirror taken from the
#      machine's own apt sources; installs containerd, runc, CNI plugins, iptables and the
#      build dependencies of CRIU and crun, and Podman (bench/peers.py). `apt-get update` only when
#      something is missing.
#   2. CRIU >= 4.1 built from the trixie source package (upstream orig tarball) into
#      /usr/local: /usr/local/sbin/criu, libcriu (+ headers, criu.pc) under
#      /usr/local/lib/<multiarch>. Debian 12's CRIU 3.17 fails `criu check` on new kernels.
#      podshim's patches (scripts/patches/criu) are applied first; an installed CRIU without
#      the current patch set is rebuilt.
#   2b. CRIU 4.2 from sid's source package (the private apt tree below, deb-src sid), with the
#      patches for 4.2, into /var/cache/podshim/criu/4.2 (sbin/criu): the tests' PODSHIM_TEST_CRIU=4.2
#      and the package's /opt/podshim/sbin/criu. /usr/local/sbin/criu stays as it is.
#      Patch layout: scripts/patches/criu/*.patch apply to every CRIU built, and
#      scripts/patches/criu/<major.minor>/*.patch to that series only; sorted by file name together.
#   3. crun with CRIU support from the trixie source package: /usr/local/bin/crun.
#      (Debian 12's crun 1.8 has no CRIU.) A failure here is a warning, not an error; the
#      test suite's crun variants then fail (PODSHIM_TESTS_WITHOUT_CRUN=1 skips them).
#   3b. containerd 1.7 (trixie) and 2.1 (sid) binary packages unpacked (not installed) into
#      /var/cache/podshim/containerd/<minor>/bin for the test bed (PODSHIM_TEST_CONTAINERD).
#   3c. the Go programs the tests drive, built from pinned Go modules (tools/go/, scripts/gotools.sh)
#      into /var/cache/podshim/go/bin: kubelet, crictl, critest, containerd 2.2 and 2.4 (with ctr), runc 1.3;
#      and the modules of podshim-front (native/front/) fetched into the same module cache.
#   3d. pristine Debian roots (debootstrap, bookworm; PODSHIM_DEBROOTS="bookworm trixie" adds 13)
#      in /var/cache/podshim/debroot/<release> for the package's install test.
#   4. Python: .venv, `pip install -e '.[dev,docs]'` when pyproject.toml changed, and pycriu
#      (from CRIU's source, *_pb2 regenerated with the venv's grpc_tools) into the venv;
#      the compiled runtime wrapper native/podshim-runc.c as .venv/bin/podshim-runc (its
#      Python hook is the console script .venv/bin/podshim-runc-hook), and podshim-front (the
#      compiled server of podshim's socket, Go: native/front/) as .venv/bin/podshim-front.
#
# Environment:
#   PODSHIM_BUILD_DIR   where sources are fetched and built (default /var/cache/podshim/build)
#   PODSHIM_FORCE_BUILD=1  rebuild and reinstall CRIU and crun even if they look fine
#   PODSHIM_SKIP_SYSTEM=1  (non-root only) skip steps 1-3 instead of running them via sudo
#
# Steps 1-3 need root; run as another user, they go through sudo.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
# shellcheck source=scripts/pycriu.sh
. "$REPO_ROOT/scripts/pycriu.sh"

BUILD_DIR=${PODSHIM_BUILD_DIR:-/var/cache/podshim/build}
FORCE_BUILD=${PODSHIM_FORCE_BUILD:-0}
PREFIX=/usr/local
NEW_SUITE=trixie
CRIU_MIN=4.1
CRUN_MIN=1.21
APT_SRC_FILE=/etc/apt/sources.list.d/podshim-src.sources
PYCRIU_SRC_DIR=$PREFIX/share/podshim/pycriu-src
CRIU_PATCH_DIR=$REPO_ROOT/scripts/patches/criu
CRIU_PATCH_STAMP=$PREFIX/share/podshim/criu-patches  # the patch set the installed CRIU carries
VENV=$REPO_ROOT/.venv
export DEBIAN_FRONTEND=noninteractive
export PATH="$PREFIX/sbin:$PREFIX/bin:$PATH"

APT_PACKAGES=(
  # runtime: the container stack podshim drives
  containerd runc iptables iproute2 containernetworking-plugins busybox-static
  # toolchain
  build-essential dpkg-dev pkgconf xz-utils ca-certificates python3 python3-venv patch
  # podshim-runc, linked statically against musl (native/Makefile: a cheaper exec than glibc's)
  musl-tools
  # CRIU 4.1 build dependencies (trixie's criu source package, without docs)
  libbsd-dev libcap-dev libgnutls28-dev libnet1-dev libnftables-dev libnl-3-dev
  libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler uuid-dev
  python3-protobuf
  # crun 1.21 build dependencies (upstream tarball: vendored libocispec, no go-md2man)
  libseccomp-dev libyajl-dev libsystemd-dev gperf automake autoconf libtool
  # checkpoints through an OCI registry: the tests' registry and htpasswd -B for its basic auth
  docker-registry apache2-utils
  # the package's install test (tests/test_package.py): a fresh Debian root per run
  debootstrap
  # bench/peers.py: Podman's own checkpoint/restore beside podshim's (private store per run)
  podman
)

T0=$(date +%s)
step() { printf '==> %s\n' "$*"; }
info() { printf '    %s\n' "$*"; }
warn() { printf 'WARNING: %s\n' "$*" >&2; }
die() { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

# version_ge A B: true when version A >= B (sort -V order).
version_ge() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$2" ]; }

# run_logged LOG CMD...: run CMD with its output in LOG; on failure show the log's tail.
run_logged() {
  local log=$1; shift
  if ! "$@" >>"$log" 2>&1; then
    warn "command failed: $* (log: $log)"
    tail -n 40 "$log" >&2 || true
    return 1
  fi
}

multiarch() {
  dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch
}

# ---------------------------------------------------------------------------------------
# 1. apt
# ---------------------------------------------------------------------------------------
APT_UPDATED=0
apt_update() {
  if [ "$APT_UPDATED" = 0 ]; then
    info "apt-get update"
    apt-get update -qq
    APT_UPDATED=1
  fi
}

# The machine's Debian mirror URI, read from its own apt sources (never hard-coded here).
mirror_uri() {
  local codename uri=""
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
  if [ -r /etc/apt/sources.list.d/debian.sources ]; then
    # deb822: the URIs of the stanza whose Suites name the release itself.
    uri=$(awk -v c="$codename" '
      BEGIN { RS = ""; FS = "\n" }
      { u = ""; s = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/)   { split($i, a, /[ \t]+/); u = a[2] }
          if ($i ~ /^Suites:/) { n = split($i, b, /[ \t]+/); for (j = 2; j <= n; j++) if (b[j] == c) s = 1 }
        }
        if (s && u != "") { print u; exit } }' /etc/apt/sources.list.d/debian.sources)
    if [ -z "$uri" ]; then
      uri=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
    fi
  fi
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    # one-line format: deb [opts] URI suite components...
    uri=$(awk -v c="$codename" '
      $1 == "deb" { i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                    if ($(i + 1) == c) { print $i; exit } }' /etc/apt/sources.list)
  fi
  [ -n "$uri" ] || die "cannot find the Debian mirror URI in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"
  printf '%s\n' "${uri%/}"
}

step_apt() {
  step "apt: $NEW_SUITE deb-src entry and packages"
  local uri want
  uri=$(mirror_uri)
  want="# Managed by podshim scripts/setup.sh: source packages of Debian's $NEW_SUITE, used only
# to build CRIU and crun from source. No binary packages come from this entry.
Types: deb-src
URIs: $uri
Suites: $NEW_SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
  if [ "$(cat "$APT_SRC_FILE" 2>/dev/null)" != "$want" ]; then
    printf '%s\n' "$want" >"$APT_SRC_FILE"
    info "wrote $APT_SRC_FILE"
    apt_update
  fi

  local missing=() p installed
  # dpkg-query prints nothing for packages it has never heard of: compare names.
  installed=" $({ dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' "${APT_PACKAGES[@]}" 2>/dev/null || true; } |
    awk '$1 == "ii" { printf "%s ", $2 }')"
  for p in "${APT_PACKAGES[@]}"; do
    [[ "$installed" == *" $p "* ]] || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    info "installing: ${missing[*]}"
    apt_update
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    info "all ${#APT_PACKAGES[@]} packages installed"
  fi
  # docker-registry's package enables a registry on :5000 (all addresses) under systemd; the tests
  # start their own on loopback (testbed/registry.py), so keep the packaged one off
  if [ -d /run/systemd/system ] && systemctl is-enabled --quiet docker-registry 2>/dev/null; then
    systemctl disable --now docker-registry >/dev/null 2>&1 && info "disabled the packaged docker-registry service"
  fi
  # podman's package enables its API socket (root's, on the host's store); bench/peers.py runs
  # podman with a private store and needs no service
  if [ -d /run/systemd/system ] && systemctl is-enabled --quiet podman.socket 2>/dev/null; then
    systemctl disable --now podman.socket >/dev/null 2>&1 && info "disabled the packaged podman.socket"
  fi
}

# ---------------------------------------------------------------------------------------
# Source packages from the newer release: fetch the orig (upstream) tarball with apt-get
# source (apt checks it against the signed Sources index; we check its SHA256 again) and
# unpack it. We build upstream's source as released, not Debian's packaging, so only the
# orig tarball is needed (the mirror proxy here serves it, but not always the .dsc).
# ---------------------------------------------------------------------------------------
# Which apt the source functions ask: the system's (its deb-src entry for $NEW_SUITE), or, with
# SRC_APT=private_apt set by fetch_private_source, the private tree's (deb-src sid) and only
# versions of the upstream series SRC_SERIES ("4.2": 4.2.x).
SRC_APT=""
SRC_SERIES=""
src_apt() { if [ -n "$SRC_APT" ]; then "$SRC_APT" "$@"; else "$@"; fi; }
src_apt_update() { if [ -n "$SRC_APT" ]; then private_apt_update force; else apt_update; fi; }

# src_version PKG: newest version of source package PKG that apt knows (of SRC_SERIES, if set).
src_version() {
  src_apt apt-cache showsrc --only-source "$1" 2>/dev/null | awk -v s="$SRC_SERIES" '
    /^Version:/ { v = $2; u = v; sub(/^[0-9]+:/, "", u); if (s == "" || index(u, s ".") == 1) print v }' |
    sort -V | tail -n1
}

# orig_sha256 PKG VERSION FILE: the SHA256 of FILE listed in PKG's Sources stanza.
orig_sha256() {
  src_apt apt-cache showsrc --only-source "$1" 2>/dev/null | awk -v v="$2" -v f="$3" '
    BEGIN { RS = ""; FS = "\n" }
    { ok = 0; for (i = 1; i <= NF; i++) if ($i == "Version: " v) ok = 1
      if (!ok) next
      in_sums = 0
      for (i = 1; i <= NF; i++) {
        if ($i ~ /^Checksums-Sha256:/) { in_sums = 1; continue }
        if (in_sums && $i ~ /^ /) { split($i, a, " "); if (a[3] == f && !done) { print a[1]; done = 1 } }
        else in_sums = 0
      } }'
}

# find_orig DIR PKG UPVER: the orig tarball of PKG UPVER in DIR, if there.
find_orig() {
  local f
  for f in "$1/${2}_${3}".orig.tar.*; do
    case $f in *.asc) ;; *) [ -f "$f" ] && { printf '%s\n' "$f"; return 0; } ;; esac
  done
  return 0
}

# fetch_source PKG MINVER: unpack PKG's upstream source into $BUILD_DIR/PKG-UPVER and
# print that directory.
fetch_source() {
  local pkg=$1 min=$2 ver upver dl orig sum want top tmp
  ver=$(src_version "$pkg")
  if [ -z "$ver" ] || ! version_ge "${ver#*:}" "$min"; then
    src_apt_update >&2
    ver=$(src_version "$pkg")
  fi
  [ -n "$ver" ] || { warn "apt knows no source package '$pkg'${SRC_SERIES:+ $SRC_SERIES.x} (is the ${SRC_APT:+private }deb-src entry working?)"; return 1; }
  upver=${ver#*:}; upver=${upver%-*}
  version_ge "$upver" "$min" || { warn "$pkg source $ver is older than $min"; return 1; }

  if [ -f "$BUILD_DIR/$pkg-$upver/.podshim-unpacked" ]; then
    printf '%s\n' "$BUILD_DIR/$pkg-$upver"
    return 0
  fi
  dl=$BUILD_DIR/downloads
  mkdir -p "$dl" || return 1
  orig=$(find_orig "$dl" "$pkg" "$upver")
  if [ -z "$orig" ]; then
    info "apt-get source --download-only $pkg=$ver" >&2
    # Non-fatal: only the orig tarball matters (see above); checked just below.
    (cd "$dl" && src_apt apt-get source -qq --download-only -o APT::Sandbox::User=root "$pkg=$ver") \
      >>"$BUILD_DIR/logs/fetch-$pkg.log" 2>&1 || true
    orig=$(find_orig "$dl" "$pkg" "$upver")
    if [ -z "$orig" ]; then
      src_apt_update >&2
      (cd "$dl" && src_apt apt-get source -qq --download-only -o APT::Sandbox::User=root "$pkg=$ver") \
        >>"$BUILD_DIR/logs/fetch-$pkg.log" 2>&1 || true
      orig=$(find_orig "$dl" "$pkg" "$upver")
    fi
  fi
  [ -n "$orig" ] || { warn "could not fetch ${pkg}_${upver}.orig.tar.* (log: $BUILD_DIR/logs/fetch-$pkg.log)"; return 1; }
  want=$(orig_sha256 "$pkg" "$ver" "$(basename "$orig")")
  sum=$(sha256sum "$orig" | cut -d' ' -f1)
  if [ -z "$want" ] || [ "$sum" != "$want" ]; then
    rm -f "$orig"
    warn "SHA256 of $(basename "$orig") does not match the Sources index"; return 1
  fi

  # (set -e does not reach in here: callers run this as `src=$(fetch_source ..) || ..`.)
  tmp=$(mktemp -d "$BUILD_DIR/unpack.XXXXXX") || return 1
  tar -xf "$orig" -C "$tmp" || { rm -rf "$tmp"; warn "cannot unpack $orig"; return 1; }
  top=$(ls "$tmp")
  if [ -z "$top" ] || [ "$(printf '%s\n' "$top" | wc -l)" != 1 ] || [ ! -d "$tmp/$top" ]; then
    rm -rf "$tmp"; warn "unexpected layout of $orig"; return 1
  fi
  rm -rf "${BUILD_DIR:?}/$pkg-$upver"
  mv "$tmp/$top" "$BUILD_DIR/$pkg-$upver" && rmdir "$tmp" || return 1
  printf '%s\n' "$ver" >"$BUILD_DIR/$pkg-$upver/.podshim-unpacked" || return 1
  printf '%s\n' "$BUILD_DIR/$pkg-$upver"
}

# ---------------------------------------------------------------------------------------
# 2. CRIU
# ---------------------------------------------------------------------------------------
criu_version() { "$1" --version 2>/dev/null | awk '/^Version:/ { print $2 }'; }

# criu_patches VERSION: podshim's CRIU patches for CRIU VERSION, in the order they apply: the
# shared ones (scripts/patches/criu/*.patch) and those of VERSION's minor only
# (scripts/patches/criu/<major.minor>/*.patch, e.g. 4.1/ holds a fix 4.2 has upstream), sorted by
# file name together.
criu_patches() {
  local minor p
  minor=$(printf '%s\n' "$1" | cut -d. -f1,2)
  for p in "$CRIU_PATCH_DIR"/*.patch "$CRIU_PATCH_DIR/$minor"/*.patch; do
    if [ -f "$p" ]; then printf '%s\t%s\n' "$(basename "$p")" "$p"; fi
  done | sort | cut -f2
}

# criu_patch_id VERSION: one hash of the patches CRIU VERSION gets.
criu_patch_id() {
  local ps
  mapfile -t ps < <(criu_patches "$1")
  cat "${ps[@]}" /dev/null | sha256sum | cut -d' ' -f1
}

# unpack_again SRC: SRC ($BUILD_DIR/<pkg>-<upver>, made by fetch_source) unpacked afresh from its
# orig tarball in $BUILD_DIR/downloads.
unpack_again() {
  local src=$1 name ver orig tmp top
  name=${src##*/}
  ver=$(cat "$src/.podshim-unpacked")
  orig=$(find_orig "$BUILD_DIR/downloads" "${name%-*}" "${name##*-}")
  [ -n "$orig" ] || return 1
  tmp=$(mktemp -d "$BUILD_DIR/unpack.XXXXXX") || return 1
  tar -xf "$orig" -C "$tmp" && top=$(ls "$tmp") && [ -d "$tmp/$top" ] &&
    rm -rf "$src" && mv "$tmp/$top" "$src" && rmdir "$tmp" && printf '%s\n' "$ver" >"$src/.podshim-unpacked"
}

# apply_patches SRC VERSION: podshim's patches for CRIU VERSION, applied to SRC once. The stamp
# .podshim-patches, written after the last one applied, says which set a tree carries. A tree
# without this set's stamp (never patched, patched with another set, or left half-patched by a
# killed run) is unpacked again from the orig tarball and patched from scratch: a patch's clean
# reverse cannot tell "applied" on a fully patched tree, where later patches change its lines.
apply_patches() {
  local src=$1 p ps id
  id=$(criu_patch_id "$2")
  if [ "$(cat "$src/.podshim-patches" 2>/dev/null)" = "$id" ]; then
    info "CRIU's tree in $src carries podshim's patches ($id)"
    return 0
  fi
  unpack_again "$src" || die "cannot unpack CRIU's source again into $src"
  mapfile -t ps < <(criu_patches "$2")
  for p in "${ps[@]}"; do
    patch -d "$src" -p1 -s -f -N <"$p" || die "patch $(basename "$p") does not apply to $src"
    info "patch $(basename "$p"): applied"
  done
  printf '%s\n' "$id" >"$src/.podshim-patches"
}

# criu_state: prints "ok VERSION" or the reason it is not ok.
criu_state() {
  local bin=$PREFIX/sbin/criu ma v pcv out
  ma=$(multiarch)
  [ -x "$bin" ] || { echo "$bin missing"; return; }
  v=$(criu_version "$bin")
  { [ -n "$v" ] && version_ge "$v" "$CRIU_MIN"; } || { echo "$bin is version '${v:-?}' (< $CRIU_MIN)"; return; }
  [ -e "$PREFIX/lib/$ma/libcriu.so.2" ] || { echo "libcriu.so.2 missing in $PREFIX/lib/$ma"; return; }
  pcv=$(PKG_CONFIG_PATH=$PREFIX/lib/$ma/pkgconfig pkg-config --modversion criu 2>/dev/null || true)
  [ "$pcv" = "$v" ] || { echo "criu.pc says '${pcv:-none}', binary says $v"; return; }
  { [ -f "$PYCRIU_SRC_DIR/VERSION" ] && [ "$(cat "$PYCRIU_SRC_DIR/VERSION")" = "$v" ]; } ||
    { echo "pycriu sources for $v missing in $PYCRIU_SRC_DIR"; return; }
  [ "$(cat "$CRIU_PATCH_STAMP" 2>/dev/null)" = "$(criu_patch_id "$v")" ] ||
    { echo "the installed CRIU lacks podshim's patches (scripts/patches/criu)"; return; }
  out=$("$bin" check 2>&1 || true)
  [[ "$out" == *"Looks good"* ]] || { echo "'criu check' fails: ${out##*$'\n'}"; return; }
  echo "ok $v"
}

step_criu() {
  step "CRIU >= $CRIU_MIN in $PREFIX"
  local state src log ma t
  state=$(criu_state)
  if [ "$FORCE_BUILD" != 1 ] && [ "${state%% *}" = ok ]; then
    info "criu ${state#ok } at $PREFIX/sbin/criu, 'criu check': Looks good"
  else
    [ "$FORCE_BUILD" = 1 ] && state="PODSHIM_FORCE_BUILD=1 (was: $state)"
    info "building CRIU: $state"
    t=$(date +%s)
    mkdir -p "$BUILD_DIR/logs"
    src=$(fetch_source criu "$CRIU_MIN") || die "cannot get CRIU's source"
    apply_patches "$src" "${src##*/criu-}"
    log=$BUILD_DIR/logs/criu-build.log
    : >"$log"
    info "make -j2 criu lib in $src (log: $log)"
    # No docs (asciidoc/xmlto), no plugins; SKIP_PIP_INSTALL keeps pycriu out of the
    # system Python (the venv gets its own copy in the Python step).
    run_logged "$log" make -C "$src" -j2 PREFIX="$PREFIX" SKIP_PIP_INSTALL=1 criu lib ||
      die "CRIU build failed"
    run_logged "$log" make -C "$src" PREFIX="$PREFIX" SKIP_PIP_INSTALL=1 install-criu install-lib ||
      die "CRIU install failed"
    ldconfig

    # Keep what the venv's pycriu is made from (python sources, image .proto files).
    pycriu_save_src "$src" "$PYCRIU_SRC_DIR" || die "cannot keep pycriu's sources in $PYCRIU_SRC_DIR"
    criu_patch_id "$(criu_version "$src/criu/criu")" >"$CRIU_PATCH_STAMP"
    info "installed in $(( $(date +%s) - t ))s"

    state=$(criu_state)
    [ "${state%% *}" = ok ] || die "CRIU still not usable after install: $state"
    info "criu ${state#ok } at $PREFIX/sbin/criu, 'criu check': Looks good"
  fi
  ma=$(multiarch)
  ldconfig -p | grep "libcriu.so.2 .*=> $PREFIX/lib/$ma/libcriu.so.2" >/dev/null ||
    warn "the dynamic linker does not resolve libcriu.so.2 to $PREFIX/lib/$ma (run ldconfig)"
  if [ "$(command -v criu)" != "$PREFIX/sbin/criu" ]; then
    warn "'criu' on PATH is $(command -v criu || echo nothing), not $PREFIX/sbin/criu: put $PREFIX/sbin first in PATH or pass --criu/CriuPath"
  fi
}

# ---------------------------------------------------------------------------------------
# 2b. Newer CRIU series in private prefixes, for the tests (PODSHIM_TEST_CRIU=4.2, testbed/versions.py)
# and the package (`make deb` ships it as /opt/podshim/sbin/criu): built from sid's source
# package (the private apt tree's deb-src entry) with podshim's patches for that series, into
# $CRIU_PRIVATE_DIR/<series>: sbin/criu and, for the package, pycriu's sources (share/pycriu-src);
# no libcriu (crun links /usr/local's).
# /usr/local/sbin/criu is never touched.
# ---------------------------------------------------------------------------------------
CRIU_PRIVATE_DIR=/var/cache/podshim/criu
CRIU_PRIVATE_SERIES=("4.2")

# fetch_private_source PKG SERIES: fetch_source from the private tree, newest SERIES.x.
fetch_private_source() {
  local SRC_APT=private_apt SRC_SERIES=$2
  fetch_source "$1" "$2"
}

# criu_private_state SERIES: "ok VERSION" or why $CRIU_PRIVATE_DIR/SERIES is not usable.
criu_private_state() {
  local dir=$CRIU_PRIVATE_DIR/$1 v out
  [ -x "$dir/sbin/criu" ] || { echo "$dir/sbin/criu missing"; return; }
  v=$(criu_version "$dir/sbin/criu")
  [[ "$v" == "$1".* ]] || { echo "$dir/sbin/criu is version '${v:-?}', not $1.x"; return; }
  [ "$(cat "$dir/share/podshim/criu-patches" 2>/dev/null)" = "$(criu_patch_id "$v")" ] ||
    { echo "it lacks podshim's patches for $v (scripts/patches/criu)"; return; }
  [ "$(cat "$dir/share/pycriu-src/VERSION" 2>/dev/null)" = "$v" ] ||
    { echo "pycriu sources for $v missing in $dir/share/pycriu-src (the package's pycriu)"; return; }
  out=$("$dir/sbin/criu" check 2>&1 || true)
  [[ "$out" == *"Looks good"* ]] || { echo "'criu check' fails: ${out##*$'\n'}"; return; }
  echo "ok $v"
}

build_criu_private() {
  local series=$1 dir=$CRIU_PRIVATE_DIR/$1 src log v tmp
  src=$(fetch_private_source criu "$series") || return 1
  v=${src##*/criu-}
  apply_patches "$src" "$v"
  log=$BUILD_DIR/logs/criu-$series-build.log
  : >"$log"
  info "make -j2 criu lib in $src (log: $log)"
  # lib: also generates pycriu's version.py and magic.py (the package's pycriu)
  run_logged "$log" make -C "$src" -j2 PREFIX="$dir" SKIP_PIP_INSTALL=1 criu lib || return 1
  # installed beside, then renamed into place: a bed using the old one keeps a whole binary
  tmp=$(mktemp -d "$CRIU_PRIVATE_DIR/.install.XXXXXX") || return 1
  install -D -m 0755 "$src/criu/criu" "$tmp/sbin/criu" &&
    pycriu_save_src "$src" "$tmp/share/pycriu-src" &&
    mkdir -p "$tmp/share/podshim" &&
    criu_patch_id "$v" >"$tmp/share/podshim/criu-patches" &&
    criu_patches "$v" | xargs -r -n1 basename >"$tmp/share/podshim/criu-patches.list" || { rm -rf "$tmp"; return 1; }
  rm -rf "$dir.old"
  [ ! -e "$dir" ] || mv "$dir" "$dir.old"
  mv "$tmp" "$dir" && rm -rf "$dir.old"
}

step_criu_private() {
  local series state t
  for series in "${CRIU_PRIVATE_SERIES[@]}"; do
    step "CRIU $series.x (sid, podshim's patches) in $CRIU_PRIVATE_DIR/$series"
    mkdir -p "$CRIU_PRIVATE_DIR"
    state=$(criu_private_state "$series")
    if [ "$FORCE_BUILD" != 1 ] && [ "${state%% *}" = ok ]; then
      info "criu ${state#ok }, 'criu check': Looks good"
      continue
    fi
    info "building CRIU $series: $state"
    t=$(date +%s)
    build_criu_private "$series" || die "building CRIU $series failed"
    state=$(criu_private_state "$series")
    [ "${state%% *}" = ok ] || die "CRIU $series not usable after the build: $state"
    info "criu ${state#ok } built in $(( $(date +%s) - t ))s"
  done
}

# ---------------------------------------------------------------------------------------
# 3. crun with CRIU
# ---------------------------------------------------------------------------------------
CRUN_WARNING=""
crun_state() {
  local bin=$PREFIX/bin/crun v out
  [ -x "$bin" ] || { echo "$bin missing"; return; }
  out=$("$bin" --version 2>/dev/null || true)
  v=$(awk '/^crun version/ { print $3 }' <<<"$out")
  { [ -n "$v" ] && version_ge "$v" "$CRUN_MIN"; } || { echo "$bin is version '${v:-?}' (< $CRUN_MIN)"; return; }
  [[ "$out" == *"+CRIU"* ]] || { echo "$bin built without CRIU"; return; }
  "$bin" checkpoint --help >/dev/null 2>&1 || { echo "'$bin checkpoint --help' fails"; return; }
  echo "ok $v"
}

build_crun() {
  local src log ma
  ma=$(multiarch)
  src=$(fetch_source crun "$CRUN_MIN") || { CRUN_WARNING="cannot get crun's source"; return 1; }
  log=$BUILD_DIR/logs/crun-build.log
  : >"$log"
  info "configure && make -j2 crun in $src (log: $log)"
  # The release tarball carries libocispec with its JSON schemas and generated C, so the
  # golang-github-opencontainers-*-dev packages Debian's packaging wants are not needed.
  # crun dlopen()s libcriu.so.2: the rpath makes it find ours, not a distro one.
  if ! (cd "$src" &&
        run_logged "$log" env PKG_CONFIG_PATH="$PREFIX/lib/$ma/pkgconfig" \
          ./configure --prefix="$PREFIX" LDFLAGS="-Wl,-rpath,$PREFIX/lib/$ma"); then
    CRUN_WARNING="crun configure failed (log: $log)"; return 1
  fi
  if ! grep -q '^#define HAVE_CRIU 1' "$src/config.h"; then
    CRUN_WARNING="crun's configure did not find libcriu (criu.pc in $PREFIX/lib/$ma/pkgconfig); log: $log"
    return 1
  fi
  # `make crun` alone skips BUILT_SOURCES (git-version.h comes from the tarball's copy).
  { run_logged "$log" make -C "$src" git-version.h .version &&
    run_logged "$log" make -C "$src" -j2 crun; } || { CRUN_WARNING="crun build failed (log: $log)"; return 1; }
  install -m 0755 "$src/crun" "$PREFIX/bin/crun" || { CRUN_WARNING="cannot install $PREFIX/bin/crun"; return 1; }
}

step_crun() {
  step "crun >= $CRUN_MIN with CRIU at $PREFIX/bin/crun"
  local state t
  state=$(crun_state)
  if [ "$FORCE_BUILD" != 1 ] && [ "${state%% *}" = ok ]; then
    info "crun ${state#ok } (+CRIU)"
    return 0
  fi
  [ "$FORCE_BUILD" = 1 ] && state="PODSHIM_FORCE_BUILD=1 (was: $state)"
  info "building crun: $state"
  t=$(date +%s)
  mkdir -p "$BUILD_DIR/logs"
  if build_crun; then
    state=$(crun_state)
    if [ "${state%% *}" = ok ]; then
      info "crun ${state#ok } (+CRIU) installed in $(( $(date +%s) - t ))s"
      return 0
    fi
    CRUN_WARNING="crun installed but not usable: $state"
  fi
  warn "crun with CRIU is NOT available: $CRUN_WARNING. podshim can still use runc."
}

# ---------------------------------------------------------------------------------------
# podshim-runc, the compiled runtime wrapper (native/; docs/design/runtime-wrapper.md (The runtime
# wrapper)): $VENV/bin/podshim-runc, next to the Python hook $VENV/bin/podshim-runc-hook (a
# console script). make rebuilds it when native/ changed; it is checked, then renamed into
# place, so the name works at every moment for a containerd that is using it.
# ---------------------------------------------------------------------------------------
WRAPPER_BUILT=$REPO_ROOT/native/build/podshim-runc
FRONT_BUILT=$REPO_ROOT/native/build/podshim-front

build_wrapper() {
  step "podshim-runc and podshim-front: native/podshim-runc.c, native/front/"
  make -s -C "$REPO_ROOT/native" >/dev/null || die "building native/ (podshim-runc, podshim-front) failed"
  local out
  out=$(PODSHIM_CONFIG=/dev/null PODSHIM_RUNTIME_BINARY=/bin/echo "$WRAPPER_BUILT" --root /x state id 2>&1) || true
  [ "$out" = "--root /x state id" ] || die "$WRAPPER_BUILT does not exec the runtime: ${out:-no output}"
  out=$("$FRONT_BUILT" 2>/dev/null) || true
  [ "$out" = "error: --listen, --upstream and --daemon are required" ] || die "$FRONT_BUILT does not run: ${out:-no output}"
}

# install_built BUILT NAME WHAT: $VENV/bin/NAME becomes BUILT by a rename (a no-op if the same),
# so a containerd or podshim running it finds a whole file at every moment.
install_built() {
  local built=$1 dest=$VENV/bin/$2
  if cmp -s "$built" "$dest"; then
    info "$dest is the built $2, up to date"
    return 0
  fi
  install -m 0755 "$built" "$dest.new" && mv -f "$dest.new" "$dest"
  info "installed $dest ($3)"
}

# podshim-runc: the compiled wrapper; podshim-front: where `podshim serve` looks for it, beside
# its interpreter.
install_wrapper() {
  install_built "$WRAPPER_BUILT" podshim-runc "compiled; hands restores to $VENV/bin/podshim-runc-hook"
}
install_front() {
  install_built "$FRONT_BUILT" podshim-front "the compiled server of podshim's socket"
}

# A venv from before the compiled wrapper has podshim-runc as pip's console script. The wrapper
# takes the name before pip runs: the hook is the old script under its new name until pip
# writes it, and the name leaves the old version's RECORD and entry points (pip's uninstall
# removes the files of both), so pip keeps it.
adopt_wrapper_name() {
  local info
  for info in "$VENV"/lib/python3*/site-packages/podshim-*.dist-info; do
    [ -f "$info/RECORD" ] || continue
    grep -q '/bin/podshim-runc,' "$info/RECORD" || grep -qs '^podshim-runc *=' "$info/entry_points.txt" || continue
    if [ ! -e "$VENV/bin/podshim-runc-hook" ] && [ "$(head -c 2 "$VENV/bin/podshim-runc")" = '#!' ]; then
      cp "$VENV/bin/podshim-runc" "$VENV/bin/podshim-runc-hook.new"
      mv -f "$VENV/bin/podshim-runc-hook.new" "$VENV/bin/podshim-runc-hook"
    fi
    sed -i '/\/bin\/podshim-runc,/d' "$info/RECORD"
    [ ! -f "$info/entry_points.txt" ] || sed -i '/^podshim-runc *=/d' "$info/entry_points.txt"
  done
}

# ---------------------------------------------------------------------------------------
# 4. Python: venv, project, pycriu
# ---------------------------------------------------------------------------------------
step_python() {
  build_wrapper
  step "Python venv $VENV"
  if [ ! -x "$VENV/bin/python" ]; then
    info "python3 -m venv .venv"
    python3 -m venv "$VENV"
  fi
  adopt_wrapper_name
  [ ! -e "$VENV/bin/podshim-runc-hook" ] || install_wrapper
  local stamp=$VENV/.podshim-pyproject.sha256 want
  # compat: the editable install is a plain path in a .pth file, not setuptools' import finder,
  # which cost every Python start here (podshim-runc's restore hook at each StartContainer of a
  # restored container among them) about 18 ms.
  # The extras: dev (tests, lint), docs (`make docs`: man pages, the site).
  local extras=dev,docs
  want="$(sha256sum pyproject.toml | cut -d' ' -f1) editable_mode=compat extras=$extras"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    info "pip install -e '.[$extras]' (pyproject.toml, the extras or the install mode changed since last install)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[$extras]" \
      --config-settings editable_mode=compat
    printf '%s\n' "$want" >"$stamp"
  else
    info "project installed, pyproject.toml unchanged"
  fi
  [ -x "$VENV/bin/podshim-runc-hook" ] || die "pip did not install $VENV/bin/podshim-runc-hook"
  install_wrapper
  install_front

  step "pycriu in the venv"
  [ -f "$PYCRIU_SRC_DIR/VERSION" ] || die "no pycriu sources in $PYCRIU_SRC_DIR (CRIU step not done?)"
  local criu_v have pstamp=$VENV/.podshim-pycriu.stamp
  criu_v=$(cat "$PYCRIU_SRC_DIR/VERSION")
  # One interpreter start: the versions pycriu's generated code depends on, and whether
  # pycriu imports at all.
  have=$("$VENV/bin/python" - <<'EOF'
from importlib.metadata import version
state = "ok"
try:
    import pycriu
    from pycriu import images  # noqa: F401
except Exception as e:  # any failure means: reinstall
    state = "broken:" + type(e).__name__
print(f"protobuf={version('protobuf')} grpcio-tools={version('grpcio-tools')} {state}")
EOF
  )
  want="criu=$criu_v ${have% *}"
  if [ "${have##* }" = ok ] && [ "$(cat "$pstamp" 2>/dev/null)" = "$want" ]; then
    info "pycriu $criu_v installed (${have% *})"
    return 0
  fi
  info "installing pycriu $criu_v (${have% *})"
  local stage=$VENV/.podshim-build/pycriu
  pycriu_stage "$PYCRIU_SRC_DIR" "$VENV/bin/python" "$stage" || die "generating pycriu failed"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation --force-reinstall "$stage"
  rm -rf "$VENV/.podshim-build"
  "$VENV/bin/python" -c 'import pycriu; from pycriu import images' ||
    die "pycriu does not import after install"
  pycriu_smoke_test
  printf '%s\n' "$want" >"$pstamp"
}

# Decode a real CRIU image with the venv's pycriu: dump a sleeping process (left running).
pycriu_smoke_test() {
  if [ "$(id -u)" != 0 ]; then
    info "not root: skipping the criu dump / pycriu decode test"
    return 0
  fi
  local dir pid out
  dir=$(mktemp -d /tmp/podshim-pycriu-test.XXXXXX)
  setsid sleep 1000 </dev/null >/dev/null 2>&1 &
  pid=$!
  sleep 0.2
  if ! "$PREFIX/sbin/criu" dump -t "$pid" --leave-running --shell-job -D "$dir" -o dump.log >/dev/null 2>&1; then
    kill "$pid" 2>/dev/null || true
    warn "criu dump for the pycriu test failed, decode not tested: $(tail -n 3 "$dir/dump.log" 2>/dev/null)"
    rm -rf "$dir"
    return 0
  fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  out=$("$VENV/bin/python" - "$dir" <<'EOF'
import sys
import pycriu
d = sys.argv[1]
st = pycriu.images.load(open(d + "/stats-dump", "rb"))
assert st["magic"] == "STATS", st["magic"]
dump = st["entries"][0]["dump"]
pid = pycriu.images.load(open(d + "/pstree.img", "rb"))["entries"][0]["pid"]
core = pycriu.images.load(open("%s/core-%d.img" % (d, pid), "rb"))
# and back: dict -> binary must give the same bytes
import io
for name in ("stats-dump", "core-%d.img" % pid):
    raw = open(d + "/" + name, "rb").read()
    out = io.BytesIO()
    pycriu.images.dump(pycriu.images.load(io.BytesIO(raw)), out)
    assert out.getvalue() == raw, "round trip of %s differs" % name
print("stats-dump: frozen_time=%sus pages_written=%s; core-%d.img: comm=%s" % (
    dump["frozen_time"], dump["pages_written"], pid, core["entries"][0]["tc"]["comm"]))
EOF
  ) || { rm -rf "$dir"; die "pycriu could not decode CRIU's images"; }
  rm -rf "$dir"
  info "decoded (and re-encoded) a real dump: $out"
}

# ---------------------------------------------------------------------------------------
# 3b. containerd 1.7 and 2.1 for the test bed (PODSHIM_TEST_CONTAINERD=1.7|2.1), from the
# binary packages of Debian's newer releases, unpacked (never installed) into
# $CONTAINERD_CACHE/<minor>/bin: containerd, containerd-shim-runc-v2, ctr. They need only libc.
# The apt sources used for this live in a private apt tree ($CONTAINERD_CACHE/apt: its own
# sources list, lists and cache), so the system's apt never sees (nor installs from) them;
# `apt-get download` checks each .deb against the signed Packages index.
# ---------------------------------------------------------------------------------------
CONTAINERD_CACHE=/var/cache/podshim/containerd
CONTAINERD_EXTRA=("1.7:trixie" "2.1:sid")  # upstream minor : Debian suite that ships it
CONTAINERD_WARNING=""

# private_apt CMD ARGS...: apt-get/apt-cache on the private tree only.
private_apt() {
  local cmd=$1 a=$CONTAINERD_CACHE/apt; shift
  "$cmd" -o Dir::Etc::sourcelist="$a/sources.list" -o Dir::Etc::sourceparts=- \
    -o Dir::State::lists="$a/lists" -o Dir::Cache="$a/cache" -o Dir::State::status=/dev/null \
    -o Dir::Etc::preferencesparts=- -o APT::Sandbox::User=root "$@"
}

# containerd_state MINOR: "ok VERSION" when $CONTAINERD_CACHE/MINOR holds a working containerd MINOR.x.
containerd_state() {
  local dir=$CONTAINERD_CACHE/$1 v b
  [ -f "$dir/.podshim-unpacked" ] || { echo "not unpacked"; return; }
  for b in containerd containerd-shim-runc-v2 ctr; do
    [ -x "$dir/bin/$b" ] || { echo "$dir/bin/$b missing"; return; }
  done
  v=$("$dir/bin/containerd" --version 2>/dev/null | awk '{ print $3 }')
  [[ "$v" == "$1".* ]] || { echo "$dir/bin/containerd is version '${v:-?}', not $1.x"; return; }
  echo "ok $v"
}

# private_apt_update [force]: the private tree's sources (binary packages of trixie and sid for
# containerd, sid's source packages for CRIU 4.2) and its lists, updated when older than an hour,
# when the sources changed, or when forced.
private_apt_update() {
  local a=$CONTAINERD_CACHE/apt uri want s
  uri=$(mirror_uri)
  mkdir -p "$a/lists/partial" "$a/cache/archives/partial" || return 1
  want="# Managed by podshim scripts/setup.sh: used only by apt-get download of containerd and apt-get source of CRIU"
  for s in "deb trixie" "deb sid" "deb-src sid"; do
    want+=$'\n'"${s% *} [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri ${s#* } main"
  done
  if [ "$(cat "$a/sources.list" 2>/dev/null)" != "$want" ]; then
    printf '%s\n' "$want" >"$a/sources.list"
    rm -f "$a/.updated"
  fi
  if [ "${1:-}" = force ] || [ ! -f "$a/.updated" ] || [ -n "$(find "$a/.updated" -mmin +60)" ]; then
    info "apt-get update (private list: trixie, sid, sid sources)"
    run_logged "$BUILD_DIR/logs/private-apt.log" private_apt apt-get update || return 1
    touch "$a/.updated"
  fi
}

fetch_containerd() {
  local minor=$1 suite=$2 ver dl dir tmp deb b
  private_apt_update || return 1
  # newest version of $suite's containerd whose upstream version is $minor.x
  ver=$(private_apt apt-cache madison containerd 2>/dev/null |
    awk -F'|' -v s="$suite" -v m="$minor" '{ gsub(/ /, "", $2); split($3, p, " ") }
      p[2] ~ "^" s "/" && $2 ~ "^(.*:)?" m "\\." { print $2 }' | sort -V | tail -n1)
  [ -n "$ver" ] || { CONTAINERD_WARNING+=" no containerd $minor.x in $suite;"; return 1; }
  dl=$CONTAINERD_CACHE/downloads
  mkdir -p "$dl" || return 1
  info "apt-get download containerd=$ver ($suite)"
  (cd "$dl" && run_logged "$BUILD_DIR/logs/containerd-fetch.log" private_apt apt-get download "containerd=$ver") ||
    return 1
  deb=$(ls "$dl"/containerd_"${ver#*:}"_*.deb 2>/dev/null | head -n1)
  [ -n "$deb" ] || return 1
  dir=$CONTAINERD_CACHE/$minor
  tmp=$(mktemp -d "$CONTAINERD_CACHE/unpack.XXXXXX") || return 1
  dpkg -x "$deb" "$tmp/root" || { rm -rf "$tmp"; return 1; }
  mkdir -p "$tmp/out/bin"
  for b in containerd containerd-shim-runc-v2 ctr; do
    mv "$tmp/root/usr/bin/$b" "$tmp/out/bin/$b" || { rm -rf "$tmp"; return 1; }
  done
  printf '%s\n' "$ver" >"$tmp/out/.podshim-unpacked"
  rm -rf "$dir" && mv "$tmp/out" "$dir" && rm -rf "$tmp" "$deb"
}

step_containerd() {
  step "containerd ${CONTAINERD_EXTRA[*]%%:*} for the test bed in $CONTAINERD_CACHE"
  local entry minor suite state
  for entry in "${CONTAINERD_EXTRA[@]}"; do
    minor=${entry%%:*}; suite=${entry#*:}
    state=$(containerd_state "$minor")
    if [ "${state%% *}" != ok ]; then
      info "containerd $minor: $state; fetching from $suite"
      fetch_containerd "$minor" "$suite" || CONTAINERD_WARNING+=" containerd $minor from $suite failed (log: $BUILD_DIR/logs/containerd-fetch.log);"
      state=$(containerd_state "$minor")
    fi
    if [ "${state%% *}" = ok ]; then
      info "containerd ${state#ok } at $CONTAINERD_CACHE/$minor/bin"
    else
      CONTAINERD_WARNING+=" containerd $minor: $state;"
    fi
  done
  [ -z "$CONTAINERD_WARNING" ] || warn "containerd for the test bed:$CONTAINERD_WARNING the core tests on those versions will fail"
}

# ---------------------------------------------------------------------------------------
# crun refuses a hybrid cgroup layout whose cgroup2 mount still offers controllers ("cgroups in
# hybrid mode not supported"). On this kind of machine every controller is a v1 hierarchy except
# hugetlb, left on the cgroup2 mount; mount the leftovers as v1 hierarchies too, as a systemd
# hybrid layout does. No-op on a pure v1 or pure v2 host.
step_cgroups() {
  step "cgroup layout"
  local unified=/sys/fs/cgroup/unified ctrl
  if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ] || [ ! -r "$unified/cgroup.controllers" ]; then
    info "not a hybrid layout: nothing to do"
    return
  fi
  for ctrl in $(cat "$unified/cgroup.controllers"); do
    if [ -n "$(cat "$unified/cgroup.subtree_control")" ]; then
      warn "cgroup2 controllers are in use ($(cat "$unified/cgroup.subtree_control")): crun will not run here"
      return
    fi
    mkdir -p "/sys/fs/cgroup/$ctrl"
    mount -t cgroup -o "$ctrl" cgroup "/sys/fs/cgroup/$ctrl" || warn "could not mount the $ctrl v1 hierarchy"
    info "mounted the $ctrl controller as a v1 hierarchy (was on the cgroup2 mount)"
  done
  info "cgroup2 mount offers no controllers: crun accepts the layout"
}

# ---------------------------------------------------------------------------------------
# 3c. The Go programs the tests drive (kubelet, crictl, critest, containerd 2.2/2.4, runc 1.3),
# built from the pinned modules under tools/go/ into /var/cache/podshim/go (scripts/gotools.sh).
# ---------------------------------------------------------------------------------------
step_gotools() {
  step "Go programs for the tests (tools/go/) in ${PODSHIM_GO_CACHE:-/var/cache/podshim/go}"
  bash "$REPO_ROOT/scripts/gotools.sh"
  step_front_modules
}

# The modules podshim-front needs (native/front/go.sum pins each), fetched into the same module
# cache here, as root; step 4 builds it from that cache alone (native/Makefile: GOPROXY=off).
step_front_modules() {
  local cache=${PODSHIM_GO_CACHE:-/var/cache/podshim/go} src=$REPO_ROOT/native/front key
  key=$(cat "$src/go.mod" "$src/go.sum" | sha256sum | cut -c1-16)
  local stamp=$cache/mod/.podshim-front.$key
  [ -f "$stamp" ] && return 0
  step "podshim-front's Go modules (native/front/go.sum) into $cache/mod"
  (cd "$src" && GOMODCACHE=$cache/mod GOCACHE=$cache/build GOPATH=$cache/path GOTOOLCHAIN=local \
    GOFLAGS=-mod=readonly go mod download) || die "fetching native/front's Go modules failed"
  touch "$stamp"
}

# ---------------------------------------------------------------------------------------
# 3d. Pristine Debian roots for the package's install test (tests/test_package.py, which lays a
# fresh overlay on one per run): debootstrap --variant=minbase with a node's container stack
# (Debian's containerd, runc, CNI plugins, iptables, iproute2, procps), from the machine's own mirror, into
# $DEBROOT_DIR/<release>. PODSHIM_DEBROOTS lists the releases (default bookworm; the matrix adds
# trixie). Built once; again when the package list changes.
# ---------------------------------------------------------------------------------------
DEBROOT_DIR=/var/cache/podshim/debroot
DEBROOT_PACKAGES=containerd,runc,iptables,iproute2,containernetworking-plugins,ca-certificates,procps

step_debroots() {
  local release dir t
  for release in ${PODSHIM_DEBROOTS:-bookworm}; do
    dir=$DEBROOT_DIR/$release
    step "Debian $release root for the package test in $dir"
    if [ "$(cat "$DEBROOT_DIR/.$release.packages" 2>/dev/null)" = "$DEBROOT_PACKAGES" ] && [ -d "$dir" ]; then
      info "present"
      continue
    fi
    t=$(date +%s)
    mkdir -p "$DEBROOT_DIR"
    rm -rf "$dir.tmp"
    info "debootstrap --variant=minbase $release (log: $BUILD_DIR/logs/debootstrap-$release.log)"
    run_logged "$BUILD_DIR/logs/debootstrap-$release.log" debootstrap --variant=minbase \
      --include="$DEBROOT_PACKAGES" "$release" "$dir.tmp" "$(mirror_uri)" || die "debootstrap $release failed"
    rm -rf "$dir.tmp/var/cache/apt/archives/"*.deb
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
    printf '%s\n' "$DEBROOT_PACKAGES" >"$DEBROOT_DIR/.$release.packages"
    info "built in $(( $(date +%s) - t ))s"
  done
}

# ---------------------------------------------------------------------------------------
# 3e. The real-workload test images (PostgreSQL 15, Node.js 18, OpenJDK 17): Debian's own packages, downloaded
# once into the cache, unpacked into OCI images in the test bed's image cache (images/debian.py).
# ---------------------------------------------------------------------------------------
step_debian_images() {
  step "real-workload test images from Debian's packages"
  mkdir -p "$REPO_ROOT/.testbed/images"
  python3 "$REPO_ROOT/images/debian.py" "$REPO_ROOT/.testbed/images" --debs /var/cache/podshim/debs >/dev/null ||
    die "building the real-workload test images failed (images/debian.py)"
  info "$REPO_ROOT/.testbed/images/{postgres,node,jre}.tar"
}

# ---------------------------------------------------------------------------------------
system_steps() {
  mkdir -p "$BUILD_DIR/logs"
  step_apt
  step_cgroups
  step_criu
  step_criu_private
  step_crun
  step_containerd
  step_gotools
  step_debroots
  step_debian_images
}

if [ "${1:-}" = "--system-only" ]; then
  system_steps
  exit 0
fi

if [ "$(id -u)" = 0 ]; then
  system_steps
elif [ "${PODSHIM_SKIP_SYSTEM:-0}" = 1 ]; then
  step "system steps skipped (PODSHIM_SKIP_SYSTEM=1)"
else
  command -v sudo >/dev/null || die "steps 1-3 need root: run as root or install sudo"
  sudo env PODSHIM_BUILD_DIR="$BUILD_DIR" PODSHIM_FORCE_BUILD="$FORCE_BUILD" PODSHIM_DEBROOTS="${PODSHIM_DEBROOTS:-}" \
    bash "$REPO_ROOT/scripts/setup.sh" --system-only
fi
step_python

step "done in $(( $(date +%s) - T0 ))s: criu $(criu_version "$PREFIX/sbin/criu") ($PREFIX/sbin/criu), $(
  "$PREFIX/bin/crun" --version 2>/dev/null | awk 'NR == 1' || echo 'crun: not built') ($PREFIX/bin/crun)"
if [ -n "$CRUN_WARNING" ]; then
  warn "crun with CRIU is NOT available: $CRUN_WARNING"
fi
if [ -n "$CONTAINERD_WARNING" ]; then
  warn "containerd for the test bed:$CONTAINERD_WARNING"
fi
