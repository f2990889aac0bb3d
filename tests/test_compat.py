"""What RestorePod compares between the checkpointing node and this one (shim/archive/compat.py),
without a bed: cgroup version detection, old manifests, several mismatches in one refusal."""

from __future__ import annotations

import base64
import io
import json
import platform
from pathlib import Path
from typing import Any

import pytest

from shim.archive import compat
from shim.archive.manifest import HostInfo, Manifest, SandboxInfo
from shim.errors import FailedPrecondition

NODE = compat.Node("4.1.1", "runc", "runc version 1.1.5", platform.machine(), "6.18.4-x", "1")


def archive(**host: str) -> Manifest:
    info = HostInfo(criu_version="4.1.1", runtime_name="runc", runtime_version="runc version 1.1.5")
    info.kernel, info.arch = "6.18.4-x", platform.machine()
    for k, v in host.items():
        setattr(info, k, v)
    return Manifest(sandbox=SandboxInfo(id="x", metadata={}, config={}), host=info)


def test_cgroup_version_from_mountinfo(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    v1.write_text("30 1 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n")
    v2 = tmp_path / "v2"
    v2.write_text("30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
    assert compat.cgroup_version(str(v1)) == "1"
    assert compat.cgroup_version(str(v2)) == "2"
    assert compat.cgroup_version(str(tmp_path / "missing")) == ""


def test_same_node_and_newer_node_pass() -> None:
    compat.check(archive(cgroup_version="1"), NODE)
    compat.check(archive(kernel="6.1.0", criu_version="4.0"), NODE)  # older checkpointing node: fine


def test_every_mismatch_is_named_in_one_refusal() -> None:
    m = archive(kernel="6.19.0", cgroup_version="2", criu_version="4.2", runtime_version="runc version 1.3")
    with pytest.raises(FailedPrecondition) as err:
        compat.check(m, NODE)
    msg = err.value.message
    assert "4 mismatches" in msg, msg
    for needle in ("kernel 6.19.0", "cgroup v2", "upgrade CRIU", "upgrade runc"):
        assert needle in msg, (needle, msg)


def test_an_old_manifest_without_the_new_facts_is_read_and_not_compared() -> None:
    doc = json.loads(archive().to_json())
    for k in ("cgroup_version", "cpuinfo"):
        del doc["host"][k]
    m = Manifest.from_dict(doc)
    assert m.host.cgroup_version == "" and m.host.cpuinfo == ""
    compat.check(m, compat.Node("4.1.1", "runc", "runc version 1.1.5", platform.machine(), "6.18.4-x", "2"))


def test_image_mismatch_messages() -> None:
    assert compat.image_mismatch("app", "img:1", ["sha256:a"], "sha256:a") is None
    assert compat.image_mismatch("app", "img:1", ["sha256:a", "img@sha256:d"], "img@sha256:d") is None
    assert "is not on this node" in (compat.image_mismatch("app", "img:1", None, "sha256:a") or "")
    assert "the checkpoint ran sha256:a" in (
        compat.image_mismatch("app", "img:1", ["sha256:b"], "sha256:a") or ""
    )


CRIU = "/usr/local/sbin/criu"


def _x86_entry(recorded: str) -> dict[str, Any]:
    """The x86 entry of a cpuinfo.img (base64)."""
    import pycriu

    img = pycriu.images.load(io.BytesIO(base64.b64decode(recorded)))
    return img["entries"][0]["x86_entry"][0]  # type: ignore[no-any-return]


def _edited(recorded: str, field: str, value: int) -> str:
    """`recorded` with its x86 entry's `field` set to `value`."""
    import pycriu

    img = pycriu.images.load(io.BytesIO(base64.b64decode(recorded)))
    img["entries"][0]["x86_entry"][0][field] = value
    out = io.BytesIO()
    pycriu.images.dump(img, out)
    return base64.b64encode(out.getvalue()).decode()


def foreign_cpu(recorded: str, host: str) -> tuple[str, int]:
    """`recorded` (a cpuinfo.img, base64) edited to claim one more xsave state component: the
    lowest one this node's own image `host` lacks. Whatever this CPU has, the edit is a CPU it
    is not: CRIU's `cpuinfo check` refuses an image whose `xfeatures_mask` has a bit the node's
    lacks (criu/arch/x86/cpu.c, cpu_validate_features, "CPU xfeatures has unsupported bits").
    Returns (the edited image, the bit added)."""
    mask = _x86_entry(recorded)["xfeatures_mask"]
    here = _x86_entry(host)["xfeatures_mask"]
    # bit 63 of XCR0 is reserved: some lower bit is always free
    bit = next(1 << n for n in range(63) if not (here | mask) & (1 << n))
    return _edited(recorded, "xfeatures_mask", mask | bit), bit


# CRIU's cpuinfo image is x86's; on x86 the set-up installs CRIU, so these run (and fail without it)
X86_CRIU = pytest.mark.skipif(
    platform.machine() != "x86_64",
    reason=f"criu cpuinfo compares x86 CPUs; this node is {platform.machine()}",
)


@X86_CRIU
def test_cpu_features_are_compared_by_criu() -> None:
    """This CPU's own image passes; the same image with one xsave component this CPU lacks is
    refused, naming that component (the comparison works, whatever the CPU)."""
    here = compat.cpuinfo(CRIU)
    assert here, "criu cpuinfo dump failed"
    assert compat.cpuinfo_problem(here, CRIU) is None
    other, bit = foreign_cpu(here, here)
    problem = compat.cpuinfo_problem(other, CRIU)
    assert problem and f"xfeatures has unsupported bits ({bit:#x})" in problem, (hex(bit), problem)


@X86_CRIU
def test_xsave_frame_size_must_match() -> None:
    """CRIU also requires the xsave frame sizes equal (a restored libc sized its frames by them)."""
    here = compat.cpuinfo(CRIU)
    size = _x86_entry(here)["xsave_size"]
    problem = compat.cpuinfo_problem(_edited(here, "xsave_size", size + 64), CRIU)
    assert problem and f"xsave size mismatch ({size + 64}/{size})" in problem, problem
