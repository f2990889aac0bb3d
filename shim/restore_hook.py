"""The restore side of podshim-runc: `create` of an annotated container becomes `restore`.

Filled in by RestorePod; until then every container is created normally.
"""

from __future__ import annotations


def maybe_handle(binary: str, argv: list[str], flags: dict[str, str], command: str, rest: list[str]) -> None:
    """Handle `create`/`start` of a container to restore (exits); return for any other container."""
    return None
