"""The configuration files a test bed writes before it starts anything: the CNI conflist of its
bridge, containerd's config (version 2 for containerd 1.x, 3 for 2.x) with the runtime handlers and
the registry mirror, and podshim's podshim.toml; each made from the bed's paths and choices
(``TestBed._write_files``), nothing read from the host."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Any

CNI_BIN_DIR = "/usr/lib/cni"


def toml_str(value: str | os.PathLike[str]) -> str:
    return json.dumps(os.fspath(value))  # a JSON string is a valid TOML basic string here


def toml_dump(config: dict[str, Any]) -> str:
    """Write podshim's TOML: tables of strings, numbers and lists of strings, one level of
    sub-tables ([runtimes.crun])."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        subtables = {k: v for k, v in values.items() if isinstance(v, dict)}
        for k, v in values.items():
            if not isinstance(v, dict):
                lines.append(f"{k} = {json.dumps(v)}")  # JSON strings/numbers/lists are TOML
        lines.append("")
        for k, v in subtables.items():
            table(f"{name}.{k}", v)

    for name, values in config.items():
        table(name, values)
    return "\n".join(lines)


def _toml_list(values: list[str]) -> str:
    return "[" + ", ".join(toml_str(v) for v in values) + "]"


def cni_conflist(network: str, bridge: str, subnet: ipaddress.IPv4Network, ipam_dir: Path) -> str:
    """The bed's CNI network: a bridge with its gateway first in `subnet`, host-local IPAM in
    `ipam_dir`, portmap and loopback."""
    gateway = subnet.network_address + 1
    conflist = {
        "cniVersion": "1.0.0",
        "name": network,
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(subnet), "gateway": str(gateway)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
            {"type": "loopback"},
        ],
    }
    return json.dumps(conflist, indent=2) + "\n"


def podshim_toml(
    *,
    socket: Path,
    state_dir: Path,
    containerd_socket: Path,
    runc: Path,
    runc_root: Path,
    criu: Path,
    crun: tuple[Path, Path] | None,
    checkpoint_roots: list[str] | None,
    sections: dict[str, dict[str, Any]],
) -> str:
    """podshim.toml: `crun` (the real crun, its root) adds a `[runtimes.crun]` handler;
    `checkpoint_roots` None leaves podshim's built-in allowed roots; `sections` come last."""
    crun_section = ""
    if crun is not None:
        crun_section = f"""
[runtimes.crun]
binary = {toml_str(crun[0])}
root = {toml_str(crun[1])}
criu = {toml_str(criu)}
"""
    checkpoint_section = ""
    if checkpoint_roots is not None:
        checkpoint_section = f"[checkpoint]\nallowed_roots = {_toml_list(checkpoint_roots)}\n"
    podshim = f"""# written by testbed/bed_files.py
[server]
socket = {toml_str(socket)}
state_dir = {toml_str(state_dir)}
metrics_address = ""

[upstream]
endpoint = {toml_str("unix://" + str(containerd_socket))}

[runtime]
binary = {toml_str(runc)}
root = {toml_str(runc_root)}
criu = {toml_str(criu)}

{crun_section}
{checkpoint_section}
[log]
format = "json"
level = "info"
"""
    if sections:
        podshim += "\n" + toml_dump(sections) + "\n"
    return podshim


def containerd_toml(
    *,
    version: str,
    runtimes: list[tuple[str, Path, Path]],
    container_annotations: list[str],
    runc_criu: Path | None,
    root: Path,
    state: Path,
    socket: Path,
    log_level: str,
    opt_dir: Path,
    cni_conf_dir: Path,
    pause_image: str,
    registry_mirror: str | None,
    hosts_dir: Path,
    restore_via_create: bool = False,
) -> str:
    """containerd's config: version 2 for 1.6 and 1.7; version 3 for 2.x (2.4 migrates it to its
    4), whose CRI is split into the plugins io.containerd.cri.v1.runtime (runtimes, CNI, OOM,
    SELinux/AppArmor) and io.containerd.cri.v1.images (snapshotter, the pause image as
    pinned_images.sandbox), the streaming server staying in io.containerd.grpc.v1.cri
    (docs/design/versions.md (containerd, runc and CRIU versions)). `runtimes`: (handler name,
    BinaryName, Root); `runc_criu`: containerd 1.x's CriuPath of the runc handler, if any; a
    `registry_mirror` of 2.x gets its hosts file in `hosts_dir`; `restore_via_create` (2.x only) lets
    containerd's own CRI restore a checkpoint tar given to CreateContainer as the image (2.2's
    `enable_experimental_restore_via_create`, off by default there)."""
    v3 = version.startswith("2.")
    cri = 'plugins."io.containerd.cri.v1.runtime"' if v3 else 'plugins."io.containerd.grpc.v1.cri"'
    runtime_blocks = []
    for name, binary, runtime_root in runtimes:
        # the shim passes CriuPath as a global `--criu PATH`, which crun rejects (exit 64) and
        # runc >= 1.2 ignores with a warning; containerd 2.x has no CriuPath
        criu = ""
        if name == "runc" and not v3 and runc_criu is not None:  # as `podshim node setup`
            criu = f"\n          CriuPath = {toml_str(runc_criu)}"
        runtime_blocks.append(
            f"""
      [{cri}.containerd.runtimes.{name}]
        runtime_type = "io.containerd.runc.v2"
        container_annotations = {json.dumps(container_annotations)}
        pod_annotations = ["podshim.*"]
        [{cri}.containerd.runtimes.{name}.options]
          BinaryName = {toml_str(binary)}
          Root = {toml_str(runtime_root)}{criu}
          SystemdCgroup = false
"""
        )
    common = f"""# written by testbed/bed_files.py for containerd {version}
version = {3 if v3 else 2}
root = {toml_str(root)}
state = {toml_str(state)}
oom_score = 0

[grpc]
  address = {toml_str(socket)}

[ttrpc]
  address = {toml_str(str(socket) + ".ttrpc")}

[debug]
  address = ""
  level = {toml_str(log_level)}

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = {toml_str(opt_dir)}
"""
    if restore_via_create and not v3:
        raise ValueError(f"containerd {version} has no restore via CreateContainer (2.x only)")
    restore = "\n    enable_experimental_restore_via_create = true" if restore_via_create else ""
    if v3:
        images = 'plugins."io.containerd.cri.v1.images"'
        return (
            common
            + f"""
  [plugins."io.containerd.grpc.v1.cri"]
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_tls_streaming = false

  [{images}]
    snapshotter = "overlayfs"
    [{images}.pinned_images]
      sandbox = {toml_str(pause_image)}
{_mirror_v3(images, registry_mirror, hosts_dir)}
  [{cri}]
    restrict_oom_score_adj = true
    enable_selinux = false
    disable_apparmor = true{restore}

    [{cri}.containerd]
      default_runtime_name = "runc"
{"".join(runtime_blocks)}
    [{cri}.cni]
      bin_dirs = [{toml_str(CNI_BIN_DIR)}]
      conf_dir = {toml_str(cni_conf_dir)}
      max_conf_num = 1
"""
        )
    return (
        common
        + f"""
  [{cri}]
    sandbox_image = {toml_str(pause_image)}
    restrict_oom_score_adj = true
    enable_selinux = false
    disable_apparmor = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_tls_streaming = false

    [{cri}.containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
{"".join(runtime_blocks)}
    [{cri}.cni]
      bin_dir = {toml_str(CNI_BIN_DIR)}
      conf_dir = {toml_str(cni_conf_dir)}
      max_conf_num = 1
{_mirror_v2(cri, registry_mirror)}"""
    )


def _mirror_v2(cri: str, registry_mirror: str | None) -> str:
    """containerd 1.x: every registry ("*") pulls from the mirror first."""
    if not registry_mirror:
        return ""
    return f"""
    [{cri}.registry.mirrors."*"]
      endpoint = [{toml_str("http://" + registry_mirror)}]
"""


def _mirror_v3(images: str, registry_mirror: str | None, hosts: Path) -> str:
    """containerd 2.x: a hosts directory whose _default entry (every registry) is the mirror."""
    if not registry_mirror:
        return ""
    (hosts / "_default").mkdir(parents=True, exist_ok=True)
    url = "http://" + registry_mirror
    (hosts / "_default" / "hosts.toml").write_text(
        f'server = {toml_str(url)}\n[host.{toml_str(url)}]\n  capabilities = ["pull", "resolve"]\n'
    )
    return f"""    [{images}.registry]
      config_path = {toml_str(hosts)}
"""
