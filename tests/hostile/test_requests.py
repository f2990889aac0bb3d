"""Hostile CheckpointPod / RestorePod / CreateContainer requests through podshim's socket:
paths (relative, '..', symlink loops and escapes, device files, FIFOs, very long, control
characters, non-UTF-8), options (unknown keys, bad values), ids (empty, unknown, another pod's
container) and container configs that do not match the checkpoint.

For each: the documented code and a message naming the problem; podshim (same process) still
answers Version; the canary outside the allowed roots is neither read nor written; the output
directory offered is left empty; the victim pod runs on unfrozen.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from api.runtime.v1 import api_pb2 as cri
from shim import __version__
from testbed._cri import field_bytes, field_str

from .corpus import INVALID, NOT_FOUND, Case, Ctx, counter

pytestmark = pytest.mark.e2e


def _link(ctx: Ctx, target: str | Path, tag: str = "link") -> Path:
    p = ctx.name(tag)
    p.symlink_to(target)
    return p


def _file(ctx: Ctx) -> Path:
    p = ctx.name("file")
    p.write_text("not a directory\n")
    return p


def _fifo(ctx: Ctx) -> Path:
    p = ctx.name("fifo")
    os.mkfifo(p, 0o600)
    return p


def _device(ctx: Ctx) -> Path:
    p = ctx.name("dev")
    os.mknod(p, 0o600 | 0o020000, os.makedev(1, 3))  # a /dev/null
    return p


def _loop(ctx: Ctx) -> Path:
    p = ctx.name("loop")
    p.symlink_to(p.name)
    return p


def _loop_pair(ctx: Ctx) -> Path:
    a, b = ctx.name("loop-a"), ctx.name("loop-b")
    a.symlink_to(b.name)
    b.symlink_to(a.name)
    return a / "x"


def _not_empty(ctx: Ctx) -> Path:
    d = ctx.fresh("full")
    (d / "keep-me").write_text("caller data\n")
    return d


def _undecodable_neighbour(ctx: Ctx) -> str:
    """A directory whose name is not UTF-8 (b'\\xff') exists; the request names the closest
    valid string, U+FFFD, which must not match it."""
    d = ctx.fresh("bytes")
    os.mkdir(os.fsencode(str(d)) + b"/\xff")
    return f"{d}/\ufffd"


def _raw_checkpoint(ctx: Ctx, path: bytes) -> Callable[[], Any]:
    """CheckpointPodRequest with a non-UTF-8 output_path, encoded by hand (protobuf libraries
    refuse to build one): pod_sandbox_id = 1, output_path = 2."""
    body = field_str(1, ctx.victim.id) + field_bytes(2, path)
    call = ctx.bed.channel(ctx.bed.podshim_socket).unary_unary("/runtime.v1.RuntimeService/CheckpointPod")
    return lambda: call(body, timeout=30)


CHECKPOINT_PATHS = [
    Case("empty", lambda c: c.checkpoint(""), INVALID, ("empty",)),
    Case("relative", lambda c: c.checkpoint("checkpoints/x"), INVALID, ("not absolute",)),
    Case("dotdot-inside", lambda c: c.checkpoint(f"{c.fresh()}/../x"), INVALID, ("'..'",)),
    Case("dotdot-escape", lambda c: c.checkpoint(f"{c.root}/../{c.canary.dir.name}"), INVALID, ("'..'",)),
    Case("outside-roots", lambda c: c.checkpoint(str(c.canary.dir)), INVALID, ("outside the allowed",)),
    Case("root-itself", lambda c: c.checkpoint(str(c.root)), INVALID, ("checkpoint root",)),
    Case("root-trailing-dot", lambda c: c.checkpoint(f"{c.root}/."), INVALID, ("checkpoint root",)),
    Case(
        "symlink-escape",
        lambda c: c.checkpoint(str(_link(c, c.canary.dir))),
        INVALID,
        ("outside the allowed", "symlink"),
    ),
    Case("symlink-to-slash", lambda c: c.checkpoint(str(_link(c, "/"))), INVALID, ("outside",)),
    Case(
        "symlink-intermediate",
        lambda c: c.checkpoint(f"{_link(c, c.canary.dir)}/sub"),
        INVALID,
        ("outside the allowed",),
    ),
    Case("symlink-relative-escape", lambda c: c.checkpoint(str(_link(c, "../.."))), INVALID, ("outside",)),
    Case("symlink-loop", lambda c: c.checkpoint(str(_loop(c))), INVALID, ("symlink loop",)),
    Case("symlink-loop-pair", lambda c: c.checkpoint(str(_loop_pair(c))), INVALID, ("symlink loop",)),
    Case("dev-null", lambda c: c.checkpoint("/dev/null"), INVALID, ("outside",)),
    Case("symlink-to-dev-null", lambda c: c.checkpoint(str(_link(c, "/dev/null"))), INVALID, ("outside",)),
    Case(
        "proc-self-root",
        lambda c: c.checkpoint(f"/proc/self/root{c.canary.dir}"),
        INVALID,
        ("outside the allowed",),
    ),
    Case("proc-self-cwd", lambda c: c.checkpoint("/proc/self/cwd"), INVALID, ("outside",)),
    Case("regular-file", lambda c: c.checkpoint(str(_file(c))), INVALID, ("not a directory",)),
    Case("fifo", lambda c: c.checkpoint(str(_fifo(c))), INVALID, ("not a directory",)),
    Case("char-device", lambda c: c.checkpoint(str(_device(c))), INVALID, ("not a directory",)),
    Case("missing-inside", lambda c: c.checkpoint(str(c.name("missing"))), NOT_FOUND, ("does not exist",)),
    Case(
        "missing-outside",
        lambda c: c.checkpoint(f"{c.canary.dir}/missing"),
        INVALID,
        ("outside the allowed",),
    ),
    Case("not-empty", lambda c: c.checkpoint(str(_not_empty(c))), INVALID, ("not empty", "keep-me")),
    Case("longer-than-path-max", lambda c: c.checkpoint(f"{c.root}/" + "a/" * 2100), INVALID, ("PATH_MAX",)),
    Case("component-over-name-max", lambda c: c.checkpoint(f"{c.root}/{'n' * 300}"), INVALID, ("NAME_MAX",)),
    Case("nul-byte", lambda c: c.checkpoint(f"{c.fresh()}\x00/x"), INVALID, ("NUL",)),
    Case("newline", lambda c: c.checkpoint(f"{c.fresh()}\nx"), INVALID, ("control characters",)),
    Case("escape-sequence", lambda c: c.checkpoint(f"{c.fresh()}\x1b[2J"), INVALID, ("control characters",)),
    Case(
        "closest-to-non-utf8",
        lambda c: c.checkpoint(_undecodable_neighbour(c)),
        NOT_FOUND,
        ("does not exist",),
    ),
]

CHECKPOINT_RAW = [
    pytest.param(
        Case(
            "non-utf8-on-the-wire", lambda c: _raw_checkpoint(c, b"%s/\xff\xfe" % bytes(c.fresh())), INVALID
        ),
        id="non-utf8-on-the-wire",
    ),
    pytest.param(
        Case("overlong-utf8-slash", lambda c: _raw_checkpoint(c, b"%s/\xc0\xaf" % bytes(c.fresh())), INVALID),
        id="overlong-utf8-slash",
    ),
]

CHECKPOINT_OPTIONS = [
    Case(
        "unknown-option",
        lambda c: c.checkpoint(str(c.fresh()), options={"leave-frozen": "true"}),
        INVALID,
        ("unknown checkpoint option", "leave-frozen", "file-locks"),
    ),
    Case(
        "empty-option-key",
        lambda c: c.checkpoint(str(c.fresh()), options={"": "x"}),
        INVALID,
        ("unknown checkpoint option",),
    ),
    Case(
        "bad-boolean",
        lambda c: c.checkpoint(str(c.fresh()), options={"file-locks": "maybe"}),
        INVALID,
        ("file-locks", "expected true or false"),
    ),
    Case(
        "bad-compression",
        lambda c: c.checkpoint(str(c.fresh()), options={"rootfs-compression": "zstd"}),
        INVALID,
        ("rootfs-compression", "none or gzip"),
    ),
    Case(
        "criu-flag-injection",
        lambda c: c.checkpoint(str(c.fresh()), options={"tcp-established": "true --action-script=/bin/sh"}),
        INVALID,
        ("expected true or false",),
    ),
    Case(
        "post-state-out-of-range",
        lambda c: c.checkpoint(str(c.fresh()), post_checkpoint_state=7),
        INVALID,
        ("post_checkpoint_state",),
    ),
    Case(
        "post-state-negative",
        lambda c: c.checkpoint(str(c.fresh()), post_checkpoint_state=-1),
        INVALID,
        ("post_checkpoint_state",),
    ),
]

CHECKPOINT_OPTIONS_HUGE = [
    pytest.param(
        Case(
            "huge-option-value",
            lambda c: c.checkpoint(str(c.fresh()), options={"file-locks": "x" * 100_000}),
            INVALID,
            ("file-locks",),
        ),
        id="huge-option-value",
    ),
]

CHECKPOINT_IDS = [
    Case("empty-pod-id", lambda c: c.checkpoint(str(c.fresh()), pod_sandbox_id=""), INVALID, ("empty",)),
    Case(
        "unknown-pod-id",
        lambda c: c.checkpoint(str(c.fresh()), pod_sandbox_id="f" * 64),
        NOT_FOUND,
        ("not found",),
    ),
    Case(
        "traversal-pod-id",
        lambda c: c.checkpoint(str(c.fresh()), pod_sandbox_id="../../../etc"),
        NOT_FOUND,
        ("not found",),
    ),
    Case(
        "other-pods-container",
        lambda c: c.checkpoint(str(c.fresh()), container_ids=[c.other.containers["counter"]]),
        NOT_FOUND,
        ("is not a container of pod",),
    ),
    Case(
        "empty-container-id",
        lambda c: c.checkpoint(str(c.fresh()), container_ids=[""]),
        INVALID,
        ("empty id",),
    ),
    Case(
        "duplicate-container-id",
        lambda c: c.checkpoint(str(c.fresh()), container_ids=[c.victim.containers["counter"]] * 2),
        INVALID,
        ("more than once",),
    ),
    Case(
        "unknown-container-id",
        lambda c: c.checkpoint(str(c.fresh()), container_ids=["0" * 64]),
        NOT_FOUND,
        ("is not a container of pod",),
    ),
]


def _nameless(ctx: Ctx) -> Callable[[], Any]:
    req = cri.RestorePodRequest(
        checkpoint_path=str(ctx.archive), config=cri.PodSandboxConfig(), container_configs=[counter()]
    )
    return lambda: ctx.rt.RestorePod(req, timeout=30)


def _create_reserved(ctx: Ctx) -> Callable[[], Any]:
    """A plain CreateContainer carrying the restore annotation at the canary: the podshim-runc
    hook must never be pointed at a directory by a client."""
    st = ctx.rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=ctx.victim.id), timeout=10)
    cc = counter("sneaky")
    cc.annotations["podshim.restore.checkpoint-dir"] = str(ctx.canary.dir)
    sandbox = cri.PodSandboxConfig(metadata=st.status.metadata, log_directory=str(ctx.bed.pod_logs_dir))
    req = cri.CreateContainerRequest(pod_sandbox_id=ctx.victim.id, config=cc, sandbox_config=sandbox)
    return lambda: ctx.rt.CreateContainer(req, timeout=30)


RESTORE_REQUESTS = [
    Case("no-config", lambda c: c.restore(with_config=False), INVALID, ("config",)),
    Case("config-without-name", _nameless, INVALID, ("config",)),
    Case("no-container-configs", lambda c: c.restore(containers=[]), INVALID, ("missing counter",)),
    Case(
        "extra-container",
        lambda c: c.restore(containers=[counter(), counter("intruder")]),
        INVALID,
        ("not in the checkpoint intruder",),
    ),
    Case("duplicate-container", lambda c: c.restore(containers=[counter(), counter()]), INVALID, ("twice",)),
    Case(
        "nameless-container",
        lambda c: c.restore(containers=[cri.ContainerConfig()]),
        INVALID,
        ("no metadata.name",),
    ),
    Case("mismatched-args", lambda c: c.restore(containers=[counter(args=["--evil"])]), INVALID, ("args",)),
    Case(
        "mismatched-command",
        lambda c: c.restore(containers=[counter(command=["/bin/sh"])]),
        INVALID,
        ("'counter'", "command"),
    ),
    Case(
        "mismatched-env",
        lambda c: c.restore(containers=[counter(env={"LD_PRELOAD": "/x"})]),
        INVALID,
        ("env",),
    ),
    Case(
        "mismatched-working-dir",
        lambda c: c.restore(containers=[counter(working_dir="/etc")]),
        INVALID,
        ("working_dir",),
    ),
    Case(
        "mismatched-image",
        lambda c: c.restore(containers=[counter(image="localhost/podshim/busybox:1")]),
        INVALID,
        ("image",),
    ),
    Case(
        "mismatched-credentials",
        lambda c: c.restore(containers=[counter(run_as_user=0)]),
        INVALID,
        ("credentials",),
    ),
    Case(
        "unknown-runtime-handler",
        lambda c: c.restore(runtime_handler="gvisor"),
        INVALID,
        ("runtime_handler",),
    ),
    Case(
        "unknown-restore-option",
        lambda c: c.restore(options={"privileged": "true"}),
        INVALID,
        ("unknown restore",),
    ),
    Case(
        "bad-start-value",
        lambda c: c.restore(options={"start": "perhaps"}),
        INVALID,
        ("expected true or false",),
    ),
    Case("path-relative", lambda c: c.restore(path="checkpoints/x"), INVALID, ("not absolute",)),
    Case("path-outside", lambda c: c.restore(path=c.canary.dir), INVALID, ("outside the allowed",)),
    Case("path-symlink-escape", lambda c: c.restore(path=_link(c, c.canary.dir)), INVALID, ("outside",)),
    Case("path-dotdot", lambda c: c.restore(path=f"{c.archive}/../{c.archive.name}"), INVALID, ("'..'",)),
    Case("path-file", lambda c: c.restore(path=_file(c)), INVALID, ("not a directory",)),
    Case("path-fifo", lambda c: c.restore(path=_fifo(c)), INVALID, ("not a directory",)),
    Case("path-missing", lambda c: c.restore(path=c.name("missing")), NOT_FOUND, ("does not exist",)),
    Case("path-dev-null", lambda c: c.restore(path="/dev/null"), INVALID, ("outside",)),
    Case("create-with-reserved-annotation", _create_reserved, INVALID, ("reserved",)),
]


def check(ctx: Ctx, case: Case) -> str:
    """Run `case`; assert the code, message, podshim up, canary untouched, victim unfrozen."""
    before = ctx.canary.fingerprint()
    pid = ctx.bed.podshim_pid
    with pytest.raises(grpc.RpcError) as err:
        case.build(ctx)()
    code, details = err.value.code(), err.value.details() or ""
    assert code == case.code, f"{case.id}: {code}: {details}"
    for n in case.needles:
        assert n in details, f"{case.id}: {n!r} not in {details!r}"
    version = ctx.rt.Version(cri.VersionRequest(), timeout=10).runtime_version
    assert version.endswith(f"+podshim.{__version__}"), version
    assert ctx.bed.podshim_pid == pid and ctx.bed.podshim_running, "podshim restarted or died"
    assert ctx.canary.fingerprint() == before, "something outside the allowed roots was read or written"
    for d in ctx.outputs:  # offered as output_path (or next to the case): nothing written there
        if d.is_dir() and not d.is_symlink():
            left = sorted(p.name for p in d.iterdir())
            assert left in ([], ["keep-me"], ["\udcff"]), f"{case.id}: {d} got {left}"
    st = ctx.rt.ContainerStatus(cri.ContainerStatusRequest(container_id=ctx.victim.containers["counter"]))
    assert st.status.state == cri.CONTAINER_RUNNING
    return details


@pytest.mark.parametrize(
    "case",
    CHECKPOINT_PATHS + CHECKPOINT_OPTIONS + CHECKPOINT_IDS,
    ids=lambda c: c.id,
)
def test_checkpoint_pod(ctx: Ctx, case: Case) -> None:
    check(ctx, case)


@pytest.mark.parametrize("case", CHECKPOINT_RAW + CHECKPOINT_OPTIONS_HUGE)
def test_checkpoint_pod_known_bugs(ctx: Ctx, case: Case) -> None:
    check(ctx, case)


@pytest.mark.parametrize("case", RESTORE_REQUESTS, ids=lambda c: c.id)
def test_restore_pod_request(ctx: Ctx, case: Case) -> None:
    check(ctx, case)
    assert not [
        p for p in ctx.rt.ListPodSandbox(cri.ListPodSandboxRequest()).items if "hostile-" in p.metadata.name
    ]


def test_not_empty_dir_is_left_alone(ctx: Ctx) -> None:
    d = _not_empty(ctx)
    before = (d / "keep-me").stat()
    with pytest.raises(grpc.RpcError):
        ctx.checkpoint(str(d))()
    after = (d / "keep-me").stat()
    assert (after.st_mtime_ns, after.st_size, after.st_ino) == (
        before.st_mtime_ns,
        before.st_size,
        before.st_ino,
    )
    assert Path(d / "keep-me").read_text() == "caller data\n"
