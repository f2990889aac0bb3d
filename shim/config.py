"""podshim's configuration: one TOML file, overridden by environment, overridden by flags.

Precedence: built-in defaults < config file < PODSHIM_<SECTION>_<KEY> env < command-line flags.
A bad value is a ConfigError whose one-line message names the key.
"""

from __future__ import annotations

import os
import stat
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = "/etc/podshim/config.toml"
KUBELET_KUBECONFIG = "/etc/kubernetes/kubelet.conf"
KUBELET_CHECKPOINT_ROOTS = ("/var/lib/kubelet/pod-checkpoints", "/var/lib/kubelet/checkpoints")
RUNTIME_NAMES = ("upstream", "podshim")
CONFIG_ENV = "PODSHIM_CONFIG"


class ConfigError(Exception):
    """A configuration problem; str() is one line naming the key."""


@dataclass(frozen=True)
class RuntimeConfig:
    """One OCI runtime the upstream uses (runc or crun) and where its state lives; each key's meaning
    is KEY_DOCS["runtime.<key>"]."""

    binary: str = "/usr/sbin/runc"
    root: str = "/run/containerd/runc/k8s.io"
    criu: str = "criu"


@dataclass(frozen=True)
class Config:
    """The effective configuration. Each field is a key of _SCHEMA (a section's key, by its TOML
    name), whose meaning is KEY_DOCS["<section>.<key>"]; `runtime` and `runtimes` are the [runtime]
    and [runtimes.<handler>] tables."""

    socket: str = "/run/podshim/podshim.sock"
    state_dir: str = "/var/lib/podshim"
    metrics_address: str = ""
    runtime_name: str = "upstream"
    front: bool = True
    front_binary: str = ""
    upstream_endpoint: str = "unix:///run/containerd/containerd.sock"
    upstream_timeout: float = 120.0
    allowed_roots: tuple[str, ...] = KUBELET_CHECKPOINT_ROOTS
    container_checkpoint: str = "always"
    encryption_key_file: str = ""
    writeback_ahead: str = "auto"
    file_locks: bool = True
    tcp_established: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False
    rootfs_compression: str = "none"
    ghost_limit: str = "auto"
    ghost_limit_max: str = "64M"
    irmap_scan_paths: tuple[str, ...] = ()
    volume_limit: str = "1G"
    lazy_pages: bool = False
    migration_listen: str = ""
    migration_cert_file: str = ""
    migration_key_file: str = ""
    migration_ca_file: str = ""
    migration_tcp_congestion: str = "cubic"
    kubernetes_kubeconfig: str = KUBELET_KUBECONFIG
    kubernetes_node_name: str = ""
    log_format: str = "json"
    log_level: str = "info"
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    runtimes: dict[str, RuntimeConfig] = field(default_factory=dict)

    def option_defaults(self) -> dict[str, str]:
        """The CheckpointPod options a request leaves out, as option values (docs/design/checkpoint-pod.md
        (What the kubelet sends))."""
        return {
            "file-locks": str(self.file_locks).lower(),
            "tcp-established": str(self.tcp_established).lower(),
            "ext-unix-sk": str(self.ext_unix_sk).lower(),
            "shell-job": str(self.shell_job).lower(),
            "rootfs-compression": self.rootfs_compression,
            "ghost-limit": self.ghost_limit,
            "irmap-scan-paths": ",".join(self.irmap_scan_paths),
        }

    @property
    def scratch_dir(self) -> str:
        """`<state_dir>/scratch`: the short-lived files a dump hands to runc and CRIU (its CRIU
        config file, its DumpGate), emptied at every start (a podshim killed mid-dump leaves
        them), never in the shared temp dir."""
        return os.path.join(self.state_dir, "scratch")

    def runtime_for_handler(self, handler: str) -> RuntimeConfig | None:
        if handler in self.runtimes:
            return self.runtimes[handler]
        if handler in ("", "runc", "default"):
            return self.runtime
        return None

    def runtime_for_root(self, root: str) -> RuntimeConfig:
        """The runtime whose state root is `root` (how podshim-runc tells handlers apart)."""
        norm = os.path.normpath(root)
        for rt in (self.runtime, *self.runtimes.values()):
            if os.path.normpath(rt.root) == norm or os.path.dirname(os.path.normpath(rt.root)) == norm:
                return rt
        return self.runtime


# TOML layout: section -> key -> (Config attribute, type)
_SCHEMA: dict[str, dict[str, tuple[str, type]]] = {
    "server": {
        "socket": ("socket", str),
        "state_dir": ("state_dir", str),
        "metrics_address": ("metrics_address", str),
        "runtime_name": ("runtime_name", str),
        "front": ("front", bool),
        "front_binary": ("front_binary", str),
    },
    "upstream": {
        "endpoint": ("upstream_endpoint", str),
        "timeout_seconds": ("upstream_timeout", float),
    },
    "checkpoint": {
        "allowed_roots": ("allowed_roots", list),
        "container_checkpoint": ("container_checkpoint", str),
        "encryption_key_file": ("encryption_key_file", str),
        "writeback_ahead": ("writeback_ahead", str),
        "file_locks": ("file_locks", bool),
        "tcp_established": ("tcp_established", bool),
        "ext_unix_sk": ("ext_unix_sk", bool),
        "shell_job": ("shell_job", bool),
        "rootfs_compression": ("rootfs_compression", str),
        "ghost_limit": ("ghost_limit", str),
        "ghost_limit_max": ("ghost_limit_max", str),
        "irmap_scan_paths": ("irmap_scan_paths", list),
        "volume_limit": ("volume_limit", str),
    },
    "restore": {"lazy_pages": ("lazy_pages", bool)},
    "migration": {
        "listen": ("migration_listen", str),
        "cert_file": ("migration_cert_file", str),
        "key_file": ("migration_key_file", str),
        "ca_file": ("migration_ca_file", str),
        "tcp_congestion": ("migration_tcp_congestion", str),
    },
    "kubernetes": {
        "kubeconfig": ("kubernetes_kubeconfig", str),
        "node_name": ("kubernetes_node_name", str),
    },
    "log": {"format": ("log_format", str), "level": ("log_level", str)},
}
_RUNTIME_KEYS: dict[str, type] = {f.name: str for f in fields(RuntimeConfig)}

# What each section and key means: the one description of the configuration, which
# docs/reference/config.md is generated from (`make docs`, shim/docgen.py; tests/test_reference_docs.py
# fails when a key of _SCHEMA or RuntimeConfig has none here).
SECTION_DOCS: dict[str, str] = {
    "server": "The socket podshim serves and the files it keeps.",
    "upstream": "The CRI runtime behind podshim (containerd or CRI-O).",
    "checkpoint": (
        "Where checkpoints may be written and read, and each CheckpointPod option's node default "
        "(the kubelet sends none; a request's options override them)."
    ),
    "restore": "RestorePod's node defaults.",
    "migration": (
        "Live migration between nodes (docs/design/migration.md (Live migration)); set on both nodes."
    ),
    "kubernetes": (
        "The cluster API podshim serves for the pods of its node (docs/cluster.md): PodCheckpoint "
        "objects and Pods that name one to restore from."
    ),
    "log": "podshim's log on stderr.",
    "runtime": "The real OCI runtime behind podshim-runc (runtime handler runc, the default one).",
    "runtimes": (
        "Further runtime handlers by CRI runtime_handler name (`[runtimes.crun]`), told apart by their "
        "root; the same keys as `[runtime]`, each defaulting as there. No environment variables."
    ),
}
KEY_DOCS: dict[str, str] = {
    "server.socket": (
        "The CRI socket podshim serves (the kubelet's --container-runtime-endpoint); an absolute path."
    ),
    "server.state_dir": (
        "The journal of in-flight operations, kept CRIU logs and scratch/ (emptied at every start). "
        "One podshim per state dir: a second exits 1 before it touches anything."
    ),
    "server.metrics_address": (
        "HOST:PORT of the Prometheus /metrics endpoint (`:PORT` for all addresses, `[::1]:PORT` for "
        'IPv6); "": none (docs/reference/metrics.md).'
    ),
    "server.runtime_name": (
        'What Version answers as runtime_name: "upstream" (the upstream\'s, so a kubelet shows '
        "containerd://<id> and node agents keyed on it keep working; podshim is in runtime_version) "
        'or "podshim" (runtime_version <podshim>+<upstream>-<version>).'
    ),
    "server.front": (
        "podshim-front, the compiled program, serves `socket`: every call podshim does not own goes "
        "from it straight to the upstream, the rest to the daemon over <state_dir>/daemon.sock "
        "(docs/design/proxy.md (The proxy)). false: the daemon serves `socket` itself (pure "
        "Python: slower, for debugging and comparison)."
    ),
    "server.front_binary": (
        'The podshim-front to run; "": the one beside the interpreter podshim runs on (bin/ of the '
        "venv or the package). An absolute path."
    ),
    "upstream.endpoint": "The upstream's CRI socket, a unix socket URL (unix:///path).",
    "upstream.timeout_seconds": (
        "The deadline of each call podshim makes on its own when the caller set none (passed-through "
        "calls keep their deadline, less 0.1 s); positive."
    ),
    "checkpoint.allowed_roots": (
        "Absolute directories that output_path, checkpoint_path and location must be inside. The "
        "kubelet's checkpoint API writes into <root-dir>/checkpoints; pod checkpoints go into "
        "pod-checkpoints by convention."
    ),
    "checkpoint.container_checkpoint": (
        'CheckpointContainer: "always" checkpoints in podshim (its freeze window, journal, deadline, '
        "manifest and the container's emptyDirs), never asking the upstream; "
        '"fallback" asks the upstream first (containerd 2.x checkpoints the container itself, '
        "keeping it paused while it copies the images) and checkpoints in podshim only when it "
        "answers UNIMPLEMENTED."
    ),
    "checkpoint.encryption_key_file": (
        "The node key (32 random bytes, a root-owned 0600 file) CheckpointPod archives are "
        'encrypted with (docs/encryption.md); "": plaintext archives.'
    ),
    "checkpoint.writeback_ahead": (
        "CheckpointPod writes the page images back while the pod is frozen: "
        '"auto" when the dumps would otherwise meet the kernel\'s dirty-page throttling '
        '(docs/design/checkpoint-pod.md (The freeze window)), "always", or "never" (the kernel\'s own '
        "writeback only)."
    ),
    "checkpoint.file_locks": (
        "The default of CheckpointPod's `file-locks` option: checkpoint held file locks."
    ),
    "checkpoint.tcp_established": (
        "The default of CheckpointPod's `tcp-established` option: dump established TCP connections "
        "(else CRIU refuses pods with open connections)."
    ),
    "checkpoint.ext_unix_sk": (
        "The default of CheckpointPod's `ext-unix-sk` option: allow unix sockets connected to a peer "
        "outside the checkpointed containers."
    ),
    "checkpoint.shell_job": (
        "The default of CheckpointPod's `shell-job` option: allow containers attached to a terminal."
    ),
    "checkpoint.rootfs_compression": (
        'The default of CheckpointPod\'s `rootfs-compression` option: "none" or "gzip" (compress '
        "rootfs-diff.tar)."
    ),
    "checkpoint.ghost_limit": (
        "The default of CheckpointPod's `ghost-limit` option, the largest deleted-but-open file CRIU "
        'copies into the images: "auto" (sized before the freeze from the deleted files the pod holds '
        "open, up to ghost_limit_max) or a size (bytes, K/M/G suffix, up to 1T)."
    ),
    "checkpoint.ghost_limit_max": 'The cap of an "auto" ghost_limit; a size (bytes, K/M/G suffix, up to 1T).',
    "checkpoint.irmap_scan_paths": (
        "The default of CheckpointPod's `irmap-scan-paths` option: absolute directories, as the "
        "containers see them, where CRIU looks for the path of a watched file it cannot open by "
        "handle; podshim adds the watched files' own directories to these."
    ),
    "checkpoint.volume_limit": (
        "The most a pod's emptyDir volumes and /dev/shm may hold together for CheckpointPod to "
        "carry them, and the emptyDirs of one container for CheckpointContainer (they are copied "
        "while it is frozen); over it, the checkpoint is refused before the freeze. A size "
        "(bytes, K/M/G suffix, up to 1T)."
    ),
    "restore.lazy_pages": (
        "RestorePod's default for its `lazy-pages` option (docs/design/restore-pod.md (Lazy restore))."
    ),
    "migration.listen": 'HOST:PORT this node listens on while a pod migrates into it; "": it accepts none.',
    "migration.cert_file": "This node's certificate (PEM; it names the node: its node name, its address).",
    "migration.key_file": "The key of cert_file (PEM).",
    "migration.ca_file": "The CA every node's certificate is signed by (PEM).",
    "migration.tcp_congestion": (
        "The TCP congestion control of the pages' connections (CRIU's page server and lazy-pages "
        'daemon, patch 0010: set per socket, not for the host); "": the host\'s default. Not BBR '
        "without the fq qdisc: its pacing made the page server CPU-bound. One the kernel lacks "
        "(tcp_available_congestion_control) is refused at start-up."
    ),
    "kubernetes.kubeconfig": (
        "The node's credentials for the cluster API (the kubelet's own, by default); \"\" or a "
        "missing file: off, podshim serves CRI alone."
    ),
    "kubernetes.node_name": "The node's name; \"\": the host name (the kubelet's default node name).",
    "log.format": '"json" or "console".',
    "log.level": '"debug", "info", "warning" or "error".',
    "runtime.binary": "The OCI runtime's binary (runc or crun).",
    "runtime.root": (
        "The runtime's --root as the upstream's shim passes it (containerd: <runc Root option>/"
        "<namespace>); a fallback: podshim reads the root from containerd."
    ),
    "runtime.criu": "The CRIU binary the runtime runs.",
}
_LOG_FORMATS = ("json", "console")
CONTAINER_CHECKPOINT_MODES = ("fallback", "always")
WRITEBACK_AHEAD_MODES = ("auto", "always", "never")
_LOG_LEVELS = ("debug", "info", "warning", "error")
ROOTFS_COMPRESSIONS = ("none", "gzip")
GHOST_LIMIT_AUTO = "auto"
GHOST_LIMIT_MAX = 1 << 40  # 1 TiB: a bound a typo cannot pass (the images hold the file)


def parse_size(value: str) -> int:
    """Bytes, optionally with a K, M or G suffix (binary, as CRIU reads them), 1 to 1 TiB;
    ValueError otherwise."""
    v = value.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
    digits = v[:-1] if scale > 1 else v
    if not digits.isdigit() or not 0 < int(digits) * scale <= GHOST_LIMIT_MAX:
        raise ValueError(f"expected a size in bytes (e.g. 8388608 or 8M), 1 to 1T, got {value!r}")
    return int(digits) * scale


def _typed(key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        return tuple(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def _runtime_from(key: str, table: Any, base: RuntimeConfig) -> RuntimeConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{key}: expected a table")
    values: dict[str, Any] = {}
    for k, v in table.items():
        if k not in _RUNTIME_KEYS:
            raise ConfigError(f"{key}.{k}: unknown key (known: {', '.join(_RUNTIME_KEYS)})")
        values[k] = _typed(f"{key}.{k}", v, str)
    return replace(base, **values)


def _apply_table(cfg: Config, data: dict[str, Any]) -> Config:
    updates: dict[str, Any] = {}
    for section, table in data.items():
        if section == "runtime":
            updates["runtime"] = _runtime_from("runtime", table, cfg.runtime)
            continue
        if section == "runtimes":
            if not isinstance(table, dict):
                raise ConfigError("runtimes: expected a table of [runtimes.<handler>] tables")
            updates["runtimes"] = {
                name: _runtime_from(f"runtimes.{name}", t, RuntimeConfig()) for name, t in table.items()
            }
            continue
        if section not in _SCHEMA:
            raise ConfigError(f"{section}: unknown section (known: {', '.join(_SCHEMA)}, runtime, runtimes)")
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: expected a table")
        for key, value in table.items():
            if key not in _SCHEMA[section]:
                known = ", ".join(_SCHEMA[section])
                raise ConfigError(f"{section}.{key}: unknown key (known: {known})")
            attr, kind = _SCHEMA[section][key]
            updates[attr] = _typed(f"{section}.{key}", value, kind)
    return replace(cfg, **updates)


def _from_env(env: dict[str, str]) -> dict[str, Any]:
    """PODSHIM_<SECTION>_<KEY>=value, e.g. PODSHIM_UPSTREAM_ENDPOINT; lists are comma-separated."""
    data: dict[str, dict[str, Any]] = {}
    for section, keys in _SCHEMA.items():
        for key, (_, kind) in keys.items():
            name = f"PODSHIM_{section}_{key}".upper()
            if name not in env:
                continue
            raw = env[name]
            value: Any = raw
            if kind is list:
                value = [p for p in raw.split(",") if p]
            elif kind is bool:
                if raw.lower() not in ("true", "false"):
                    raise ConfigError(f"{name}: expected true or false, got {raw!r}")
                value = raw.lower() == "true"
            elif kind is float:
                try:
                    value = float(raw)
                except ValueError:
                    raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
            data.setdefault(section, {})[key] = value
    for key in _RUNTIME_KEYS:
        name = f"PODSHIM_RUNTIME_{key}".upper()
        if name in env:
            data.setdefault("runtime", {})[key] = env[name]
    return data


def _validate(cfg: Config) -> Config:
    if cfg.log_format not in _LOG_FORMATS:
        raise ConfigError(f"log.format: must be one of {', '.join(_LOG_FORMATS)}, got {cfg.log_format!r}")
    if cfg.log_level not in _LOG_LEVELS:
        raise ConfigError(f"log.level: must be one of {', '.join(_LOG_LEVELS)}, got {cfg.log_level!r}")
    if cfg.runtime_name not in RUNTIME_NAMES:
        raise ConfigError(
            f"server.runtime_name: must be one of {', '.join(RUNTIME_NAMES)}, got {cfg.runtime_name!r}"
        )
    if not cfg.socket.startswith("/"):
        raise ConfigError(f"server.socket: must be an absolute path, got {cfg.socket!r}")
    if cfg.front_binary and not cfg.front_binary.startswith("/"):
        raise ConfigError(f"server.front_binary: must be an absolute path, got {cfg.front_binary!r}")
    if not cfg.upstream_endpoint.startswith(("unix://", "unix:")):
        raise ConfigError(
            f"upstream.endpoint: must be a unix socket URL (unix:///path), got {cfg.upstream_endpoint!r}"
        )
    if cfg.container_checkpoint not in CONTAINER_CHECKPOINT_MODES:
        raise ConfigError(
            f"checkpoint.container_checkpoint: must be one of {', '.join(CONTAINER_CHECKPOINT_MODES)}, "
            f"got {cfg.container_checkpoint!r}"
        )
    if cfg.rootfs_compression not in ROOTFS_COMPRESSIONS:
        raise ConfigError(
            f"checkpoint.rootfs_compression: must be one of {', '.join(ROOTFS_COMPRESSIONS)}, "
            f"got {cfg.rootfs_compression!r}"
        )
    sizes = (
        ("ghost_limit", cfg.ghost_limit),
        ("ghost_limit_max", cfg.ghost_limit_max),
        ("volume_limit", cfg.volume_limit),
    )
    for key, size in sizes:
        if key == "ghost_limit" and size == GHOST_LIMIT_AUTO:
            continue
        try:
            parse_size(size)
        except ValueError as e:
            raise ConfigError(
                f"checkpoint.{key}: {e}" + (' or "auto"' if key == "ghost_limit" else "")
            ) from None
    for path in cfg.irmap_scan_paths:
        if not path.startswith("/") or ".." in path.split("/"):
            raise ConfigError(f"checkpoint.irmap_scan_paths: {path!r} is not an absolute path (no '..')")
    if cfg.writeback_ahead not in WRITEBACK_AHEAD_MODES:
        raise ConfigError(
            f"checkpoint.writeback_ahead: must be one of {', '.join(WRITEBACK_AHEAD_MODES)}, "
            f"got {cfg.writeback_ahead!r}"
        )
    for root in cfg.allowed_roots:
        if not root.startswith("/"):
            raise ConfigError(f"checkpoint.allowed_roots: {root!r} is not an absolute path")
    if cfg.encryption_key_file and not cfg.encryption_key_file.startswith("/"):
        raise ConfigError(
            f"checkpoint.encryption_key_file: must be an absolute path, got {cfg.encryption_key_file!r}"
        )
    for key in ("cert_file", "key_file", "ca_file"):
        value = getattr(cfg, f"migration_{key}")
        if value and not value.startswith("/"):
            raise ConfigError(f"migration.{key}: must be an absolute path, got {value!r}")
    if cfg.migration_listen and ":" not in cfg.migration_listen:
        raise ConfigError(f"migration.listen: expected HOST:PORT, got {cfg.migration_listen!r}")
    if cfg.upstream_timeout <= 0:
        raise ConfigError("upstream.timeout_seconds: must be positive")
    if cfg.metrics_address and ":" not in cfg.metrics_address:
        raise ConfigError(f"server.metrics_address: expected HOST:PORT, got {cfg.metrics_address!r}")
    return cfg


TCP_AVAILABLE_CONGESTION = "/proc/sys/net/ipv4/tcp_available_congestion_control"


def tcp_congestion_problem(name: str, available_file: str = TCP_AVAILABLE_CONGESTION) -> str | None:
    """Why the kernel would refuse TCP congestion control `name` (None: it would not, or `name` is
    "", the host's default): not one of the algorithms it has loaded."""
    if not name:
        return None
    try:
        with open(available_file) as f:
            available = f.read().split()
    except OSError as e:
        return f"{name!r} cannot be checked: {available_file}: {e.strerror}"
    if name not in available:
        return (
            f"{name!r} is not a congestion control this kernel has ({available_file}: "
            f'{" ".join(available)}); name one of them, or "" for the host\'s default'
        )
    return None


KEY_SIZE = 32


def key_file_problem(path: str) -> str | None:
    """What is wrong with the node key file at `path` (None: nothing). It must be a regular file
    (not a symlink) of exactly KEY_SIZE bytes, owned by root (podshim's user) and mode 0600/0400."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"does not exist (create it: head -c {KEY_SIZE} /dev/urandom > {path}; chmod 600 {path})"
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink: name the key file itself"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}, must be owned by root"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, must be 0600 (chmod 600 {path})"
    if st.st_size != KEY_SIZE:
        return f"is {st.st_size} bytes, must hold exactly {KEY_SIZE} random bytes"
    return None


def load(
    path: str | None = None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
    check_files: bool = True,
) -> Config:
    """Build the effective config. `path` None means $PODSHIM_CONFIG or the default path if it exists.

    check_files=False skips checking the node key file and the migration's congestion control
    against the kernel (podshim-runc, which never needs either, must not fail every runtime call of
    the node over a key file's mode)."""
    env = dict(os.environ) if env is None else env
    cfg = Config()
    explicit = path is not None or CONFIG_ENV in env
    file_path = path or env.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH
    if explicit or Path(file_path).exists():
        try:
            with open(file_path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {file_path}: not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {file_path}: not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"config file {file_path}: {e.strerror}") from None
        try:
            cfg = _apply_table(cfg, data)
        except ConfigError as e:
            raise ConfigError(f"config file {file_path}: {e}") from None
    cfg = _apply_table(cfg, _from_env(env))
    if overrides:
        cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    cfg = _validate(cfg)
    if check_files and cfg.encryption_key_file:
        problem = key_file_problem(cfg.encryption_key_file)
        if problem is not None:
            raise ConfigError(f"checkpoint.encryption_key_file: {cfg.encryption_key_file} {problem}")
    congestion_problem = tcp_congestion_problem(cfg.migration_tcp_congestion) if check_files else None
    if congestion_problem:
        raise ConfigError(f"migration.tcp_congestion: {congestion_problem}")
    return cfg
