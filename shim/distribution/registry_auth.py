"""Registry access for push and pull (docs/design/distribution.md (Checkpoints through a registry)):
which credentials, which scheme, and the oras client podshim talks through.

Credentials come from the environment (`PODSHIM_REGISTRY_AUTH=user:password`) or a docker config
file (`--registry-config FILE`, else `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`:
`auths.<host>.auth`, base64 of user:password, or `username`/`password`), never from a command-line
value, and never reach a log or an error message. Plain HTTP is used for loopback registries
(127.0.0.0/8, ::1, localhost) and, with `insecure`, for any other; else HTTPS.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import oras.auth.token
import oras.container
import oras.provider
import requests

from shim.deadlines import REGISTRY_CONNECT_TIMEOUT, REGISTRY_READ_TIMEOUT
from shim.errors import FailedPrecondition, InvalidArgument, ShimError, Unavailable

AUTH_ENV = "PODSHIM_REGISTRY_AUTH"
DOCKER_CONFIG_ENV = "DOCKER_CONFIG"


@dataclass(frozen=True)
class Credentials:
    username: str = ""
    password: str = field(default="", repr=False)  # never printed
    source: str = "none"  # where they came from (for messages: never the values)

    def __bool__(self) -> bool:
        return bool(self.username or self.password)


@dataclass(frozen=True)
class Reference:
    """`host[:port]/repository[:tag|@digest]`, parsed by oras."""

    text: str
    container: oras.container.Container

    @property
    def host(self) -> str:
        return str(self.container.registry)

    @property
    def repository(self) -> str:
        return str(self.container.api_prefix)

    @property
    def tag_or_digest(self) -> str:
        return str(self.container.digest or self.container.tag)


def parse_reference(ref: str) -> Reference:
    """A registry reference with an explicit registry host (no implicit Docker Hub)."""
    if not ref or any(c.isspace() or ord(c) < 0x20 for c in ref):
        raise InvalidArgument(f"registry reference {ref!r} is empty or holds spaces/control characters")
    first = ref.split("/", 1)[0]
    if "/" not in ref or not ("." in first or ":" in first or first == "localhost"):
        raise InvalidArgument(
            f"registry reference {ref!r} names no registry host: write HOST[:PORT]/REPOSITORY[:TAG]"
        )
    try:
        c = oras.container.Container(ref)
    except ValueError as e:
        raise InvalidArgument(f"registry reference {ref!r} is not valid: {e}") from None
    return Reference(ref, c)


def is_loopback(host: str) -> bool:
    name = host
    if name.startswith("["):  # [::1]:5000
        name = name[1 : name.find("]")]
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def scheme_for(host: str, insecure: bool) -> str:
    return "http" if insecure or is_loopback(host) else "https"


# ---------------------------------------------------------------------------- credentials


def docker_config_path(explicit: str | None = None, env: Mapping[str, str] | None = None) -> Path | None:
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit)
    if env.get(DOCKER_CONFIG_ENV):
        return Path(env[DOCKER_CONFIG_ENV]) / "config.json"
    home = env.get("HOME") or os.path.expanduser("~")
    p = Path(home) / ".docker" / "config.json"
    return p if p.exists() else None


def _host_keys(host: str) -> list[str]:
    keys = [host, f"https://{host}", f"http://{host}", f"https://{host}/v1/", f"https://{host}/v2/"]
    if host.startswith("localhost:"):
        keys.append(host.replace("localhost", "127.0.0.1", 1))
    elif host.startswith("127.0.0.1:"):
        keys.append(host.replace("127.0.0.1", "localhost", 1))
    return keys


def credentials_for(
    host: str, config_file: str | None = None, env: Mapping[str, str] | None = None
) -> Credentials:
    """The credentials for `host`: $PODSHIM_REGISTRY_AUTH first, then the docker config file
    (an explicit `config_file` must exist and parse). None found: anonymous."""
    env = os.environ if env is None else env
    raw = env.get(AUTH_ENV)
    if raw:
        user, sep, password = raw.partition(":")
        if not sep or not user:
            raise InvalidArgument(f"${AUTH_ENV} must be USER:PASSWORD (its value is not shown)")
        return Credentials(user, password, f"${AUTH_ENV}")
    path = docker_config_path(config_file, env)
    if path is None:
        return Credentials()
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        if config_file:
            raise InvalidArgument(f"registry config {path} does not exist") from None
        return Credentials()
    except (OSError, ValueError) as e:
        raise InvalidArgument(
            f"registry config {path} is unreadable or not JSON ({type(e).__name__})"
        ) from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        return Credentials()
    for key in _host_keys(host):
        entry = auths.get(key)
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise InvalidArgument(
                    f"registry config {path}: auths.{key}.auth is not base64 of USER:PASSWORD"
                ) from None
            if sep:
                return Credentials(user, password, str(path))
        if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
            return Credentials(entry["username"], entry["password"], str(path))
    return Credentials()


# ---------------------------------------------------------------------------- the client


class _Auth(oras.auth.token.TokenAuth):
    """oras' token flow for registries that answer with a Bearer challenge, and plain basic auth
    for those that answer `Basic` (distribution with htpasswd): the header is then sent with every
    request, so a streamed body is never sent twice."""

    def __init__(self) -> None:
        super().__init__()
        self._basic_auth: str | None = None
        self.basic = False

    def get_auth_header(self) -> dict[str, str]:
        if self.basic and self._basic_auth:
            return {"Authorization": f"Basic {self._basic_auth}"}
        return super().get_auth_header()

    def authenticate_request(
        self, original: requests.Response, headers: dict, refresh: bool = False
    ) -> tuple[dict, bool]:
        challenge = original.headers.get("Www-Authenticate", "")
        if challenge.lower().startswith("basic"):
            if not self._basic_auth:
                return headers, False
            self.basic = True
            return {**(headers or {}), **self.get_auth_header()}, True
        return super().authenticate_request(original, headers, refresh)


class RegistryClient(oras.provider.Registry):
    """oras' Registry with podshim's rules: credentials from `credentials_for`, one attempt per
    request (oras retries for minutes; a pull or push fails at once and says why), timeouts, and
    errors as podshim's typed errors (UNAVAILABLE: unreachable; FAILED_PRECONDITION: refused)."""

    def __init__(self, ref: Reference, creds: Credentials, insecure: bool = False) -> None:
        super().__init__(hostname=ref.host, insecure=scheme_for(ref.host, insecure) == "http")
        self.ref = ref
        self.auth = _Auth()
        self.auth.session = self.session
        self.auth.prefix = self.prefix
        self.auth._tls_verify = self._tls_verify
        self.auth._auth_config = {"auths": {}}  # oras must not read other files on its own
        self.creds_source = creds.source
        if creds:
            self.auth.set_basic_auth(creds.username, creds.password)
        self.session.request = functools.partial(
            self.session.request, timeout=(REGISTRY_CONNECT_TIMEOUT, REGISTRY_READ_TIMEOUT)
        )

    def url(self, path: str) -> str:
        return f"{self.prefix}://{path}"

    def do_request(
        self,
        url: str,
        method: str = "GET",
        data: Any = None,
        headers: dict | None = None,
        json: dict | None = None,
        stream: bool = False,
    ) -> requests.Response:
        """One request (plus one with credentials after a 401/403 challenge, only when the body
        can be sent again)."""
        headers = dict(headers or {})
        if self.auth.basic or self.auth.token:
            headers.update(self.auth.get_auth_header())
        try:
            r = self.session.request(method, url, data=data, json=json, headers=headers, stream=stream)
            if r.status_code in (401, 403) and not (data is not None and not isinstance(data, bytes)):
                new, changed = self.auth.authenticate_request(r, headers, refresh=r.status_code == 403)
                if changed:
                    r.close()
                    r = self.session.request(method, url, data=data, json=json, headers=new, stream=stream)
        except requests.exceptions.SSLError as e:
            raise Unavailable(
                f"TLS with registry {self.ref.host} failed ({type(e).__name__}); for a plain-HTTP "
                "registry that is not on loopback pass --insecure"
            ) from None
        except requests.exceptions.RequestException as e:
            raise Unavailable(f"registry {self.ref.host} is unreachable: {_reason(e)}") from None
        if r.status_code in (401, 403):
            r.close()
            said = (
                f"credentials from {self.creds_source}" if self.creds_source != "none" else "no credentials"
            )
            raise FailedPrecondition(
                f"registry {self.ref.host} refused {method} ({r.status_code}) with {said}: set "
                f"${AUTH_ENV}=USER:PASSWORD or log in (docker config file, --registry-config)"
            )
        return r

    def check(self, r: requests.Response, what: str) -> requests.Response:
        if r.status_code in (200, 201, 202, 204):
            return r
        detail = ""
        with _suppress():
            errs = r.json().get("errors") or []
            detail = "; ".join(str(e.get("message") or e.get("code")) for e in errs if isinstance(e, dict))
        r.close()
        if r.status_code == 404:
            from shim.errors import NotFound

            raise NotFound(f"{what}: {self.ref.text} not found in the registry ({detail or 'HTTP 404'})")
        err: type[ShimError] = Unavailable if r.status_code >= 500 else FailedPrecondition
        raise err(f"{what}: registry {self.ref.host} answered HTTP {r.status_code} {detail}".rstrip())


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def _reason(e: BaseException) -> str:
    text = str(e)
    for marker in ("Connection refused", "timed out", "Name or service not known", "Connection reset"):
        if marker in text:
            return marker.lower()
    return type(e).__name__


def client_for(
    ref: str | Reference, *, insecure: bool = False, registry_config: str | None = None
) -> RegistryClient:
    r = parse_reference(ref) if isinstance(ref, str) else ref
    return RegistryClient(r, credentials_for(r.host, registry_config), insecure)
