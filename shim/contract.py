"""The restore contract between podshim (the daemon) and podshim-runc (the OCI runtime wrapper):
every name both sides must spell the same (docs/design/runtime-wrapper.md (The runtime wrapper)).

The daemon creates a container with RESTORE_ANNOTATION (the checkpoint directory) and
RESTORE_OPTIONS_ANNOTATION (the CRIU option record); the wrapper restores it at `create` and
leaves RESTORED_MARKER in the runtime's state dir, which the daemon reads back. The compiled
wrapper (native/podshim-runc.c) spells RESTORE_ANNOTATION, RESTORED_MARKER and HOOK_NAME in its
own #defines; tests/test_contract.py keeps them equal. This module imports nothing of podshim's
at import time: the wrapper loads it on every restore.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

RESTORE_ANNOTATION = "podshim.restore.checkpoint-dir"  # no "/": containerd matches with filepath.Match
RESTORE_OPTIONS_ANNOTATION = "podshim.restore.criu-options"  # the CRIU option record (to_record)
RESTORED_MARKER = "podshim-restored"  # in the runtime's state dir of the container
HOOK_NAME = "podshim-runc-hook"  # the Python side the compiled wrapper execs
WORK_DIR = "podshim-restore"  # in the bundle: CRIU's work dir (log, restore stats, config)
BROKER_SOCKET = "restore.sock"  # in server.state_dir: podshim's restore broker (shim/ops/restore_broker.py)
ABORT_ENV = "PODSHIM_RUNC_ABORT"  # podshim-runc -> its hook: undo the restore podshim lost, and why
CRIU_CONFIG_ANNOTATION = "org.criu.config"  # runc/crun read CRIU options from this file
# <state_dir>/imports: container checkpoint tars extracted by podshim's CreateContainer
# (shim/ops/restore_container.py); podshim-owned, so accepted like the allowed roots.
IMPORTS_DIR = "imports"
# <state_dir>/decrypted/<random>/: one container's plaintext of an encrypted archive
# (shim/archive/crypto.py); podshim-owned too. DECRYPTED_MARKER in it says whose it is: the wrapper
# removes the plaintext after the restore, telling such a dir by it (without importing crypto).
DECRYPTED_DIR = "decrypted"
DECRYPTED_MARKER = ".podshim-decrypted"
# Lazy restore (docs/design/restore-pod.md (Lazy restore)): the daemon sets LAZY_PAGES_ANNOTATION to the
# work dir <state_dir>/lazy/<random>/ of the container's `criu lazy-pages`, which listens on
# LAZY_PAGES_SOCKET there; the wrapper restores with `--lazy-pages --work-path` that dir.
LAZY_PAGES_ANNOTATION = "podshim.restore.lazy-pages-dir"
LAZY_DIR = "lazy"
LAZY_PAGES_SOCKET = "lazy-pages.socket"
# written by podshim in place of the socket when the lazy restore failed before the container started
LAZY_PAGES_FAILED = "lazy-pages.failed"

# Eager restore of a plain archive (docs/design/restore-pod.md (RestorePod) step 4): RestorePod leaves
# the CRIU page images (checkpoint/pages-*.img) unverified and hands their sha256 to the wrapper as
# JSON {member path relative to the container's checkpoint dir: sha256 hex}; the wrapper restores
# the tasks stopped, hashes the images meanwhile and continues the tasks only when all match.
PAGE_DIGESTS_ANNOTATION = "podshim.restore.page-digests"
PAGE_IMAGE_RE = r"checkpoint/pages-[0-9]+\.img"  # what CRIU names a page image (pages-<id>.img)
# how the wrapper's failure names a page image that differs (StartContainer and RestorePod
# start=true answer it DATA_LOSS: is_page_mismatch)
PAGE_MISMATCH = "checksum mismatch of "

# The CRIU switches, by the names CheckpointPod `options`, the archive manifests' `options` and
# the restore record use, with the CriuOptions field each sets.
FILE_LOCKS = "file-locks"
TCP_ESTABLISHED = "tcp-established"
EXT_UNIX_SK = "ext-unix-sk"
SHELL_JOB = "shell-job"
CRIU_SWITCHES: dict[str, str] = {
    FILE_LOCKS: "file_locks",
    TCP_ESTABLISHED: "tcp_established",
    EXT_UNIX_SK: "ext_unix_sk",
    SHELL_JOB: "shell_job",
}


def owned_roots(state_dir: str | Path) -> list[str]:
    """The podshim-owned directories a checkpoint to restore may lie in, beside the allowed roots."""
    return [str(Path(state_dir) / IMPORTS_DIR), str(Path(state_dir) / DECRYPTED_DIR)]


def lazy_root(state_dir: str | Path) -> Path:
    """Where the work dirs of the lazy-pages daemons live (<state_dir>/lazy)."""
    return Path(state_dir) / LAZY_DIR


def to_record(options: Mapping[str, str]) -> str:
    """The restore record (RESTORE_OPTIONS_ANNOTATION) of a manifest's `options`: the switches that
    were on at the dump, comma-separated."""
    return ",".join(name for name in CRIU_SWITCHES if options.get(name) == "true")


def page_digests_record(digests: Mapping[str, str]) -> str:
    """PAGE_DIGESTS_ANNOTATION's value: the page images' sha256 by relative path, as JSON."""
    return json.dumps(dict(sorted(digests.items())), separators=(",", ":"))


def parse_page_digests(value: str) -> dict[str, str]:
    """PAGE_DIGESTS_ANNOTATION's value back; ValueError for anything but a non-empty JSON object of
    page image paths (PAGE_IMAGE_RE: nothing else is ever opened through it) to sha256 hex."""
    doc = json.loads(value)
    if not isinstance(doc, dict) or not doc:
        raise ValueError("not a non-empty JSON object")
    for rel, digest in doc.items():
        if not re.fullmatch(PAGE_IMAGE_RE, rel):
            raise ValueError(f"{rel!r} is not a page image path (checkpoint/pages-<n>.img)")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError(f"{rel}: {digest!r} is not a sha256 hex digest")
    return doc


def is_page_mismatch(details: str) -> bool:
    """Whether an upstream's error message carries the wrapper's failure for a page image whose
    sha256 differs (docs/design/restore-pod.md (RestorePod) step 4)."""
    return PAGE_MISMATCH + "checkpoint/" in details
