"""What the node tools read of containerd: its version, the config schema it speaks, its config file
and the files that file imports, and the effective CRI config (`containerd config dump`).

containerd 1.x reads config version 2 with the CRI plugin `io.containerd.grpc.v1.cri`, and an
imported file REPLACES a plugin's whole section; 2.0-2.3 speak version 3, 2.4 version 4, both with
the runtimes under `io.containerd.cri.v1.runtime`, and merge imported sections key by key (a list
is replaced as a whole). Only files named in the main config's `imports` are read: the
`/etc/containerd/conf.d/*.toml` that `containerd config default` of 2.2+ prints is not applied
without it (measured, docs/design/install.md (Installing a node)).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shim.deadlines import VERSION_TIMEOUT

CRI_V2 = "io.containerd.grpc.v1.cri"  # containerd 1.x, config version 2
CRI_RUNTIME = "io.containerd.cri.v1.runtime"  # containerd 2.x, config version 3 and 4
RUNC_SHIM = "io.containerd.runc.v2"
DEFAULT_CONFIG = "/etc/containerd/config.toml"


class ContainerdError(Exception):
    """containerd or its config cannot be read; str() says which and what to do."""


@dataclass(frozen=True)
class Containerd:
    binary: str
    version: str  # "1.6.20", "2.4.2"
    schema: int  # the config version it writes itself (`config default`)

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def cri_plugin(self) -> str:
        """The plugin whose section holds the runtimes (and restrict_oom_score_adj)."""
        return CRI_V2 if self.schema <= 2 else CRI_RUNTIME

    @property
    def merges_imports(self) -> bool:
        """2.x merges an imported plugin section into the main one; 1.x replaces it whole."""
        return self.major >= 2

    def section(self, *keys: str) -> str:
        """A table's name as the operator writes it: plugins."<cri>".containerd.runtimes.runc."""
        return ".".join([f'plugins."{self.cri_plugin}"', *keys])


def _run(argv: list[str]) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT * 3)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ContainerdError(f"cannot run {' '.join(argv)}: {e}") from None
    if res.returncode != 0:
        raise ContainerdError(f"{' '.join(argv)} exited {res.returncode}: {res.stderr.strip()[-300:]}")
    return res.stdout


def _toml(text: str, what: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ContainerdError(f"{what} is not valid TOML: {e}") from None


def detect(binary: str) -> Containerd:
    """containerd's version (`--version`) and the config version it speaks (`config default`)."""
    out = _run([binary, "--version"])
    m = re.search(r"\s[v]?(\d+\.\d+\.\d+)", out)
    if not m:
        raise ContainerdError(f"cannot read containerd's version from {binary} --version: {out.strip()!r}")
    schema = _toml(_run([binary, "config", "default"]), f"{binary} config default").get("version", 1)
    return Containerd(binary, m.group(1), int(schema))


def effective(ctd: Containerd, config: Path) -> dict[str, Any]:
    """The config containerd would run with (`config dump`: the file, its imports, migrated)."""
    argv = [ctd.binary, "--config", str(config), "config", "dump"]
    return _toml(_run(argv), " ".join(argv))


def cri_section(ctd: Containerd, config: dict[str, Any]) -> dict[str, Any]:
    """The CRI runtime section of a parsed config (a `config dump`, or one file in ctd's schema)."""
    section = (config.get("plugins") or {}).get(ctd.cri_plugin)
    return section if isinstance(section, dict) else {}


def handler_table(ctd: Containerd, config: dict[str, Any], handler: str) -> dict[str, Any]:
    runtimes = (cri_section(ctd, config).get("containerd") or {}).get("runtimes") or {}
    table = runtimes.get(handler)
    return table if isinstance(table, dict) else {}


def default_handler(ctd: Containerd, config: dict[str, Any]) -> str:
    return str((cri_section(ctd, config).get("containerd") or {}).get("default_runtime_name") or "runc")


@dataclass
class MainConfig:
    """containerd's main config file as text (None: no file) and parsed."""

    path: Path
    text: str | None
    data: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> MainConfig:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls(path, None, {})
        except OSError as e:
            raise ContainerdError(f"cannot read {path}: {e.strerror}") from None
        return cls(path, text, _toml(text, str(path)))

    @property
    def version(self) -> int:
        return int(self.data.get("version", 1)) if self.text is not None else 0

    def imports(self) -> list[str]:
        """The import patterns, absolute (containerd resolves relative ones from the file's dir)."""
        found = self.data.get("imports") or []
        if not isinstance(found, list):
            return []
        return [p if os.path.isabs(p) else str(self.path.parent / p) for p in found if isinstance(p, str)]

    def imported_files(self) -> list[Path]:
        """The files the imports name, in the order containerd reads them (each pattern's matches
        sorted, as Go's filepath.Glob returns them)."""
        files: list[Path] = []
        for pattern in self.imports():
            files += [Path(p) for p in sorted(glob.glob(pattern)) if os.path.isfile(p)]
        return files

    def covers(self, path: Path) -> bool:
        from shim.checks.wiring import go_match

        return any(go_match(p, str(path)) for p in self.imports())


def cri_base(ctd: Containerd, main: MainConfig, exclude: Path) -> tuple[dict[str, Any], Path | None]:
    """containerd 1.x: the CRI section it runs with is the one of the LAST file that has one (the
    main config, then its imports in order; each replaces the section whole), `exclude` (the
    drop-in being written) left out. Returns it and the file it came from."""
    base: dict[str, Any] = cri_section(ctd, main.data)
    source = main.path if base else None
    for f in main.imported_files():
        if f == exclude:
            continue
        try:
            section = cri_section(ctd, _toml(f.read_text(), str(f)))
        except OSError:
            continue
        if section:
            base, source = section, f
    return base, source
