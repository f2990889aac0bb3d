"""Typed journal records: what each operation kind writes into its record's `data` and what its
recovery reads back, one dataclass per kind registered in RECORDS, in the on-disk format of the
untyped journal (docs/design/crash-safety.md (Crash safety))."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar

RECORDS: dict[str, type[JournalData]] = {}

_T = TypeVar("_T", bound="type[JournalData]")


def register(cls: _T) -> _T:
    """Class decorator: `cls` types the records of its KIND."""
    if cls.KIND in RECORDS:
        raise ValueError(f"journal kind {cls.KIND!r} registered twice")
    RECORDS[cls.KIND] = cls
    return cls


def _check(name: str, hint: str, value: Any) -> Any:
    """`value` if it has the type `hint` names (the annotation as written), else ValueError."""
    base = hint.split(" | ")[0]
    if base == "str":
        ok = isinstance(value, str)
    elif base == "list[str]":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base == "list[dict[str, Any]]":
        ok = isinstance(value, list) and all(isinstance(v, dict) for v in value)
    elif base.startswith("dict"):
        ok = isinstance(value, dict)
    else:  # a record class with a field type this reader does not know: a programming error
        raise TypeError(f"journal record field {name}: unsupported type {hint}")
    if not ok:
        raise ValueError(f"field {name} is not a {base}: {value!r}")
    return value


def _annotation(cls: type, name: str) -> str:
    """The field's annotation as written (a string: `from __future__ import annotations`)."""
    for klass in cls.__mro__:
        ann = klass.__dict__.get("__annotations__", {})
        if name in ann:
            return str(ann[name])
    raise TypeError(f"{cls.__name__}.{name} has no annotation")


@dataclass
class JournalData:
    """Base of the typed records; `extra` holds the keys this version does not know."""

    KIND: ClassVar[str]
    extra: dict[str, Any] = field(default_factory=dict, repr=False, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The record in `data` (a missing key takes its default; None is an absent key)."""
        known = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        values = {
            name: _check(name, _annotation(cls, name), data[name])
            for name in known
            if data.get(name) is not None
        }
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})


@register
@dataclass
class CheckpointRecord(JournalData):
    """CheckpointPod (shim/ops/checkpoint_pod.py): recovery (checkpoint_pod_recovery.py) thaws
    `cgroups` and clears a partial archive in `output_path` (one without manifest.json)."""

    KIND: ClassVar[str] = "checkpoint"
    output_path: str = ""
    cgroups: list[str] = field(default_factory=list)  # the cgroups this checkpoint may freeze
    # the pod's network namespace, set before podshim locks it for a tcp-established dump:
    # recovery removes a lock a crash left there
    netns: str | None = None


@register
@dataclass
class ContainerCheckpointRecord(CheckpointRecord):
    """CheckpointContainer (shim/ops/checkpoint_container.py): `output_path` is podshim's
    staging dir next to the tar (`target`); recovery thaws `cgroups` and removes the staging dir.
    A record whose `output_path` is no staging dir is recovered like a pod checkpoint's."""

    KIND: ClassVar[str] = "checkpoint-container"
    container_id: str | None = None
    target: str | None = None


@register
@dataclass
class RestoreRecord(JournalData):
    """RestorePod (shim/ops/restore_pod.py): recovery removes the sandbox it created, found by
    `sandbox_id`, else by `sandbox_metadata` (a RunPodSandbox that got no answer, from
    `sandbox_unknown_since` on), then empties the volumes it was filling."""

    KIND: ClassVar[str] = "restore"
    checkpoint_path: str = ""
    sandbox_metadata: dict[str, Any] | None = None  # the new sandbox's, as protobuf JSON
    sandbox_id: str | None = None
    sandbox_unknown_since: float | None = None  # epoch seconds
    # the new pod's volumes about to be filled ({"target", mode, owner, times}: shim/ops/pod_volumes.py),
    # emptied again after the sandbox is removed
    volumes: list[dict[str, Any]] | None = None


@register
@dataclass
class VolumeFillRecord(JournalData):
    """A kubelet's restore of one container filling the pod's still-empty volumes
    (PodRestorer.restore_into), which has no record of its own: begun before the fill, closed when
    it ends, before the container is created; recovery empties `volumes` (a fill a crash cut
    short would pass for a filled volume at the kubelet's retry)."""

    KIND: ClassVar[str] = "volume-fill"
    volumes: list[dict[str, Any]] = field(default_factory=list)  # as RestoreRecord's


@register
@dataclass
class LazyPagesRecord(JournalData):
    """A live lazy-pages daemon (shim/ops/lazy_pages.py): recovery kills the container it serves
    (its result cannot be known any more) with the daemon's userfaultfds held (by its guard too),
    ends the daemon and the guard, and removes its work dir and the decrypted copy it served."""

    KIND: ClassVar[str] = "lazy-pages"
    container: str = ""  # the container's name in the archive
    work_dir: str = ""
    images: str = ""
    decrypted_dir: str = ""  # "" for a plain archive
    pid: int = 0  # 0 until the daemon runs
    start_time: int = -1  # the daemon's, from /proc (pid reuse)
    container_id: str = ""  # "" until its container is created
    verifying: int = 0  # page images whose checksums are not yet known to match
    guard: int = 0  # the uffd guard's pid (shim/criu/uffd_guard.py), 0 until it runs
    guard_start_time: int = -1


@register
@dataclass
class MigrationSourceRecord(JournalData):
    """A pod migrating out (shim/migration/source.py): recovery (source_recovery.py) ends its dumps
    (their page servers), then, by phase: before `handed-over` thaws `cgroups` at once; at
    `handed-over` (the destination may run) waits the destination's lease and then thaws; at
    `committed` (the destination has every page) kills the pod's processes and removes its
    containers. A partial archive in `output_path` is cleared unless committed."""

    KIND: ClassVar[str] = "migration-source"
    output_path: str = ""
    cgroups: list[str] = field(default_factory=list)  # what it froze: the pod cgroup, its containers'
    work_dir: str = ""  # the dumps' work dirs (CRIU logs), below <state_dir>/migration
    destination: str = ""
    container_ids: list[str] = field(default_factory=list)  # removed once committed


@register
@dataclass
class MigrationDestinationRecord(JournalData):
    """A pod migrating in (shim/migration/destination.py): until `acked` the source may thaw its
    pod after the lease, so recovery removes the new sandbox (its containers die with it) and
    clears the received archive in `checkpoint_path`."""

    KIND: ClassVar[str] = "migration-destination"
    checkpoint_path: str = ""
    source: str = ""
    sandbox_id: str | None = None
    # the new sandbox's metadata, recorded before it is asked for: a crash before its id was
    # journaled still finds it (RestoreRecord's rule)
    sandbox_metadata: dict[str, Any] | None = None
