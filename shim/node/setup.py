"""`podshim node setup`: wire containerd for podshim, as `nvidia-ctk runtime configure` does for its
runtime: one drop-in in the schema of the containerd it finds, imported by the main config; a
second run changes nothing, every changed file is backed up first, `--undo` takes out what it
added, and nothing is restarted (docs/design/install.md (Installing a node))."""

from __future__ import annotations

import copy
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from shim.config import Config
from shim.node import kubelet
from shim.node.containerd import (
    RUNC_SHIM,
    Containerd,
    ContainerdError,
    MainConfig,
    cri_base,
    cri_section,
    default_handler,
    effective,
    handler_table,
)

MARK = "podshim node setup"
DEFAULT_DROP_IN = "/etc/containerd/conf.d/podshim.toml"
CAP_SYS_RESOURCE = 24
# containerd shims that run an OCI runtime binary, as shim/checks/wiring.py judges them
RUNC_SHIMS = ("io.containerd.runc.v2", "io.containerd.runc.v1")
DEFAULT_RUNC_ROOT = "/run/containerd/runc"  # the runc shim's Root when its option is unset
CRI_NAMESPACE = "k8s.io"


@dataclass
class Change:
    path: Path
    old: str | None  # None: the file does not exist
    new: str | None  # None: remove it
    why: str


@dataclass
class Plan:
    containerd: Containerd | None
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the operator must do or should know
    problems: list[str] = field(default_factory=list)  # what stops the set-up (nothing is written)

    @property
    def to_write(self) -> list[Change]:
        return [c for c in self.changes if c.old != c.new]


# ---------------------------------------------------------------------------- the drop-in


def has_capability(cap: int, status: str | None = None) -> bool:
    """Whether this process holds capability `cap` (CapEff of /proc/self/status)."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return True
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status, re.M)
    return bool(m and int(m.group(1), 16) >> cap & 1)


def _annotations(existing: Any) -> list[str]:
    from shim.checks.wiring import PASSED_ANNOTATIONS, go_match

    patterns = [str(p) for p in existing] if isinstance(existing, list) else []
    if not all(any(go_match(p, a) for p in patterns) for a in PASSED_ANNOTATIONS):
        patterns.append("podshim.*")
    return patterns


def drop_in_config(
    ctd: Containerd,
    now: dict[str, Any],
    base: dict[str, Any],
    handlers: list[str],
    podshim_runc: str,
    criu_paths: dict[str, str],
    restrict_oom: bool,
) -> tuple[dict[str, Any], list[str]]:
    """The drop-in's content: `base` (1.x: the CRI section in force; 2.x: empty) with podshim's keys
    for each handler, read against `now` (the effective config); `criu_paths`: the CriuPath of the
    handlers that get one. Returns it and the problems."""
    section = copy.deepcopy(base) if not ctd.merges_imports else {}
    problems = []
    for h in handlers:
        current = handler_table(ctd, now, h)
        rtype = str(current.get("runtime_type") or RUNC_SHIM)
        if rtype not in RUNC_SHIMS:
            problems.append(
                f"runtime handler {h!r} has runtime_type {rtype!r}, which runs no OCI runtime binary "
                "podshim-runc could wrap: wire another handler (--runtime)"
            )
            continue
        table = section.setdefault("containerd", {}).setdefault("runtimes", {}).setdefault(h, {})
        table["runtime_type"] = rtype
        table["container_annotations"] = _annotations(current.get("container_annotations"))
        options = table.setdefault("options", {})
        options["BinaryName"] = podshim_runc
        if h in criu_paths and ctd.major < 2:
            options["CriuPath"] = criu_paths[h]  # 2.x has no such option
    if restrict_oom:  # (set even when in force already: it may be this drop-in's, of a first run)
        section["restrict_oom_score_adj"] = True
    return {"version": ctd.schema, "plugins": {ctd.cri_plugin: section}}, problems


def drop_in_text(ctd: Containerd, config: dict[str, Any]) -> str:
    how = (
        "containerd 2.x merges this section into the main config's"
        if ctd.merges_imports
        else "containerd 1.x REPLACES the CRI section with this file's: it holds the whole section "
        "containerd ran with at set-up plus podshim's keys; change CRI settings here from now on"
    )
    return (
        f"# Written by `{MARK}` for containerd {ctd.version} (config version {ctd.schema}); {how}.\n"
        f"# `{MARK} --undo` removes it. Restart containerd after a change.\n" + tomli_w.dumps(config)
    )


def wants_criu_path(runtime: str) -> bool:
    """Whether a handler's real runtime takes containerd 1.x's CriuPath (its `--criu`): runc before
    1.2 only. crun refuses the flag; runc >= 1.2 ignores it with a warning on stderr, which lands
    in the log of every container it creates (podshim names its CRIU on PATH for both)."""
    from shim.criu.runtime import binary_version

    if "crun" in os.path.basename(runtime):
        return False
    m = re.search(r"(\d+)\.(\d+)", binary_version(runtime))
    return m is not None and (int(m.group(1)), int(m.group(2))) < (1, 2)


# ---------------------------------------------------------------------------- the main config's imports

_TABLE = re.compile(r"^\s*\[")
_IMPORTS = re.compile(r"^\s*imports\s*=\s*\[(?P<list>[^\]]*)\]\s*(?:#.*)?$")
_ADDED = f"  # {MARK}: added "


def _top_level(lines: list[str]) -> int:
    """Index of the first table header (top-level keys must come before it)."""
    return next((i for i, line in enumerate(lines) if _TABLE.match(line)), len(lines))


def add_import(main: MainConfig, pattern: str, schema: int) -> tuple[str | None, str]:
    """The main config's text importing `pattern` too (None and a reason when it cannot be
    edited safely). Its line carries a comment with what it was, for --undo."""
    entry = tomli_w.dumps({"x": pattern})[4:].strip()  # the pattern as a TOML string
    if main.text is None:
        return f"version = {schema}\nimports = [{entry}]{_ADDED}{entry}; was: no file\n", ""
    lines = main.text.splitlines(keepends=True)
    top = _top_level(lines)
    for i, line in enumerate(lines[:top]):
        m = _IMPORTS.match(line.rstrip("\n"))
        if m:
            items = [s.strip() for s in m.group("list").split(",") if s.strip()]
            lines[i] = f"imports = [{', '.join([*items, entry])}]{_ADDED}{entry}; was: {line.rstrip()}\n"
            return "".join(lines), ""
    if "imports" in main.data:
        return None, f'its imports span several lines: add "{pattern}" to them yourself and run again'
    lines.insert(top, f"imports = [{entry}]{_ADDED}{entry}; was: no line\n")
    return "".join(lines), ""


def remove_import(text: str) -> str | None:
    """The main config's text without the line `add_import` changed (restored as it was); None
    when it was a file `add_import` created and nothing else was added since."""
    out = []
    for line in text.splitlines(keepends=True):
        if _ADDED not in line:
            out.append(line)
            continue
        was = line.rsplit("; was: ", 1)[-1].rstrip("\n")
        if was == "no file":
            rest = [x for x in out if x.strip() and not x.startswith("version =")]
            if not rest:
                return None
        elif was != "no line":
            out.append(was + "\n")
    return "".join(out)


# ---------------------------------------------------------------------------- planning


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def plan_setup(
    ctd: Containerd,
    config_path: Path,
    drop_in: Path,
    cfg: Config,
    podshim_runc: str,
    handlers: list[str],
    restrict_oom: bool | None = None,
) -> Plan:
    plan = Plan(ctd)
    main = MainConfig.read(config_path)
    if main.text is not None and main.version < 2:
        plan.problems.append(
            f"{config_path} is config version {main.version}: containerd {ctd.version} reads version "
            f"{ctd.schema} (containerd 1.x: version 2); convert it first"
        )
        return plan
    now = effective(ctd, config_path) if main.text is not None else {}
    handlers = handlers or [default_handler(ctd, now)]
    base, source = cri_base(ctd, main, drop_in) if not ctd.merges_imports else ({}, None)
    if restrict_oom is None:
        restrict_oom = not has_capability(CAP_SYS_RESOURCE)
    criu_paths = {
        h: rt.criu for h in handlers if (rt := cfg.runtime_for_handler(h)) and wants_criu_path(rt.binary)
    }
    config, problems = drop_in_config(ctd, now, base, handlers, podshim_runc, criu_paths, restrict_oom)
    plan.problems += problems
    if plan.problems:
        return plan
    plan.changes.append(
        Change(
            drop_in, _read(drop_in), drop_in_text(ctd, config), f"podshim's keys for {', '.join(handlers)}"
        )
    )
    if not ctd.merges_imports and source is not None:
        plan.notes.append(
            f"containerd 1.x replaces the CRI section with the drop-in's: it carries the one of {source} "
            f"(now hidden); edit CRI settings in {drop_in} from now on"
        )
        later = [f for f in main.imported_files() if f > drop_in and cri_section(ctd, _parse(f))]
        if later:
            plan.problems.append(
                f"{', '.join(map(str, later))} (imported after {drop_in}) replace(s) the CRI section again: "
                "move its CRI settings into the drop-in or name the drop-in to sort last (--drop-in)"
            )
    if not main.covers(drop_in):
        text, why = add_import(main, str(drop_in.parent / "*.toml"), ctd.schema)
        if text is None:
            plan.problems.append(f"cannot add the import to {config_path}: {why}")
        else:
            plan.changes.append(Change(config_path, main.text, text, f"imports {drop_in.parent}/*.toml"))
    plan.notes += _runtime_notes(ctd, now, handlers, cfg)
    plan.notes += kubelet.endpoint_notes("unix://" + cfg.socket)
    plan.notes.append(cluster_note(cfg))
    return plan


def cluster_note(cfg: Config) -> str:
    """Whether podshim will serve the cluster API (docs/cluster.md) with the node's credentials."""
    path = cfg.kubernetes_kubeconfig
    if path and os.path.isfile(path):
        return (
            f"the cluster API (PodCheckpoint, restore-from Pods) is served with the node's credentials "
            f"{path}; install its objects once per cluster: kubectl apply -k /usr/share/podshim/deploy"
        )
    return (
        f"no cluster API: [kubernetes] kubeconfig {path!r} names no file (the kubelet's credentials, "
        "once it has joined a cluster); podshim serves CRI alone until it does and podshim restarts"
    )


def _parse(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _runtime_notes(ctd: Containerd, now: dict[str, Any], handlers: list[str], cfg: Config) -> list[str]:
    """What podshim's own config must say for the handlers wired: the real runtime podshim-runc
    runs (containerd ran the old BinaryName) and the state root it is told apart by."""
    from shim.checks.wiring import executes_podshim_runc

    notes = []
    for h in handlers:
        rt = cfg.runtime_for_handler(h)
        table = handler_table(ctd, now, h)
        options = table.get("options")
        if not isinstance(options, dict):
            options = {}
        where = "[runtime]" if rt is cfg.runtime else f"[runtimes.{h}]"
        if rt is None:
            notes.append(f"podshim's config has no [runtimes.{h}]: add binary, root and criu for it")
            continue
        old = str(options.get("BinaryName") or "runc")
        if not executes_podshim_runc(old):
            real = shutil.which(old) or old
            if os.path.realpath(real) != os.path.realpath(rt.binary):
                notes.append(
                    f"handler {h!r} ran {real}; podshim-runc will run {where} binary = {rt.binary!r}: "
                    f"set it to {real!r} in podshim's config if that is the runtime you mean"
                )
        root = os.path.join(str(options.get("Root") or DEFAULT_RUNC_ROOT), CRI_NAMESPACE)
        if os.path.normpath(root) != os.path.normpath(rt.root):
            notes.append(f"handler {h!r} keeps its containers in {root}: set {where} root = {root!r}")
    return notes


def plan_undo(config_path: Path, drop_in: Path) -> Plan:
    plan = Plan(None)
    text = _read(drop_in)
    if text is not None:
        if MARK in text.split("\n", 1)[0]:
            plan.changes.append(Change(drop_in, text, None, "the drop-in podshim node setup wrote"))
        else:
            plan.notes.append(f"{drop_in} was not written by {MARK}: left as it is")
    main = _read(config_path)
    if main is not None and _ADDED in main:
        plan.changes.append(Change(config_path, main, remove_import(main), "the import podshim added"))
    return plan


# ---------------------------------------------------------------------------- applying


def apply(plan: Plan) -> list[str]:
    """Write the plan's changes (each file it rewrites backed up first); what was done, one line
    each."""
    done = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for c in plan.to_write:
        if c.old is not None and c.new is not None:  # (a drop-in it wrote goes without a copy)
            backup = c.path.with_name(f"{c.path.name}.podshim-backup-{stamp}")
            shutil.copy2(c.path, backup)
            done.append(f"backed up {c.path} to {backup}")
        if c.new is None:
            c.path.unlink()
            done.append(f"removed {c.path} ({c.why})")
            continue
        c.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        mode = c.path.stat().st_mode & 0o7777 if c.old is not None else 0o644
        tmp = c.path.with_name(f".{c.path.name}.podshim-tmp")
        tmp.write_text(c.new)
        os.chmod(tmp, mode)
        os.replace(tmp, c.path)
        done.append(f"wrote {c.path} ({c.why})")
    return done


__all__ = ["ContainerdError", "DEFAULT_DROP_IN", "Plan", "apply", "plan_setup", "plan_undo"]
