"""Hostile archives given to RestorePod: a copy of a good checkpoint, then one thing broken —
the manifest (missing, not JSON, nested 100k deep, huge, a symlink or FIFO, unknown format,
absolute or escaping member paths, huge or negative sizes, bad digests), the files (missing,
extra, flipped byte (in an image CRIU parses: a page image's is StartContainer's failure, see
tests/test_restore_pod.py), truncated, a symlink to the canary, a FIFO, a device), the host (arch,
CRIU version), or a consistent-looking archive whose contents lie (checksums recomputed).

For each: the documented code and message, no sandbox created, podshim up, the canary outside
the roots neither read nor written, the good archive unchanged.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri

from .corpus import (
    DATA_LOSS,
    INVALID,
    NOT_FOUND,
    PRECONDITION,
    Case,
    Ctx,
    counter,
    edit_manifest,
    first_pages,
    rehash,
    rewrite,
)
from .test_requests import check

pytestmark = pytest.mark.e2e


def mutated(fn: Callable[[Path], object], **restore: Any) -> Callable[[Ctx], Callable[[], Any]]:
    """A case builder: copy the good archive, apply `fn` to the copy, restore from it."""

    def build(ctx: Ctx) -> Callable[[], Any]:
        root = ctx.copy()
        fn(root)
        return ctx.restore(path=root, **restore)

    return build


def manifest_is(data: bytes) -> Callable[[Path], object]:
    return lambda root: rewrite(root / "manifest.json", data)


def files_entry(rel: str, **entry: Any) -> Callable[[Path], object]:
    def fn(root: Path) -> None:
        edit_manifest(root, lambda m: m["files"].__setitem__(rel, {"size": 1, "sha256": "0" * 64, **entry}))

    return fn


def entry_of(pick: Callable[[Path], str], **change: Any) -> Callable[[Path], object]:
    def fn(root: Path) -> None:
        rel = pick(root)
        edit_manifest(root, lambda m: m["files"][rel].update(change))

    return fn


def _flip_byte(root: Path) -> None:
    """In a CRIU image other than the page images (which an eager restore checks beside CRIU's
    restore, at StartContainer: tests/test_restore_pod.py), so RestorePod refuses it up front."""
    p = sorted(root.glob("containers/counter/checkpoint/pagemap-*.img"))[0]
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rewrite(p, bytes(data))


def _truncate(root: Path) -> None:
    p = root / first_pages(root)
    rewrite(p, p.read_bytes()[:-4096])


def _symlink_member(target: Callable[[Path], Path]) -> Callable[[Path], object]:
    """A listed file replaced by a symlink (to the canary's secret, say)."""

    def fn(root: Path) -> None:
        p = root / "containers/counter/spec.dump"
        p.unlink()
        p.symlink_to(target(root))

    return fn


def _manifest_symlink(ctx_secret: Callable[[Path], Path]) -> Callable[[Path], object]:
    def fn(root: Path) -> None:
        (root / "manifest.json").unlink()
        (root / "manifest.json").symlink_to(ctx_secret(root))

    return fn


def _manifest_fifo(root: Path) -> None:
    (root / "manifest.json").unlink()
    os.mkfifo(root / "manifest.json", 0o600)


def _manifest_sparse_huge(root: Path) -> None:
    (root / "manifest.json").unlink()
    with open(root / "manifest.json", "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: nothing to read, only a size


def _extra_fifo(root: Path) -> None:
    os.mkfifo(root / "containers/counter/checkpoint/pipe", 0o600)


def _extra_zero_device(root: Path) -> None:
    os.mknod(root / "containers/counter/checkpoint/zero", 0o600 | 0o020000, os.makedev(1, 5))


def _config_dump(data: bytes) -> Callable[[Path], object]:
    def fn(root: Path) -> None:
        rewrite(root / "containers/counter/config.dump", data)
        rehash(root, "containers/counter/config.dump")

    return fn


def _ghost_container(root: Path) -> None:
    """The manifest claims a second checkpointed container that has no files at all."""

    def add(m: dict[str, Any]) -> None:
        m["containers"].append({**m["containers"][0], "name": "ghost", "dir": "containers/ghost"})

    edit_manifest(root, add)


def _container(**change: Any) -> Callable[[Path], object]:
    return lambda root: edit_manifest(root, lambda m: m["containers"][0].update(change))


def _duplicate_container(root: Path) -> None:
    edit_manifest(root, lambda m: m["containers"].append(dict(m["containers"][0])))


def _host(**change: Any) -> Callable[[Path], object]:
    return lambda root: edit_manifest(root, lambda m: m["host"].update(change))


def _escaping_container_name(ctx: Ctx) -> Callable[[], Any]:
    """Manifest and request agree on a container named '../../x': the archive layout refuses."""
    root = ctx.copy()
    edit_manifest(root, lambda m: m["containers"][0].update(name="../../x"))
    return ctx.restore(path=root, containers=[counter("../../x")])


ARCHIVES = [
    Case("no-manifest", mutated(lambda r: (r / "manifest.json").unlink()), NOT_FOUND, ("no manifest.json",)),
    Case("manifest-not-json", mutated(manifest_is(b"{ not json")), DATA_LOSS, ("not valid JSON",)),
    Case(
        "manifest-truncated",
        mutated(manifest_is(b'{"format": "podshim.checkpoint.v1", "files": {')),
        DATA_LOSS,
        ("not valid JSON",),
    ),
    Case(
        "manifest-not-utf8", mutated(manifest_is(b'{"format": "\xff\xfe"}')), DATA_LOSS, ("not valid JSON",)
    ),
    Case(
        "manifest-nested-100k", mutated(manifest_is(b"[" * 100_000 + b"]" * 100_000)), DATA_LOSS, ("corrupt",)
    ),
    Case(
        "manifest-5000-digit-int",
        mutated(manifest_is(b'{"format": ' + b"9" * 5000 + b"}")),
        DATA_LOSS,
        ("corrupt",),
    ),
    Case("manifest-empty-object", mutated(manifest_is(b"{}")), DATA_LOSS, ("format",)),
    Case("manifest-a-list", mutated(manifest_is(b"[]")), DATA_LOSS, ("top level",)),
    Case(
        "manifest-not-podshim",
        mutated(manifest_is(b'{"format": "docker.v2"}')),
        PRECONDITION,
        ("not a podshim checkpoint",),
    ),
    Case(
        "manifest-future-format",
        mutated(manifest_is(b'{"format": "podshim.checkpoint.v9"}')),
        PRECONDITION,
        ("not supported",),
    ),
    Case("manifest-over-64mib", mutated(_manifest_sparse_huge), DATA_LOSS, ("limit",)),
    Case("manifest-is-fifo", mutated(_manifest_fifo), INVALID, ("not a regular file",)),
    Case("missing-file", mutated(lambda r: (r / first_pages(r)).unlink()), DATA_LOSS, ("missing",)),
    Case(
        "extra-file",
        mutated(lambda r: (r / "containers/counter/evil.sh").write_text("x")),
        DATA_LOSS,
        ("not listed", "evil.sh"),
    ),
    Case("flipped-byte", mutated(_flip_byte), DATA_LOSS, ("sha256", "pagemap-")),
    Case("truncated-file", mutated(_truncate), DATA_LOSS, ("bytes", "pages-")),
    Case(
        "huge-declared-size", mutated(entry_of(first_pages, size=2**62)), DATA_LOSS, ("4611686018427387904",)
    ),
    Case("negative-size", mutated(entry_of(first_pages, size=-1)), DATA_LOSS, ("non-negative",)),
    Case("bool-size", mutated(entry_of(first_pages, size=True)), DATA_LOSS, ("size",)),
    Case("bad-digest", mutated(entry_of(first_pages, sha256="zz")), DATA_LOSS, ("sha256",)),
    Case("absolute-member", mutated(files_entry("/etc/shadow")), INVALID, ("absolute",)),
    Case("escaping-member", mutated(files_entry("../../outside/secret")), INVALID, ("escapes",)),
    Case("escaping-inner-member", mutated(files_entry("containers/../../x")), INVALID, ("escapes",)),
    Case(
        "member-not-normal",
        mutated(files_entry("containers//counter/./spec.dump")),
        INVALID,
        ("normal form",),
    ),
    Case("escaping-container-dir", mutated(_container(dir="../../outside")), INVALID, ("escapes",)),
    Case("escaping-container-name", _escaping_container_name, INVALID, ("container name",)),
    Case("duplicate-container", mutated(_duplicate_container), DATA_LOSS, ("twice",)),
    Case("fifo-in-archive", mutated(_extra_fifo), INVALID, ("not a regular file",)),
    Case("zero-device-in-archive", mutated(_extra_zero_device), INVALID, ("not a regular file",)),
    Case("other-arch", mutated(_host(arch="s390x")), PRECONDITION, ("s390x",)),
    Case("newer-criu", mutated(_host(criu_version="99.1")), PRECONDITION, ("upgrade CRIU",)),
]

# archive pieces pointing at the canary: built per test, since they need its path
CANARY_ARCHIVES = [
    (
        "manifest-symlink-to-canary",
        lambda c: mutated(_manifest_symlink(lambda r: c.canary.secret))(c),
        INVALID,
        ("not a regular file",),
    ),
    (
        "member-symlink-to-canary",
        lambda c: mutated(_symlink_member(lambda r: c.canary.secret))(c),
        INVALID,
        ("symlink",),
    ),
    (
        "member-symlink-inside",
        lambda c: mutated(_symlink_member(lambda r: r / "sandbox/config.json"))(c),
        INVALID,
        ("symlink",),
    ),
]

UNREADABLE_RECORDS = [
    pytest.param(
        Case("config-dump-not-json", mutated(_config_dump(b"not json")), DATA_LOSS, ("config.dump",)),
        id="config-dump-not-json",
    ),
    pytest.param(
        Case("config-dump-a-list", mutated(_config_dump(b"[1, 2]")), DATA_LOSS, ("config.dump",)),
        id="config-dump-a-list",
    ),
    pytest.param(
        Case(
            "container-without-files",
            mutated(_ghost_container, containers=[counter(), counter("ghost")]),
            DATA_LOSS,
            ("ghost",),
        ),
        id="container-without-files",
    ),
]


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def good_digest(ctx_module_archive: Path) -> str:
    return _digest(ctx_module_archive)


@pytest.fixture(scope="module")
def ctx_module_archive(hostile_pods: tuple[Any, Any, Path]) -> Path:
    return hostile_pods[2]


def _no_restored_pod(ctx: Ctx) -> None:
    left = [
        p.id
        for p in ctx.rt.ListPodSandbox(cri.ListPodSandboxRequest()).items
        if "hostile-" in p.metadata.name
    ]
    assert left == [], "a hostile archive got a sandbox created"


@pytest.mark.parametrize("case", ARCHIVES, ids=lambda c: c.id)
def test_hostile_archive(ctx: Ctx, case: Case, good_digest: str) -> None:
    check(ctx, case)
    _no_restored_pod(ctx)
    assert _digest(ctx.archive) == good_digest, "the good archive changed through a copy"


@pytest.mark.parametrize(
    ("name", "build", "code", "needles"), CANARY_ARCHIVES, ids=[c[0] for c in CANARY_ARCHIVES]
)
def test_archive_pointing_at_canary(
    ctx: Ctx, name: str, build: Any, code: Any, needles: tuple[str, ...]
) -> None:
    check(ctx, Case(name, build, code, needles))
    _no_restored_pod(ctx)


@pytest.mark.parametrize("case", UNREADABLE_RECORDS)
def test_lying_archive_known_bugs(ctx: Ctx, case: Case) -> None:
    check(ctx, case)
    _no_restored_pod(ctx)
