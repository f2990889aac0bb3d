"""RestorePod's container config checks against the checkpoint (shim/ops/restore_checks.py), no
bed: environment values compared as the upstream stored them (a byte that is not UTF-8 is U+FFFD
in containerd 1.6's JSON, shim/checks/env.py), and the image a config names in
`user_specified_image` held to the checkpoint's image as `image.image` is (docs/design/archive.md
(Image identity))."""

from __future__ import annotations

from typing import Any

import pytest

from api.runtime.v1 import api_pb2 as cri
from shim.archive import config_dump, manifest
from shim.checks.env import as_stored, stored_envs
from shim.ops.restore_checks import RestoreChecks, config_mismatch
from shim.sandbox.images import Images

# ---------------------------------------------------------------------------- env as stored

# Go's encoding/json on each value (json.Marshal then Unmarshal, go1.2x): one U+FFFD per byte that
# is not part of a valid UTF-8 sequence, valid sequences kept
GO_JSON = [
    (b"\xff", "\ufffd"),
    (b"a\xe2\x82", "a\ufffd\ufffd"),  # a truncated sequence: one per byte (Python's "replace": one)
    (b"\xed\xa0\x80", "\ufffd" * 3),  # an encoded surrogate
    (b"\xf0\x9f\x98", "\ufffd" * 3),
    (b"\xc0\xaf", "\ufffd" * 2),  # overlong
    (b"\xf4\x90\x80\x80", "\ufffd" * 4),  # above U+10FFFF
    (b"\xe2\x82\xe2\x82\xac", "\ufffd\ufffd\u20ac"),
    (b"ok\xe2\x82\xacok", "ok\u20acok"),
    (b"", ""),
]


@pytest.mark.parametrize(("raw", "stored"), GO_JSON, ids=[r.hex() or "empty" for r, _ in GO_JSON])
def test_values_are_stored_as_go_json_writes_them(raw: bytes, stored: str) -> None:
    assert as_stored(raw) == stored.encode()
    assert as_stored(as_stored(raw)) == as_stored(raw)  # the stored form is its own


def _archived(envs: list[tuple[str, str]]) -> cri.ContainerConfig:
    """A config as config.dump records it: containerd's JSON, values as text."""
    return config_dump.container_config({"envs": [{"key": k, "value": v} for k, v in envs]})


def _requested(envs: list[tuple[str, bytes]]) -> cri.ContainerConfig:
    return cri.ContainerConfig(envs=[cri.KeyValue(key=k, value=v) for k, v in envs])


def test_the_identical_request_of_a_non_utf8_value_matches_its_checkpoint() -> None:
    """BIN=\\xff, stored by containerd 1.6 as U+FFFD, is the same env as the request's \\xff."""
    archived = _archived([("PATH", "/bin"), ("BIN", "\ufffd")])
    assert config_mismatch("app", _requested([("PATH", b"/bin"), ("BIN", b"\xff")]), archived) is None
    # what the upstream cannot tell apart from it is the same env too: it stored the same text
    assert config_mismatch("app", _requested([("PATH", b"/bin"), ("BIN", b"\xfe")]), archived) is None
    assert (
        config_mismatch("app", _requested([("PATH", b"/bin"), ("BIN", "\ufffd".encode())]), archived) is None
    )


@pytest.mark.parametrize(
    "envs",
    [
        [("PATH", b"/bin"), ("BIN", b"x")],
        [("PATH", b"/bin"), ("BIN", b"\xff\xff")],  # two bytes: two U+FFFD
        [("PATH", b"/bin"), ("BIN", b"")],
        [("PATH", b"/bin")],
        [("PATH", b"/bin"), ("BIN", b"\xff"), ("MORE", b"1")],
        [("PATH", b"/bin"), ("bin", b"\xff")],
    ],
    ids=["other-value", "two-bad-bytes", "empty-value", "missing", "extra", "key-case"],
)
def test_a_different_env_is_still_refused(envs: list[tuple[str, bytes]]) -> None:
    problem = config_mismatch("app", _requested(envs), _archived([("PATH", "/bin"), ("BIN", "\ufffd")]))
    assert problem is not None and problem.startswith("container 'app': env differs from the checkpoint")
    assert repr(envs) in problem, problem  # the request's env as it was sent, not normalised


def test_valid_utf8_values_compare_as_before() -> None:
    archived = _archived([("GREETING", "grüß dich"), ("EMPTY", "")])
    assert (
        config_mismatch("app", _requested([("GREETING", "grüß dich".encode()), ("EMPTY", b"")]), archived)
        is None
    )
    assert stored_envs(archived.envs) == [("GREETING", "grüß dich".encode()), ("EMPTY", b"")]


# ---------------------------------------------------------------------------- user_specified_image

COUNTER, BUSYBOX = "localhost/podshim/counter:1", "localhost/podshim/busybox:1"
COUNTER_ID, BUSYBOX_ID = "sha256:" + "c" * 64, "sha256:" + "b" * 64
COUNTER_DIGEST = "localhost/podshim/counter@sha256:" + "d" * 64


class FakeImages:
    """ImageStatus over a few references (reference -> image ID); any other is not on the node."""

    def __init__(self, refs: dict[str, str]) -> None:
        self.refs = refs

    async def image_status(self, image: str, *, doing: str = "", timeout: float | None = None) -> Any:
        found = self.refs.get(image)
        return cri.ImageStatusResponse(image=cri.Image(id=found)) if found else cri.ImageStatusResponse()


NODE = {COUNTER: COUNTER_ID, COUNTER_DIGEST: COUNTER_ID, BUSYBOX: BUSYBOX_ID}


def _entry(image: str, image_id: str = "", user_specified_image: str = "") -> manifest.ContainerEntry:
    return manifest.ContainerEntry(
        name="counter",
        id="1" * 64,
        image=image,
        state="CONTAINER_RUNNING",
        restart_count=0,
        checkpointed=True,
        dir="containers/counter",
        image_id=image_id,
        user_specified_image=user_specified_image,
    )


ENTRY = _entry(COUNTER, COUNTER_ID, COUNTER)


async def _mismatch(image: str, user: str, node: dict[str, str] = NODE, entry: Any = ENTRY) -> str | None:
    requested = cri.ContainerConfig(image=cri.ImageSpec(image=image, user_specified_image=user))
    record = {"image_ref": COUNTER_DIGEST, "image_id": entry.image_id}
    return await RestoreChecks._image_mismatch(entry, requested, record, Images(FakeImages(node)))


@pytest.mark.parametrize(
    ("image", "user"),
    [
        (COUNTER_ID, ""),  # the empty value: the checkpoint's name is reported
        (COUNTER_ID, COUNTER),  # the kubelet's shape: the ID and the spec's name
        (COUNTER_ID, COUNTER_ID),
        (COUNTER_ID, COUNTER_DIGEST),
        (COUNTER, COUNTER),
        (COUNTER_DIGEST, ""),
    ],
    ids=["empty", "recorded-name", "recorded-id", "digest", "by-name", "image-by-digest"],
)
async def test_the_checkpoints_image_in_any_form_is_accepted(image: str, user: str) -> None:
    assert await _mismatch(image, user) is None


async def test_a_user_specified_image_naming_another_image_is_refused() -> None:
    problem = await _mismatch(COUNTER_ID, BUSYBOX)
    assert problem is not None
    assert problem.startswith(f"container 'counter': user_specified_image {BUSYBOX!r} differs"), problem
    assert COUNTER in problem and COUNTER_ID in problem and f"is {BUSYBOX_ID} on this node" in problem


async def test_a_user_specified_image_this_node_does_not_have_is_refused() -> None:
    """Not provably the checkpoint's image, while the checkpoint's is known here: as a container
    tar's restore answers it (restore_container.py), a mismatch."""
    problem = await _mismatch(COUNTER_ID, "docker.io/library/nginx:1")
    assert (
        problem is not None and "'docker.io/library/nginx:1'" in problem and "is not on this node" in problem
    )


async def test_image_image_naming_another_image_is_still_refused_first() -> None:
    problem = await _mismatch(BUSYBOX, COUNTER)
    assert problem is not None and problem.startswith(f"container 'counter': image {BUSYBOX!r} differs"), (
        problem
    )
    problem = await _mismatch(COUNTER, BUSYBOX)
    assert problem is not None and "user_specified_image" in problem, problem


async def test_undecided_when_the_checkpoints_image_is_not_on_this_node() -> None:
    """None of the checkpoint's references resolves here: the check that its image is on the node
    speaks (FAILED_PRECONDITION, pull it first), not a mismatch."""
    entry = _entry("elsewhere/app:1")
    requested = cri.ContainerConfig(
        image=cri.ImageSpec(image="elsewhere/app:1", user_specified_image=BUSYBOX)
    )
    assert await RestoreChecks._image_mismatch(entry, requested, {}, Images(FakeImages(NODE))) is None
