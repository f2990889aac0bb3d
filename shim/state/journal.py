"""The durable journal of in-flight operations (docs/design/crash-safety.md (Crash safety)).

Each operation is one JSON file `<state_dir>/ops/<op_id>.json`, written atomically BEFORE the
caller touches the pod, rewritten at each phase and removed when the operation ends. After a
crash, `pending()` lists what a previous podshim left unfinished so that start-up can thaw the
pod and remove the partial archive. Writes go through shim.archive.fsutil.atomic_write: a
record is the old or the new version, never torn.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shim import logs
from shim.archive.fsutil import atomic_write, fsync_dir, is_temp_name, make_private_dir
from shim.archive.manifest import rfc3339_now
from shim.errors import Internal, InvalidArgument, NotFound
from shim.state.records import RECORDS, JournalData

log = logs.get("shim.state.journal")

KINDS = (
    "checkpoint",
    "restore",
    "volume-fill",
    "checkpoint-container",
    "lazy-pages",
    "migration-source",
    "migration-destination",
)
RECORD_VERSION = 1
OPS_DIR = "ops"
CORRUPT_SUFFIX = ".corrupt"
PHASE_BEGUN = "begun"


@dataclass
class OpRecord:
    op_id: str
    kind: str  # one of KINDS
    pod_key: str  # the pod (sandbox id, or archive path for a restore) the operation holds
    phase: str
    # what recovery needs (cgroups to thaw, output_path to clean ...): the kind's typed record
    # (shim/state/records.py), or a plain dict for a kind without one
    data: Any
    started: str  # RFC 3339
    updated: str
    pid: int  # the podshim process that wrote it: another pid means a previous run
    path: Path = field(repr=False, compare=False)

    def to_json(self) -> bytes:
        doc = {
            "version": RECORD_VERSION,
            "op_id": self.op_id,
            "kind": self.kind,
            "pod_key": self.pod_key,
            "phase": self.phase,
            "started": self.started,
            "updated": self.updated,
            "pid": self.pid,
            "data": self.data.to_dict() if isinstance(self.data, JournalData) else self.data,
        }
        try:
            return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
        except (TypeError, ValueError) as e:
            raise Internal(f"journal record {self.op_id} ({self.kind}) is not JSON-serialisable: {e}") from e


@dataclass(frozen=True)
class CorruptRecord:
    """A journal file that could not be read back; `moved_to` is where it was set aside."""

    path: Path
    error: str
    moved_to: Path | None = None


@dataclass
class JournalScan:
    records: list[OpRecord]
    corrupt: list[CorruptRecord]


def _parse(path: Path, raw: bytes) -> OpRecord:
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("version") != RECORD_VERSION:
        raise ValueError(f"unknown record version {doc.get('version')!r}")
    str_fields = ("op_id", "kind", "pod_key", "phase", "started", "updated")
    for k in str_fields:
        if not isinstance(doc.get(k), str):
            raise ValueError(f"field {k} missing or not a string")
    if doc["kind"] not in KINDS:
        raise ValueError(f"unknown kind {doc['kind']!r}")
    if not isinstance(doc.get("data"), dict):
        raise ValueError("field data missing or not an object")
    pid = doc.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        raise ValueError("field pid missing or not an integer")
    if path.name != f"{doc['op_id']}.json":
        raise ValueError(f"op_id {doc['op_id']!r} does not match the file name")
    data = _typed(doc["kind"], doc["data"])
    return OpRecord(path=path, pid=pid, data=data, **{k: doc[k] for k in str_fields})


def _typed(kind: str, data: dict[str, Any]) -> Any:
    """`data` as the kind's typed record (ValueError when a field has the wrong type)."""
    cls = RECORDS.get(kind)
    return cls.from_dict(data) if cls is not None else data


class Journal:
    """Journal rooted at `state_dir` (created 0700 on first use)."""

    def __init__(self, state_dir: Path | str) -> None:
        self.state_dir = Path(state_dir)
        self.ops_dir = self.state_dir / OPS_DIR
        self._ready = False

    def _ensure_dir(self) -> None:
        # lazily: constructing a Journal must not need the disk (config checks, tests)
        if not self._ready:
            make_private_dir(self.ops_dir)
            self._ready = True

    def begin(self, kind: str, pod_key: str, data: JournalData | dict[str, Any] | None = None) -> OpRecord:
        """Record a new operation durably; call before acting on the pod. `data`: the kind's typed
        record (a dict is read as one)."""
        if kind not in KINDS:
            raise InvalidArgument(f"journal: unknown operation kind {kind!r} (known: {', '.join(KINDS)})")
        if not isinstance(pod_key, str) or not pod_key:
            raise InvalidArgument("journal: an operation needs a non-empty pod key")
        if isinstance(data, JournalData):
            if RECORDS.get(kind) is not type(data):
                raise InvalidArgument(f"journal: a {type(data).__name__} is no record of kind {kind!r}")
            typed: Any = data
        else:
            try:
                typed = _typed(kind, dict(data or {}))
            except ValueError as e:
                raise InvalidArgument(f"journal: bad {kind} record: {e}") from None
        self._ensure_dir()
        # time first: file names sort by start; the random part keeps them unique
        op_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{kind}-{secrets.token_hex(4)}"
        now = rfc3339_now()
        rec = OpRecord(
            op_id=op_id,
            kind=kind,
            pod_key=pod_key,
            phase=PHASE_BEGUN,
            data=typed,
            started=now,
            updated=now,
            pid=os.getpid(),
            path=self.ops_dir / f"{op_id}.json",
        )
        atomic_write(rec.path, rec.to_json())
        return rec

    def update(self, rec: OpRecord, phase: str, **data: Any) -> OpRecord:
        """Move `rec` to `phase`, setting the fields in `data` (a typed record's; a plain dict's
        keys are merged); durable when this returns."""
        if not rec.path.exists():
            raise NotFound(
                f"journal record {rec.op_id} ({rec.kind} of {rec.pod_key}) no longer exists: "
                "the operation was already finished"
            )
        if isinstance(rec.data, JournalData):
            try:
                merged: Any = replace(rec.data, **data)
            except TypeError as e:  # a field the record does not have: a programming error
                raise Internal(f"journal record {rec.op_id} ({rec.kind}): {e}") from None
        else:
            merged = {**rec.data, **data}
        new = replace(rec, phase=phase, data=merged, updated=rfc3339_now())
        atomic_write(rec.path, new.to_json())
        # the caller's object follows the disk only once the disk has it
        rec.phase, rec.data, rec.updated = new.phase, new.data, new.updated
        return rec

    def finish(self, rec: OpRecord) -> None:
        """Remove the record (idempotent) and make the removal durable."""
        try:
            os.unlink(rec.path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise Internal(f"cannot remove journal record {rec.path}: {e}; remove it by hand") from e
        fsync_dir(rec.path.parent)

    def scan(self) -> JournalScan:
        """Every readable record (oldest first) and every unreadable one, without changing anything.

        Temporary files of interrupted writes are ignored: the rename never happened, so the
        previous version (or nothing) is the truth.
        """
        records: list[OpRecord] = []
        corrupt: list[CorruptRecord] = []
        try:
            entries = sorted(os.scandir(self.ops_dir), key=lambda e: e.name)
        except FileNotFoundError:
            return JournalScan(records, corrupt)
        for e in entries:
            if is_temp_name(e.name) or not e.name.endswith(".json"):
                continue
            path = Path(e.path)
            try:
                if not e.is_file(follow_symlinks=False):
                    raise ValueError("not a regular file")
                records.append(_parse(path, path.read_bytes()))
            except (OSError, ValueError, UnicodeDecodeError) as err:
                corrupt.append(CorruptRecord(path=path, error=str(err)))
        records.sort(key=lambda r: (r.started, r.op_id))
        return JournalScan(records, corrupt)

    def pending(self) -> list[OpRecord]:
        """Operations left unfinished, oldest first, for replay at start.

        A corrupt record is reported (logged with where it went) and renamed to
        `<name>.corrupt` beside the others, so it is kept for the operator and never replayed.
        """
        self._remove_temp_files()
        result = self.scan()
        for c in result.corrupt:
            moved = self.quarantine(c)
            log.warning(
                "unreadable journal record set aside; check the pod it concerned by hand",
                path=str(c.path),
                error=c.error,
                moved_to=str(moved.moved_to) if moved.moved_to else None,
            )
        return result.records

    def _remove_temp_files(self) -> None:
        """Temporary files of record writes a crash interrupted (the rename never happened, so
        they are not the record): at start nothing else writes here, so they go."""
        try:
            entries = [e for e in os.scandir(self.ops_dir) if is_temp_name(e.name)]
        except FileNotFoundError:
            return
        for e in entries:
            try:
                os.unlink(e.path)
            except OSError as err:
                log.warning("cannot remove a temporary journal file", path=e.path, error=str(err))
                continue
            log.info("removed the temporary file of an interrupted journal write", path=e.path)
        if entries:
            fsync_dir(self.ops_dir)

    def quarantine(self, c: CorruptRecord) -> CorruptRecord:
        """Rename a corrupt record out of the replay set; returns it with `moved_to` set."""
        dest = c.path.with_name(c.path.name + CORRUPT_SUFFIX)
        try:
            os.replace(c.path, dest)
            fsync_dir(c.path.parent)
        except OSError as e:
            log.error("cannot set aside corrupt journal record", path=str(c.path), error=str(e))
            return c
        return CorruptRecord(path=c.path, error=c.error, moved_to=dest)
