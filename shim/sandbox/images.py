"""Image identity (docs/design/archive.md (Image identity)).

One image has many references: its ID (`sha256:<hex>` of its config, what the kubelet puts in
`ImageSpec.image`), digest references (`name@sha256:<manifest digest>`) and names
(`name:tag`, the kubelet's `user_specified_image`). Two references name the same image when
they are equal or the upstream's ImageStatus resolves both to the same ID. An ID is its own
answer; a reference the node does not know resolves to nothing, so "the same image" is then
undecided, never "different".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from api.runtime.v1 import api_pb2 as cri
    from shim.sandbox.view import ContainerView


class ImageSource(Protocol):
    """The upstream's ImageStatus, raising podshim's typed errors (shim/upstream's client
    satisfies it)."""

    async def image_status(
        self, image: str, *, doing: str = ..., timeout: float | None = None
    ) -> cri.ImageStatusResponse: ...


IMAGE_ID_RE = re.compile(r"sha256:[0-9a-f]{64}")


def is_image_id(ref: str) -> bool:
    return IMAGE_ID_RE.fullmatch(ref) is not None


class Images:
    """The image IDs behind references, each reference asked of the upstream once per operation."""

    def __init__(self, upstream: ImageSource) -> None:
        self.upstream = upstream
        self._ids: dict[str, str | None] = {}

    async def id_of(self, ref: str) -> str | None:
        """The ID of the image `ref` names on this node; None when the node has no such image."""
        if not ref:
            return None
        if is_image_id(ref):
            return ref
        if ref not in self._ids:
            st = await self.upstream.image_status(ref)
            self._ids[ref] = st.image.id if st.HasField("image") and st.image.id else None
        return self._ids[ref]

    async def first_id(self, refs: Iterable[str]) -> str | None:
        """The ID of the first of `refs` the node resolves (None: none)."""
        for ref in refs:
            found = await self.id_of(ref)
            if found is not None:
                return found
        return None

    async def differs(self, ref: str, image_id: str | None) -> bool:
        """`ref` provably names another image than `image_id`: both are known and their IDs differ."""
        if image_id is None:
            return False
        found = await self.id_of(ref)
        return found is not None and found != image_id

    async def disagreeing(
        self, refs: Mapping[str, object], recorded: Sequence[str]
    ) -> tuple[str, str, str | None] | None:
        """The first of `refs` (where it is written -> reference) this node resolves to another
        image than the checkpoint's, which `recorded` names (the first of them the node resolves):
        (where, reference, the checkpoint's ID); None when every one names that image or is
        undecided. A reference among `recorded` is taken as it. What a checkpoint's own records say
        of its image: one that disagrees means the archive changed (DATA_LOSS)."""
        recorded_id = await self.first_id(recorded)
        for where, ref in refs.items():
            if not ref or not isinstance(ref, str) or ref in recorded:
                continue
            if await self.differs(ref, recorded_id):
                return where, ref, recorded_id
        return None

    async def mismatch(self, want: str, recorded: Sequence[str]) -> tuple[str, str | None] | None:
        """Whether the reference a restore request gives, `want`, names another image than the
        checkpoint's (named by `recorded`, the first the node resolves): None when it is one of
        them, resolves to the same ID, or the node resolves none of `recorded` (undecided: the check
        that the image is on the node speaks); else (the checkpoint's ID, `want`'s here or None).
        A different image is a config mismatch (INVALID_ARGUMENT)."""
        if want in recorded:
            return None
        checkpoint_id = await self.first_id(recorded)
        if checkpoint_id is None:
            return None
        found = await self.id_of(want)
        return None if found == checkpoint_id else (checkpoint_id, found)


async def resolve_container_images(upstream: ImageSource, containers: Iterable[ContainerView]) -> None:
    """Set each container's `image_id`: the upstream's status field (containerd 2.x), else its
    `image_ref` when that is an ID (containerd 1.x for an image without a repo digest), else what
    ImageStatus says of that reference or of the container's configured image."""
    images = Images(upstream)
    for c in containers:
        c.image_id = c.status.image_id or (
            await images.first_id((c.status.image_ref, c.configured_image, c.image)) or ""
        )
