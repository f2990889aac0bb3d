"""Path confinement for caller-supplied checkpoint paths and archive members.

podshim runs as root and writes memory images that hold secrets, so a path from a request
is only used after it is proven to be a real directory inside an allowed root. The checks
return the resolved path: callers must use that, not the string they were given.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from shim.errors import InvalidArgument, NotFound

PATH_MAX = 4096
NAME_MAX = 255


def check_syntax(path: str, what: str) -> str:
    """Reject paths that cannot be a sane absolute directory name. Returns the normalised path."""
    if not isinstance(path, str) or path == "":
        raise InvalidArgument(f"{what} is empty: pass an absolute directory path")
    if "\x00" in path:
        raise InvalidArgument(f"{what} {path!r} contains a NUL byte")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise InvalidArgument(f"{what} {path!r} contains control characters")
    try:
        encoded = path.encode("utf-8")  # surrogates (undecodable bytes) fail here
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"{what} {path!r} is not valid UTF-8") from e
    if not path.startswith("/"):
        raise InvalidArgument(f"{what} {path!r} is not absolute: pass an absolute path")
    parts = path.split("/")
    if ".." in parts:
        raise InvalidArgument(f"{what} {path!r} has a '..' component, which is not allowed")
    if len(encoded) >= PATH_MAX:
        raise InvalidArgument(f"{what} is {len(encoded)} bytes long, over PATH_MAX ({PATH_MAX})")
    for part in parts:
        if len(part.encode("utf-8")) > NAME_MAX:
            raise InvalidArgument(f"{what} {path[:80]!r}... has a component over NAME_MAX ({NAME_MAX} bytes)")
    return os.path.normpath(path)


def resolved_roots(allowed_roots: Sequence[str]) -> list[Path]:
    if not allowed_roots:
        raise InvalidArgument("no allowed checkpoint roots are configured: configure at least one")
    roots = []
    for r in allowed_roots:
        if not str(r).startswith("/"):
            raise InvalidArgument(f"allowed checkpoint root {r!r} is not absolute: fix the config")
        roots.append(Path(os.path.realpath(r)))
    return roots


def is_inside(path: Path, root: Path) -> bool:
    return path != root and path.is_relative_to(root)


def _resolve_confined(path: str, allowed_roots: Sequence[str], what: str) -> Path:
    """Resolve symlinks of an existing path and prove it lies strictly inside an allowed root."""
    norm = check_syntax(path, what)
    roots = resolved_roots(allowed_roots)
    roots_text = ", ".join(str(r) for r in roots)
    try:
        real = Path(os.path.realpath(norm, strict=True))
    except FileNotFoundError as e:
        loose = Path(os.path.realpath(norm))
        if not any(is_inside(loose, r) for r in roots):
            # outside roots: say so rather than disclose whether it exists
            raise InvalidArgument(
                f"{what} {path} is outside the allowed checkpoint roots ({roots_text})"
            ) from e
        raise NotFound(f"{what} {path} does not exist: create the directory first") from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidArgument(f"{what} {path} contains a symlink loop") from e
        if e.errno == errno.ENOTDIR:
            raise InvalidArgument(f"{what} {path}: a component is not a directory") from e
        if e.errno == errno.ENAMETOOLONG:
            raise InvalidArgument(f"{what} {path[:80]}... is too long") from e
        raise InvalidArgument(f"{what} {path} cannot be resolved: {e.strerror}") from e
    for r in roots:
        if real == r:
            raise InvalidArgument(
                f"{what} {path} is the checkpoint root {r} itself: pass a directory inside it"
            )
    if not any(is_inside(real, r) for r in roots):
        via = "" if str(real) == norm else f" (resolves through a symlink to {real})"
        raise InvalidArgument(f"{what} {path}{via} is outside the allowed checkpoint roots ({roots_text})")
    st = os.lstat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"{what} {path} is not a directory")
    return real


def validate_output_dir(path: str, allowed_roots: Sequence[str]) -> Path:
    """Check a CheckpointPod `output_path`; return its resolved path.

    Rules: absolute, no '..', no NUL/control/non-UTF-8, resolved inside (not equal to) a
    resolved allowed root, an existing directory, empty. NotFound when it does not exist,
    InvalidArgument for every other rule.
    """
    real = _resolve_confined(path, allowed_roots, "output path")
    with os.scandir(real) as it:
        first = next(it, None)
    if first is not None:
        raise InvalidArgument(
            f"output path {path} is not empty (contains {first.name!r}): "
            "pass an empty directory; podshim never removes caller files"
        )
    return real


def validate_archive_dir(path: str, allowed_roots: Sequence[str]) -> Path:
    """Check a RestorePod `checkpoint_path`: same confinement rules, must exist (NotFound)."""
    return _resolve_confined(path, allowed_roots, "checkpoint path")


def check_member_path(relative: str, what: str = "archive member") -> PurePosixPath:
    """Validate a path relative to an archive root: non-empty, relative, no '..', no NUL.

    Returns the normalised relative path ('a//b/./c' -> 'a/b/c').
    """
    if not isinstance(relative, str) or relative in ("", ".", "./"):
        raise InvalidArgument(f"{what} path is empty")
    if "\x00" in relative:
        raise InvalidArgument(f"{what} path {relative!r} contains a NUL byte")
    if relative.startswith("/"):
        raise InvalidArgument(f"{what} path {relative!r} is absolute; archive paths are relative")
    parts = [p for p in relative.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidArgument(f"{what} path {relative!r} escapes the archive with '..'")
    if not parts:
        raise InvalidArgument(f"{what} path {relative!r} is empty")
    return PurePosixPath(*parts)


def check_component(name: str, what: str) -> str:
    """Validate one path component used as a directory name (e.g. a container name)."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        raise InvalidArgument(f"{what} {name!r} cannot be used as a directory name")
    if "/" in name or "\x00" in name:
        raise InvalidArgument(f"{what} {name!r} contains '/' or NUL")
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX:
        raise InvalidArgument(f"{what} {name[:40]!r}... is longer than {NAME_MAX} bytes")
    return name
