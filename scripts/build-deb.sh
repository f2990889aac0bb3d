#!/usr/bin/env bash
# `make deb`: podshim_<version>_amd64.deb from this checkout, with dpkg-deb (docs/design/install.md
# (Installing a node)). Run after the set-up (`make setup`): it takes the compiled wrapper and
# the private CRIU 4.2 build (with podshim's patches) from it; the only network it uses is PyPI.
#
#   bash scripts/build-deb.sh [OUT_DIR]      (default dist/)
#
# What the package holds (one venv for Debian 12's Python 3.11 and Debian 13's 3.13):
#   /opt/podshim/bin/podshim, podshim-runc-hook,    entry scripts on /opt/podshim/bin/python3
#     kubectl-podshim
#   /opt/podshim/bin/python3 -> /usr/bin/python3      the venv's interpreter (pyvenv.cfg next to bin/)
#   /opt/podshim/lib/python3.11/site-packages,        podshim, its pinned dependencies and pycriu, the
#   /opt/podshim/lib/python3.13/site-packages         binary wheels of each Python (pip --python-version);
#                                                     bytecode is compiled by postinst for the one present
#   /opt/podshim/bin/podshim-runc                     the compiled wrapper (static)
#   /opt/podshim/bin/podshim-front                    the server of podshim's socket (Go, static), found
#                                                     beside the interpreter by `podshim serve`
#   /opt/podshim/sbin/criu                            CRIU 4.2 with podshim's patches (never /usr/sbin/criu)
#   /opt/podshim/share/podshim/                       examples (containerd drop-in, kubelet flags), CRIU's
#                                                     patches (GPL: with Debian's criu source they are its source)
#   /usr/bin/podshim -> /opt/podshim/bin/podshim
#   /usr/bin/kubectl-podshim -> /opt/podshim/bin/kubectl-podshim   `kubectl podshim`
#   /usr/share/podshim/deploy/                        the cluster API: kubectl apply -k /usr/share/podshim/deploy
#   /usr/lib/systemd/system/podshim.service           not enabled, not started by the package
#   /usr/share/man/man1/*.1.gz, /usr/share/man/man5/   the manual pages of docs/man/ (`man podshim-checkpointpod`,
#     podshim-config.toml.5.gz                          `man 5 podshim-config.toml`), gzip -9n as Debian's policy asks
#   /etc/podshim/config.toml                          conffile
# Depends only on packages Debian 12 and 13 both ship (CRIU's libraries, python3, iptables).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(realpath -m "${1:-$REPO/dist}")
# shellcheck source=scripts/pycriu.sh
. "$REPO/scripts/pycriu.sh"

PYTHONS=(3.11 3.13)  # Debian 12, Debian 13
CRIU_DIR=/var/cache/podshim/criu/4.2
WRAPPER=$REPO/native/build/podshim-runc
FRONT=$REPO/native/build/podshim-front
DEV_PY=$REPO/.venv/bin/python  # has pip, setuptools and grpc_tools (pycriu's *_pb2)
VERSION=$("$DEV_PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
ARCH=$(dpkg --print-architecture)
PKG=podshim_${VERSION}_${ARCH}

die() { printf 'build-deb: %s\n' "$*" >&2; exit 1; }
info() { printf '    %s\n' "$*"; }
cd "$REPO"
[ -x "$WRAPPER" ] || die "$WRAPPER missing: run make setup"
[ -x "$FRONT" ] || die "$FRONT missing: run make setup"
[ -x "$CRIU_DIR/sbin/criu" ] && [ -f "$CRIU_DIR/share/pycriu-src/VERSION" ] ||
  die "CRIU 4.2 is not built in $CRIU_DIR: run make setup"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/podshim-deb.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/root
OPT=$ROOT/opt/podshim
mkdir -p "$OPT/bin" "$OPT/sbin" "$OPT/share/podshim/criu-patches" "$ROOT/DEBIAN" "$ROOT/usr/bin" \
  "$ROOT/usr/lib/systemd/system" "$ROOT/etc/podshim" "$ROOT/usr/share/doc/podshim" "$OUT"

echo "==> wheels: podshim $VERSION and pycriu $(cat "$CRIU_DIR/share/pycriu-src/VERSION") (pure Python)"
"$DEV_PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WORK/wheels" "$REPO"
pycriu_stage "$CRIU_DIR/share/pycriu-src" "$DEV_PY" "$WORK/pycriu"
"$DEV_PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$WORK/wheels" "$WORK/pycriu"

for py in "${PYTHONS[@]}"; do
  echo "==> site-packages for Python $py (binary wheels from PyPI, pinned by pyproject.toml)"
  # No bytecode: the installed Python's compiles it (postinst), the other's is never used.
  "$DEV_PY" -m pip install -q --disable-pip-version-check --no-compile --target "$OPT/lib/python$py/site-packages" \
    --python-version "$py" --implementation cp --abi "cp${py/./}" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --only-binary=:all: "$WORK"/wheels/*.whl
  rm -rf "$OPT/lib/python$py/site-packages/bin"  # pip --target's scripts (ours are below)
  "$DEV_PY" -m pip list --disable-pip-version-check --format=freeze --path "$OPT/lib/python$py/site-packages" \
    >"$OPT/share/podshim/python$py-packages.txt"
done

echo "==> the venv, the wrapper, CRIU"
ln -s /usr/bin/python3 "$OPT/bin/python3"
ln -s python3 "$OPT/bin/python"
printf 'home = /usr/bin\ninclude-system-site-packages = false\n' >"$OPT/pyvenv.cfg"
entry() {  # NAME MODULE FUNCTION: a console script as pip writes it
  printf '#!/opt/podshim/bin/python3\nimport sys\nfrom %s import %s\nif __name__ == "__main__":\n    sys.exit(%s())\n' \
    "$2" "$3" "$3" >"$OPT/bin/$1"
  chmod 0755 "$OPT/bin/$1"
}
entry podshim shim.cli main
entry podshim-runc-hook shim.wrapper.main main
entry kubectl-podshim shim.kube.plugin main
install -m 0755 "$WRAPPER" "$OPT/bin/podshim-runc"
install -m 0755 "$FRONT" "$OPT/bin/podshim-front"
install -m 0755 "$CRIU_DIR/sbin/criu" "$OPT/sbin/criu"
cp "$CRIU_DIR/share/podshim/criu-patches.list" "$OPT/share/podshim/criu-patches/series"
while IFS= read -r p; do
  cp "$(find "$REPO/scripts/patches/criu" -name "$p" | head -n1)" "$OPT/share/podshim/criu-patches/"
done <"$CRIU_DIR/share/podshim/criu-patches.list"
ln -s /opt/podshim/bin/podshim "$ROOT/usr/bin/podshim"
ln -s /opt/podshim/bin/kubectl-podshim "$ROOT/usr/bin/kubectl-podshim"

echo "==> configuration, unit, examples"
install -m 0644 systemd/config.toml "$ROOT/etc/podshim/config.toml"
install -m 0644 systemd/podshim.service "$ROOT/usr/lib/systemd/system/podshim.service"
install -m 0644 systemd/containerd-podshim.toml systemd/kubelet.env systemd/kubelet-podshim.conf \
  "$OPT/share/podshim/"
install -d "$ROOT/usr/share/podshim/deploy"
install -m 0644 deploy/*.yaml "$ROOT/usr/share/podshim/deploy/"

echo "==> manual pages"
for page in docs/man/*.1 docs/man/*.5; do
  section=${page##*.}
  install -d "$ROOT/usr/share/man/man$section"
  # -n: no name or time stamp in the .gz, so the same page gives the same bytes
  gzip -9n <"$page" >"$ROOT/usr/share/man/man$section/$(basename "$page").gz"
done
[ -f "$ROOT/usr/share/man/man1/podshim-checkpointpod.1.gz" ] && [ -f "$ROOT/usr/share/man/man5/podshim-config.toml.5.gz" ] ||
  die "docs/man/ lacks the manual pages: make docs"

cat >"$ROOT/usr/share/doc/podshim/copyright" <<EOF
podshim $VERSION: Apache-2.0 (the project's checkout: LICENSE terms in pyproject.toml).
/opt/podshim/sbin/criu: CRIU $("$CRIU_DIR/sbin/criu" --version | awk '/^Version:/ { print $2 }'), GPL-2.0-only, built
  from Debian's criu source package with the patches in /opt/podshim/share/podshim/criu-patches/.
/opt/podshim/lib/python3.*/site-packages: each distribution under its own license (its .dist-info);
  pycriu: GPL-2.0-only (CRIU's).
EOF

echo "==> maintainer scripts"
install -m 0755 packaging/debian/postinst packaging/debian/prerm packaging/debian/postrm "$ROOT/DEBIAN/"
echo /etc/podshim/config.toml >"$ROOT/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$ROOT" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$size/" packaging/debian/control >"$ROOT/DEBIAN/control"

find "$ROOT" -type d -exec chmod 0755 {} +
find "$ROOT" -type f ! -perm -u+x -exec chmod 0644 {} +
chmod -R go-w "$ROOT"
dpkg-deb --root-owner-group -Zxz -z2 --build "$ROOT" "$OUT/$PKG.deb" >/dev/null
echo "==> $OUT/$PKG.deb: $(du -h "$OUT/$PKG.deb" | cut -f1) ($(( size / 1024 )) MiB installed)"
