"""CRI strings the upstream accepts but cannot undo (a NUL, ';' or '=' in what CNI gets in
`CNI_ARGS`, values over the kernel's limits), refused with INVALID_ARGUMENT before anything is
created: in RestorePod and in the passed-through RunPodSandbox and CreateContainer, which are
decoded for this check only and forwarded as the original bytes (docs/design/restore-pod.md
(RestorePod) step 1, docs/design/errors.md (Errors))."""

from __future__ import annotations

from api.runtime.v1 import api_pb2 as cri
from shim.errors import InvalidArgument

# Far above the Kubernetes limits (name 253, namespace 63, uid 36) and far below MAX_ARG_STRLEN
# (128 KiB), which CNI_ARGS, holding the three of them, must fit.
MAX_ID_BYTES = 4096
HOST_NAME_MAX = 64  # sethostname(2)
CNI_ARGS_SEPARATORS = (";", "=")


def _shown(value: str) -> str:
    return repr(value[:60]) + ("..." if len(value) > 60 else "")


def check_identity(what: str, value: str) -> None:
    """A metadata name, namespace or uid: no NUL, ';' or '=', at most MAX_ID_BYTES."""
    if "\x00" in value:
        raise InvalidArgument(f"{what} {_shown(value)} contains a NUL byte")
    bad = [c for c in CNI_ARGS_SEPARATORS if c in value]
    if bad:
        raise InvalidArgument(
            f"{what} {_shown(value)} contains {bad[0]!r}: CNI receives it in CNI_ARGS "
            "(';'-separated key=value pairs) and could neither set up nor tear down the pod network"
        )
    if len(value.encode()) > MAX_ID_BYTES:
        raise InvalidArgument(f"{what} is {len(value.encode())} bytes long, over {MAX_ID_BYTES}")


def _no_nul(what: str, value: str) -> None:
    if "\x00" in value:
        raise InvalidArgument(f"{what} {_shown(value)} contains a NUL byte")


def check_sandbox_config(config: cri.PodSandboxConfig, what: str = "config") -> None:
    """InvalidArgument for a PodSandboxConfig the upstream would turn into a sandbox it cannot
    remove, or that fails only after it was created."""
    md = config.metadata
    check_identity(f"{what}.metadata.name", md.name)
    check_identity(f"{what}.metadata.namespace", md.namespace)
    check_identity(f"{what}.metadata.uid", md.uid)
    _no_nul(f"{what}.hostname", config.hostname)
    if len(config.hostname.encode()) > HOST_NAME_MAX:
        raise InvalidArgument(
            f"{what}.hostname {_shown(config.hostname)} is over {HOST_NAME_MAX} bytes (HOST_NAME_MAX)"
        )
    _no_nul(f"{what}.log_directory", config.log_directory)
    _no_nul(f"{what}.linux.cgroup_parent", config.linux.cgroup_parent)


def check_container_config(config: cri.ContainerConfig, what: str = "config") -> None:
    """InvalidArgument for a ContainerConfig with a NUL in its name or log path (containerd
    creates it, and StartContainer fails on the log path). Its name is not in CNI_ARGS: ';' and
    '=' are fine there."""
    _no_nul(f"{what}.metadata.name", config.metadata.name)
    _no_nul(f"{what}.log_path", config.log_path)
