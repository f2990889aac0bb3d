"""Which containerd, runc and CRIU a test bed runs, and where each is: chosen by the variables
``PODSHIM_TEST_CONTAINERD``, ``PODSHIM_TEST_RUNC`` and ``PODSHIM_TEST_CRIU`` (``make test-core
CONTAINERD= RUNC= CRIU=``), else the defaults; the binaries are the set-up's."""

from __future__ import annotations

import os
from pathlib import Path

from testbed.errors import TestBedError

# The upstream containerd the bed runs (PODSHIM_TEST_CONTAINERD): 1.6 is the system's (Debian 12),
# 1.7 and 2.1 are unpacked by scripts/setup.sh from Debian's newer releases into a private prefix,
# 2.2 and 2.4 built from pinned Go modules (tools/go/containerd-<minor>, scripts/gotools.sh).
CONTAINERD_VERSIONS = ("1.6", "1.7", "2.1", "2.2", "2.4")
DEFAULT_CONTAINERD = "1.6"
CONTAINERD_PREFIX = Path("/var/cache/podshim/containerd")
GO_BIN = Path("/var/cache/podshim/go/bin")  # scripts/gotools.sh: <name>/<binary>
# The OCI runtime behind podshim-runc (PODSHIM_TEST_RUNC): Debian 12's runc 1.1.5, or runc 1.3 from
# its pinned Go module. crun stays the set-up's.
RUNC_BINARIES = {"1.1": Path("/usr/sbin/runc"), "1.3": GO_BIN / "runc-1.3" / "runc"}
DEFAULT_RUNC = "1.1"
# The CRIU podshim and the runtimes use (PODSHIM_TEST_CRIU): the set-up's /usr/local one (4.1), or
# 4.2 from its private prefix (scripts/setup.sh step 2b); both carry podshim's patches.
CRIU_BINARIES = {"4.1": Path("/usr/local/sbin/criu"), "4.2": Path("/var/cache/podshim/criu/4.2/sbin/criu")}
DEFAULT_CRIU = "4.1"
# A CRIU binary of that series built elsewhere (an absolute path), used instead of the set-up's:
# a CRIU patch in development runs in the beds and benches without replacing the machine's.
CRIU_BIN_ENV = "PODSHIM_TEST_CRIU_BIN"
REAL_RUNC = RUNC_BINARIES[DEFAULT_RUNC]  # the defaults (the benches use them)
CRIU = Path(os.environ.get(CRIU_BIN_ENV, "") or CRIU_BINARIES[DEFAULT_CRIU])


def _choice_from_env(variable: str, choices: tuple[str, ...] | dict[str, Path], default: str) -> str:
    v = os.environ.get(variable, "") or default
    if v not in choices:
        raise TestBedError(f"{variable}={v!r}: must be one of {', '.join(choices)}")
    return v


def containerd_version_from_env() -> str:
    """The upstream version tests run against: ``PODSHIM_TEST_CONTAINERD`` (default 1.6)."""
    return _choice_from_env("PODSHIM_TEST_CONTAINERD", CONTAINERD_VERSIONS, DEFAULT_CONTAINERD)


def runc_version_from_env() -> str:
    """The runc tests run with: ``PODSHIM_TEST_RUNC`` (default 1.1, the system's)."""
    return _choice_from_env("PODSHIM_TEST_RUNC", RUNC_BINARIES, DEFAULT_RUNC)


def real_runc() -> Path:
    """The runc binary tests run with (``PODSHIM_TEST_RUNC``)."""
    return RUNC_BINARIES[runc_version_from_env()]


def criu_version_from_env() -> str:
    """The CRIU tests run with: ``PODSHIM_TEST_CRIU`` (default 4.1, /usr/local's)."""
    return _choice_from_env("PODSHIM_TEST_CRIU", CRIU_BINARIES, DEFAULT_CRIU)


def criu_binary(version: str) -> Path:
    """CRIU ``version``'s binary: ``PODSHIM_TEST_CRIU_BIN`` when set (a build of that series
    elsewhere), else the set-up's."""
    override = os.environ.get(CRIU_BIN_ENV, "")
    if override and not override.startswith("/"):
        raise TestBedError(f"{CRIU_BIN_ENV}={override!r}: must be an absolute path")
    return built(Path(override) if override else CRIU_BINARIES[version], f"CRIU {version}")


def built(path: Path, what: str) -> Path:
    if not path.is_file():
        raise TestBedError(f"{what} is not at {path}: run the set-up (scripts/setup.sh)")
    return path


def containerd_bin_dir(version: str) -> Path | None:
    """Where containerd ``version``'s containerd, shim and ctr are: None for the system's (on PATH)."""
    if version == DEFAULT_CONTAINERD:
        return None
    d = GO_BIN / f"containerd-{version}" if version in ("2.2", "2.4") else CONTAINERD_PREFIX / version / "bin"
    for binary in ("containerd", "containerd-shim-runc-v2", "ctr"):
        built(d / binary, f"containerd {version}'s {binary}")
    return d
