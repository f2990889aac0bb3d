#!/usr/bin/env python3
"""Build the real-workload test images from Debian 12's own packages, as OCI image-layout
tarballs, without an image registry: ``localhost/podshim/postgres:15`` (PostgreSQL 15),
``localhost/podshim/node:18`` (Node.js 18) and ``localhost/podshim/jre:17`` (OpenJDK 17).

    python images/debian.py OUT_DIR [--debs DIR] [--force] [NAME ...]

Each image is the busybox layer of images/build.py plus one layer holding the ``.deb`` files of
its packages unpacked (``dpkg-deb -x``; documentation and translations left out), at the newest
version a Debian repository serves (never a third-party one's). Writes ``OUT_DIR/<file>.tar``
and ``OUT_DIR/<file>.json`` (name, file, digests, the inputs' stamp). The build checks that every
shared library the image's programs need is in it (the dynamic loader's ``--list`` in a chroot of
it), so a package list that misses one fails here, not in a test.
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build  # noqa: E402  (images/build.py, beside this file)

PG_BIN = "/usr/lib/postgresql/15/bin"
PG_UID = 999
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LIBC = ("libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libssl3", "libicu72")


@dataclass(frozen=True)
class DebianImage:
    name: str
    file: str  # <file>.tar, <file>.json
    packages: tuple[str, ...]
    checked: tuple[str, ...]  # programs whose libraries must all be in the image
    env: tuple[str, ...] = (f"PATH={PATH}",)
    users: tuple[tuple[str, int], ...] = ()  # (name, uid = gid) added to /etc/passwd and /etc/group


# postgresql-15 and the libraries its programs link (ldd); tzdata for the server's time zones.
# postgresql-common (perl wrappers, cluster management) is not needed.
POSTGRES = DebianImage(
    "localhost/podshim/postgres:15",
    "postgres",
    (
        "postgresql-15",
        "postgresql-client-15",
        "libpq5",
        *LIBC,
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
        "libsystemd0",
        "libtasn1-6",
        "libtinfo6",
        "libunistring2",
        "libxml2",
        "libzstd1",
        "tzdata",
    ),
    (f"{PG_BIN}/postgres", f"{PG_BIN}/psql", f"{PG_BIN}/initdb", f"{PG_BIN}/pg_ctl"),
    env=(f"PATH={PG_BIN}:{PATH}",),
    users=(("postgres", PG_UID),),
)
# Debian's node loads these builtins from /usr/share/nodejs (libnode108's Depends)
NODE_JS = ("node-acorn", "node-xtend", "node-cjs-module-lexer", "node-undici", "node-busboy")
NODE = DebianImage(
    "localhost/podshim/node:18",
    "node",
    ("nodejs", "libnode108", *LIBC, "libbrotli1", "libc-ares2", "libnghttp2-14", "libuv1", *NODE_JS),
    ("/usr/bin/node",),
)
# the JRE alone: its module image holds jdk.compiler (the single-file source launcher, `java
# Server.java`) and jdk.httpserver; the AWT and sound libraries it depends on are never loaded
JVM_HOME = "/usr/lib/jvm/java-17-openjdk-amd64"
JVM = DebianImage(
    "localhost/podshim/jre:17",
    "jre",
    ("openjdk-17-jre-headless", *LIBC),
    # the launcher and the VM (the VM's own libraries link the VM, which the launcher has loaded)
    (f"{JVM_HOME}/bin/java", f"{JVM_HOME}/lib/server/libjvm.so"),
    env=(f"PATH={JVM_HOME}/bin:{PATH}", f"JAVA_HOME={JVM_HOME}"),
)
IMAGES = {i.file: i for i in (POSTGRES, NODE, JVM)}
SKIP = ("usr/share/doc/", "usr/share/man/", "usr/share/locale/", "usr/share/lintian/", "usr/share/info/")


def debian_version(package: str) -> str:
    """The newest version of `package` a Debian repository serves (apt-cache madison lists the
    newest first; a third-party repository's build of the same name is passed over)."""
    out = subprocess.run(["apt-cache", "madison", package], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 3 and "debian.org" in fields[2] and fields[2].endswith("Packages"):
            return fields[1]
    raise SystemExit(f"debian.py: no Debian repository serves {package}")


def download(packages: tuple[str, ...], debs: Path) -> list[Path]:
    """The .deb of each package, downloaded by apt into `debs` unless there already."""
    debs.mkdir(parents=True, exist_ok=True)

    def have() -> dict[str, Path]:
        return {p.name.split("_", 1)[0]: p for p in debs.glob("*.deb")}

    missing = [name for name in packages if name not in have()]
    if missing:
        wanted = [f"{name}={debian_version(name)}" for name in missing]
        subprocess.run(["apt-get", "download", "-q", *wanted], cwd=debs, check=True, capture_output=True)
    found = have()
    lost = [name for name in packages if name not in found]
    if lost:
        raise SystemExit(f"debian.py: apt did not download {', '.join(lost)}")
    return [found[name] for name in packages]


def unpack(debs: list[Path], root: Path) -> None:
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)


def check_libraries(root: Path, checked: tuple[str, ...]) -> None:
    """Every library the programs need resolves inside the image (the dynamic loader's --list,
    run in a chroot of it: what ldd prints)."""
    for prog in checked:
        out = subprocess.run(
            ["chroot", str(root), "/lib64/ld-linux-x86-64.so.2", "--list", prog],
            capture_output=True,
            text=True,
            check=False,
        )
        missing = [line.split()[0] for line in out.stdout.splitlines() if "not found" in line]
        if out.returncode != 0 or missing:
            raise SystemExit(f"debian.py: {prog} lacks {', '.join(missing) or out.stderr.strip()}")


def packages_layer(root: Path, users: tuple[tuple[str, int], ...]) -> build.Layer:
    """The unpacked packages as a layer (hard links as copies), and the image's users."""
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
    passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    group = b"root:x:0:\nnogroup:x:65534:\n"
    for name, uid in users:
        passwd += f"{name}:x:{uid}:{uid}:{name}:/var/lib/{name}:/bin/sh\n".encode()
        group += f"{name}:x:{uid}:\n".encode()
    layer.add_file("etc/passwd", passwd)
    layer.add_file("etc/group", group)
    return layer


def stamp_of(image: DebianImage, debs: list[Path]) -> str:
    h = hashlib.sha256(repr(image).encode())
    for p in (Path(__file__).resolve(), Path(build.__file__).resolve(), build.BUSYBOX):
        h.update(p.name.encode() + build.sha256_hex(p.read_bytes()).encode())
    for deb in debs:
        h.update(deb.name.encode())
    return h.hexdigest()


def build_image(image: DebianImage, out_dir: Path, debs_dir: Path, force: bool = False) -> build.BuiltImage:
    """`image` into `out_dir` unless its stamp says it is up to date; its packages kept in
    `debs_dir/<file>/`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f".lock-{image.file}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent builders wait for each other
        debs = download(image.packages, debs_dir / image.file)
        stamp = stamp_of(image, debs)
        listed = out_dir / f"{image.file}.json"
        if not force and listed.is_file():
            doc = json.loads(listed.read_text())
            if doc.get("stamp") == stamp and (out_dir / doc["file"]).is_file():
                fields = ("name", "file", "manifest_digest", "config_digest")
                return build.BuiltImage(*(doc[f] for f in fields))
        with tempfile.TemporaryDirectory(prefix=f"{image.file}-", dir=out_dir) as tmp:
            root = Path(tmp) / "root"
            root.mkdir()
            unpack(debs, root)
            check_libraries(root, image.checked)
            layer = packages_layer(root, image.users)
        spec = build.ImageSpec(
            image.name, f"{image.file}.tar", [build.busybox_layer(), layer], cmd=["sh"], env=list(image.env)
        )
        built = build.write_oci_archive(spec, out_dir / spec.file)
        tmp_list = listed.with_name(listed.name + ".tmp")
        tmp_list.write_text(json.dumps({**built.__dict__, "stamp": stamp}, indent=2) + "\n")
        os.replace(tmp_list, listed)
        return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("names", nargs="*", help=f"the images: {', '.join(IMAGES)} (default: all)")
    parser.add_argument("--debs", type=Path, help="where the .deb files are kept (default OUT_DIR/debs)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_intermixed_args(argv)
    for tool in ("apt-get", "apt-cache", "dpkg-deb", "chroot"):
        if shutil.which(tool) is None:
            print(f"debian.py: {tool} not found", file=sys.stderr)
            return 1
    unknown = [n for n in args.names if n not in IMAGES]
    if unknown:
        parser.error(f"unknown image {unknown[0]!r} (known: {', '.join(IMAGES)})")
    for name in args.names or IMAGES:
        b = build_image(IMAGES[name], args.out_dir, args.debs or args.out_dir / "debs", force=args.force)
        print(f"{b.name}\t{args.out_dir / b.file}\t{b.manifest_digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
