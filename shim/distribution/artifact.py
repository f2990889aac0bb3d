"""The OCI artifact a pod checkpoint becomes: podshim's manifest.json as the config, one
deterministic tar layer per unit of the archive (`sandbox`, then `containers/<name>`), large files
as raw file layers whose digest is their sha256, and annotations a scheduler needs without pulling
(docs/design/distribution.md (Checkpoints through a registry)). Encrypted archives move as they
are."""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shim import __version__
from shim.archive import manifest as mf
from shim.archive.layout import CONTAINERS_DIR, SANDBOX_DIR
from shim.archive.paths import check_component, check_member_path
from shim.errors import DataLoss, InvalidArgument

ARTIFACT_TYPE = "application/vnd.podshim.checkpoint.v1"
CONFIG_MEDIA_TYPE = "application/vnd.podshim.checkpoint.config.v1+json"
LAYER_MEDIA_TYPE = "application/vnd.podshim.checkpoint.layer.v1.tar"
LAYER_MEDIA_TYPE_ZSTD = LAYER_MEDIA_TYPE + "+zstd"
LAYER_MEDIA_TYPES = {LAYER_MEDIA_TYPE: "none", LAYER_MEDIA_TYPE_ZSTD: "zstd"}
FILE_MEDIA_TYPE = "application/vnd.podshim.checkpoint.file.v1"  # one file's bytes, as they are
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
COMPRESSIONS = ("none", "zstd")

TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
# checkpointctl's names (org.criu.checkpoint.*)
CRIU = "org.criu.checkpoint"
# podshim's own
PODSHIM = "io.podshim.checkpoint"

BLOCK = 512
MAX_LAYERS = 256  # a pod of more containers than this is not something a registry artifact holds
MAX_OCI_MANIFEST_BYTES = 4 << 20
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
TAR_SLACK_PER_ENTRY = 3 * BLOCK  # a PAX header (name, size) before a member's own header
RAW_FILE_MIN = 1 << 20  # a file this large travels as a layer of its own (when not compressed)


@dataclass
class Unit:
    """One layer's share of the archive: `title` is its top directory ("sandbox",
    "containers/<name>"); `files` its files (archive-relative path -> size)."""

    title: str
    container: str = ""  # the container's name ("" for the sandbox)
    files: dict[str, int] = field(default_factory=dict)  # in its tar
    raw: dict[str, int] = field(default_factory=dict)  # each a layer of its own (FILE_MEDIA_TYPE)

    @property
    def size(self) -> int:
        return sum(self.files.values()) + sum(self.raw.values())

    def dirs(self) -> list[str]:
        """Every directory below and including `title` that holds a file (in its tar or raw),
        parents first: the tar creates them all."""
        out = {self.title}
        for rel in [*self.files, *self.raw]:
            parts = rel.split("/")[:-1]
            for i in range(self.title.count("/") + 1, len(parts) + 1):
                out.add("/".join(parts[:i]))
        return sorted(out, key=lambda d: (d.count("/"), d))

    def tar_cap(self) -> int:
        """The most bytes a tar of these files can take (headers, padding, end blocks)."""
        n = len(self.files) + len(self.dirs())
        data = sum(-(-s // BLOCK) * BLOCK for s in self.files.values())
        return data + n * (BLOCK + TAR_SLACK_PER_ENTRY) + 2 * BLOCK + 20 * BLOCK


def layer_cap(unit: Unit, media_type: str) -> int:
    """The largest layer blob `unit` can legitimately be (zstd never grows data by more than
    ~1/128 + its frame overhead)."""
    cap = unit.tar_cap()
    if LAYER_MEDIA_TYPES.get(media_type) == "zstd":
        cap += cap // 128 + (1 << 20)
    return cap


def units_of(m: mf.Manifest) -> list[Unit]:
    """The archive's files grouped by layer, in layer order. A file outside `sandbox/` and
    `containers/<name>/`: InvalidArgument (not a podshim layout this artifact can carry)."""
    sandbox = Unit(SANDBOX_DIR)
    containers: dict[str, Unit] = {}
    for c in m.containers:
        check_component(c.name, "container name")
        if c.dir != f"{CONTAINERS_DIR}/{c.name}":
            raise InvalidArgument(f"container {c.name!r} lives in {c.dir!r}, not {CONTAINERS_DIR}/{c.name}")
        containers[c.name] = Unit(c.dir, c.name)
    for rel, fe in m.files.items():
        parts = rel.split("/")
        if parts[0] == SANDBOX_DIR and len(parts) > 1:
            sandbox.files[rel] = fe.size
        elif parts[0] == CONTAINERS_DIR and len(parts) > 2 and parts[1] in containers:
            containers[parts[1]].files[rel] = fe.size
        else:
            raise InvalidArgument(
                f"archive file {rel!r} is outside sandbox/ and the containers' directories: "
                "the registry artifact carries only podshim's layout"
            )
    return [sandbox, *containers.values()]


def split_raw(units: list[Unit], raw: set[str]) -> None:
    """Move the files named in `raw` out of their unit's tar into raw file layers."""
    for u in units:
        for rel in sorted(raw & set(u.files)):
            u.raw[rel] = u.files.pop(rel)


def raw_files(units: list[Unit]) -> set[str]:
    """The files push carries raw (uncompressed pushes): RAW_FILE_MIN bytes or more, the largest
    first while the layer count stays within MAX_LAYERS."""
    big = sorted(
        ((size, rel) for u in units for rel, size in u.files.items() if size >= RAW_FILE_MIN),
        key=lambda x: (-x[0], x[1]),
    )
    return {rel for _, rel in big[: MAX_LAYERS - len(units)]}


# ---------------------------------------------------------------------------- tar (deterministic)


def tar_header(name: str, size: int, is_dir: bool) -> bytes:
    ti = tarfile.TarInfo(name + ("/" if is_dir else ""))
    ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    ti.mode = 0o700 if is_dir else 0o600
    ti.size = 0 if is_dir else size
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")


def tar_padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


TAR_END = b"\0" * (2 * BLOCK)


# ---------------------------------------------------------------------------- annotations


def _cgroup(m: mf.Manifest) -> str:
    return str(getattr(m.host, "cgroup_version", "") or "")


def manifest_annotations(m: mf.Manifest, compression: str, units: list[Unit]) -> dict[str, str]:
    md = m.sandbox.metadata
    checkpointed = [c.name for c in m.containers if c.checkpointed]
    a = {
        CREATED: m.created,
        TITLE: str(md.get("name", "")),
        f"{CRIU}.engine.name": "podshim",
        f"{CRIU}.engine.version": m.host.podshim_version or __version__,
        f"{CRIU}.pod.name": str(md.get("name", "")),
        f"{CRIU}.pod.namespace": str(md.get("namespace", "")),
        f"{CRIU}.pod.uid": str(md.get("uid", "")),
        f"{CRIU}.pod.id": m.sandbox.id,
        f"{CRIU}.runtime.name": m.host.runtime_name,
        f"{CRIU}.runtime.version": m.host.runtime_version,
        f"{CRIU}.criu.version": m.host.criu_version,
        f"{CRIU}.host.arch": m.host.arch,
        f"{CRIU}.host.kernel": m.host.kernel,
        f"{CRIU}.cgroup.version": _cgroup(m),
        f"{PODSHIM}.format": m.format,
        f"{PODSHIM}.containers": ",".join(checkpointed),
        f"{PODSHIM}.recorded-containers": ",".join(c.name for c in m.containers if not c.checkpointed),
        f"{PODSHIM}.images": ",".join(f"{c.name}={c.image}" for c in m.containers if c.checkpointed),
        f"{PODSHIM}.size": str(sum(u.size for u in units)),
        f"{PODSHIM}.files": str(sum(len(u.files) + len(u.raw) for u in units)),
        f"{PODSHIM}.compression": compression,
        f"{PODSHIM}.post-checkpoint-state": m.post_checkpoint_state,
        f"{PODSHIM}.pushed-by": f"podshim {__version__}",
    }
    if "freeze_window" in m.timings:
        a[f"{PODSHIM}.freeze-window-seconds"] = f"{m.timings['freeze_window']:.3f}"
    if m.encryption is not None:
        a[f"{PODSHIM}.encryption.scheme"] = m.encryption.scheme
        a[f"{PODSHIM}.encryption.key-id"] = m.encryption.key_id
    return {k: v for k, v in a.items() if v != ""}


def file_annotations(rel: str) -> dict[str, str]:
    return {TITLE: rel}


def layer_annotations(unit: Unit, m: mf.Manifest) -> dict[str, str]:
    a = {
        TITLE: unit.title,
        f"{PODSHIM}.layer.size": str(sum(unit.files.values())),  # what its tar holds
        f"{PODSHIM}.layer.files": str(len(unit.files)),
    }
    if unit.container:
        c = m.container(unit.container)
        a[f"{CRIU}.container.name"] = c.name
        a[f"{PODSHIM}.container.image"] = c.image
        a[f"{PODSHIM}.container.checkpointed"] = "true" if c.checkpointed else "false"
    return a


def descriptor(media_type: str, digest: str, size: int, annotations: dict[str, str] | None = None) -> dict:
    d: dict[str, Any] = {"mediaType": media_type, "digest": digest, "size": size}
    if annotations:
        d["annotations"] = annotations
    return d


def oci_manifest(config: dict, layers: list[dict], annotations: dict[str, str]) -> dict:
    return {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": config,
        "layers": layers,
        "annotations": annotations,
    }


# ---------------------------------------------------------------------------- reading one (untrusted)


@dataclass(frozen=True)
class Layer:
    title: str
    media_type: str
    digest: str
    size: int

    @property
    def compression(self) -> str:
        return LAYER_MEDIA_TYPES.get(self.media_type, "none")  # a file layer: raw bytes

    @property
    def is_file(self) -> bool:
        """One file's raw bytes (titled with its archive path), not a unit's tar."""
        return self.media_type == FILE_MEDIA_TYPE


@dataclass(frozen=True)
class Artifact:
    config_digest: str
    config_size: int
    layers: list[Layer]
    annotations: dict[str, str]


def _bad(what: str) -> DataLoss:
    return DataLoss(f"registry artifact: {what}: not a podshim checkpoint artifact, or it was tampered with")


def _descriptor(d: Any, where: str) -> tuple[str, str, int]:
    if not isinstance(d, dict):
        raise _bad(f"{where} is not an object")
    mt, dg, size = d.get("mediaType"), d.get("digest"), d.get("size")
    if not isinstance(mt, str) or not isinstance(dg, str) or not DIGEST_RE.fullmatch(dg):
        raise _bad(f"{where} has no media type or no sha256 digest")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _bad(f"{where} has no valid size")
    return mt, dg, size


def parse_oci_manifest(doc: Any) -> Artifact:
    """Check the shape of a pulled OCI manifest (DATA_LOSS when it is not podshim's artifact).
    Sizes and digests are only announcements here: pull.py holds the bytes to them."""
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        raise _bad("manifest is not an OCI manifest (schemaVersion 2)")
    if doc.get("mediaType", OCI_MANIFEST) != OCI_MANIFEST:
        raise _bad(f"manifest media type {str(doc.get('mediaType'))[:100]!r}")
    cmt, cdg, csize = _descriptor(doc.get("config"), "config")
    if cmt != CONFIG_MEDIA_TYPE:
        raise _bad(f"config media type {cmt[:100]!r} (expected {CONFIG_MEDIA_TYPE})")
    if csize > mf.MAX_MANIFEST_BYTES:
        raise _bad(f"config announces {csize} bytes, over the {mf.MAX_MANIFEST_BYTES} limit")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers or len(raw_layers) > MAX_LAYERS:
        raise _bad(f"manifest has no layers or more than {MAX_LAYERS}")
    layers: list[Layer] = []
    titles: set[str] = set()
    for i, d in enumerate(raw_layers):
        mt, dg, size = _descriptor(d, f"layers[{i}]")
        if mt not in LAYER_MEDIA_TYPES and mt != FILE_MEDIA_TYPE:
            raise _bad(f"layers[{i}] media type {mt[:100]!r}")
        ann = d.get("annotations") if isinstance(d, dict) else None
        title = ann.get(TITLE) if isinstance(ann, dict) else None
        if not isinstance(title, str):
            raise _bad(f"layers[{i}] has no {TITLE}")
        if mt != FILE_MEDIA_TYPE:  # a file layer's title is a manifest file entry: pull.py checks it
            check_title(title, f"layers[{i}]")
        if title in titles:
            raise _bad(f"layer {title!r} appears twice")
        titles.add(title)
        layers.append(Layer(title, mt, dg, size))
    ann = doc.get("annotations") or {}
    if not isinstance(ann, dict):
        raise _bad("annotations are not an object")
    return Artifact(cdg, csize, layers, {str(k): str(v) for k, v in ann.items()})


def check_title(title: str, where: str) -> None:
    """A layer title is `sandbox` or `containers/<name>` (InvalidArgument otherwise: it would
    place files elsewhere)."""
    norm = str(check_member_path(title, f"registry artifact {where} title"))
    parts = norm.split("/")
    ok = norm == title and (
        parts == [SANDBOX_DIR]
        or (len(parts) == 2 and parts[0] == CONTAINERS_DIR and check_component(parts[1], "container"))
    )
    if not ok:
        raise InvalidArgument(
            f"registry artifact {where} is titled {title[:120]!r}: a layer is {SANDBOX_DIR} or "
            f"{CONTAINERS_DIR}/<name>; refused"
        )


def iter_chunks(data: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    view = memoryview(data)
    for i in range(0, len(view), size):
        yield bytes(view[i : i + size])
