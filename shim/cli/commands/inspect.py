"""`podshim inspect PATH`: what a checkpoint holds, read from disk (no daemon needed).

PATH is a pod checkpoint directory (CheckpointPod's output_path, with manifest.json) or a
container checkpoint tar (CheckpointContainer's output; also those of CRI-O and containerd,
minus what only podshim's manifest records). Nothing is extracted or modified.

The archive code loads when a path is inspected, not with the parser.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shim.cli import base, output
from shim.cli.commands import inspectp

if TYPE_CHECKING:
    import tarfile

    from shim.archive import manifest
    from shim.archive.container_tar import ContainerTarManifest


def _pages() -> str:
    from shim.archive import layout

    return f"{layout.CHECKPOINT_DIR}/pages-*.img"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a pod checkpoint directory or a container checkpoint tar (or containers by id)",
        description=(
            "Read a pod checkpoint directory (manifest.json: pod, containers, sizes, versions, "
            "timings, freeze window) or a container checkpoint tar (config.dump, spec.dump, "
            "podshim's manifest) and print what it holds; nothing is extracted or changed. "
            "Arguments that are not existing paths are container ids (crictl inspect)."
        ),
    )
    base.add_global_options(p, suppress=True)
    p.add_argument(
        "targets", nargs="+", metavar="PATH|ID", help="checkpoint dir, checkpoint .tar or container id"
    )
    p.add_argument(
        "--verify", action="store_true", help="also check every file's size and sha256 against the manifest"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shim import errors

    targets = [str(t) for t in args.targets]
    existing = [t for t in targets if os.path.lexists(t)]
    if not existing:
        return inspectp.inspect_container(args, targets)
    if len(existing) != len(targets):
        missing = ", ".join(t for t in targets if t not in existing)
        base.report("inspect", f"mix of checkpoint paths and container ids ({missing}): inspect them apart")
        return base.EXIT_USAGE
    try:
        infos = [inspect_path(Path(t), verify=args.verify) for t in targets]
    except errors.ShimError as e:
        base.report("inspect", e.message)
        return base.EXIT_RUNTIME
    except OSError as e:
        base.report("inspect", f"{e.filename or ''}: {e.strerror or e}")
        return base.EXIT_RUNTIME
    fmt = base.output_of(args, "table")
    if fmt == "table":
        print("\n\n".join(pod_table(i) if i["kind"] == "pod" else container_table(i) for i in infos))
    else:
        output.render(infos[0] if len(infos) == 1 else infos, fmt)
    return base.EXIT_OK


def inspect_path(path: Path, verify: bool = False) -> dict[str, Any]:
    from shim import errors

    if path.is_dir():
        return inspect_pod(path, verify)
    if path.is_file():
        return inspect_container_tar(path, verify)
    if not path.exists():
        raise errors.NotFound(f"{path} does not exist")
    raise errors.InvalidArgument(f"{path} is neither a checkpoint directory nor a tar")


# ---------------------------------------------------------------------------- pod checkpoint


def _sum(files: dict[str, int], pattern: str) -> int:
    return sum(size for rel, size in files.items() if fnmatch.fnmatchcase(rel, pattern))


def inspect_pod(root: Path, verify: bool) -> dict[str, Any]:
    from shim.archive import layout, manifest

    m = manifest.read_manifest(root)
    if verify:
        manifest.verify_files(root, m, workers=4)
    sizes = {rel: f.size for rel, f in m.files.items()}
    md = m.sandbox.metadata
    containers = []
    for c in m.containers:
        prefix = c.dir.rstrip("/") + "/"
        containers.append(
            {
                "name": c.name,
                "id": c.id,
                "image": c.image,
                "state": c.state,
                "restart_count": c.restart_count,
                "checkpointed": c.checkpointed,
                "bytes": _sum(sizes, prefix + "*"),
                "pages_bytes": _sum(sizes, prefix + _pages()),
                "rootfs_diff_bytes": sizes.get(prefix + layout.ROOTFS_DIFF_TAR, 0),
                "criu_stats": m.criu_stats.get(c.name, {}),
            }
        )
    return {
        "kind": "pod",
        "path": str(root),
        "format": m.format,
        "created": m.created,
        "verified": verify,
        "host": vars(m.host),
        "pod": {
            "id": m.sandbox.id,
            "name": md.get("name", ""),
            "namespace": md.get("namespace", ""),
            "uid": md.get("uid", ""),
            "attempt": md.get("attempt", 0),
        },
        "post_checkpoint_state": m.post_checkpoint_state,
        "options": m.options,
        "timings": m.timings,
        "freeze_window_seconds": m.timings.get("freeze_window"),
        "network": _network(root, m),
        "containers": containers,
        "files": len(m.files),
        "total_bytes": sum(sizes.values()),
    }


def _network(root: Path, m: manifest.Manifest) -> dict[str, list[str]] | None:
    """The pod's interfaces and their addresses at checkpoint (sandbox/network.json; shim/cni),
    loopback left out; None when the archive has none or it is encrypted."""
    from shim.archive import layout

    rel = f"{layout.SANDBOX_DIR}/{layout.SANDBOX_NETWORK_FILE}"
    if m.encryption is not None or rel not in m.files:
        return None
    try:
        doc = json.loads((root / rel).read_text())
    except (OSError, ValueError):
        return None
    nics = ((doc.get("netns") or {}) if isinstance(doc, dict) else {}).get("interfaces") or []
    return {str(i.get("name")): list(i.get("addresses") or []) for i in nics if i.get("name") != "lo"}


# ---------------------------------------------------------------------------- container tar


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> Any:
    from shim import errors
    from shim.archive.container_tar import MAX_METADATA_BYTES

    if member.size > MAX_METADATA_BYTES:
        raise errors.DataLoss(f"{path}: {member.name} is {member.size} bytes, too large to be metadata")
    f = tar.extractfile(member)
    if f is None:
        raise errors.DataLoss(f"{path}: {member.name} is not a regular file")
    try:
        return json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.DataLoss(f"{path}: {member.name} is not valid JSON ({e})") from e


def _hash_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> str:
    import hashlib

    from shim.archive import fsutil

    h = hashlib.sha256()
    f = tar.extractfile(member)
    assert f is not None
    while chunk := f.read(fsutil.CHUNK_SIZE):
        h.update(chunk)
    return h.hexdigest()


def inspect_container_tar(path: Path, verify: bool) -> dict[str, Any]:
    import tarfile

    from shim import errors
    from shim.archive import layout
    from shim.archive.container_tar import MANIFEST_FILE as CONTAINER_MANIFEST
    from shim.archive.container_tar import REQUIRED_MEMBERS, ContainerTarManifest, tar_error

    wanted = {layout.CONFIG_DUMP_FILE, layout.SPEC_DUMP_FILE, CONTAINER_MANIFEST}
    docs: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    digests: dict[str, str] = {}
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in tar:
                name = os.path.normpath(member.name).lstrip("/")
                if member.isdir() or name == ".":
                    continue
                sizes[name] = member.size
                if name in wanted and member.isreg():
                    docs[name] = _read_member(tar, member, path)
                elif verify and member.isreg():
                    digests[name] = _hash_member(tar, member)
    except (tarfile.TarError, EOFError) as e:
        raise errors.DataLoss(f"{path} is not a readable tar: {tar_error(e)}") from e
    record = docs.get(layout.CONFIG_DUMP_FILE) or {}
    spec = docs.get(layout.SPEC_DUMP_FILE) or {}
    doc = docs.get(CONTAINER_MANIFEST) or {}
    if not isinstance(record, dict) or not isinstance(spec, dict) or not isinstance(doc, dict):
        raise errors.DataLoss(f"{path}: config.dump, spec.dump and the manifest must be JSON objects")
    m = ContainerTarManifest.from_dict(doc, str(path)) if doc else None
    if m is None and isinstance(record.get("podshim"), dict):
        raise errors.DataLoss(
            f"{path} was written by podshim but has no {CONTAINER_MANIFEST} (its last member): "
            "the archive is truncated"
        )
    missing = [r for r in REQUIRED_MEMBERS if r not in sizes]
    if missing and not record and m is None:
        raise errors.InvalidArgument(f"{path} is not a container checkpoint (no {', '.join(missing)})")
    if verify:
        _verify_tar(path, m, sizes, digests, docs)
    annotations = (spec.get("annotations") or {}) if isinstance(spec.get("annotations"), dict) else {}
    pod = record.get("pod") or (m.pod if m is not None else {})
    return {
        "kind": "container",
        "path": str(path),
        "format": (m.format if m is not None else "") or "(no podshim manifest)",
        "created": m.created if m is not None else "",
        "verified": verify,
        "host": m.host if m is not None else {},
        "container": {
            "id": record.get("id", ""),
            "name": record.get("name", ""),
            "image": record.get("rootfsImageName") or record.get("rootfsImage") or record.get("image", ""),
            "image_ref": record.get("rootfsImageRef") or record.get("image_ref", ""),
            "runtime": record.get("runtime", ""),
            "created": record.get("createdTime", ""),
            "checkpointed": record.get("checkpointedTime", ""),
            "restored": bool(record.get("restored", False)),
        },
        "pod": {
            "id": pod.get("id") or annotations.get("io.kubernetes.cri.sandbox-id", ""),
            "name": pod.get("name") or annotations.get("io.kubernetes.cri.sandbox-name", ""),
            "namespace": pod.get("namespace") or annotations.get("io.kubernetes.cri.sandbox-namespace", ""),
            "uid": pod.get("uid") or annotations.get("io.kubernetes.cri.sandbox-uid", ""),
        },
        "process": (spec.get("process") or {}).get("args", []),
        "options": m.options if m is not None else {},
        "timings": m.timings if m is not None else {},
        "freeze_window_seconds": m.timings.get("freeze_window") if m is not None else None,
        "criu_stats": m.criu_stats if m is not None else {},
        "members": len(sizes),
        "missing_required": missing,
        "total_bytes": sum(sizes.values()),
        "pages_bytes": _sum(sizes, _pages()),
        "rootfs_diff_bytes": sizes.get(layout.ROOTFS_DIFF_TAR, 0),
    }


def _verify_tar(
    path: Path,
    m: ContainerTarManifest | None,
    sizes: dict[str, int],
    digests: dict[str, str],
    docs: dict[str, Any],
) -> None:
    import tarfile

    from shim import errors
    from shim.archive import manifest
    from shim.archive.container_tar import FORMAT as CONTAINER_FORMAT
    from shim.archive.container_tar import MANIFEST_FILE as CONTAINER_MANIFEST

    if m is None or m.format != CONTAINER_FORMAT:
        raise errors.FailedPrecondition(
            f"{path} has no podshim manifest ({CONTAINER_FORMAT}) to verify against"
        )
    reread = [rel for rel in docs if rel in m.files and rel != CONTAINER_MANIFEST]
    if reread:  # metadata members were parsed, not hashed: read them again
        with tarfile.open(path, mode="r:*") as tar:
            digests = {**digests, **{rel: _hash_member(tar, tar.getmember(rel)) for rel in reread}}
    actual = {
        rel: manifest.FileEntry(size=size, sha256=digests.get(rel, ""))
        for rel, size in sizes.items()
        if rel != CONTAINER_MANIFEST
    }
    m.check_files(actual, str(path))


# ---------------------------------------------------------------------------- tables


def _seconds(v: Any) -> str:
    return f"{float(v) * 1000:.1f} ms" if isinstance(v, int | float) else "-"


def _fields(pairs: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in pairs) + 2
    return "\n".join(f"{(k + ':').ljust(width)}{v}" for k, v in pairs)


def _host(h: dict[str, Any]) -> str:
    if not h:
        return "-"
    return (
        f"podshim {h.get('podshim_version', '?')}, CRIU {h.get('criu_version', '?')}, "
        f"{h.get('runtime_name', '?')} {h.get('runtime_version', '?')}, "
        f"kernel {h.get('kernel', '?')} {h.get('arch', '')}".rstrip()
    )


def _timings(t: dict[str, Any]) -> str:
    return ", ".join(f"{k} {float(v):.3f}s" for k, v in t.items() if isinstance(v, int | float)) or "-"


def _network_line(network: dict[str, list[str]] | None) -> str:
    if not network:
        return "-"
    return "; ".join(f"{name} {' '.join(addrs) or '(no address)'}" for name, addrs in network.items())


def _migration_line(options: dict[str, str]) -> list[tuple[str, str]]:
    from shim.archive import manifest

    if options.get(manifest.PAGES_OPTION) != manifest.PAGES_SERVED_BY_SOURCE:
        return []
    return [("Restorable", "no: a live migration's archive, its pages were served by the source node")]


def pod_table(info: dict[str, Any]) -> str:
    p = info["pod"]
    head = _fields(
        [
            ("Pod checkpoint", f"{info['path']} ({info['format']})"),
            ("Created", info["created"]),
            ("Pod", f"{p['namespace']}/{p['name']} (uid {p['uid']}, sandbox {p['id'][:13]})"),
            ("Host", _host(info["host"])),
            ("Post state", info["post_checkpoint_state"]),
            ("Network", _network_line(info.get("network"))),
            ("Freeze window", _seconds(info["freeze_window_seconds"])),
            ("Timings", _timings(info["timings"])),
            ("Size", f"{output.human_bytes(info['total_bytes'])} in {info['files']} files"),
            ("Verified", "yes (sizes and sha256)" if info["verified"] else "no (use --verify)"),
            *_migration_line(info.get("options", {})),
        ]
    )
    rows = [
        [
            c["name"],
            c["id"][:13],
            c["image"],
            c["state"].removeprefix("CONTAINER_"),
            "yes" if c["checkpointed"] else "no",
            output.human_bytes(c["bytes"]),
            output.human_bytes(c["pages_bytes"]),
            output.human_bytes(c["rootfs_diff_bytes"]),
        ]
        for c in info["containers"]
    ]
    headers = ["CONTAINER", "ID", "IMAGE", "STATE", "DUMPED", "SIZE", "PAGES", "ROOTFS DIFF"]
    return head + "\n\n" + output.table(headers, rows)


def container_table(info: dict[str, Any]) -> str:
    c, p = info["container"], info["pod"]
    pod = f"{p['namespace']}/{p['name']}" if p["name"] else "-"
    if p["uid"]:
        pod += f" (uid {p['uid']})"
    return _fields(
        [
            ("Container checkpoint", f"{info['path']} ({info['format']})"),
            ("Container", f"{c['name']} ({c['id'][:13]})"),
            ("Image", f"{c['image']} ({c['image_ref'] or '-'})"),
            ("Pod", pod),
            ("Process", " ".join(str(a) for a in info["process"]) or "-"),
            ("Runtime", c["runtime"] or "-"),
            ("Created", c["created"] or "-"),
            ("Checkpointed", c["checkpointed"] or "-"),
            ("Host", _host(info["host"])),
            ("Freeze window", _seconds(info["freeze_window_seconds"])),
            ("Timings", _timings(info["timings"])),
            (
                "Size",
                f"{output.human_bytes(info['total_bytes'])} in {info['members']} members (pages "
                f"{output.human_bytes(info['pages_bytes'])}, "
                f"rootfs diff {output.human_bytes(info['rootfs_diff_bytes'])})",
            ),
            ("Missing", ", ".join(info["missing_required"]) or "nothing the node e2e check requires"),
            ("Verified", "yes (sizes and sha256)" if info["verified"] else "no (use --verify)"),
        ]
    )
