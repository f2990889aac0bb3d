"""Image identity (docs/design/archive.md (Image identity)) against a node's images (a fake
ImageStatus): what RestorePod and a container tar's restore decide from the references an archive
records and a request gives, and the image a tar restore creates its container with."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import errors
from shim.archive.container_tar import ContainerTarManifest
from shim.config import Config
from shim.ops.restore_container import ArchiveImporter, ImportedCheckpoint, tar_image_refs
from shim.sandbox.images import Images


def image_id(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


COUNTER, BUSYBOX = image_id("counter"), image_id("busybox")
DIGEST = "localhost/podshim/counter@sha256:" + "d" * 64


class Node:
    """ImageStatus of a node holding counter (by tag and digest reference) and busybox."""

    def __init__(self, images: dict[str, str] | None = None) -> None:
        self.images = (
            images
            if images is not None
            else {
                "localhost/podshim/counter:1": COUNTER,
                DIGEST: COUNTER,
                COUNTER: COUNTER,
                "localhost/podshim/busybox:1": BUSYBOX,
                BUSYBOX: BUSYBOX,
            }
        )
        self.asked: list[str] = []

    async def image_status(self, image: str, **_: Any) -> cri.ImageStatusResponse:
        self.asked.append(image)
        found = self.images.get(image)
        return cri.ImageStatusResponse(image=cri.Image(id=found)) if found else cri.ImageStatusResponse()


RECORDED = [COUNTER, "localhost/podshim/counter:1"]


async def test_a_request_naming_the_same_image_any_way_matches() -> None:
    images = Images(Node())
    for want in (COUNTER, DIGEST, "localhost/podshim/counter:1"):
        assert await images.mismatch(want, RECORDED) is None, want
    assert await images.mismatch("localhost/podshim/busybox:1", RECORDED) == (COUNTER, BUSYBOX)
    assert await images.mismatch("localhost/none:1", RECORDED) == (COUNTER, None)
    # the checkpoint's image unknown here: undecided (the presence check speaks)
    assert await images.mismatch("localhost/podshim/busybox:1", ["localhost/gone:1"]) is None


async def test_records_that_name_another_image_disagree() -> None:
    images = Images(Node())
    same = {"image": "localhost/podshim/counter:1", "config.image": DIGEST, "image_id": COUNTER}
    assert await images.disagreeing(same, RECORDED) is None
    other = {"image": "localhost/podshim/counter:1", "config.image": BUSYBOX}
    assert await images.disagreeing(other, RECORDED) == ("config.image", BUSYBOX, COUNTER)
    unknown = {"config.image": "localhost/none:1", "odd": 3}  # unresolvable or not a reference
    assert await images.disagreeing(unknown, RECORDED) is None


def tar(tmp_path: Path, record: dict[str, Any], container: dict[str, Any] | None) -> ImportedCheckpoint:
    m = ContainerTarManifest(container=container) if container is not None else None
    return ImportedCheckpoint(root=tmp_path, record=record, spec={}, manifest=m)


def podshim_tar(tmp_path: Path, **record: Any) -> ImportedCheckpoint:
    """A podshim tar of a container the kubelet made (image by ID, user-specified name)."""
    container = {
        "image": "localhost/podshim/counter:1",
        "image_ref": COUNTER,
        "image_id": COUNTER,
        "user_specified_image": "localhost/podshim/counter:1",
    }
    base = {
        "image": "localhost/podshim/counter:1",
        "image_id": COUNTER,
        "rootfsImage": COUNTER,
        "rootfsImageRef": COUNTER,
        "rootfsImageName": "localhost/podshim/counter:1",
        "config": {"image": {"image": COUNTER}},
    }
    return tar(tmp_path, {**base, **record}, container)


def request(user_specified: str = "") -> cri.ContainerConfig:
    image = cri.ImageSpec(image="/ck/counter.tar", user_specified_image=user_specified)
    return cri.ContainerConfig(metadata=cri.ContainerMetadata(name="copy"), image=image)


def importer(tmp_path: Path, node: Node) -> ArchiveImporter:
    return ArchiveImporter(Config(state_dir=str(tmp_path)), node)  # type: ignore[arg-type]


async def test_a_tar_restores_its_image_by_id(tmp_path: Path) -> None:
    ck = podshim_tar(tmp_path)
    assert tar_image_refs(ck) == [COUNTER, "localhost/podshim/counter:1"]
    got = await importer(tmp_path, Node())._image(ck, request(), Path("/ck/counter.tar"))
    assert got == cri.ImageSpec(image=COUNTER, user_specified_image="localhost/podshim/counter:1")
    # the request may name the image it expects, by ID, digest reference or name
    for want in (COUNTER, DIGEST, "localhost/podshim/counter:1"):
        got = await importer(tmp_path, Node())._image(ck, request(want), Path("/ck/counter.tar"))
        assert got == cri.ImageSpec(image=COUNTER, user_specified_image=want), want
    # a request that names the tar itself names no image
    got = await importer(tmp_path, Node())._image(ck, request("/ck/counter.tar"), Path("/ck/counter.tar"))
    assert got.image == COUNTER


async def test_a_tar_refuses_another_image(tmp_path: Path) -> None:
    ck = podshim_tar(tmp_path)
    where = Path("/ck/counter.tar")
    # the request expects another image: a config mismatch
    with pytest.raises(errors.InvalidArgument) as err:
        await importer(tmp_path, Node())._image(ck, request("localhost/podshim/busybox:1"), where)
    for needle in ("'copy'", "localhost/podshim/busybox:1", COUNTER, BUSYBOX, "nothing was created"):
        assert needle in err.value.message, err.value.message
    # its config.dump names another image than its manifest: the tar changed
    changed = podshim_tar(tmp_path, config={"image": {"image": BUSYBOX}})
    with pytest.raises(errors.DataLoss) as loss:
        await importer(tmp_path, Node())._image(changed, request(), where)
    assert "config.image" in loss.value.message and BUSYBOX in loss.value.message, loss.value.message
    # the node lacks the image the checkpoint ran; its name is another image here
    moved = Node({"localhost/podshim/counter:1": BUSYBOX, BUSYBOX: BUSYBOX})
    with pytest.raises(errors.FailedPrecondition) as missing:
        await importer(tmp_path, moved)._image(ck, request(), where)
    msg = missing.value.message
    assert COUNTER in msg and f"localhost/podshim/counter:1 is {BUSYBOX} here" in msg, msg
    assert "pull it first" in msg, msg


async def test_a_foreign_or_older_tar_restores_by_what_it_records(tmp_path: Path) -> None:
    """A tar without podshim's manifest (containerd 2.x's) or of a podshim before image IDs were
    recorded: its references resolved on this node name the image."""
    foreign = tar(
        tmp_path,
        {"rootfsImageRef": DIGEST, "rootfsImage": COUNTER, "rootfsImageName": "localhost/podshim/counter:1"},
        None,
    )
    assert tar_image_refs(foreign) == [DIGEST, COUNTER, "localhost/podshim/counter:1"]
    got = await importer(tmp_path, Node())._image(foreign, request(), Path("/t.tar"))
    assert got == cri.ImageSpec(image=COUNTER, user_specified_image="localhost/podshim/counter:1")
    older = tar(tmp_path, {"image": "localhost/podshim/counter:1"}, {"image": "localhost/podshim/counter:1"})
    got = await importer(tmp_path, Node())._image(older, request(), Path("/t.tar"))
    assert got == cri.ImageSpec(image=COUNTER, user_specified_image="localhost/podshim/counter:1")
    with pytest.raises(errors.FailedPrecondition, match="not on this node"):
        await importer(tmp_path, Node({}))._image(older, request(), Path("/t.tar"))
