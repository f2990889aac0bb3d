"""cgroups: host freezer detection (v1/v2), cgroupsPath resolution (cgroupfs and systemd
drivers), the freezer, and the pod-wide freeze in one cut. Everything lives in `freezer`."""

from shim.cgroups.freezer import (
    CgroupMode,
    CutTimings,
    Freezer,
    FreezerState,
    FreezerTimeout,
    Hierarchy,
    PodCut,
    cgroup_procs,
    default_freezer,
    detect_hierarchy,
    expand_slice,
    parse_mountinfo,
    resolve_cgroups_path,
    thaw_paths,
)

__all__ = [
    "CgroupMode",
    "CutTimings",
    "Freezer",
    "FreezerState",
    "FreezerTimeout",
    "Hierarchy",
    "PodCut",
    "cgroup_procs",
    "default_freezer",
    "detect_hierarchy",
    "expand_slice",
    "parse_mountinfo",
    "resolve_cgroups_path",
    "thaw_paths",
]
