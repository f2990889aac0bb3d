"""A private OCI registry for the tests (issue 17): Debian's `docker-registry` (distribution 2.8)
on a loopback port chosen at run time, basic auth (htpasswd -B), storage in a directory of its
own; stopped by its pid. Nothing of it is written outside that directory.

    with Registry(workdir) as reg:
        reg.host            # "127.0.0.1:<port>"
        reg.auth_env()      # {"PODSHIM_REGISTRY_AUTH": "user:password"}
        reg.blob_path(digest)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

REGISTRY_BINARY = "/usr/bin/docker-registry"
HTPASSWD = "/usr/bin/htpasswd"
LOOPBACK = "127.0.0.1"


class RegistryError(RuntimeError):
    pass


def registry_available() -> bool:
    return os.access(REGISTRY_BINARY, os.X_OK) and os.access(HTPASSWD, os.X_OK)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class Registry:
    """One registry process. `workdir` must exist; the registry's files go to `workdir/registry-*`."""

    __test__ = False

    def __init__(self, workdir: str | os.PathLike[str], user: str = "podshim", timeout: float = 20.0) -> None:
        self.dir = Path(workdir) / f"registry-{secrets.token_hex(3)}"
        self.storage = self.dir / "storage"
        self.config = self.dir / "config.yml"
        self.htpasswd = self.dir / "htpasswd"
        self.log = self.dir / "registry.log"
        self.user = user
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
        self.htpasswd.write_bytes(hashed)
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
auth:
  htpasswd:
    realm: podshim-tests
    path: {self.htpasswd}
"""

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
