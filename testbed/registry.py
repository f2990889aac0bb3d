"""A private OCI registry for the tests: Debian's `docker-registry` (distribution 2.8)
on a loopback port chosen at run time, basic auth (htpasswd -B) unless ``auth=False``, storage in
a directory of its own; stopped by its pid. Nothing of it is written outside that directory.

    with Registry(workdir) as reg:
        reg.host            # "127.0.0.1:<port>"
        reg.auth_env()      # {"PODSHIM_REGISTRY_AUTH": "user:password"}
        reg.blob_path(digest)
        reg.push_archive(oci_tar, "e2e-test-images/busybox:1.29-2")   # an images/build.py archive

Without auth it is the test bed's registry mirror (``TestBed(registry_mirror=...)``): critest's
images pushed under their repository paths, containerd pulling every registry's images from it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REGISTRY_BINARY = "/usr/bin/docker-registry"
HTPASSWD = "/usr/bin/htpasswd"
LOOPBACK = "127.0.0.1"


class RegistryError(RuntimeError):
    pass


def registry_available() -> bool:
    return os.access(REGISTRY_BINARY, os.X_OK) and os.access(HTPASSWD, os.X_OK)


def _cmdline(pid: int) -> list[str]:
    """The argv of a live process (not a zombie), else []."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return []
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (OSError, IndexError):
        return []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class Registry:
    """One registry process. `workdir` must exist; the registry's files go to `workdir/registry-*`."""

    __test__ = False

    def __init__(
        self, workdir: str | os.PathLike[str], user: str = "podshim", timeout: float = 20.0, auth: bool = True
    ) -> None:
        self.dir = Path(workdir) / f"registry-{secrets.token_hex(3)}"
        self.storage = self.dir / "storage"
        self.config = self.dir / "config.yml"
        self.htpasswd = self.dir / "htpasswd"
        self.log = self.dir / "registry.log"
        self.user = user
        self.auth = auth
        self.password = secrets.token_urlsafe(12)
        self.timeout = timeout
        self.port = 0
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def auth_env(self) -> dict[str, str]:
        return {"PODSHIM_REGISTRY_AUTH": f"{self.user}:{self.password}"}

    def ref(self, repo: str, tag: str = "latest") -> str:
        return f"{self.host}/{repo}:{tag}"

    def blob_path(self, digest: str) -> Path:
        """Where distribution's filesystem driver keeps the blob `sha256:<hex>`."""
        algo, _, hexd = digest.partition(":")
        return self.storage / "docker/registry/v2/blobs" / algo / hexd[:2] / hexd / "data"

    # ------------------------------------------------------------------ start / stop

    def __enter__(self) -> Registry:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if not registry_available():
            raise RegistryError(f"{REGISTRY_BINARY} or {HTPASSWD} is missing: run scripts/setup.sh")
        self.dir.mkdir(mode=0o700, parents=True)
        self.storage.mkdir(mode=0o700)
        hashed = subprocess.run(
            [HTPASSWD, "-niB", self.user], input=self.password.encode(), capture_output=True, check=True
        ).stdout
        self.htpasswd.write_bytes(hashed)  # unused without auth
        for attempt in range(5):  # the port is chosen free, but another process may take it meanwhile
            self.port = _free_port()
            self.config.write_text(self._config_yaml())
            out = open(self.log, "ab")
            try:
                self._proc = subprocess.Popen(
                    [REGISTRY_BINARY, "serve", str(self.config)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            finally:
                out.close()
            self.pid = self._proc.pid
            if self._wait_ready():
                return
            self.stop(remove=False)
            if attempt == 4:
                raise RegistryError(f"the registry did not start: {self.log.read_text()[-2000:]}")

    def _config_yaml(self) -> str:
        return f"""version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {self.storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: {self.host}
  secret: {secrets.token_hex(16)}
""" + (
            f"""auth:
  htpasswd:
    realm: podshim-tests
    path: {self.htpasswd}
"""
            if self.auth
            else ""
        )

    def _wait_ready(self) -> bool:
        end = time.monotonic() + self.timeout
        while time.monotonic() < end:
            if self._proc is not None and self._proc.poll() is not None:
                return False
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1)
                return True
            except urllib.error.HTTPError as e:
                if e.code == 401:  # up, and asking for credentials
                    return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def stop(self, remove: bool = True) -> None:
        """Stop the registry process (by its pid) and, with `remove`, its files."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=5)
        self._proc = None
        self.pid = None
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def describe(self) -> dict[str, Any]:
        """What stop_described() needs to stop it from another process (`make down`)."""
        return {"pid": self.pid, "dir": str(self.dir), "config": str(self.config), "host": self.host}

    @staticmethod
    def stop_described(desc: dict[str, Any]) -> None:
        """Stop a registry another process started (its pid, if it still runs our config) and
        remove its files."""
        pid = desc.get("pid")
        if pid and any(desc["config"] in a for a in _cmdline(int(pid))):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)
            end = time.monotonic() + 10
            while _cmdline(int(pid)) and time.monotonic() < end:
                time.sleep(0.05)
            if _cmdline(int(pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(desc["dir"], ignore_errors=True)

    # ------------------------------------------------------------------ push an image archive

    def _request(
        self, method: str, url: str, data: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Any:
        h = dict(headers or {})
        if self.auth:
            h["Authorization"] = "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        req = urllib.request.Request(url, data=data, method=method, headers=h)
        return urllib.request.urlopen(req, timeout=60)

    def push_archive(self, archive: str | os.PathLike[str], ref: str) -> str:
        """Push the one image of an OCI image-layout tarball (images/build.py) as ``repo:tag``;
        returns its manifest digest. Blobs the registry has are not sent again."""
        repo, _, tag = ref.rpartition(":")
        base = f"http://{self.host}/v2/{repo}"
        with tarfile.open(archive) as tar:

            def member(name: str) -> bytes:
                f = tar.extractfile(name)
                if f is None:
                    raise RegistryError(f"{archive}: no {name}")
                return f.read()

            index = json.loads(member("index.json"))
            desc = index["manifests"][0]
            manifest_bytes = member("blobs/sha256/" + desc["digest"].split(":", 1)[1])
            manifest = json.loads(manifest_bytes)
            for blob in [manifest["config"], *manifest["layers"]]:
                digest = blob["digest"]
                try:
                    self._request("HEAD", f"{base}/blobs/{digest}")
                    continue
                except urllib.error.HTTPError as e:
                    if e.code != 404:
                        raise
                upload = self._request("POST", f"{base}/blobs/uploads/", b"")
                location = urllib.parse.urljoin(f"http://{self.host}", upload.headers["Location"])
                sep = "&" if "?" in location else "?"
                data = member("blobs/sha256/" + digest.split(":", 1)[1])
                self._request(
                    "PUT",
                    f"{location}{sep}digest={digest}",
                    data,
                    {"Content-Type": "application/octet-stream"},
                )
            self._request(
                "PUT", f"{base}/manifests/{tag}", manifest_bytes, {"Content-Type": desc["mediaType"]}
            )
        return str(desc["digest"])
