#!/usr/bin/env python3
"""Build podshim's test images as OCI image-layout tarballs, from scratch, without docker.

    python images/build.py OUT_DIR [--force]

Writes into OUT_DIR:

* ``pause.tar``   -> ``localhost/podshim/pause:1``   (/pause, static)
* ``busybox.tar`` -> ``localhost/podshim/busybox:1`` (static busybox + applet symlinks, /etc, /tmp)
* ``counter.tar`` -> ``localhost/podshim/counter:1`` (busybox layer + /counter,
  /ticker and /sharer; Entrypoint /counter)
* ``images.json``  the list of images: name, tar file, manifest/config digests
* ``stamp``        hash of every input; a rebuild is skipped when it matches

    python images/build.py OUT_DIR --critest

writes critest's images instead (``critest-*.tar``, ``critest.json``; see CRITEST_DEFAULT).

Each tarball is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``) whose
index names its manifest with the ``org.opencontainers.image.ref.name`` (and containerd's
``io.containerd.image.name``) annotation, so that
``ctr -n k8s.io images import --all-platforms X.tar`` registers it under the full name.

Everything is deterministic: fixed mtimes, root owner, sorted entries, gzip without a timestamp.
The C programs are compiled here with ``gcc -O2 -static``.  Standard library only.
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
EPOCH = 946684800  # 2000-01-01T00:00:00Z, the mtime of every file in every layer
CREATED = "2000-01-01T00:00:00Z"
BUSYBOX = Path("/bin/busybox")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CC = ["gcc", "-O2", "-static", "-s", "-Wall", "-Wextra"]

PAUSE_IMAGE = "localhost/podshim/pause:1"
BUSYBOX_IMAGE = "localhost/podshim/busybox:1"
COUNTER_IMAGE = "localhost/podshim/counter:1"

MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_INDEX = "application/vnd.oci.image.index.v1+json"


def oci_arch() -> str:
    machine = platform.machine()
    return {
        "x86_64": "amd64",
        "aarch64": "arm64",
        "armv7l": "arm",
        "ppc64le": "ppc64le",
        "s390x": "s390x",
        "riscv64": "riscv64",
    }.get(machine, machine)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------- layers


@dataclass
class Entry:
    """One file-system entry of a layer."""

    path: str  # relative, no leading slash
    kind: str  # "dir" | "file" | "symlink" | "hardlink" (target: a path of the layer)
    mode: int = 0o755
    data: bytes = b""
    target: str = ""


@dataclass
class Layer:
    entries: dict[str, Entry] = field(default_factory=dict)

    def add_dir(self, path: str, mode: int = 0o755) -> None:
        self._parents(path)
        self.entries[path] = Entry(path, "dir", mode)

    def add_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._parents(path)
        self.entries[path] = Entry(path, "file", mode, data)

    def add_symlink(self, path: str, target: str) -> None:
        self._parents(path)
        self.entries[path] = Entry(path, "symlink", 0o777, target=target)

    def add_hardlink(self, path: str, target: str) -> None:
        self._parents(path)
        self.entries[path] = Entry(path, "hardlink", 0o755, target=target)

    def _parents(self, path: str) -> None:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            parent = "/".join(parts[:i])
            if parent not in self.entries:
                self.entries[parent] = Entry(parent, "dir", 0o755)

    def tar_bytes(self) -> bytes:
        """An uncompressed, deterministic tar of the layer (the diff)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            # hard links after every file (their targets), each group sorted
            for path in sorted(self.entries, key=lambda p: (self.entries[p].kind == "hardlink", p)):
                e = self.entries[path]
                info = tarfile.TarInfo(e.path + ("/" if e.kind == "dir" else ""))
                info.mtime = EPOCH
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mode = e.mode
                if e.kind == "dir":
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                elif e.kind in ("symlink", "hardlink"):
                    info.type = tarfile.SYMTYPE if e.kind == "symlink" else tarfile.LNKTYPE
                    info.linkname = e.target
                    tar.addfile(info)
                else:
                    info.type = tarfile.REGTYPE
                    info.size = len(e.data)
                    tar.addfile(info, io.BytesIO(e.data))
        return buf.getvalue()


@dataclass
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + sha256_hex(self.data)

    def descriptor(self) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data)}


@dataclass
class ImageSpec:
    name: str
    file: str
    layers: list[Layer]
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    env: list[str] = field(default_factory=lambda: [PATH_ENV])
    working_dir: str = "/"
    user: str = ""  # the config's User ("uid", "name", "uid:gid"...); empty: root


@dataclass
class BuiltImage:
    name: str
    file: str
    manifest_digest: str
    config_digest: str


def _gzip_layer(diff: bytes) -> bytes:
    return gzip.compress(diff, compresslevel=6, mtime=0)


def write_oci_archive(spec: ImageSpec, out: Path) -> BuiltImage:
    """Write ``spec`` as an OCI image-layout tarball at ``out`` (atomically)."""
    blobs: dict[str, Blob] = {}
    layer_blobs: list[Blob] = []
    diff_ids: list[str] = []
    for layer in spec.layers:
        diff = layer.tar_bytes()
        diff_ids.append("sha256:" + sha256_hex(diff))
        blob = Blob(MT_LAYER, _gzip_layer(diff))
        layer_blobs.append(blob)
        blobs[blob.digest] = blob

    container_config: dict[str, object] = {"Env": spec.env, "WorkingDir": spec.working_dir}
    if spec.user:
        container_config["User"] = spec.user
    if spec.entrypoint is not None:
        container_config["Entrypoint"] = spec.entrypoint
    if spec.cmd is not None:
        container_config["Cmd"] = spec.cmd
    config = {
        "architecture": oci_arch(),
        "os": "linux",
        "created": CREATED,
        "config": container_config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [
            {"created": CREATED, "created_by": f"podshim images/build.py ({spec.name})"} for _ in spec.layers
        ],
    }
    config_blob = Blob(MT_CONFIG, canonical_json(config))
    blobs[config_blob.digest] = config_blob

    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": config_blob.descriptor(),
        "layers": [b.descriptor() for b in layer_blobs],
    }
    manifest_blob = Blob(MT_MANIFEST, canonical_json(manifest))
    blobs[manifest_blob.digest] = manifest_blob

    manifest_desc = manifest_blob.descriptor()
    manifest_desc["platform"] = {"architecture": oci_arch(), "os": "linux"}
    manifest_desc["annotations"] = {
        "org.opencontainers.image.ref.name": spec.name,
        "io.containerd.image.name": spec.name,
    }
    index = {"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [manifest_desc]}

    files: list[tuple[str, bytes]] = [
        ("oci-layout", canonical_json({"imageLayoutVersion": "1.0.0"})),
        ("index.json", canonical_json(index)),
    ]
    for digest in sorted(blobs):
        files.append(("blobs/sha256/" + digest.split(":", 1)[1], blobs[digest].data))

    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(d + "/")
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, out)
    return BuiltImage(spec.name, out.name, manifest_blob.digest, config_blob.digest)


# ---------------------------------------------------------------------------- contents


def compile_c(source: Path, output: Path) -> bytes:
    subprocess.run([*CC, "-o", str(output), str(source)], check=True)
    return output.read_bytes()


def busybox_layer(hardlinks: bool = False) -> Layer:
    """busybox and its applets: symlinks to /bin/busybox, or (``hardlinks``, as in the e2e busybox
    image critest was written for) hard links, so that masking one applet masks only it."""
    layer = Layer()
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "home", "var", "dev", "proc", "sys"):
        layer.add_dir(d, 0o700 if d == "root" else 0o755)
    layer.add_dir("tmp", 0o1777)
    layer.add_dir("var/tmp", 0o1777)
    layer.add_file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    listing = subprocess.run([str(BUSYBOX), "--list-full"], check=True, capture_output=True, text=True).stdout
    for applet in listing.split():
        applet = applet.strip("/")
        if "/" not in applet or applet == "bin/busybox":
            continue  # e.g. "linuxrc"
        if hardlinks:
            layer.add_hardlink(applet, "bin/busybox")
        else:
            layer.add_symlink(applet, "/bin/busybox")
    layer.add_file(
        "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    )
    layer.add_file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
    layer.add_file("etc/hostname", b"podshim\n")
    return layer


def input_stamp() -> str:
    """A hash of everything the output depends on."""
    h = hashlib.sha256()
    sources = [
        HERE / f"{name}.c" for name in ("pause", "counter", "ticker", "sharer", "webserver", "nonewprivs")
    ]
    for path in (Path(__file__).resolve(), *sources, BUSYBOX):
        h.update(path.name.encode() + b"\0" + sha256_hex(path.read_bytes()).encode() + b"\n")
    cc = subprocess.run([CC[0], "--version"], capture_output=True, text=True, check=True).stdout
    h.update(" ".join(CC).encode() + b"\n" + cc.encode() + oci_arch().encode())
    return h.hexdigest()


def build_all(out_dir: Path, force: bool = False) -> list[BuiltImage]:
    """Build the three images into ``out_dir`` unless the stamp says they are up to date."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent builders wait for each other
        stamp = input_stamp()
        stamp_file, list_file = out_dir / "stamp", out_dir / "images.json"
        if not force and stamp_file.is_file() and list_file.is_file():
            if stamp_file.read_text().strip() == stamp:
                built = [BuiltImage(**d) for d in json.loads(list_file.read_text())]
                if all((out_dir / b.file).is_file() for b in built):
                    return built
        with tempfile.TemporaryDirectory(prefix="build-", dir=out_dir) as tmp:
            pause = compile_c(HERE / "pause.c", Path(tmp) / "pause")
            counter = compile_c(HERE / "counter.c", Path(tmp) / "counter")
            ticker = compile_c(HERE / "ticker.c", Path(tmp) / "ticker")
            sharer = compile_c(HERE / "sharer.c", Path(tmp) / "sharer")
        pause_layer = Layer()
        pause_layer.add_file("pause", pause, 0o755)
        base = busybox_layer()
        counter_layer = Layer()
        counter_layer.add_file("counter", counter, 0o755)
        counter_layer.add_file("ticker", ticker, 0o755)  # periodic timers (tests of restored timers)
        counter_layer.add_file("sharer", sharer, 0o755)  # state shared between containers
        specs = [
            ImageSpec(PAUSE_IMAGE, "pause.tar", [pause_layer], entrypoint=["/pause"]),
            ImageSpec(BUSYBOX_IMAGE, "busybox.tar", [base], cmd=["sh"]),
            ImageSpec(COUNTER_IMAGE, "counter.tar", [base, counter_layer], entrypoint=["/counter"]),
        ]
        built = [write_oci_archive(spec, out_dir / spec.file) for spec in specs]
        tmp_list = list_file.with_name(list_file.name + ".tmp")
        tmp_list.write_text(json.dumps([b.__dict__ for b in built], indent=2) + "\n")
        os.replace(tmp_list, list_file)
        stamp_file.write_text(stamp + "\n")
        return built


# ---------------------------------------------------------------------------- critest's images

# The images critest v1.37.0 pulls (sigs.k8s.io/cri-tools pkg/validate, pkg/framework), named by
# repository path and tag only: the test bed's loopback registry serves them as the mirror of every
# registry (testbed/registry.py, TestBed(registry_mirror=...)), so no registry host is named here.
# Stand-ins built from this directory's sources: busybox for busybox, webserver.c for nginx, httpd
# and hostnet-nginx (the page, the name in the log, nginx's pid file), nonewprivs.c (setuid root).
# The digest-pinned test image cannot be rebuilt (its digest is of the public image's manifest).
CRITEST_DEFAULT = "podshim/busybox:1"  # the test-images file's defaultTestContainerImage
CRITEST_WEBSERVER = "podshim/webserver:1"  # ... and webServerTestImage


PGREP = b"""#!/bin/sh
# pgrep NAME: the pids whose name is NAME (critest's stand-in busybox has no pgrep)
rc=1
for d in /proc/[0-9]*; do
  [ "$(cat "$d/comm" 2>/dev/null)" = "$1" ] && { echo "${d#/proc/}"; rc=0; }
done
exit $rc
"""
IPCS = b"""#!/bin/sh
# ipcs -m: this IPC namespace's shared memory segments (critest's stand-in busybox has no ipcs)
echo "------ Shared Memory Segments --------"
echo "key        shmid      owner      perms      bytes      nattch"
tail -n +2 /proc/sysvipc/shm | while read -r key shmid perms size cpid lpid nattch uid rest; do
  printf "0x%08x %-10s %-10s %-10s %-10s %-10s\\n" "$key" "$shmid" "$uid" "$perms" "$size" "$nattch"
done
"""


def critest_specs(webserver: bytes, nonewprivs: bytes, pause: bytes) -> list[tuple[str, ImageSpec]]:
    base = busybox_layer(hardlinks=True)

    def server(path: str, *args: str) -> ImageSpec:
        layer = Layer()
        layer.add_file(path.lstrip("/"), webserver, 0o755)
        layer.add_dir("var/run")
        return ImageSpec("", "", [base, layer], entrypoint=[path, *args])

    def marked(mark: str, user: str = "", passwd: bytes = b"", group: bytes = b"") -> ImageSpec:
        layer = Layer()
        layer.add_file("etc/podshim-test-image", mark.encode() + b"\n")
        if passwd:
            layer.add_file("etc/passwd", passwd)
        if group:
            layer.add_file("etc/group", group)
        return ImageSpec("", "", [base, layer], cmd=["sh"], user=user)

    root = b"root:x:0:0:root:/root:/bin/sh\n"
    www = root + b"www-data:x:33:33:www-data:/var/www:/bin/false\n"
    www_group = b"root:x:0:\nwww-data:x:33:\n"
    nnp = Layer()
    nnp.add_file("usr/local/bin/nonewprivs", nonewprivs, 0o4755)
    pause_layer = Layer()
    pause_layer.add_file("pause", pause, 0o755)
    tags_image = marked("tags")
    # busybox's applets lack two that critest runs in its default image: stand-ins reading /proc
    tools = Layer()
    tools.add_file("usr/bin/pgrep", PGREP, 0o755)
    tools.add_file("usr/bin/ipcs", IPCS, 0o755)
    return [
        (CRITEST_DEFAULT, ImageSpec("", "", [base, tools], cmd=["sh"])),
        (CRITEST_WEBSERVER, server("/usr/sbin/webserver", "--port", "80", "--name", "nginx")),
        (
            "e2e-test-images/nginx:1.14-2",
            server(
                "/usr/sbin/nginx",
                *("--port", "80", "--name", "nginx", "--pidfile", "/var/run/nginx.pid"),
                *("--title", "nginx: master process nginx -g daemon off;"),  # what critest greps for
            ),
        ),
        (
            "e2e-test-images/httpd:2.4.39-4",
            server("/usr/local/apache2/bin/httpd", "--port", "80", "--name", "httpd"),
        ),
        (
            f"k8s-staging-cri-tools/hostnet-nginx-{oci_arch()}:latest",
            server("/usr/sbin/nginx", "--port", "12003", "--name", "nginx"),
        ),
        (
            "e2e-test-images/nonewprivs:1.3",
            ImageSpec("", "", [base, nnp], entrypoint=["/usr/local/bin/nonewprivs"]),
        ),
        ("k8s-staging-cri-tools/test-image-user-uid:latest", marked("user-uid", "1002")),
        (
            "k8s-staging-cri-tools/test-image-user-username:latest",
            marked("user-username", "www-data", www, www_group),
        ),
        ("k8s-staging-cri-tools/test-image-user-uid-group:latest", marked("user-uid-group", "1003:1003")),
        (
            "k8s-staging-cri-tools/test-image-user-username-group:latest",
            marked("user-username-group", "www-data:www-data", www, www_group),
        ),
        (
            "k8s-staging-cri-tools/test-image-predefined-group:latest",
            marked(
                "predefined-group",
                "1000",
                root + b"default-user:x:1000:1000::/home/default-user:/bin/sh\n",
                b"root:x:0:\ndefault-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n",
            ),
        ),
        ("k8s-staging-cri-tools/test-image-latest:latest", marked("latest")),
        ("k8s-staging-cri-tools/test-image-tag:test", marked("tag")),
        ("k8s-staging-cri-tools/test-image-tag:all", marked("all")),
        *((f"k8s-staging-cri-tools/test-image-{i}:latest", marked(f"different-{i}")) for i in (1, 2, 3)),
        *((f"k8s-staging-cri-tools/test-image-tags:{i}", tags_image) for i in (1, 2, 3)),
        ("pause:3.9", ImageSpec("", "", [pause_layer], entrypoint=["/pause"])),
    ]


def build_critest(out_dir: Path, force: bool = False) -> list[dict[str, str]]:
    """critest's images as OCI archives in ``out_dir`` (``critest.json``: ref, file, digest),
    unless the stamp says they are up to date."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = input_stamp()
        stamp_file, list_file = out_dir / "stamp-critest", out_dir / "critest.json"
        if (
            not force
            and stamp_file.is_file()
            and list_file.is_file()
            and stamp_file.read_text().strip() == stamp
        ):
            listed: list[dict[str, str]] = json.loads(list_file.read_text())
            if all((out_dir / e["file"]).is_file() for e in listed):
                return listed
        with tempfile.TemporaryDirectory(prefix="build-", dir=out_dir) as tmp:
            binaries = [
                compile_c(HERE / f"{n}.c", Path(tmp) / n) for n in ("webserver", "nonewprivs", "pause")
            ]
        listed = []
        built: dict[int, BuiltImage] = {}  # one image under several tags is built once
        for ref, spec in critest_specs(*binaries):
            if id(spec) not in built:
                spec.name = ref
                spec.file = "critest-" + ref.replace("/", "_").replace(":", "_") + ".tar"
                built[id(spec)] = write_oci_archive(spec, out_dir / spec.file)
            b = built[id(spec)]
            listed.append({"ref": ref, "file": b.file, "digest": b.manifest_digest})
        tmp_list = list_file.with_name(list_file.name + ".tmp")
        tmp_list.write_text(json.dumps(listed, indent=2) + "\n")
        os.replace(tmp_list, list_file)
        stamp_file.write_text(stamp + "\n")
        return listed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--critest", action="store_true", help="critest's images instead (critest.json)")
    args = parser.parse_args(argv)
    if shutil.which(CC[0]) is None:
        print(f"build.py: {CC[0]} not found", file=sys.stderr)
        return 1
    if args.critest:
        for e in build_critest(args.out_dir, force=args.force):
            print(f"{e['ref']}\t{args.out_dir / e['file']}\t{e['digest']}")
        return 0
    for b in build_all(args.out_dir, force=args.force):
        print(f"{b.name}\t{args.out_dir / b.file}\t{b.manifest_digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
