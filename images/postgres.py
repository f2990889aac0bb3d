#!/usr/bin/env python3
"""Build ``localhost/podshim/postgres:15``: Debian 12's own PostgreSQL 15, as an OCI image-layout
tarball, from the packages apt downloads (no image registry).

    python images/postgres.py OUT_DIR [--debs DIR] [--force]

Writes ``OUT_DIR/postgres.tar`` and ``OUT_DIR/postgres.json`` (name, file, digests). The image is
the busybox layer of images/build.py plus one layer holding the ``.deb`` files of PACKAGES
unpacked (``dpkg-deb -x``; documentation and translations left out) and a ``postgres`` user
(uid/gid 999). The server and its tools are in /usr/lib/postgresql/15/bin (on PATH); nothing is
configured: a container runs ``initdb`` and ``postgres`` itself, as the project's tests do. The
build checks that every shared library the server and psql need is in the image (the dynamic
loader's ``--list`` in a chroot of it), so a package list that misses one fails here, not in a test.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (images/build.py, beside this file)

POSTGRES_IMAGE = "localhost/podshim/postgres:15"
PG_BIN = "/usr/lib/postgresql/15/bin"
PG_UID = 999
# postgresql-15 and the libraries its programs link (ldd), Debian 12's names; tzdata for the
# server's time zones. postgresql-common (perl wrappers, cluster management) is not needed.
PACKAGES = (
    "postgresql-15",
    "postgresql-client-15",
    "libpq5",
    "libc6",
    "libgcc-s1",
    "libstdc++6",
    "libaudit1",
    "libcap-ng0",
    "libcap2",
    "libcom-err2",
    "libffi8",
    "libgcrypt20",
    "libgmp10",
    "libgnutls30",
    "libgpg-error0",
    "libgssapi-krb5-2",
    "libhogweed6",
    "libicu72",
    "libidn2-0",
    "libk5crypto3",
    "libkeyutils1",
    "libkrb5-3",
    "libkrb5support0",
    "libldap-2.5-0",
    "liblz4-1",
    "liblzma5",
    "libnettle8",
    "libp11-kit0",
    "libpam0g",
    "libreadline8",
    "libsasl2-2",
    "libssl3",
    "libsystemd0",
    "libtasn1-6",
    "libtinfo6",
    "libunistring2",
    "libxml2",
    "libzstd1",
    "zlib1g",
    "tzdata",
)
SKIP = ("usr/share/doc/", "usr/share/man/", "usr/share/locale/", "usr/share/lintian/", "usr/share/info/")
CHECKED = (f"{PG_BIN}/postgres", f"{PG_BIN}/psql", f"{PG_BIN}/initdb", f"{PG_BIN}/pg_ctl")


def download(debs: Path) -> list[Path]:
    """The .deb of each package, downloaded by apt into `debs` unless there already."""
    debs.mkdir(parents=True, exist_ok=True)
    have = {p.name.split("_", 1)[0]: p for p in debs.glob("*.deb")}
    missing = [name for name in PACKAGES if name not in have]
    if missing:
        subprocess.run(["apt-get", "download", "-q", *missing], cwd=debs, check=True, capture_output=True)
        have = {p.name.split("_", 1)[0]: p for p in debs.glob("*.deb")}
    lost = [name for name in PACKAGES if name not in have]
    if lost:
        raise SystemExit(f"postgres.py: apt did not download {', '.join(lost)}")
    return [have[name] for name in PACKAGES]


def unpack(debs: list[Path], root: Path) -> None:
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)


def check_libraries(root: Path) -> None:
    """Every library the programs need resolves inside the image (the dynamic loader's --list,
    run in a chroot of it: what ldd prints)."""
    for prog in CHECKED:
        out = subprocess.run(
            ["chroot", str(root), "/lib64/ld-linux-x86-64.so.2", "--list", prog],
            capture_output=True,
            text=True,
            check=False,
        )
        missing = [line.split()[0] for line in out.stdout.splitlines() if "not found" in line]
        if out.returncode != 0 or missing:
            raise SystemExit(f"postgres.py: {prog} lacks {', '.join(missing) or out.stderr.strip()}")


def server_layer(root: Path) -> build.Layer:
    """The unpacked packages as a layer (hard links as copies), and the postgres user."""
    layer = build.Layer()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath) / name
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if rel.startswith(SKIP) or rel + "/" in SKIP:
                continue
            st = path.lstat()
            if path.is_symlink():
                layer.add_symlink(rel, os.readlink(path))
            elif path.is_dir():
                layer.add_dir(rel, st.st_mode & 0o7777)
            else:
                layer.add_file(rel, path.read_bytes(), st.st_mode & 0o7777)
    layer.add_file(
        "etc/passwd",
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        + f"postgres:x:{PG_UID}:{PG_UID}:PostgreSQL:/var/lib/postgresql:/bin/sh\n".encode(),
    )
    layer.add_file("etc/group", f"root:x:0:\nnogroup:x:65534:\npostgres:x:{PG_UID}:\n".encode())
    return layer


def stamp_of(debs: list[Path]) -> str:
    h = hashlib.sha256()
    for p in (Path(__file__).resolve(), Path(build.__file__).resolve(), build.BUSYBOX):
        h.update(p.name.encode() + build.sha256_hex(p.read_bytes()).encode())
    for deb in debs:
        h.update(deb.name.encode())
    return h.hexdigest()


def build_postgres(out_dir: Path, debs_dir: Path, force: bool = False) -> build.BuiltImage:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock-postgres", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent builders wait for each other
        debs = download(debs_dir)
        stamp = stamp_of(debs)
        listed = out_dir / "postgres.json"
        if not force and listed.is_file():
            doc = json.loads(listed.read_text())
            if doc.get("stamp") == stamp and (out_dir / doc["file"]).is_file():
                return build.BuiltImage(
                    doc["name"], doc["file"], doc["manifest_digest"], doc["config_digest"]
                )
        with tempfile.TemporaryDirectory(prefix="postgres-", dir=out_dir) as tmp:
            root = Path(tmp) / "root"
            root.mkdir()
            unpack(debs, root)
            check_libraries(root)
            layer = server_layer(root)
        spec = build.ImageSpec(
            POSTGRES_IMAGE,
            "postgres.tar",
            [build.busybox_layer(), layer],
            cmd=["sh"],
            env=[f"PATH={PG_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        )
        built = build.write_oci_archive(spec, out_dir / spec.file)
        tmp_list = listed.with_name(listed.name + ".tmp")
        tmp_list.write_text(json.dumps({**built.__dict__, "stamp": stamp}, indent=2) + "\n")
        os.replace(tmp_list, listed)
        return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--debs", type=Path, help="where the .deb files are kept (default OUT_DIR/debs)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    for tool in ("apt-get", "dpkg-deb", "chroot"):
        if shutil.which(tool) is None:
            print(f"postgres.py: {tool} not found", file=sys.stderr)
            return 1
    b = build_postgres(args.out_dir, args.debs or args.out_dir / "debs", force=args.force)
    print(f"{b.name}\t{args.out_dir / b.file}\t{b.manifest_digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
